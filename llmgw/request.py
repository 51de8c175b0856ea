"""Turn what an edge saw (headers, maybe a JSON body) into a RequestInfo.

Shared by both edges so that the same request gets the same RequestInfo, the same
errors and therefore the same Decision, whether it came through Envoy or ASGI.
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.catalog import is_catalog_path
from llmgw.config import Config
from llmgw.errors import BadRequest, BodyTooLarge, MethodNotAllowed
from llmgw.scheduling.plugins import SCORERS
from llmgw.scheduling.strategies import resolve
from llmgw.tokenize import ChatPrompt, TextPrompt
from llmgw.types import CHARS_PER_TOKEN, RequestInfo

# Chat request fields that change what the engine prefills besides the messages.
_TEMPLATE_FIELDS = (
    "tools",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_effort",
    "add_special_tokens",
)
# Paths whose JSON body names the model: the OpenAI-compatible APIs, and vLLM's and SGLang's
# other JSON ones (reranking, scoring, pooling, classification, tokenizing).
BODY_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
)


def on_paths(path: str, paths: tuple[str, ...] = BODY_PATHS) -> bool:
    """Is `path` (its query aside) one of `paths`, or below one? Whole segments only:
    `/tokenizer_info` is not `/tokenize`."""
    bare = path.split("?", 1)[0]
    return bare in paths or any(bare.startswith(p + "/") for p in paths)


# Request header limits past which a client gets 431 (both edges: the proxy checks them as
# it parses, the generated Envoy config with a Lua filter before ext_proc).
CLIENT_MAX_HEADERS = 90
CLIENT_MAX_HEADERS_KB = 60
HEADERS_TOO_LARGE = (
    f"too many or too large request headers (at most {CLIENT_MAX_HEADERS} headers, "
    f"{CLIENT_MAX_HEADERS_KB} KB)"
)


def wrong_method(method: str | None, path: str) -> MethodNotAllowed | None:
    """405 for anything but POST on an inference path (the engines answer the same; without
    this a GET reads as an empty body: "not valid JSON") and anything but GET or HEAD on the
    model catalog (`/v1/models`, `/v1/models/{id}`)."""
    if method is None:
        return None
    bare = path.split("?", 1)[0]
    if bare in BODY_PATHS:
        if method == "POST":
            return None
        allowed = "POST"
    elif is_catalog_path(bare):
        if method in ("GET", "HEAD"):
            return None
        allowed = "GET, HEAD"
    else:
        return None
    return MethodNotAllowed(
        f"{method} is not allowed on {bare}: send the request with {allowed.split(',')[0]}",
        headers={"allow": allowed},
    )


# A browser's CORS preflight answered as vLLM answers it by default (Starlette's
# CORSMiddleware with origins, methods and headers all "*", no credentials).
CORS_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
CORS_MAX_AGE = 600
# On llmgw's own answers to a request with an Origin (the catalog): what vLLM adds.
CORS_ANSWER_HEADERS = {"access-control-allow-origin": "*", "vary": "Origin"}


def cors_preflight(
    method: str | None, path: str, headers: Mapping[str, str]
) -> dict[str, str] | None:
    """The headers of a 200 answer to a browser's CORS preflight (an OPTIONS with `Origin`
    and `Access-Control-Request-Method`) on an inference path or the model catalog: any
    origin, the methods, the headers asked for, as vLLM by default (a browser app sends
    one before a POST with `content-type: application/json`, or a GET with an API key).
    None for any other request (an OPTIONS without them stays a 405)."""
    if method != "OPTIONS" or "origin" not in headers:
        return None
    wanted = headers.get("access-control-request-method")
    bare = path.split("?", 1)[0]
    if wanted not in CORS_METHODS or not (on_paths(bare) or is_catalog_path(bare)):
        return None
    answer = {
        "vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        "access-control-allow-origin": "*",
        "access-control-allow-methods": ", ".join(CORS_METHODS),
        "access-control-max-age": str(CORS_MAX_AGE),
    }
    asked = headers.get("access-control-request-headers")
    if asked is not None:  # any header: the ones asked for, echoed
        answer["access-control-allow-headers"] = asked
    return answer


@dataclass(frozen=True, slots=True)
class BodyFields:
    model: str
    prompt: str
    stream: bool
    prompt_chars: int = 0  # the whole prompt, however much of it `prompt` keeps
    # The body's `messages` list or `prompt` string, uncut (exact prefix matching renders
    # and tokenizes it as the engine does).
    raw_prompt: Any = None
    reads_cache: bool = True  # `RequestInfo.reads_cache`
    cache_salt: str | None = None
    lead_chars: int = 0  # `RequestInfo.lead_tokens`, in characters


# Media parts vLLM turns into placeholder tokens it prefills (576 a LLaVA-1.5 image, 256
# Gemma 3's, ~1,300 Qwen2-VL's at 1024x1024): counted at this many, in characters, and
# kept in the prefix as their URL's digest (the same image, the same text). Counted as
# nothing, "Describe this." with an image read as a 6-token prefill.
MEDIA_PART_TOKENS = 576
_MEDIA_PARTS = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video"}
)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: the text parts, then the media's
        return "".join(_part_text(p) for p in content)
    return ""


def _part_text(part: Any) -> str:
    if isinstance(part, str):  # vLLM takes a bare string part as text
        return part
    if not isinstance(part, dict):
        return ""
    text = part.get("text")
    if isinstance(text, str):
        return text
    kind = part.get("type")
    if kind in _MEDIA_PARTS:
        source = orjson.dumps(part.get(kind, part), option=orjson.OPT_SORT_KEYS)
        digest = hashlib.blake2b(source, digest_size=8).hexdigest()
        tag = f"<|{kind}|>{digest}"
        return tag + "\x00" * max(0, int(MEDIA_PART_TOKENS * CHARS_PER_TOKEN) - len(tag))
    return ""


def prompt_text(payload: Mapping[str, Any], limit: int) -> str:
    """The prompt as one string (role-tagged messages, or `prompt`), cut at `limit` chars."""
    return prompt_parts(payload, limit)[0]


def prompt_parts(payload: Mapping[str, Any], limit: int) -> tuple[str, int, int]:
    """`prompt_text`, the length in characters of the whole prompt it was cut from, and how
    many characters more than its own the text's leading digest stands for (the tools').

    What an engine's template renders, in its order: the tools' schemas (before the
    messages, where templates put them; a digest in the text, their length in the count),
    each message's role and text with the tool calls
    it made (name and arguments), or a completion's prompt; a Responses API `input` list
    (with `instructions` first) reads like messages. Token ids are counted as tokens.
    Without the tools and calls, an agent's request read as a few tokens, and histories
    that differed only in their calls as one prefix."""
    prompt = payload.get("prompt", payload.get("input"))
    batch = _id_prompts(prompt) if payload.get("messages") is None else None
    if batch is not None:
        # A stable text to hash: the same ids, the same text. A batch reads as its prompts
        # one after the other, as a list of strings does: all counted, the first in front.
        ids = ",".join(map(str, itertools.chain.from_iterable(batch)))
        return ids[:limit], int(sum(map(len, batch)) * CHARS_PER_TOKEN), 0
    parts: list[str] = []
    size = lead = kept = 0
    tools = payload.get("tools")
    if isinstance(tools, list) and tools:
        # Counted whole, kept as a digest: a 20 KB tool list verbatim would fill the kept
        # prefix and hide each conversation behind it (every turn of the agent alike).
        schemas = orjson.dumps(tools)
        digest = f"<|tools|>{hashlib.blake2b(schemas, digest_size=8).hexdigest()}"
        parts.append(digest)
        size += len(schemas) + 9
        lead = size - len(digest)
        kept = len(digest)
    for text in _segments(payload, prompt):
        # Past the kept prefix (its text: a tool list past the limit kept no message at
        # all, and every conversation of that agent read as one): only count.
        if kept < limit:
            parts.append(text)
            kept += len(text)
        size += len(text)
    return "".join(parts)[:limit], size, lead


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _id_prompts(value: Any) -> list[list[int]] | None:
    """A prompt of token ids (`[ids]`), or a batch of them (`[[ids], ...]`, the openai
    client's `Iterable[Iterable[int]]`): its id lists; None for any other prompt."""
    if _token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(_token_ids(v) for v in value):
        return value
    return None


def _segments(payload: Mapping[str, Any], prompt: Any) -> Iterator[str]:
    messages = payload.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                yield _message_text(m)
        return
    # The Responses API's `instructions`: a system message before the input, a string or
    # a list (vLLM's construct_input_messages); with a string, it was left out.
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions and "input" in payload:
        yield f"<|system|>{instructions}"
    if isinstance(prompt, str):
        yield prompt
        return
    if not isinstance(prompt, list):
        yield from _pairs_text(payload)
        return
    for item in prompt:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):  # a Responses API input item
            kind = item.get("type")
            if kind == "function_call":
                yield _call_text(item)
            elif kind == "function_call_output":
                output = item.get("output")
                yield f"<|tool|>{output if isinstance(output, str) else ''}"
            elif "role" in item:
                yield _message_text(item)


_PAIR_FIELDS = (("query", "documents"), ("queries", "documents"), ("text_1", "text_2"),
                ("data_1", "data_2"))  # fmt: skip


def _pairs_text(payload: Mapping[str, Any]) -> Iterator[str]:
    """A rerank or score request: the engine prefills the query with each document, so
    the query counts once per document (read as no prompt, 50 documents of 2 KB priced as
    one token)."""
    for first, second in _PAIR_FIELDS:
        if first not in payload:
            continue
        queries = [_item_text(q) for q in _listed(payload.get(first))]
        documents = [_item_text(d) for d in _listed(payload.get(second))]
        for query in queries:
            for document in documents or [""]:
                yield query + document
        return


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def _item_text(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):  # {"text": ...}, or {"content": [parts]}
        text = item.get("text")
        return text if isinstance(text, str) else _content_text(item.get("content"))
    return ""


def _message_text(m: Mapping[str, Any]) -> str:
    text = f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}"
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                text += _call_text(function)
    return text


def _call_text(call: Mapping[str, Any]) -> str:
    """A tool call's name and arguments (a JSON string in the OpenAI APIs)."""
    name, arguments = call.get("name"), call.get("arguments")
    return (
        f"<|call|>{name if isinstance(name, str) else ''}"
        f"{arguments if isinstance(arguments, str) else ''}"
    )


# pydantic's lax-mode words for a bool (vLLM validates its request models so; sim/api.py, which
# may not import the core, keeps its own copy for the simulated engine).
_TRUE_WORDS = frozenset({"true", "yes", "on", "1", "t", "y"})
_FALSE_WORDS = frozenset({"false", "no", "off", "0", "f", "n"})


def lax_bool(value: object) -> bool | None:
    """A bool as pydantic's lax mode reads one: a bool, 0 or 1, or a word such as "true",
    "yes", "off" (any case); None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
    return None


def estimate_tokens(chars: int) -> int:
    return int(chars / CHARS_PER_TOKEN + 0.5)


def check_body_size(size: int, max_bytes: int, *, complete: bool = True) -> None:
    """Raise BodyTooLarge if `size` is over the limit. `complete=False`: `size` is only what
    has arrived so far of a streamed body (or a Content-Length not yet checked against it)."""
    if size > max_bytes:
        what = f"{size} bytes" if complete else f"more than {max_bytes} bytes"
        raise BodyTooLarge(
            f"request body is {what}; the limit is {max_bytes} bytes (limits.max_body_bytes)"
        )


def parse_body(
    body: bytes, *, max_bytes: int, prefix_chars: int, model_given: bool = False
) -> BodyFields:
    """Parse an OpenAI-style JSON body. Raises BadRequest / BodyTooLarge with a clear message.
    `model_given`: a header named the model, so the body may leave it out (engines serve
    their model then) or send null."""
    check_body_size(len(body), max_bytes)
    try:
        # A UTF-8 byte order mark (files saved by Windows tools): vLLM's json.loads skips it.
        payload = orjson.loads(body.removeprefix(b"\xef\xbb\xbf"))
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(payload).__name__}")
    model = payload.get("model")
    if model in (None, "") and model_given:  # vLLM serves its model for both
        model = ""
    elif not isinstance(model, str) or not model:
        raise BadRequest("request body needs a string field 'model'")
    # Absent or null: the OpenAI API's "boolean or null". Else what vLLM's lax validation
    # reads as a bool ("true" and 1 stream there).
    given = payload.get("stream")
    stream = False if given is None else lax_bool(given)
    if stream is None:
        raise BadRequest("field 'stream' must be a boolean or null")
    messages = payload.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise BadRequest("field 'messages' must be an array")
    prompt, chars, lead = prompt_parts(payload, prefix_chars)
    raw: Any = messages
    if messages is None:
        raw = _completion_prompt(payload.get("prompt"))
        if isinstance(raw, str) and payload.get("add_special_tokens") is False:
            raw = TextPrompt(raw, add_special_tokens=False)  # vLLM's default: true
    elif payload.get("chat_template") is not None:
        # The request's own template (vLLM with --trust-request-chat-template renders
        # with it): no tokens to match exactly, the approximate index decides. Rendered
        # with the model's, it was credited the default rendering's cached blocks.
        raw = None
    elif any(payload.get(k) is not None for k in _TEMPLATE_FIELDS):
        raw = _chat_prompt(payload, messages)
    salt = payload.get("cache_salt")
    return BodyFields(
        model=model,
        prompt=prompt,
        stream=stream,
        prompt_chars=chars,
        raw_prompt=raw,
        reads_cache=_reads_cache(payload),
        cache_salt=salt if isinstance(salt, str) and salt else None,
        lead_chars=lead,
    )


def _reads_cache(payload: Mapping[str, Any]) -> bool:
    """Whether vLLM reads its prefix cache for this body: not for prompt logprobs (asked,
    or a completion's echo with logprobs) nor `skip_reading_prefix_cache`."""
    if (
        payload.get("skip_reading_prefix_cache") is True
        or payload.get("prompt_logprobs") is not None
    ):
        return False
    return not (payload.get("echo") is True and payload.get("logprobs") is not None)


def _chat_prompt(payload: Mapping[str, Any], messages: list[Any]) -> ChatPrompt:
    """What vLLM renders a chat request with besides its messages: its kwargs are the
    request's `chat_template_kwargs` with its own fields over them (build_chat_params in
    vllm/entrypoints/openai/chat_completion/protocol.py: add_generation_prompt (true) and
    continue_final_message (false) always, documents and reasoning_effort when given,
    enable_thinking from reasoning_effort unless the kwargs set it)."""
    given = payload.get("chat_template_kwargs")
    kwargs = dict(given) if isinstance(given, dict) else {}
    generation, final = payload.get("add_generation_prompt"), payload.get("continue_final_message")
    kwargs["add_generation_prompt"] = True if generation is None else generation
    kwargs["continue_final_message"] = False if final is None else final
    effort = payload.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort != "none"
    for name in ("documents", "reasoning_effort"):
        if payload.get(name) is not None:
            kwargs[name] = payload[name]
    return ChatPrompt(
        messages, payload.get("tools"), kwargs, payload.get("add_special_tokens") is True
    )


def _completion_prompt(prompt: Any) -> str | tuple[int, ...] | None:
    """A completion's prompt as the tokenizer takes it: text, or token ids as given (a list
    of them is not chat messages); a batch of one (`["text"]`, `[[ids]]`) is its prompt;
    several prompts in one request: None (no one prefix)."""
    if isinstance(prompt, str):
        return prompt
    if _token_ids(prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        only = prompt[0]
        if isinstance(only, str):
            return only
        if _token_ids(only):
            return tuple(only)
    return None


def _other_body(
    body: bytes, *, max_bytes: int, prefix_chars: int, model_given: bool = False
) -> BodyFields | None:
    """A body on a path whose body llmgw does not know (the ext_proc edge reads it, as GIE's
    reference picker reads every path's): an OpenAI-style body as `parse_body` reads it,
    else its string `model` alone, else None (nothing to route on: not JSON, not an object,
    no model)."""
    try:
        return parse_body(
            body, max_bytes=max_bytes, prefix_chars=prefix_chars, model_given=model_given
        )
    except BadRequest:
        pass
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str) or not model:
        return None
    return BodyFields(model=model, prompt="", stream=False)


def needs_body(config: Config, headers: Mapping[str, str], path: str) -> bool:
    """Is the body needed to route: no model header, or a strategy that reads the prompt
    (on an inference path itself: below one, `/v1/responses/{id}/cancel`, a body holds no
    prompt, and often there is none: ext_proc, asking for it, could be answered by bodiless
    HTTP/2 trailers, too late to route on)?"""
    if not on_paths(path):
        return False
    model = headers.get(config.model_header)
    if not model:  # absent, or sent empty: the body names it
        return True
    if path.split("?", 1)[0] not in BODY_PATHS:
        return False
    spec = config.models.get(model)
    return spec is not None and any(
        getattr(SCORERS.get(name), "needs_prompt", False) for name in resolve(spec.strategy).scorers
    )


def session_key(config: Config, headers: Mapping[str, str], model: str) -> str | None:
    spec = config.models.get(model)
    names = spec.session.headers if spec is not None else ("x-session-id",)
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


# Ids for requests that come without `x-request-id` (both edges): a random per-process
# prefix and a counter, 32 hex digits like `uuid4().hex` (which costs a getrandom call each).
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def next_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFFFFFFFFFF:016x}"


def build_request(
    config: Config,
    headers: Mapping[str, str],
    path: str,
    body: bytes | None,
    *,
    request_id: str | None = None,
) -> RequestInfo:
    """Headers are lower-cased names. Raises the core's typed errors on bad input.

    The body is parsed on an inference path, and below one only when it is not empty:
    vLLM's `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` come without one
    (the model header names the model there)."""
    fields: BodyFields | None = None
    exact = path.split("?", 1)[0] in BODY_PATHS
    # One model served: a request that names none is that model's, as an engine serving one
    # model takes a body without `model` (and GIE's picker, one per pool, routes bodyless
    # requests: its conformance suite sends plain GETs to a pool's routes).
    only = next(iter(config.models)) if len(config.models) == 1 else None
    if body is not None and (body or exact):
        read = parse_body if on_paths(path) else _other_body
        fields = read(
            body,
            max_bytes=config.limits.max_body_bytes,
            prefix_chars=config.limits.prompt_prefix_chars,
            model_given=bool(headers.get(config.model_header)) or only is not None,
        )
    model = headers.get(config.model_header) or (fields.model if fields else None) or only
    if not model:
        if not on_paths(path):
            raise BadRequest(
                f"cannot tell the model: send a {config.model_header} header (llmgw reads "
                f"'model' from the body on {', '.join(BODY_PATHS)}, and behind a gateway "
                "from a POST's JSON object body on any path)"
            )
        if fields is None and not exact:
            raise BadRequest(
                f"cannot tell the model: the request has no body to name it; "
                f"send a {config.model_header} header"
            )
        raise BadRequest(
            f"cannot tell the model: send a JSON body with 'model' or a {config.model_header} header"
        )
    rid = request_id or headers.get("x-request-id") or next_request_id()
    return RequestInfo(
        model=model,
        request_id=rid,
        session_key=session_key(config, headers, model),
        path=path,
        prompt=fields.prompt if fields else "",
        stream=fields.stream if fields else False,
        body_size=len(body) if body is not None else 0,
        headers=headers,
        prompt_tokens=estimate_tokens(fields.prompt_chars) if fields else 0,
        raw_prompt=fields.raw_prompt if fields else None,
        reads_cache=fields.reads_cache if fields else True,
        cache_salt=fields.cache_salt if fields else None,
        lead_tokens=estimate_tokens(fields.lead_chars) if fields else 0,
    )
