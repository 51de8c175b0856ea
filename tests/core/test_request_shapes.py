"""Request shapes vLLM 0.32 accepts that llmgw refused or mis-read: Responses instructions
with a string input, string content parts, a UTF-8 BOM, media parts, rerank and score."""

from __future__ import annotations

from typing import Any

import orjson

from llmgw.request import build_request
from llmgw.types import RequestInfo

from .helpers import config, static_model

CHAT = "/v1/chat/completions"


def _parsed(path: str, payload: dict[str, Any] | bytes) -> RequestInfo:
    cfg = config({"chat": static_model(2)})
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return build_request(cfg, {}, path, raw)


def test_responses_instructions_count_with_a_string_input() -> None:
    """vLLM's Responses API renders `instructions` as a system message before the input,
    whether `input` is a list or a plain string (construct_input_messages in
    vllm/entrypoints/openai/responses/utils.py). llmgw reads it only for a list input: the
    canonical `responses.create(instructions=..., input="...")` is priced and prefixed as
    its few words of input alone."""
    system = "You are a careful assistant. " * 400  # ~11,600 chars, ~2,900 tokens
    info = _parsed("/v1/responses", {"model": "chat", "instructions": system, "input": "hi"})
    assert info.prompt_tokens > 2000, info.prompt_tokens
    assert info.prompt.startswith("<|system|>You are a careful assistant.")
    other = _parsed(
        "/v1/responses", {"model": "chat", "instructions": "Another agent. " * 800, "input": "hi"}
    )
    assert other.prompt != info.prompt  # two agents' prompts are not one prefix


def test_chat_content_parts_given_as_plain_strings_are_read() -> None:
    """vLLM accepts a content part that is a plain string (`ChatCompletionContentPartParam`
    includes `str`; `_parse_chat_message_content_part` keeps it as text), and llmgw's exact
    renderer reads it too (chat_template.py), but the estimate and the approximate prefix
    drop it: an 8,000-character message reads as 0 tokens and every such request as the
    same prefix."""
    doc = "The quick brown fox jumps over the lazy dog. " * 180  # ~8,100 chars
    info = _parsed(CHAT, {"model": "chat", "messages": [{"role": "user", "content": [doc]}]})
    assert info.prompt_tokens > 1500, info.prompt_tokens
    other = _parsed(
        CHAT,
        {"model": "chat", "messages": [{"role": "user", "content": ["something else " * 500]}]},
    )
    assert other.prompt != info.prompt


def test_a_json_body_with_a_utf8_bom_is_accepted_as_vllm_accepts_it() -> None:
    """vLLM parses the body with Starlette's `json.loads(bytes)`, which detects the encoding
    and skips a UTF-8 byte order mark (a file written by Windows tools, sent with
    `curl --data-binary @req.json`). llmgw's orjson refuses it: 400 "not valid JSON" for a
    request the engine serves."""
    body = orjson.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    info = _parsed(CHAT, b"\xef\xbb\xbf" + body)
    assert info.model == "chat" and info.prompt == "<|user|>hi"


def test_an_image_part_counts_as_the_tokens_the_engine_prefills_for_it() -> None:
    """vLLM replaces each image part with its placeholder tokens (LLaVA-1.5: 576 per image,
    Qwen2-VL: ~1,300 for 1024x1024, Gemma 3: 256, Pixtral: up to 4,096) and prefills them
    all; llmgw reads the text parts only, so "describe this" with an image is priced as
    a 4-token prefill, two orders of magnitude below what the engine computes."""
    pixels = "iVBORw0KGgo" + "A" * 200_000  # a ~150 KB PNG as a data URL
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Describe this."},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixels}"}},
        ],
    }
    info = _parsed(CHAT, {"model": "chat", "messages": [message]})
    assert info.prompt_tokens >= 256, info.prompt_tokens


def test_a_rerank_request_counts_its_query_and_documents() -> None:
    """vLLM's rerank/score (`query` + `documents`, `queries`/`documents`, `text_1`/`text_2`)
    prefills each document with the query; llmgw reads them as no prompt: 50 documents of
    2,000 characters each are priced as a 1-token prefill."""
    docs = [f"document {i} " + "lorem ipsum dolor sit amet " * 75 for i in range(50)]
    info = _parsed("/v1/rerank", {"model": "chat", "query": "what is lorem", "documents": docs})
    assert info.prompt_tokens > 20000, info.prompt_tokens
    score = _parsed("/score", {"model": "chat", "text_1": "what is lorem", "text_2": docs})
    assert score.prompt_tokens > 20000, score.prompt_tokens
