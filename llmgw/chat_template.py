"""The environment chat templates render in: transformers' (vLLM renders through it).

Outside the compiled `llmgw.tokenize` (it defines a jinja2 extension class) and loaded only
with a tokenizer.json configured: jinja2 is an optional extra.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2.ext
import jinja2.sandbox


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Loop controls, `raise_exception`, `strftime_now`, a `tojson` that neither sorts keys
    nor escapes HTML, and the `{% generation %}` tag, as transformers sets them up. Rendered
    in jinja2's defaults, a Llama 3 template dated the prompt 26 Jul 2024 while the engine
    dated it today, and tool arguments came out reordered: the tokens parted early and the
    endpoint matched ~0 of a prompt it held."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
