"""OpenAI-compatible request validation and vLLM-shaped response bodies (pure)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.sim.tokens import chat_prompt

CHAT = "chat"
COMPLETION = "completion"
SYSTEM_FINGERPRINT = "llmgw-sim"
COMPLETION_DEFAULT_MAX_TOKENS = 16

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's error shape: {"error": {"message", "type", "param", "code"}}."""
    error_type = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error")
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


@dataclass(frozen=True)
class CompletionCall:
    """A validated /v1/chat/completions or /v1/completions request."""

    kind: str
    model: str
    prompt: str
    # Set when the prompt came as token ids: the engine takes them as they are.
    prompt_token_ids: tuple[int, ...] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool


# vLLM's request models validate in pydantic's lax mode; these take what it takes (the
# router's `llmgw.request.lax_bool` is a copy: the simulator may not import the core).
_INT_TEXT = re.compile(r"[+-]?\d+(?:_\d+)*(?:\.0*)?")
_TRUE = frozenset({"true", "yes", "on", "1", "t", "y"})
_FALSE = frozenset({"false", "no", "off", "0", "f", "n"})


def _lax_int(value: object) -> int | None:
    """An int as pydantic's lax mode reads one: an int or bool, an integral float, a string
    of digits (spaces around, `_` between, `.0` after); None otherwise."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and _INT_TEXT.fullmatch(text := value.strip()):
        return int(text.split(".")[0])
    return None


def _lax_bool(value: object) -> bool | None:
    """A bool as pydantic's lax mode reads one: a bool, 0 or 1, or a word such as "true",
    "yes", "off" (any case); None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    return None


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    raw = body.get(name)
    if raw is None:
        return None
    value = _lax_int(raw)
    if value is None:
        raise ApiError(400, f"{name}: Input should be a valid integer", name)
    if value < minimum:
        raise ApiError(400, f"{name}: Input should be greater than or equal to {minimum}", name)
    return value


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    raw = body.get(name, False)
    if raw is None:
        return False
    value = _lax_bool(raw)
    if value is None:
        raise ApiError(400, f"{name}: Input should be a valid boolean", name)
    return value


def parse_call(kind: str, raw: bytes) -> CompletionCall:
    """Validate a request body; raises ApiError(400) with the offending field."""
    try:
        # vLLM's json.loads skips a UTF-8 byte order mark (files saved by Windows tools).
        body = orjson.loads(raw.removeprefix(b"\xef\xbb\xbf"))
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    model = body.get("model")
    if model is None:  # vLLM: `model: str | None = None`, served by the default model
        model = ""
    if not isinstance(model, str):
        raise ApiError(400, "model: Input should be a valid string", "model")
    prompt_token_ids: tuple[int, ...] | None = None
    if kind == CHAT:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages: Field required", "messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages: Input should be a valid list of objects", "messages")
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages.{index}.role: Field required", "messages")
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise ApiError(
                    400, f"messages.{index}.content: Input should be a valid string", "messages"
                )
        prompt = chat_prompt(messages)
    else:
        raw_prompt = body.get("prompt")
        if raw_prompt is None:
            raise ApiError(400, "prompt: Field required", "prompt")
        if isinstance(raw_prompt, list) and not raw_prompt:
            raise ApiError(400, "please provide at least one prompt", "prompt")
        if (
            isinstance(raw_prompt, list)
            and len(raw_prompt) == 1
            and not isinstance(raw_prompt[0], int)
        ):
            raw_prompt = raw_prompt[0]  # a batch of one: that prompt
        if isinstance(raw_prompt, list) and all(isinstance(p, str | list) for p in raw_prompt):
            # vLLM answers a batch with a choice per prompt; joined into one, a client lost
            # answers without an error.
            raise ApiError(
                400,
                "prompt: the simulator serves one prompt per request; send each of the "
                f"{len(raw_prompt)} prompts on its own",
                "prompt",
            )
        if isinstance(raw_prompt, str):
            prompt = raw_prompt
        elif isinstance(raw_prompt, list) and all(
            isinstance(p, int) and not isinstance(p, bool) for p in raw_prompt
        ):
            prompt = " ".join(map(str, raw_prompt))
            prompt_token_ids = tuple(raw_prompt)
        else:
            raise ApiError(400, "prompt: Input should be a string or a list of tokens", "prompt")
    max_tokens = _optional_int(body, "max_tokens", 1)
    if kind == CHAT:  # vLLM: max_completion_tokens, else max_tokens
        completion = _optional_int(body, "max_completion_tokens", 1)
        if completion is not None:
            max_tokens = completion
    elif "max_tokens" not in body:
        # vLLM's CompletionRequest: `max_tokens: int | None = 16` (OpenAI's default); chat
        # has none, and the simulator then draws a natural length.
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    n = _optional_int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "n: only n=1 is supported by the simulator", "n")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    # vLLM's check, on the raw values: `data.get("stream_options") and not data.get("stream")`
    # (an empty stream_options passes it).
    if options and not body.get("stream"):
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options: Input should be a valid object", "stream_options")
        include_usage = _optional_bool(options, "include_usage")
    return CompletionCall(
        kind=kind,
        model=model,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def full_response(
    call: CompletionCall,
    response_id: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
) -> bytes:
    usage: dict[str, Any] = _usage(prompt_tokens, completion_tokens)
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if call.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        kind = "text_completion"
    return orjson.dumps(
        {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": call.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def first_chunk(call: CompletionCall, response_id: str, created: int) -> bytes | None:
    """The chat role chunk vLLM sends before any token; completions have none."""
    if call.kind != CHAT:
        return None
    return _sse(
        {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": call.model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": None,
            "prompt_text": None,
        }
    )


def token_chunk(
    call: CompletionCall, response_id: str, created: int, piece: str, finish_reason: str | None
) -> bytes:
    """One token's chunk; the last one carries finish_reason and stop_reason."""
    choice: dict[str, Any]
    if call.kind == CHAT:
        choice = {"index": 0, "delta": {"content": piece}, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["stop_reason"] = None
    if call.kind == CHAT:
        choice["token_ids"] = None
    return _sse(
        {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": call.model,
            "choices": [choice],
        }
    )


def usage_chunk(
    call: CompletionCall,
    response_id: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
) -> bytes:
    return _sse(
        {
            "id": response_id,
            "object": "chat.completion.chunk" if call.kind == CHAT else "text_completion",
            "created": created,
            "model": call.model,
            "choices": [],
            "usage": _usage(prompt_tokens, completion_tokens),
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
    )


def models_body(models: list[str], created: int, max_model_len: int) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": None,
                    "max_model_len": max_model_len,
                }
                for name in models
            ],
        }
    )
