"""The router's tokens for a request against what vLLM 0.32 prefills for it.

Each expected text is vLLM 0.32's rendering of the same body with the same template
(vLLM's own ChatCompletionRequest, parse_chat_messages, tool model_dump, build_chat_params
and developer-role conversion, then transformers' apply_chat_template; produced by a
review helper in vLLM's venv), kept here verbatim. The tokenizer is byte-level without
merges, so any difference in the text is a difference in the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmgw.config import load_dict
from llmgw.request import build_request
from llmgw.tokenize import make_tokenizer

CHAT = "/v1/chat/completions"

# A shortened Qwen2.5 chat template.
QWEN = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen.' }}
    {%- endif %}
    {{- "\n\n# Tools\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Qwen3's reading of an assistant's reasoning.
QWEN3 = r"""{%- for message in messages %}
{%- if message.role == "assistant" %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}{%- endif %}
{{- '<|im_start|>assistant\n' }}{%- if reasoning_content %}{{- '<think>\n' + reasoning_content + '\n</think>\n\n' }}{%- endif %}{{- message.content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
# Llama 3.1's test for tool calls (`'tool_calls' in message`).
LLAMA = r"""{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim + '<|im_end|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|im_start|>assistant\n\n' }}{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|im_end|>" }}
{%- else %}
{{- '<|im_start|>ipython\n\n' + message.content | tojson + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n\n' }}{%- endif %}"""
# One that loops over content parts (vLLM's "openai" content format).
PARTS = r"""{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}
{%- if message.content is string %}{{- message.content }}{%- else %}{%- for c in message.content %}{%- if c.type == 'text' %}{{- c.text }}{%- elif c.type == 'image' %}<image>{%- endif %}{%- endfor %}{%- endif %}
{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
PLAIN = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer(folder: Path, template: str | None = QWEN, bos: bool = False) -> str:
    """A byte-level tokenizer without merges (one token a byte) with ChatML special tokens;
    `bos`: a Llama-style BOS added with the special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import decoders, models, pre_tokenizers, processors  # noqa: PLC0415

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if bos:
        bos_id = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return str(folder / "tokenizer.json")


def encode(path: str, text: str, special: bool = False) -> tuple[int, ...]:
    from tokenizers import Tokenizer  # noqa: PLC0415

    return tuple(Tokenizer.from_file(path).encode(text, add_special_tokens=special).ids)


def router_tokens(
    tmp_path: Path,
    body: dict[str, Any],
    template: str | None = QWEN,
    path: str = CHAT,
    bos: bool = False,
) -> tuple[tuple[int, ...] | None, str]:
    tok = byte_tokenizer(tmp_path / "tok", template, bos)
    config = load_dict({"models": {"m": {"endpoints": ["a:1"]}}})
    raw = build_request(config, {}, path, orjson.dumps(body)).raw_prompt
    return make_tokenizer(tok).tokens(raw), tok


def check(got: tuple[int, ...] | None, tok: str, vllm_text: str, special: bool = False) -> None:
    want = encode(tok, vllm_text, special)
    assert got is not None, "no tokens (the pick falls back), where vLLM renders the request"
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert got == want, f"the router's tokens part from vLLM's at token {first}"


def test_tools_reach_the_template_as_vllm_dumps_them(tmp_path: Path) -> None:
    """vLLM hands the template `tool.model_dump()`: type, then function's name,
    description (null when absent) and parameters, other keys dropped; the router handed
    the tools as sent, so an agent's prompt parted from the engine's within its system
    prompt (found by a review helper)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {
                "function": {"name": "get_weather", "parameters": {"type": "object"}, "x": 1},
                "type": "function",
                "cache_control": {"type": "ephemeral"},
            }
        ],
    }
    got, tok = router_tokens(tmp_path, body)
    check(
        got,
        tok,
        "<|im_start|>system\nYou are Qwen.\n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": null, '
        '"parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    )


def test_a_developer_message_becomes_the_system_message_as_in_vllm(tmp_path: Path) -> None:
    """vLLM turns `developer` messages into `system` ones, merged with the others into one
    at the start, when the template does not mention 'developer' (most do not; OpenAI-style
    agents send their instructions so); the router rendered the role as given, and this
    template skipped it for its default system prompt (found by a review helper)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s1"},
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
    }
    got, tok = router_tokens(tmp_path, body)
    check(
        got,
        tok,
        "<|im_start|>system\ns1\n\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    )


def test_system_messages_stay_apart_without_a_developer_message(tmp_path: Path) -> None:
    """vLLM merges system messages only when it converted a developer message."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "a"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "b"},
        ],
    }
    got, tok = router_tokens(tmp_path, body, PARTS)
    check(
        got,
        tok,
        "<|im_start|>system\na<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>system\nb<|im_end|>\n<|im_start|>assistant\n",
    )


def test_claude_codes_billing_header_is_dropped_as_vllm_drops_it(tmp_path: Path) -> None:
    """vLLM drops a system text's leading `x-anthropic-billing-header` line (its value
    changes every request); the router kept it, so every such request parted from the
    engine's tokens within its first block (found by a review helper)."""
    body = {
        "model": "m",
        "messages": [
            {
                "role": "system",
                "content": "x-anthropic-billing-header: cc_version=2.1; cch=93af1\nYou are Claude Code.",
            },
            {"role": "user", "content": "hi"},
        ],
    }
    got, tok = router_tokens(tmp_path, body)
    check(
        got,
        tok,
        "<|im_start|>system\nYou are Claude Code.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    )


def test_an_assistants_reasoning_reaches_the_template_as_reasoning_content(
    tmp_path: Path,
) -> None:
    """vLLM 0.32 answers with `reasoning`; a client echoing the message back sends it, and
    vLLM hands it to the template as `reasoning` and `reasoning_content` (what Qwen3 and
    DeepSeek templates read); the router handed over `reasoning` only, and the thinking
    block went missing (found by a review helper)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning": "user greets"},
            {"role": "user", "content": "more"},
        ],
    }
    got, tok = router_tokens(tmp_path, body, QWEN3)
    check(
        got,
        tok,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nuser greets\n"
        "</think>\n\nhello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n",
    )


def test_tool_calls_null_is_dropped_as_vllm_drops_it(tmp_path: Path) -> None:
    """`"tool_calls": null` on an assistant message: vLLM leaves the key out; the router
    kept it, and a Llama 3.1-style template (`'tool_calls' in message`, then
    `message.tool_calls|length`) raised: no tokens for the whole conversation (found by a
    review helper)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "tool_calls": None},
            {"role": "user", "content": "more"},
        ],
    }
    got, tok = router_tokens(tmp_path, body, LLAMA)
    check(
        got,
        tok,
        "<|im_start|>user\n\nhi<|im_end|><|im_start|>assistant\n\nhello<|im_end|>"
        "<|im_start|>user\n\nmore<|im_end|><|im_start|>assistant\n\n",
    )


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]"])
def test_tool_call_arguments_that_are_not_a_json_object_render_as_an_empty_one(
    tmp_path: Path, arguments: str
) -> None:
    """vLLM 0.32 coerces arguments that are not a JSON object (a truncated call, a list)
    to `{}` so the conversation goes on; the router's json.loads raised (or handed over
    the list), and every later turn of that conversation got no tokens (found by a review
    helper)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ],
    }
    got, tok = router_tokens(tmp_path, body)
    check(
        got,
        tok,
        "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    )


def test_a_tool_messages_text_parts_are_joined_for_a_parts_template(tmp_path: Path) -> None:
    """vLLM joins a tool message's text parts with newlines even for a template that loops
    over content parts (Claude Code and Cursor send tool results as parts); the router
    handed the parts over, which such a template concatenated (found by a review helper)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": "1",
                "content": [{"type": "text", "text": "r1"}, {"type": "input_text", "text": "r2"}],
            },
            {"role": "user", "content": "more"},
        ],
    }
    got, tok = router_tokens(tmp_path, body, PARTS)
    check(
        got,
        tok,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\nr1\nr2<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
        "<|im_start|>assistant\n",
    )


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        (QWEN, "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\na\nb\nc\nd"),
        (PARTS, "<|im_start|>user\nabcd"),
    ],
)
def test_every_text_part_type_vllm_reads_reaches_the_template(
    tmp_path: Path, template: str, rendered: str
) -> None:
    """vLLM reads input_text, output_text, refusal and thinking parts as text (and hands a
    parts template each as a `text` part); the router read only text and input_text, and
    only for a template that prints the content (found by a review helper)."""
    content = [
        {"type": "input_text", "text": "a"},
        {"type": "output_text", "text": "b"},
        {"type": "refusal", "refusal": "c"},
        {"type": "thinking", "thinking": "d"},
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    got, tok = router_tokens(tmp_path, body, template)
    check(got, tok, rendered + "<|im_end|>\n<|im_start|>assistant\n")


GENERATION = (
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    "kwargs", [{"add_generation_prompt": False}, {"continue_final_message": True}]
)
def test_the_requests_own_fields_win_over_its_chat_template_kwargs(
    tmp_path: Path, kwargs: dict[str, bool]
) -> None:
    """vLLM merges `chat_template_kwargs` first and the request's own fields over them
    (add_generation_prompt defaults to true, continue_final_message to false), so
    `chat_template_kwargs: {add_generation_prompt: false}` still renders the generation
    prompt; the router let the kwargs win (found by a review helper)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    got, tok = router_tokens(tmp_path, {**body, "chat_template_kwargs": kwargs})
    check(got, tok, GENERATION)


def test_continue_final_message_ends_the_prompt_in_the_final_message(tmp_path: Path) -> None:
    """With `continue_final_message` transformers (so vLLM) cuts the render right after the
    final message's text, so the model continues it; the router rendered it closed, with
    the end-of-turn marker after it (found by a review helper)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hel "},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    got, tok = router_tokens(tmp_path, body)
    check(got, tok, GENERATION + "Hel ")


def test_a_completion_with_add_special_tokens_false_gets_no_bos(tmp_path: Path) -> None:
    """vLLM's completions take `add_special_tokens` (default true); clients that render the
    chat template themselves send false to avoid a second BOS. The router always added
    the tokenizer's special tokens: its ids were one off from the first block (found by a
    review helper)."""
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": "m", "prompt": text, "add_special_tokens": False}
    got, tok = router_tokens(tmp_path, body, path="/v1/completions", bos=True)
    check(got, tok, text, special=False)
    body = {"model": "m", "prompt": text}
    check(router_tokens(tmp_path, body, path="/v1/completions", bos=True)[0], tok, text, True)


def test_a_chat_request_with_add_special_tokens_true_gets_the_bos(tmp_path: Path) -> None:
    """vLLM's chat requests add the tokenizer's special tokens when `add_special_tokens`
    is true (default false); the router never did (found by a review helper)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    got, tok = router_tokens(tmp_path, {**body, "add_special_tokens": True}, bos=True)
    check(got, tok, GENERATION, special=True)
    check(router_tokens(tmp_path, body, bos=True)[0], tok, GENERATION, special=False)


def test_a_request_with_tools_uses_the_named_tool_use_template(tmp_path: Path) -> None:
    """Named templates (Hermes 2 Pro, Command R: default, tool_use, rag): vLLM takes the
    template from `tokenizer.get_chat_template(None, tools=tools)`, `tool_use` when the
    request has tools; the router always rendered `default` (found by a review helper)."""
    folder = tmp_path / "tok"
    tok = byte_tokenizer(folder, None)
    loop = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    named = [
        {"name": "default", "template": loop},
        {
            "name": "tool_use",
            "template": "<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n" + loop,
        },
    ]
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": named})
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    config = load_dict({"models": {"m": {"endpoints": ["a:1"]}}})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tokenizer = make_tokenizer(tok)
    for sent, text in [
        ({**body, "tools": tools}, '<|im_start|>system\n[{"type": "function", "function": '
         '{"name": "f", "description": "d", "parameters": {"type": "object"}}}]<|im_end|>\n'),
        (body, ""),
    ]:  # fmt: skip
        raw = build_request(config, {}, CHAT, orjson.dumps(sent)).raw_prompt
        check(tokenizer.tokens(raw), tok, text + "<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.parametrize("added_tokens_decoder", [False, True])
def test_special_tokens_come_from_special_tokens_map_json_as_transformers_reads_it(
    tmp_path: Path, added_tokens_decoder: bool
) -> None:
    """transformers 5 (so vLLM) reads the special tokens from special_tokens_map.json too,
    over tokenizer_config.json's, when the config has no `added_tokens_decoder` (a repo
    that does not repeat them); the router read only tokenizer_config.json, so
    `{{ bos_token }}` rendered empty and every token was one off from the engine's (found
    by a review helper)."""
    folder = tmp_path / "tok"
    tok = byte_tokenizer(folder, PLAIN.replace("{{ bos_token }}", "{{ bos_token }}{{ eos_token }}"))
    settings: dict[str, Any] = {"eos_token": "<|im_end|>"}
    if added_tokens_decoder:
        settings["added_tokens_decoder"] = {"256": {"content": "<|endoftext|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_start|>"}})
    )
    got = make_tokenizer(tok).tokens([{"role": "user", "content": "hi"}])
    head = "<|im_end|>" if added_tokens_decoder else "<|endoftext|><|im_start|>"
    check(got, tok, head + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
