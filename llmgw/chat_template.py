"""The environment chat templates render in: transformers' (vLLM renders through it).

Outside the compiled `llmgw.tokenize` (it defines a jinja2 extension class) and loaded only
with a tokenizer.json configured: jinja2 is an optional extra.
"""

from __future__ import annotations

import json
from collections import deque
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


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_continuing(template: Any, source: str, context: dict[str, Any]) -> str:
    """The render with `continue_final_message`: cut right after the final message's text
    (transformers' render_jinja_template, transformers/utils/chat_template_utils.py, which
    vLLM renders through): a tag appended to that text marks where. `context["messages"]`
    is vLLM's (new dicts: the last one is changed in place). Raises where transformers
    does (vLLM answers 400)."""
    messages = context["messages"]
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("content") is None or "content" not in source:
        raise ValueError("continue_final_message: no final message content to continue")
    content = last["content"]
    if isinstance(content, list):
        for i in range(len(content) - 1, -1, -1):
            block = content[i]
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                content[i] = {**block, "text": final + _CONTINUE_TAG}
                break
        else:
            raise ValueError("continue_final_message: no text in the final message")
    else:
        final = content
        last["content"] = content + _CONTINUE_TAG
    rendered = str(template.render(**context))
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the template drops the final message")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def loops_over_content(source: str) -> bool:
    """Does the template iterate over a message's content (vLLM's "openai" content format:
    it then hands the template content parts; otherwise one string)? As vLLM 0.32 tells
    it from the template's syntax tree (`_iter_nodes_assign_content_item`, vllm/renderers/
    hf.py): a `for` over a message's `content` (a message: a loop variable over `messages`
    or a name assigned from it), over a macro parameter some call binds to a message's
    content (a template that renders `message.content` through `render_content(x)` read
    as one string joined "A\nB" where vLLM renders "AB"), or over `content` outside a
    macro."""
    try:
        tree = template_environment().parse(source)
    except jinja2.TemplateError:
        return False
    messages = _message_names(tree)
    in_macros: set[int] = set()
    bound: dict[int, set[str]] = {}  # a loop in a macro -> its parameters bound to content
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        content_params: set[str] = set()
        for call in tree.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_accesses(arg, m, "content") for m in messages):
                    content_params.add(params[i])
            for kwarg in call.kwargs:
                if kwarg.key in params and any(
                    _accesses(kwarg.value, m, "content") for m in messages
                ):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                bound[id(loop)] = content_params
    for loop in tree.find_all(jinja2.nodes.For):
        target = loop.iter
        if any(_accesses(target, m, "content") for m in messages):
            return True
        if isinstance(target, jinja2.nodes.Name):
            if target.name in bound.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and target.name == "content":
                return True
    return False


def _accesses(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads `name` (with `key`: its `.key` or `['key']`), through filters, tests
    and slices (vLLM's `_is_var_or_elems_access`)."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _accesses(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _accesses(node.node, name) and node.attr == key
    return False


def _message_names(tree: jinja2.nodes.Template) -> list[str]:
    """The names a message goes by: the targets of loops over `messages` or a name
    assigned from it (`{% set loop_messages = messages[1:] %}`), transitively."""
    lists, queue = ["messages"], deque(["messages"])
    while queue:
        name = queue.popleft()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                _accesses(assign.node, name)
                and isinstance(target, jinja2.nodes.Name)
                and target.name not in lists
            ):
                lists.append(target.name)
                queue.append(target.name)
    out: list[str] = []
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, n) for n in lists) and isinstance(
            loop.target, jinja2.nodes.Name
        ):
            out.append(loop.target.name)
    return out


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


# Content part types read as text, and the key holding each one's text (vLLM's
# TEXT_PART_TYPES and MM_PARSER_MAP, vllm/renderers/chat_utils.py).
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Media part types -> the part a template that loops over parts gets ({"type": modality}).
_MODALITIES = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# Part keys vLLM reads; any other key of a part reaches the template with it
# (_KNOWN_CONTENT_PART_FIELDS in vllm/renderers/chat_utils.py).
_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
        "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
        "thinking", "type", "uuid", "video_embeds", "video_url",
    }
)  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"


def mentions_developer(source: str) -> bool:
    """Does the template handle the `developer` role itself (vLLM's
    _detect_developer_role_support, vllm/renderers/hf.py)?"""
    return '"developer"' in source or "'developer'" in source


def vllm_messages(messages: list[Any], parts: bool, developer: bool = True) -> list[Any]:
    """The messages as vLLM 0.32 hands them to the template (parse_chat_messages and
    _postprocess_messages in vllm/renderers/chat_utils.py, then safe_apply_chat_template's
    developer conversion in vllm/renderers/hf.py): each a new dict of the keys vLLM keeps
    (role, content; an assistant's tool_calls unless null or empty, and its `reasoning`
    (or `reasoning_content`) as both; a tool message's tool_call_id; name; task); content
    as one string of its text parts joined with newlines (None: ""), or with `parts`, a
    list of parts ({"type": "text", "text": ...}, a media part as {"type": modality}); a
    tool message's all-text parts joined even then; a system text's leading
    x-anthropic-billing-header line dropped; tool-call arguments parsed from their JSON
    ({} when they are not a JSON object). `developer`: the template handles that role;
    otherwise developer messages become system ones, and all system messages are merged
    into one at the start. A malformed tool call raises (vLLM answers 400)."""
    out = [_vllm_message(m, parts) for m in messages]
    if not developer and any(isinstance(m, dict) and m.get("role") == "developer" for m in out):
        out = _consolidated(
            [
                {k: v for k, v in {**m, "role": "system"}.items() if k != "tools"}
                if isinstance(m, dict) and m.get("role") == "developer"
                else m
                for m in out
            ]
        )
    return out


def _vllm_message(message: Any, parts: bool) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(message, dict) or not (content is None or isinstance(content, str | list)):
        return message  # vLLM refuses it (400): rendered as given
    role = message.get("role")
    items: list[Any] = [] if content is None else [content] if isinstance(content, str) else content
    if role == "system":
        items = _without_billing_header(items)
    out: dict[str, Any] = {"role": role}
    if parts:
        rendered: Any = [p for p in map(_wrapped_part, items) if p is not None]
    else:
        rendered = "\n".join(t for t in map(_part_text, items) if t is not None)
    out["content"] = rendered
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            if calls:  # an empty list is dropped: the template's plain assistant path
                out["tool_calls"] = [_parsed_call(c) for c in calls]
        elif calls is not None:
            out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:  # the deprecated name (ChatCompletionRequest renames it)
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(rendered, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in rendered
        ):
            out["content"] = "\n".join(str(p.get("text", "")) for p in rendered)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _without_billing_header(items: list[Any]) -> list[Any]:
    """Claude Code's attribution line (its `cch` changes every request) dropped from system
    text parts (vLLM's _strip_claude_code_billing_header)."""
    out: list[Any] = []
    for part in items:
        is_dict = isinstance(part, dict)
        text = part.get("text") if is_dict and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append({**part, "text": rest} if is_dict else rest)
    return out


def _consolidated(messages: list[Any]) -> list[Any]:
    """All system messages merged into one at position 0 (vLLM's
    _consolidate_system_messages, vllm/renderers/hf.py)."""
    texts: list[str] = []
    others: list[Any] = []
    merge = False
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") == "system"):
            others.append(message)
            continue
        if i > 0 or texts:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            )
        if content:
            texts.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def _parsed_call(call: Any) -> Any:
    """A tool call as vLLM hands it over: its keys in the order its request model declares
    them (id, function, type; function: arguments, name), others after; the arguments
    parsed from their JSON, {} when absent, not valid JSON or not an object (vLLM 0.32
    coerces them so that a truncated call does not fail every later turn)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ValueError("vLLM takes only tool calls of type function (400)")
    arguments = function.get("arguments")
    if not isinstance(arguments, dict):
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
    parsed = {"arguments": arguments}
    if "name" in function:
        parsed["name"] = function["name"]
    parsed.update((k, v) for k, v in function.items() if k not in ("arguments", "name"))
    out = {"id": call["id"]} if "id" in call else {}
    out["function"] = parsed
    if "type" in call:
        out["type"] = call["type"]
    out.update((k, v) for k, v in call.items() if k not in ("id", "function", "type"))
    return out


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        key = _TEXT_KEYS.get(part.get("type"))  # type: ignore[arg-type]
        text = part.get(key) if key is not None else None
        return text if isinstance(text, str) else None
    return None  # an image, audio...: the engine's placeholder, not text


def _wrapped_part(part: Any) -> Any:
    """A content part as vLLM hands it to a template that loops over parts."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    extras = {k: v for k, v in part.items() if k not in _PART_FIELDS}
    text = _part_text(part)
    if text is not None:
        return {"type": "text", "text": text, **extras}
    if kind in _TEXT_KEYS:  # a text part without its text: skipped
        return None
    modality = _MODALITIES.get(kind)  # type: ignore[arg-type]
    if modality is not None:
        return {"type": modality, **extras}
    return part
