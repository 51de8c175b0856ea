"""The router's tokens against what vLLM 0.32 prefills: content read through a macro,
tools given in `chat_template_kwargs`, a request's own chat template.

Each expected text was produced by vLLM 0.32's own pipeline (ChatCompletionRequest,
build_chat_params(...).with_defaults({tools, tokenize}), HfRenderer.render_messages:
content-format detection, parse_chat_messages, safe_apply_chat_template with transformers
5.19) run offline in .venv-vllm on the same template; the tokenizer here is byte-level
without merges, so a difference in the text is a difference in the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from llmgw.chat_template import loops_over_content
from llmgw.config import load_dict
from llmgw.request import build_request
from llmgw.tokenize import make_tokenizer

from .test_tokenize import byte_tokenizer

CHAT = "/v1/chat/completions"


def _tokens(tmp_path: Path, template: str, body: dict[str, Any]) -> tuple[Any, str]:
    tok = byte_tokenizer(tmp_path / "tok", template)
    config = load_dict({"models": {"m": {"endpoints": ["a:1"]}}})
    raw = build_request(config, {}, CHAT, orjson.dumps(body)).raw_prompt
    return make_tokenizer(tok).tokens(raw), tok


def _check(got: Any, tok: str, vllm_text: str) -> None:
    from tokenizers import Tokenizer  # noqa: PLC0415

    t = Tokenizer.from_file(tok)
    want = tuple(t.encode(vllm_text, add_special_tokens=False).ids)
    assert got is not None, "no tokens (the pick falls back), where vLLM renders the request"
    mine = t.decode(list(got), skip_special_tokens=False)
    assert got == want, f"router rendered {mine!r}, vLLM {vllm_text!r}"


# MiMo-V2.5's shape (XiaomiMiMo/MiMo-V2.5 chat template, trimmed): message.content goes
# through a macro whose parameter is not named `content`.
MACRO_TEMPLATE = r"""{%- macro render_content(message_content) -%}
    {%- if message_content is string -%}
        {{- message_content -}}
    {%- else -%}
        {%- for content in message_content -%}
            {%- if 'text' in content -%}
                {{- content['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def test_content_passed_through_a_macro_parameter_is_read_as_parts_like_vllm(
    tmp_path: Path,
) -> None:
    """vLLM 0.32 (renderers/hf.py _iter_nodes_assign_content_item) follows
    `message.content` into a macro's parameter: a template looping over that parameter
    gets content parts ("openai" format). The router's loops_over_content only knows
    loops over `*.content` or a name `content`, so it hands such a template one string of
    the parts joined with newlines: "A\\nB" where vLLM renders "AB"."""
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            }
        ],
    }
    got, tok = _tokens(tmp_path, MACRO_TEMPLATE, body)
    _check(got, tok, "<|im_start|>user\nAB<|im_end|>\n<|im_start|>assistant\n")


TOOLS_TEMPLATE = r"""{%- if tools %}{{- '<|im_start|>system\n' + (tools | tojson) + '<|im_end|>\n' }}{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
VLLM_WITH_TOOLS = (
    '<|im_start|>system\n[{"type": "function", "function": {"name": "get_weather", '
    '"parameters": {"type": "object"}}}]<|im_end|>\n'
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    "top_level_tools",
    [None, [{"type": "function", "function": {"name": "other", "parameters": {}}}]],
)
def test_tools_in_chat_template_kwargs_reach_the_template_as_in_vllm(
    tmp_path: Path, top_level_tools: Any
) -> None:
    """vLLM's preprocess_chat puts the request's tools into the template kwargs as
    defaults (`merge_kwargs({tools, tokenize}, chat_template_kwargs)` via
    ChatParams.with_defaults), so `chat_template_kwargs.tools` is what the template sees
    (as sent, not model_dump'ed), with or without top-level tools. The router sets
    context["tools"] from the top-level field after merging the kwargs: it renders no
    tools (or the other ones) and its tokens part from the engine's in the system
    prompt."""
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tools": [WEATHER]},
    }
    if top_level_tools is not None:
        body["tools"] = top_level_tools
    got, tok = _tokens(tmp_path, TOOLS_TEMPLATE, body)
    _check(got, tok, VLLM_WITH_TOOLS)


def test_a_request_chat_template_is_not_rendered_with_the_models_own(tmp_path: Path) -> None:
    """vLLM renders with the request's `chat_template` (build_chat_params:
    `self.chat_template or default_template`; served with --trust-request-chat-template,
    else 400). The router ignores the field and renders the model's template: a request
    with its own template gets the same tokens as the default rendering of its messages,
    so it is credited the default rendering's cached blocks, which the engine will not
    reuse. Rendering the given template, or no tokens (the approximate index), is right."""
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    custom = {**plain, "chat_template": "[{{ messages[0].content }}]"}
    got, _ = _tokens(tmp_path, TOOLS_TEMPLATE, custom)
    default, _ = _tokens(tmp_path / "again", TOOLS_TEMPLATE, plain)
    assert default is not None
    assert got is None, "a request's own template rendered as the model's"  # the index's


@pytest.mark.parametrize(
    ("template", "parts"),
    [
        (
            "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m['content'] %}{% endfor %}{% endfor %}",
            True,
        ),
        ("{% for item in content %}{% endfor %}", True),  # over `content` outside a macro
        ("{% macro f(content) %}{% for c in content %}{% endfor %}{% endmacro %}", False),
        ("{% for t in tools %}{% for c in t.content %}{% endfor %}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ],
)
def test_the_content_format_is_detected_as_vllm_detects_it(template: str, parts: bool) -> None:
    assert loops_over_content(template) is parts
