"""build_request: an edge's headers and body -> RequestInfo, or a typed 400/413."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from llmgw.config import Config
from llmgw.errors import BadRequest, BodyTooLarge, LlmgwError
from llmgw.request import (
    MEDIA_PART_TOKENS,
    build_request,
    cors_preflight,
    needs_body,
    prompt_text,
    wrong_method,
)
from llmgw.types import RequestInfo

from .helpers import config, static_model

CHAT = "/v1/chat/completions"


def cfg(**top: Any) -> Config:
    return config(
        {
            "chat": static_model(2, session={"headers": ["X-Conversation-Id", "x-session-id"]}),
            "plain": static_model(1, strategy="batch"),
        },
        **top,
    )


def body(**fields: Any) -> bytes:
    return orjson.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("raw", "status", "phrase"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object, got list"),
        (b'"chat"', 400, "must be a JSON object, got str"),
        (b'{"messages": []}', 400, "'model'"),
        (b'{"model": 7}', 400, "'model'"),
        (b'{"model": ""}', 400, "'model'"),
        (b'{"model": "chat", "stream": "maybe"}', 400, "'stream' must be a boolean"),
        (b'{"model": "chat", "stream": 2}', 400, "'stream' must be a boolean"),
        (b'{"model": "chat", "messages": "hi"}', 400, "'messages' must be an array"),
    ],
    ids=[
        "bad-json",
        "empty",
        "array",
        "string",
        "no-model",
        "model-not-str",
        "model-empty",
        "stream-str",
        "stream-int",
        "messages-str",
    ],
)
def test_bad_body_is_a_400_saying_why(raw: bytes, status: int, phrase: str) -> None:
    with pytest.raises(BadRequest) as info:
        build_request(cfg(), {}, CHAT, raw)
    assert info.value.status == status == 400
    assert phrase in info.value.message
    assert orjson.loads(info.value.body())["error"]["code"] == "invalid_request"


def test_oversize_body_is_413_before_parsing() -> None:
    limit = 2048
    raw = b"{" + b" " * limit  # invalid JSON too: the size check must come first
    with pytest.raises(BodyTooLarge) as info:
        build_request(cfg(limits={"max_body_bytes": limit}), {}, CHAT, raw)
    assert info.value.status == 413
    assert str(limit) in info.value.message


def test_body_at_the_limit_is_accepted() -> None:
    raw = body()
    c = cfg(limits={"max_body_bytes": 1024})
    padded = raw[:-1] + b" " * (1024 - len(raw)) + b"}"
    assert len(padded) == 1024
    assert build_request(c, {}, CHAT, padded).model == "chat"


def test_model_comes_from_the_header_without_a_body() -> None:
    info = build_request(cfg(), {"x-llmgw-model": "plain"}, CHAT, None)
    assert info.model == "plain" and info.prompt == "" and info.body_size == 0


def test_model_header_name_is_configurable_and_wins_over_the_body() -> None:
    info = build_request(cfg(model_header="x-model"), {"x-model": "plain"}, CHAT, body())
    assert info.model == "plain"


def test_no_model_anywhere_is_a_400_naming_the_header() -> None:
    with pytest.raises(BadRequest, match="x-llmgw-model"):
        build_request(cfg(), {}, "/v1/models", None)


def test_off_list_path_without_the_header_says_where_the_body_is_read() -> None:
    """Off the list the proxy never reads the body: the message asks for the header and
    says where a body 'model' is read."""
    with pytest.raises(BadRequest) as info:
        build_request(cfg(), {}, "/v1/images/generations", None)
    message = str(info.value)
    assert message.startswith("cannot tell the model: send a x-llmgw-model header")
    assert "from the body on /v1/chat/completions" in message


@pytest.mark.parametrize(
    ("payload", "model"),
    [
        (b'{"model": "plain", "prompt": "hi"}', "plain"),
        (b'{"model": "plain", "stream": "yes"}', "plain"),  # not OpenAI's shape: model alone
        (b'{"model": "plain", "messages": 3}', "plain"),
    ],
)
def test_a_body_given_off_the_list_is_routed_by_its_model(payload: bytes, model: str) -> None:
    """The ext_proc edge reads a POST's body on any path (GIE's conformance suite POSTs to
    its routes' own prefixes); its string 'model' routes it (found by a review helper)."""
    info = build_request(cfg(), {}, "/primary-gateway-test", payload)
    assert info.model == model


def test_a_completion_off_the_list_keeps_its_prompt() -> None:
    info = build_request(cfg(), {}, "/primary-gateway-test", body(prompt="abc", messages=None))
    assert "abc" in info.prompt


@pytest.mark.parametrize("payload", [b"", b"{not json", b"[1]", b'{"model": 7}', b"{}"])
def test_a_body_off_the_list_naming_no_model_is_the_400_naming_the_header(payload: bytes) -> None:
    with pytest.raises(BadRequest, match="send a x-llmgw-model header"):
        build_request(cfg(), {}, "/primary-gateway-test", payload)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
                                  "/pooling", "/classify", "/tokenize"])  # fmt: skip
def test_engines_other_json_paths_take_the_model_from_the_body(path: str) -> None:
    """vLLM's and SGLang's reranking, scoring, pooling and tokenizing bodies name the model."""
    payload = orjson.dumps({"model": "plain", "query": "q", "documents": ["a", "b"]})
    assert needs_body(cfg(), {}, path)
    assert build_request(cfg(), {}, path, payload).model == "plain"


def test_stream_null_is_not_streamed_as_the_openai_api_allows() -> None:
    assert build_request(cfg(), {}, CHAT, body(stream=None)).stream is False


@pytest.mark.parametrize(
    ("flag", "want"),
    [("true", True), ("Yes", True), ("on", True), (1, True), (1.0, True),
     ("false", False), ("off", False), ("0", False), (0, False)],
)  # fmt: skip
def test_a_stream_flag_vllm_reads_as_a_bool_is_taken_as_it_reads_it(
    flag: object, want: bool
) -> None:
    """vLLM validates requests in pydantic's lax mode: `"stream": "true"` or `1` streams
    there, but was a 400 from llmgw (found by a review helper)."""
    assert build_request(cfg(), {}, CHAT, body(stream=flag)).stream is want


@pytest.mark.parametrize("path", ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel"])
def test_a_bodyless_request_below_an_inference_path_is_routed_by_the_model_header(
    path: str,
) -> None:
    """vLLM's `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` have no body;
    where the strategy reads the prompt, the empty body was parsed: 400 "not valid JSON"
    even with the model header (found by a review helper)."""
    # Not needed (no prompt lives there): routed at the headers, as ext_proc must (bodiless
    # HTTP/2 trailers after a body it asked for come too late to route on).
    assert not needs_body(cfg(), {"x-llmgw-model": "chat"}, path)
    info = build_request(cfg(), {"x-llmgw-model": "chat"}, path, b"")
    assert info.model == "chat" and info.prompt == "" and info.prompt_tokens == 0
    with pytest.raises(BadRequest) as refused:
        build_request(cfg(), {}, path, b"")
    message = refused.value.message
    assert "send a x-llmgw-model header" in message and "JSON" not in message
    with pytest.raises(BadRequest, match="not valid JSON"):  # a body is still read
        build_request(cfg(), {"x-llmgw-model": "chat"}, path, b"{oops")


@pytest.mark.parametrize("path", ["/tokenizer_info", "/scores", "/v1/chat/completionsx"])
def test_a_path_that_only_begins_like_a_body_path_is_not_one(path: str) -> None:
    """vLLM's GET /tokenizer_info must not be read as a /tokenize body ("not valid JSON")."""
    assert not needs_body(cfg(), {}, path)
    assert build_request(cfg(), {"x-llmgw-model": "plain"}, path, b"").model == "plain"


def test_session_header_names_are_configured_per_model_in_order() -> None:
    c = cfg()
    both = {"x-conversation-id": "conv-1", "x-session-id": "sess-1"}
    assert build_request(c, both, CHAT, body()).session_key == "conv-1"
    assert build_request(c, {"x-session-id": "sess-1"}, CHAT, body()).session_key == "sess-1"
    assert build_request(c, {}, CHAT, body()).session_key is None
    # "plain" keeps the default header only.
    plain = build_request(c, {"x-llmgw-model": "plain", **both}, CHAT, None)
    assert plain.session_key == "sess-1"


def test_request_id_comes_from_the_header_else_is_unique() -> None:
    c = cfg()
    assert build_request(c, {"x-request-id": "abc"}, CHAT, body()).request_id == "abc"
    ids = {build_request(c, {}, CHAT, body()).request_id for _ in range(50)}
    assert len(ids) == 50


def test_without_a_session_the_routing_key_is_the_request_id() -> None:
    info = build_request(cfg(), {"x-request-id": "abc"}, CHAT, body())
    assert info.routing_key == "abc"


def test_prompt_from_messages_is_role_tagged_and_keeps_text_parts() -> None:
    payload = {
        "model": "chat",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "here"},
                ],
            },
            "not a message",
        ],
        "stream": True,
    }
    info = build_request(cfg(), {}, CHAT, orjson.dumps(payload))
    # The image in its place: a digest of its source, padded to the tokens it costs.
    before, image, after = info.prompt.partition("<|image_url|>")
    assert before == "<|system|>be brief<|user|>look "
    assert image and after.endswith("here")
    assert info.prompt_tokens >= MEDIA_PART_TOKENS
    assert info.stream is True
    assert info.body_size == len(orjson.dumps(payload))


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        ({"prompt": "once upon"}, "once upon"),
        ({"prompt": ["a", "b", 3]}, "ab"),
        ({"input": "embed me"}, "embed me"),
        ({}, ""),
    ],
    ids=["prompt-str", "prompt-list", "input", "none"],
)
def test_prompt_from_prompt_or_input(payload: dict[str, Any], want: str) -> None:
    assert prompt_text(payload, 1000) == want


def test_prompt_is_cut_at_the_configured_prefix_length() -> None:
    c = cfg(limits={"prompt_prefix_chars": 10})
    info = build_request(c, {}, CHAT, body(messages=[{"role": "user", "content": "x" * 100}]))
    assert info.prompt == ("<|user|>" + "x" * 100)[:10]


def test_body_of_a_non_inference_path_is_not_parsed() -> None:
    info = build_request(cfg(), {"x-llmgw-model": "chat"}, "/v1/models", b"{not json")
    assert info.model == "chat"


def test_query_string_does_not_hide_an_inference_path() -> None:
    with pytest.raises(LlmgwError) as info:
        build_request(cfg(), {}, CHAT + "?x=1", b"{oops")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("headers", "path", "want"),
    [
        ({}, CHAT, True),  # the model is in the body
        ({"x-llmgw-model": "chat"}, CHAT, True),  # the chat strategy reads the prompt
        ({"x-llmgw-model": "plain"}, CHAT, False),  # batch has no prefix scorer
        ({"x-llmgw-model": "plain"}, "/v1/models", False),
        ({}, "/health", False),
    ],
)
def test_needs_body_only_when_routing_reads_it(
    headers: dict[str, str], path: str, want: bool
) -> None:
    assert needs_body(cfg(), headers, path) is want


# -- what the engine's template renders: tools, tool calls, Responses items, token ids -------
def _parsed(path: str, payload: dict[str, Any]) -> RequestInfo:
    cfg = config({"chat": static_model(2)})
    return build_request(cfg, {}, path, orjson.dumps(payload))


def _call(arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "write", "arguments": arguments}}


def test_tools_and_tool_calls_are_in_the_prompt_and_its_estimate() -> None:
    """An agent's ~20 KB of tool schemas and call arguments read as a few tokens, and two
    histories that differed only in their calls as one prefix."""
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "description": "d" * 500}}
        for i in range(40)
    ]
    asked = _parsed(
        CHAT, {"model": "chat", "tools": tools, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert asked.prompt_tokens > 4000
    # The tools as a digest: the conversation stays inside the kept prefix, and another
    # tool set is another prefix.
    assert asked.prompt.startswith("<|tools|>") and asked.prompt.endswith("<|user|>hi")
    fewer = _parsed(
        CHAT, {"model": "chat", "tools": tools[:1], "messages": [{"role": "user", "content": "hi"}]}
    )
    assert len(fewer.prompt) == len(asked.prompt) and fewer.prompt != asked.prompt

    def history(arguments: str) -> RequestInfo:
        messages = [
            {"role": "user", "content": "write the file"},
            {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        return _parsed(CHAT, {"model": "chat", "messages": messages})

    a, b = history("A" * 20000), history("B" * 20000)
    assert a.prompt_tokens > 4000 and a.prompt != b.prompt


def test_responses_input_items_read_like_messages_with_instructions_first() -> None:
    system = "You are careful. " * 100

    def turn(items: list[dict[str, Any]]) -> RequestInfo:
        return _parsed("/v1/responses", {"model": "chat", "instructions": system, "input": items})

    first = [{"role": "user", "content": [{"type": "input_text", "text": "hello " * 200}]}]
    later: list[dict[str, Any]] = [
        *first,
        {"type": "function_call", "name": "search", "arguments": '{"q": "x"}', "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "found " * 100},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hi " * 200}]},
    ]
    a, b = turn(first), turn(later)
    assert a.prompt.startswith("<|system|>You are careful.") and a.prompt_tokens > 500
    assert b.prompt.startswith(a.prompt) and b.prompt_tokens > a.prompt_tokens
    assert turn([{"role": "user", "content": "bye " * 300}]).prompt != a.prompt


def test_a_prompt_of_token_ids_counts_them_and_hashes_them() -> None:
    ids = list(range(1000, 5000))
    a = _parsed("/v1/completions", {"model": "chat", "prompt": ids})
    longer = _parsed("/v1/completions", {"model": "chat", "prompt": [*ids, 7, 7]})
    other = _parsed("/v1/completions", {"model": "chat", "prompt": list(range(20000, 24000))})
    assert a.prompt_tokens == 4000 and a.raw_prompt == tuple(ids)
    assert longer.prompt.startswith(a.prompt[:1000]) and other.prompt != a.prompt


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "prompt"), ("/v1/embeddings", "input")]
)
def test_a_batch_of_token_id_prompts_counts_them_all_and_one_is_its_prompt(
    path: str, field: str
) -> None:
    """`[[ids]]` (the openai client's `Iterable[Iterable[int]]`) is the one prompt `ids` to
    vLLM, but read as no prompt at all: 0 tokens (a 4000-token prefill priced as free), no
    prefix (found by a review helper). A batch counts every prompt, as a list of strings."""
    ids = list(range(1000, 5000))
    flat = _parsed(path, {"model": "chat", field: ids})
    one = _parsed(path, {"model": "chat", field: [ids]})
    assert one.prompt_tokens == flat.prompt_tokens == 4000
    assert one.prompt == flat.prompt and one.raw_prompt == flat.raw_prompt
    batch = _parsed(path, {"model": "chat", field: [ids, list(range(7, 1007))]})
    assert batch.prompt_tokens == 5000 and batch.prompt.startswith(flat.prompt[:1000])
    assert batch.raw_prompt is None  # several prompts: no one prefix to match exactly


def test_a_body_without_model_is_routed_by_the_model_header_whatever_the_strategy() -> None:
    """With the header naming the model, a body that leaves `model` out (engines serve
    theirs) was a 400 only where the strategy read the body."""
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    for model in ("chat", "plain"):
        assert build_request(cfg(), {"x-llmgw-model": model}, CHAT, body).model == model
    with pytest.raises(BadRequest, match="string field 'model'"):
        build_request(cfg(), {}, CHAT, body)
    with pytest.raises(BadRequest, match="string field 'model'"):  # a wrong type still is
        build_request(cfg(), {"x-llmgw-model": "chat"}, CHAT, orjson.dumps({"model": 3}))
    # `"model": ""` too: vLLM's _is_model_supported takes an empty name as its own model.
    empty = orjson.dumps({"model": "", "messages": [{"role": "user", "content": "hi"}]})
    for model in ("chat", "plain"):
        assert build_request(cfg(), {"x-llmgw-model": model}, CHAT, empty).model == model
    with pytest.raises(BadRequest, match="string field 'model'"):
        build_request(cfg(), {}, CHAT, empty)


# -- a browser's CORS preflight -----------------------------------------------------------
PREFLIGHT = {"origin": "http://localhost:3000", "access-control-request-method": "POST"}


@pytest.mark.parametrize("path", [CHAT, "/v1/responses/r1/cancel", "/v1/models", "/v1/models/m"])
def test_a_cors_preflight_is_answered_as_vllm_answers_it(path: str) -> None:
    """vLLM (Starlette's CORSMiddleware, everything allowed) answers a browser's preflight
    with 200; llmgw's 405 kept any browser app off it (found by a review helper)."""
    asked = {**PREFLIGHT, "access-control-request-headers": "authorization, content-type"}
    answer = cors_preflight("OPTIONS", path, asked)
    assert answer is not None
    assert answer["access-control-allow-origin"] == "*"
    assert "POST" in answer["access-control-allow-methods"].split(", ")
    assert answer["access-control-allow-headers"] == "authorization, content-type"
    assert answer["vary"].startswith("Origin")
    assert "access-control-allow-headers" not in (cors_preflight("OPTIONS", path, PREFLIGHT) or {})


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("OPTIONS", CHAT, {"origin": "http://a"}),  # no access-control-request-method
        ("OPTIONS", CHAT, {"access-control-request-method": "POST"}),  # no origin
        ("OPTIONS", CHAT, {**PREFLIGHT, "access-control-request-method": "BREW"}),
        ("OPTIONS", "/admin/explain", PREFLIGHT),
        ("POST", CHAT, PREFLIGHT),
    ],
    ids=["no-request-method", "no-origin", "unknown-method", "other-path", "not-options"],
)
def test_anything_but_a_preflight_is_not_answered_as_one(
    method: str, path: str, headers: dict[str, str]
) -> None:
    assert cors_preflight(method, path, headers) is None
    if method == "OPTIONS" and path == CHAT:  # a plain OPTIONS stays a 405
        assert wrong_method(method, path) is not None
