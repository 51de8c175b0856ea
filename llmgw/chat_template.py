"""The environment chat templates render in: transformers' (vLLM renders through it).

Outside the compiled `llmgw.tokenize` (it defines a jinja2 extension class) and loaded only
with a tokenizer.json configured: jinja2 is an optional extra.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2.ext
import jinja2.nodes
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


def loops_over_content(source: str) -> bool:
    """Does the template iterate over a message's content (vLLM's "openai" content format:
    it then hands the template content parts; otherwise one string)? As vLLM tells it
    from the template's syntax tree: a `for` over `*.content`, `*['content']` or `content`."""
    try:
        tree = template_environment().parse(source)
    except jinja2.TemplateError:
        return False
    return any(_is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node  # `message.content | selectattr(...)`
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def vllm_tools(tools: Any) -> Any:
    """The tools as vLLM hands them to the template: `tool.model_dump()` of its
    ChatCompletionToolsParam (vllm/entrypoints/openai/chat_completion/protocol.py, with
    FunctionDefinition in vllm/entrypoints/generate/base/protocol.py): `type`, then
    `function` with name, description and parameters (None when absent), `strict` and
    `defer_loading` only when set (a tool's `defer_loading` carried into its function);
    other keys dropped. A tool vLLM would reject (400) is handed over as given."""
    if not isinstance(tools, list):
        return tools
    return [_dumped_tool(t) for t in tools]


def _dumped_tool(tool: Any) -> Any:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return tool
    defer = tool.get("defer_loading")
    dumped = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        value = function.get(key)
        if value is None and key == "defer_loading":
            value = defer
        if value is not None:
            dumped[key] = value
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def vllm_messages(messages: list[Any], parts: bool) -> list[Any]:
    """The messages as vLLM hands them to the template: each content's text parts joined
    with newlines (None: ""), or with `parts`, the content as a list of parts (a string
    becomes one text part); an assistant's tool-call arguments parsed from their JSON."""
    out: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not (
            content is None or isinstance(content, str | list)
        ):
            out.append(message)
            continue
        items = [] if content is None else [content] if isinstance(content, str) else content
        if parts:
            rendered: Any = [
                {"type": "text", "text": i} if isinstance(i, str) else i for i in items
            ]
        else:
            rendered = "\n".join(t for t in map(_part_text, items) if t is not None)
        handed = {**message, "content": rendered}
        calls = handed.get("tool_calls")
        if handed.get("role") == "assistant" and isinstance(calls, list):
            if calls:
                handed["tool_calls"] = [_parsed_call(c) for c in calls]
            else:  # vLLM drops an empty list: the template's plain assistant path
                del handed["tool_calls"]
        out.append(handed)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif not isinstance(arguments, dict | list):
        arguments = json.loads(arguments)  # not JSON: vLLM answers 400, the pick falls back
    return {**call, "function": {**function, "arguments": arguments}}


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None  # an image, audio...: the engine's placeholder, not text
