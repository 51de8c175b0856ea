"""Pure translation between Envoy ext_proc v3 messages and the core's plain objects.

Protobuf in (upb-backed classes from `xds-protos`), RequestInfo/Decision in the middle,
serialized `ProcessingResponse` bytes out. No I/O, no gRPC: `extproc/server.py` owns the
stream, `Exchange` here owns the per-request protocol state.

The protocol (Gateway API Inference Extension endpoint picker, v1.0.0):

1. `request_headers`: if the body is not needed to route (`llmgw.request.needs_body`; on
   a path llmgw does not know, a POST's body whenever no header names the model, as GIE's
   reference picker reads every path's), decide now. Else, by the body mode the gateway
   configured (`protocol_config`, sent in the first message): FULL_DUPLEX_STREAMED (GIE's
   reference mode) holds the headers answer and collects the body chunks; BUFFERED waits
   for the whole body; NONE (llmgw's own config) asks for a BUFFERED body with
   `mode_override` (`allow_mode_override`).
   A gateway that sends no `:path` is not Envoy (NGINX Gateway Fabric's shim: the
   client's headers, then the whole body, and the endpoint is read from the headers
   answer only): its body is always read and the headers answer held, as in
   FULL_DUPLEX_STREAMED, then answered before the body's (`CONTINUE`) answer; it reports
   no response, so its stream's end is the outcome `unknown`.
2. Body complete (end_of_stream, or trailers in FULL_DUPLEX_STREAMED): decide. In
   FULL_DUPLEX_STREAMED the held headers answer goes first, then every chunk unchanged
   (`streamed_response`), then the trailers answer: Envoy requires that order. A body
   over `limits.max_body_bytes` is refused with 413 as soon as it passes the limit.
3. The routing answer: header `x-gateway-destination-endpoint` and dynamic metadata
   `envoy.lb` {`x-gateway-destination-endpoint`} carry the same value (the protocol forbids
   two): `primary,fb1,fb2`. A subset hint (`envoy.lb.subset_hint` filter metadata
   `x-gateway-destination-endpoint-subset`) limits the pick; none eligible: 503. Errors
   become an ImmediateResponse with the error's status, OpenAI-style JSON body and headers.
4. `response_headers`: the status decides the outcome; the host that served it
   (`envoy.lb` metadata `x-gateway-destination-endpoint-served`, else the `x-llmgw-upstream`
   header llmgw's generated config adds) is charged. The first streamed response body chunk
   is the first token (not the headers: vLLM sends them before prefill ends; not a buffered
   body: it comes when the answer is whole). Response body
   chunks pass through unchanged. With response bodies on, a stream that closes before
   the body's end was cut by the client: `cancelled`, whatever the status said. In any
   mode, a stream reset while its last answer was being written (`close(aborted=True)`:
   Envoy gave up waiting) is cut the same way.
   With `debug_headers`, the response carries `x-llmgw-decision` (endpoint + rationale).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]
from google.protobuf.struct_pb2 import Struct  # type: ignore[import-untyped]

from llmgw.errors import BodyTooLarge, LlmgwError
from llmgw.gateway import Gateway
from llmgw.lifecycle import (
    DECISION_HEADER,
    DESTINATION_HEADER,
    METADATA_NAMESPACE,
    NO_HOOKS,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    UPSTREAM_HEADER,
    AwaitActivation,
    Hooks,
    Lifecycle,
    debug_summary,
)
from llmgw.request import (
    CORS_ANSWER_HEADERS,
    check_body_size,
    cors_preflight,
    needs_body,
    on_paths,
    wrong_method,
)
from llmgw.scheduling.picking import canonical_hint
from llmgw.types import Decision, Endpoint, Outcome, outcome_for_status

# GIE's conformance suite (behind `conformance_headers`): the EPP picks among the IPs in
# the request header, and names the endpoint that served in the response header.
CONFORMANCE_SELECT_HEADER = "test-epp-endpoint-selection"
CONFORMANCE_SERVED_HEADER = "x-conformance-test-served-endpoint"

# Body send modes (ProcessingMode.BodySendMode), as plain ints for cheap comparisons.
NONE = int(ProcessingMode.NONE)
STREAMED = int(ProcessingMode.STREAMED)
BUFFERED = int(ProcessingMode.BUFFERED)
BUFFERED_PARTIAL = int(ProcessingMode.BUFFERED_PARTIAL)
FULL_DUPLEX_STREAMED = int(ProcessingMode.FULL_DUPLEX_STREAMED)
UNSAID = -1  # Envoy before 1.33 sends no protocol_config: the configured mode is unknown
# A body whose end is not marked is parsed to see whether it is whole: at most this many
# times `limits.max_body_bytes` in all, per request (`Exchange._whole`).
_PARSE_BUDGET = 4

# One answer, or several in order (FULL_DUPLEX_STREAMED), or none yet (an empty tuple).
Answer = bytes | tuple[bytes, ...]

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _serialize(message: ProcessingResponse) -> bytes:
    data: bytes = message.SerializeToString()
    return data


# Constant answers, serialized once.
CONTINUE_REQUEST_HEADERS = _serialize(ProcessingResponse(request_headers=HeadersResponse()))
CONTINUE_REQUEST_BODY = _serialize(ProcessingResponse(request_body=BodyResponse()))
CONTINUE_REQUEST_TRAILERS = _serialize(ProcessingResponse(request_trailers=TrailersResponse()))
CONTINUE_RESPONSE_HEADERS = _serialize(ProcessingResponse(response_headers=HeadersResponse()))
CONTINUE_RESPONSE_BODY = _serialize(ProcessingResponse(response_body=BodyResponse()))
CONTINUE_RESPONSE_TRAILERS = _serialize(ProcessingResponse(response_trailers=TrailersResponse()))
STRIP_UPSTREAM_HEADER = _serialize(
    ProcessingResponse(
        response_headers=HeadersResponse(
            response=CommonResponse(
                header_mutation=HeaderMutation(remove_headers=[UPSTREAM_HEADER])
            )
        )
    )
)


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """Lower-cased name -> value. Envoy sends `raw_value` (bytes); older versions `value`."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        raw = h.raw_value
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


# A gRPC error's HTTP equivalent (gRPC's own mapping, doc/http-grpc-status-mapping.md, the
# other way round): an engine's gRPC front end answers an error as HTTP 200 with
# `grpc-status` in a headers-only answer. Codes not listed are 500.
_GRPC_AS_HTTP = {
    b"1": 499, b"3": 400, b"4": 504, b"5": 404, b"6": 409, b"7": 403, b"8": 429, b"9": 400,
    b"10": 409, b"11": 400, b"12": 501, b"14": 503, b"16": 401,
}  # fmt: skip


def response_head(headers: HttpHeaders) -> tuple[int, str | None, str | None]:
    """`:status`, the `x-llmgw-upstream` value and the content type, without building a
    dict of every header. A gRPC answer's 200 carrying a `grpc-status` other than 0 (a
    trailers-only error) reads as that error's HTTP equivalent."""
    status, upstream, content_type = 0, None, None
    grpc: bytes | None = None
    for h in headers.headers.headers:
        key = h.key
        if key == ":status":
            # Three ASCII digits, else 0 (unknown): bytes.isdigit() is ASCII-only, so odd
            # input (invalid UTF-8, "²", 5000 digits) never raises here.
            raw = h.raw_value or h.value.encode()
            status = int(raw) if len(raw) == 3 and raw.isdigit() else 0
        elif key == UPSTREAM_HEADER:
            raw = h.raw_value
            upstream = raw.decode("utf-8", "replace") if raw else h.value
        elif key == "content-type":
            raw = h.raw_value
            content_type = raw.decode("latin-1") if raw else h.value
        elif key == "grpc-status":
            grpc = (h.raw_value or h.value.encode()).strip()
    if (
        grpc is not None
        and grpc != b"0"
        and status == 200
        and content_type is not None
        and content_type.startswith("application/grpc")
    ):
        status = _GRPC_AS_HTTP.get(grpc, 500)
    return status, upstream, content_type


def _set(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


_ROUTE_CACHE: dict[tuple[tuple[str, ...], bool, int | None], bytes] = {}
_ROUTE_CACHE_LIMIT = 4096
# A request handed off to a gateway that reports no response is counted in flight at most
# this long (its predicted first token, normally far sooner).
_HAND_OFF_MAX_S = 30.0


def route_response(
    decision: Decision,
    *,
    after_body: bool,
    fallbacks: bool = True,
    response_headers_for: int | None = None,
) -> bytes:
    """The routing answer to request headers (or, after a buffered body, to the body).

    It depends only on the destination list, and a pool has few distinct lists: the
    serialized bytes are cached (building the message costs more than the routing).
    `fallbacks=False`: the primary only (ORIGINAL_DST gateways cannot parse a list).
    `response_headers_for`: a headers answer that also turns the response headers on
    (`mode_override`; llmgw's own config leaves them off so that Envoy's own replies to
    requests ext_proc never saw are not held for it), keeping this response body mode.
    """
    key = (
        decision.destinations if fallbacks else decision.destinations[:1],
        after_body,
        response_headers_for,
    )
    cached = _ROUTE_CACHE.get(key)
    if cached is None:
        if len(_ROUTE_CACHE) >= _ROUTE_CACHE_LIMIT:
            _ROUTE_CACHE.clear()
        cached = _ROUTE_CACHE[key] = _build_route_response(*key)
    return cached


def _build_route_response(
    destinations: tuple[str, ...], after_body: bool, response_headers_for: int | None
) -> bytes:
    # The same value in the header and the metadata: the protocol forbids two.
    value = ",".join(destinations)
    common = CommonResponse(
        header_mutation=HeaderMutation(set_headers=[_set(DESTINATION_HEADER, value)]),
        clear_route_cache=True,
    )
    metadata = Struct()
    metadata.fields[METADATA_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    if after_body:
        message = ProcessingResponse(
            request_body=BodyResponse(response=common), dynamic_metadata=metadata
        )
    else:
        message = ProcessingResponse(
            request_headers=HeadersResponse(response=common), dynamic_metadata=metadata
        )
        if response_headers_for is not None:
            message.mode_override.CopyFrom(_override(NONE, response_headers_for))
    return _serialize(message)


def debug_response_headers(
    decision: Decision | None, endpoint: Endpoint | None = None, *, served: str | None = None
) -> bytes:
    """Answer to response headers that shows the client why (`debug_headers: true`) and,
    with `served`, the conformance-test header naming the endpoint that served."""
    mutation = HeaderMutation(remove_headers=[UPSTREAM_HEADER])
    if decision is not None:
        mutation.set_headers.append(_set(DECISION_HEADER, debug_summary(decision, endpoint)))
    if served is not None:
        mutation.set_headers.append(_set(CONFORMANCE_SERVED_HEADER, served))
    return _serialize(
        ProcessingResponse(
            response_headers=HeadersResponse(response=CommonResponse(header_mutation=mutation))
        )
    )


def local_response(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """A reply from Envoy itself (JSON unless said), for paths llmgw answers without an
    upstream; `headers`: more to set."""
    more = [_set(k, v) for k, v in (headers or {}).items()]
    return _serialize(
        ProcessingResponse(
            immediate_response=ImmediateResponse(
                status=HttpStatus(code=status),
                headers=HeaderMutation(set_headers=[_set("content-type", content_type), *more]),
                body=body,
                details="llmgw_local",
            )
        )
    )


# Answers GET paths no upstream serves (`/v1/models`, health probes): (status, JSON body),
# or None to route the request as usual.
LocalAnswers = Callable[[str], tuple[int, bytes] | None]


def immediate_response(error: LlmgwError, *, cors: bool = False) -> bytes:
    """A local reply from Envoy with the error's status, JSON body and headers; `cors`: to
    a browser's request (`Origin`), with `CORS_ANSWER_HEADERS` as well."""
    more = error.response_headers()
    if cors:
        more = {**more, **CORS_ANSWER_HEADERS}
    headers = HeaderMutation(set_headers=[_set(k, v) for k, v in more.items()])
    return _serialize(
        ProcessingResponse(
            immediate_response=ImmediateResponse(
                status=HttpStatus(code=error.status),
                headers=headers,
                body=error.body(),
                details=f"llmgw_{error.code}",
            )
        )
    )


def _streamed_body(direction: str, chunk: bytes, end_of_stream: bool) -> bytes:
    """A body chunk passed back unchanged; `direction`: request_body or response_body."""
    mutation = BodyMutation(
        streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    )
    body = BodyResponse(response=CommonResponse(body_mutation=mutation))
    return _serialize(ProcessingResponse(**{direction: body}))


def streamed_request_body(chunk: bytes, *, end_of_stream: bool) -> bytes:
    """A request body chunk passed back unchanged (FULL_DUPLEX_STREAMED needs one per chunk)."""
    return _streamed_body("request_body", chunk, end_of_stream)


def streamed_response_body(chunk: bytes, *, end_of_stream: bool) -> bytes:
    """A response body chunk passed back unchanged (FULL_DUPLEX_STREAMED)."""
    return _streamed_body("response_body", chunk, end_of_stream)


def _host_port(value: str) -> tuple[str, str | None]:
    """`ip:port`, `[v6]:port`, or an IP alone (v4 or v6, port None)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest.removeprefix(":") or None
    if value.count(":") == 1:
        host, port = value.split(":")
        return host, port
    return value, None


def _narrower(a: str, b: str) -> str | None:
    """What two endpoint names (`ip:port` or an IP alone) both allow: the one with a port
    where the hosts match, None where they allow nothing in common."""
    host_a, port_a = _host_port(a)
    host_b, port_b = _host_port(b)
    if host_a != host_b or (port_a is not None and port_b is not None and port_a != port_b):
        return None
    return a if port_a is not None else b


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        return False


def _override(request_body_mode: int, response_body_mode: int) -> ProcessingMode:
    """The processing mode llmgw asks for (`mode_override`, needs `allow_mode_override`):
    response headers on (the outcome), the gateway's response body mode kept.

    Request trailers are sent with a BUFFERED body: an HTTP/2 request whose trailers follow
    no body at all brings no body message, only them, and must still be decided (Envoy
    sends a body that trailers end as one message with `end_of_stream` false)."""
    return ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        response_header_mode=ProcessingMode.SEND,
        request_body_mode=request_body_mode,
        response_body_mode=response_body_mode,
        request_trailer_mode=ProcessingMode.SEND if request_body_mode else ProcessingMode.SKIP,
        # Where response bodies come, so do their trailers: a body that trailers end (an
        # HTTP/2 or gRPC engine) comes with end_of_stream false, and only they say it ended.
        response_trailer_mode=ProcessingMode.SEND if response_body_mode else ProcessingMode.SKIP,
    )


def _ask_for_body(response_body_mode: int) -> bytes:
    """Headers answer that switches the request body to BUFFERED."""
    return _serialize(
        ProcessingResponse(
            request_headers=HeadersResponse(),
            mode_override=_override(BUFFERED, response_body_mode),
        )
    )


# Ask for the whole request body; keep the response headers (for the outcome).
ASK_FOR_BODY = _ask_for_body(NONE)
_ASK_FOR_BODY = {
    NONE: ASK_FOR_BODY,
    STREAMED: _ask_for_body(STREAMED),
    BUFFERED: _ask_for_body(BUFFERED),
}


def _protocol_modes(message: ProcessingRequest) -> tuple[int, int]:
    """The body modes the gateway configured (sent in the first message since Envoy 1.33;
    absent: headers only, llmgw asks for the body with `mode_override`)."""
    if message.HasField("protocol_config"):
        config = message.protocol_config
        return int(config.request_body_mode), int(config.response_body_mode)
    return NONE, NONE


def _subset_hint(message: ProcessingRequest) -> tuple[str, ...] | None:
    """The endpoints the gateway allows for this request (None: no hint, any endpoint)."""
    value = metadata_value(message, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    if isinstance(value, str):  # tolerate "a,b" as well as the list the protocol specifies
        value = [value]
    if not isinstance(value, list):
        return ()
    # An entry may itself join several with commas (GIE's conformance picker splits them).
    return tuple(
        canonical_hint(part.strip())
        for v in value
        if isinstance(v, str)
        for part in v.split(",")
        if part.strip()
    )


MALFORMED = object()  # a metadata value that has no JSON form


def metadata_value(message: ProcessingRequest, namespace: str, key: str) -> Any:
    """`metadata_context.filter_metadata[namespace][key]` as plain Python, or None."""
    if not message.HasField("metadata_context"):
        return None
    spaces = message.metadata_context.filter_metadata
    if namespace not in spaces:
        return None
    fields = spaces[namespace].fields
    if key not in fields:
        return None
    try:
        return MessageToDict(fields[key])  # Value -> str | list | ...
    except ValueError:  # NaN or Infinity in it: no JSON value; the callers refuse a non-str
        return MALFORMED


def _served_report(message: ProcessingRequest, served: Any, upstream: str | None) -> str:
    """The conformance suite's served endpoint: what the gateway reported, never llmgw's
    own pick (a gateway that routed elsewhere must fail the test). `envoy.lb` metadata
    verbatim, else the `x-llmgw-upstream` header (Envoy's upstream host, in llmgw's own
    config), else the value GIE's conformance picker gives when the metadata is missing."""
    if isinstance(served, str):
        return served
    if upstream:
        return upstream
    if not message.HasField("metadata_context") or (
        METADATA_NAMESPACE not in message.metadata_context.filter_metadata
    ):
        return "fail: missing envoy lb metadata"
    return "fail: missing destination endpoint served metadata"


class Exchange:
    """The protocol state of one ext_proc stream (one HTTP request). Not thread-safe.

    `handle(message)` answers every message with bytes (one answer), a tuple of answers
    (FULL_DUPLEX_STREAMED: the held headers answer then the body chunks; empty = nothing
    yet), or `AwaitActivation` when an on-demand model must start first: the server awaits
    `llmgw.runtime.driver.activate` and sends `answer(result)`. `close()` must be called
    when the stream ends for any reason; it releases the lease if the response did not.
    """

    __slots__ = (
        "_after_body",
        "_body",
        "_body_ended",
        "_body_size",
        "_envoy",
        "_grpc",
        "_headers",
        "_held",
        "_local",
        "_parsed",
        "_path",
        "_replied",
        "_request_mode",
        "_response_ended",
        "_response_mode",
        "_subset",
        "_trailers",
        "lifecycle",
        "status",
    )

    def __init__(
        self, gateway: Gateway, hooks: Hooks = NO_HOOKS, local: LocalAnswers | None = None
    ) -> None:
        self.lifecycle = Lifecycle(gateway, hooks)
        self._local = local
        self.status: int | None = None
        self._headers: dict[str, str] = {}
        self._path = "/"
        # The gateway sent `:path` (Envoy always does); a gateway that is not Envoy, NGINX
        # Gateway Fabric's shim, sends the client's headers alone and reads the endpoint
        # only from the headers answer.
        self._envoy = True
        self._body: list[bytes] = []
        self._body_size = 0
        self._parsed = 0  # bytes `_whole` parsed, all tries
        self._body_ended = False
        self._after_body = False
        # FULL_DUPLEX_STREAMED: the headers answer is held until the body is read.
        self._held = False
        self._request_mode = UNSAID
        self._response_mode = NONE
        self._response_ended = False
        self._grpc = False  # the answer is gRPC: its trailers may carry its real status
        self._subset: tuple[str, ...] | None = None
        self._trailers = False
        self._replied = False

    @property
    def decision(self) -> Decision | None:
        return self.lifecycle.decision

    def handle(self, message: ProcessingRequest) -> Answer | AwaitActivation:
        if self._replied:  # a local reply ended the request: Envoy expects nothing more
            return ()
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            # The first message of the stream carries it: request headers, or response
            # headers when a filter before ext_proc answered locally (the buffer's 413).
            self._request_mode, self._response_mode = _protocol_modes(message)
        if kind == "request_headers":
            self._subset = _subset_hint(message)
            return self._request_headers(message.request_headers)
        if kind == "request_body":
            return self._request_body(message.request_body)
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            if self._grpc and self.status == 200:
                self._trailer_status(message.response_trailers)
            self._response_ended = True
            self.close()
            return CONTINUE_RESPONSE_TRAILERS
        if kind == "request_trailers":
            return self._request_trailers()
        return CONTINUE_REQUEST_HEADERS  # unknown: never reached with a v3 Envoy

    # -- request -------------------------------------------------------------------------
    def _request_headers(self, headers: HttpHeaders) -> Answer | AwaitActivation:
        self._headers = header_map(headers)
        path = self._headers.get(":path")
        self._envoy = path is not None
        self._path = path or "/"
        if self.lifecycle.config.conformance_headers:
            self._conformance_selection()
        if headers.end_of_stream:
            self._body_ended = True
        if self._local is not None and self._headers.get(":method") in ("GET", "HEAD"):
            # Decoded as the proxy's ASGI server does: the openai client sends
            # `/v1/models/org%2Fname` for a model id with a slash. A GET's body (some
            # clients send `{}`) means nothing here, as to the proxy: answered all the same.
            local = self._local(unquote(self._path.split("?", 1)[0]))
            if local is not None:
                self._replied = True
                cors = CORS_ANSWER_HEADERS if self._from_browser else None
                return local_response(*local, headers=cors)
        preflight = cors_preflight(self._headers.get(":method"), self._path, self._headers)
        if preflight is not None:  # a browser's, answered as vLLM does
            self._replied = True
            return local_response(
                200, b"OK", content_type="text/plain; charset=utf-8", headers=preflight
            )
        refused = wrong_method(self._headers.get(":method"), self._path)
        if refused is not None:
            return self.answer(self.lifecycle.refuse(refused))
        if not self._reads_body():
            return self._route(None)
        if headers.end_of_stream:
            return self._route(b"")
        mode = self._request_mode
        if mode == FULL_DUPLEX_STREAMED or not self._envoy:
            # Envoy streams the body without waiting for this answer; a gateway that is not
            # Envoy sends it whole, and takes the endpoint from this answer only.
            self._held = True
            return ()
        if mode in (BUFFERED, BUFFERED_PARTIAL):
            return CONTINUE_REQUEST_HEADERS  # the body comes whole, the answer rides on it
        if self._request_mode in (NONE, STREAMED):
            # Envoy said so (1.33+): the override is what it runs (a STREAMED body cannot be
            # routed anyway: its headers go upstream before it), the body comes whole in one
            # message, end_of_stream false when trailers end it. Older Envoys do not say and
            # may stream it in chunks: those wait for the end.
            self._request_mode = BUFFERED
        ask = _ASK_FOR_BODY.get(self._response_mode)
        if ask is None:  # a mode an override cannot keep (FULL_DUPLEX_STREAMED): bodies off
            self._response_mode = NONE
            return ASK_FOR_BODY
        return ask

    def _reads_body(self) -> bool:
        """Is the body needed to route? `needs_body` on llmgw's inference paths; on another
        path, a POST's body when no header names the model (GIE's reference picker reads
        the body on every path: GIE's conformance suite POSTs to its routes' own prefixes)."""
        config = self.lifecycle.config
        if not self._envoy or needs_body(config, self._headers, self._path):
            return True  # no `:path` (not Envoy): the body is all there is to go on
        return (
            self._headers.get(":method") == "POST"
            and not self._headers.get(config.model_header)
            and not on_paths(self._path)
        )

    def _request_body(self, body: HttpBody) -> Answer | AwaitActivation:
        chunk, end = body.body, body.end_of_stream
        if end:
            self._body_ended = True
        if self._request_mode == FULL_DUPLEX_STREAMED and not self._held:
            return streamed_request_body(chunk, end_of_stream=end)  # routed: pass it through
        if self._held:  # FULL_DUPLEX_STREAMED, or not Envoy: the headers answer waits
            self._hold(chunk)
            if self._body_size > self.lifecycle.config.limits.max_body_bytes:
                return self._refuse_too_large()
            return self._route(b"".join(self._body)) if end else ()
        if self.lifecycle.decision is not None:  # routed at the headers: the body is not read
            return CONTINUE_REQUEST_BODY  # (nor kept: it goes on upstream, however long)
        self._hold(chunk)
        # In every mode: an Envoy that streams the body (one before 1.33 that took no
        # override) has no buffer of its own to stop it.
        if self._body_size > self.lifecycle.config.limits.max_body_bytes:
            return self._refuse_too_large()
        if self._request_mode == BUFFERED_PARTIAL and not end:
            # The gateway's buffer filled (the body is cut), unless trailers ended the body
            # (HTTP/2 sends them after it).
            if not self._whole(chunk):
                return self._refuse_too_large()
            end = self._body_ended = True
        if not (end or self._request_mode == BUFFERED):
            # An Envoy that does not say its mode (before 1.33) may stream the body in
            # chunks or, having taken the BUFFERED override, send it whole with
            # end_of_stream false because HTTP/2 trailers end it; those trailers come too
            # late to route on (their answer cannot set headers).
            if self._request_mode != UNSAID or not self._whole(chunk):
                return CONTINUE_REQUEST_BODY
            self._body_ended = True
        self._after_body = True
        return self._route(b"".join(self._body))

    def _request_trailers(self) -> Answer | AwaitActivation:
        self._trailers = True
        if self._held:  # trailers mark the end of a streamed body that had no end_of_stream
            self._body_ended = True
            return self._route(b"".join(self._body))
        if self.lifecycle.decision is None and not self._body:
            # BUFFERED, and the trailers followed no body at all: the empty body is whole.
            # Routing needed a body, so this is an error (an immediate response may answer
            # any message; a pick could not: a trailers answer cannot set request headers).
            self._body_ended = True
            result = self.lifecycle.route(self._headers, self._path, b"", subset=self._subset)
            if isinstance(result, LlmgwError):
                return self.answer(result)
        return CONTINUE_REQUEST_TRAILERS

    def _conformance_selection(self) -> None:
        """`test-epp-endpoint-selection: ip[,ip...]` limits the pick like a subset hint.

        The listed values go to the pick as they are (it reads an IP alone as every port
        there), so endpoints from discovery or an on-demand launch match as well as the
        config file's; with a subset hint too, an endpoint must be in both."""
        listed = self._headers.get(CONFORMANCE_SELECT_HEADER)
        if listed is None:
            return
        wanted = tuple(sorted({canonical_hint(v.strip()) for v in listed.split(",") if v.strip()}))
        if self._subset is None:
            self._subset = wanted
            return
        both = set()
        for hinted in self._subset:
            for chosen in wanted:
                narrower = _narrower(hinted, chosen)
                if narrower is not None:
                    both.add(narrower)
        self._subset = tuple(sorted(both))

    def _whole(self, last: bytes) -> bool:
        """Whether the body held, its end not marked, is all of it: as long as its
        content-length says, or, sent without one, a whole JSON object (a cut one never
        parses). Parsing all the body on each chunk was quadratic: it is parsed only when
        `last`, the newest chunk, ends as an object does, and at most `_PARSE_BUDGET` times
        the body limit in all (a body whose chunks all end so, sent to cost CPU, then
        waits for its end)."""
        length = self._headers.get("content-length")
        if length is not None and length.isdecimal():
            return int(length) == self._body_size
        budget = _PARSE_BUDGET * self.lifecycle.config.limits.max_body_bytes
        if self._parsed + self._body_size > budget or not last.rstrip().endswith(b"}"):
            return False
        self._parsed += self._body_size
        return _is_json_object(b"".join(self._body))

    def _hold(self, chunk: bytes) -> None:
        self._body.append(chunk)
        self._body_size += len(chunk)

    def _refuse_too_large(self) -> bytes:
        limit = self.lifecycle.config.limits.max_body_bytes
        self._held = False
        self._replied = True
        try:
            check_body_size(self._body_size, limit, complete=self._body_ended)
        except LlmgwError as exc:
            return immediate_response(self.lifecycle.refuse(exc), cors=self._from_browser)
        return immediate_response(  # BUFFERED_PARTIAL cut below the limit: still too large
            self.lifecycle.refuse(
                BodyTooLarge(
                    f"request body is larger than the gateway's buffer ({self._body_size} bytes "
                    "arrived); raise the listener's per_connection_buffer_limit_bytes"
                )
            ),
            cors=self._from_browser,
        )

    def _route(self, body: bytes | None) -> Answer | AwaitActivation:
        result = self.lifecycle.route(self._headers, self._path, body, subset=self._subset)
        if isinstance(result, AwaitActivation):
            return result
        return self.answer(result)

    def answer(self, result: Decision | LlmgwError) -> Answer:
        """The routing answer (after headers or body), or the error as a local reply."""
        if isinstance(result, LlmgwError):
            self._held = False
            self._replied = True
            return immediate_response(result, cors=self._from_browser)
        if not self._held:
            # Routed at the headers in llmgw's own mode: turn the response headers on.
            keep = self._response_mode
            # (Not when Envoy did not say its modes: before 1.33, an override kept no response
            # body mode it did not know of.)
            at_headers = not self._after_body and self._request_mode == NONE
            return route_response(
                result,
                after_body=self._after_body,
                fallbacks=self._fallbacks(),
                response_headers_for=keep if at_headers and keep in _ASK_FOR_BODY else None,
            )
        # FULL_DUPLEX_STREAMED: headers first, then every held chunk unchanged, in order.
        self._held = False
        chunks, self._body = self._body, []
        if self._request_mode != FULL_DUPLEX_STREAMED:
            # Not Envoy: the headers answer, then one answer to each body message, unchanged.
            head = route_response(result, after_body=False, fallbacks=self._fallbacks())
            tail = (CONTINUE_REQUEST_TRAILERS,) if self._trailers else ()
            return (head, *(CONTINUE_REQUEST_BODY for _ in chunks), *tail)
        last = len(chunks) - 1
        # With trailers the body's end is theirs: answer them last (headers-body-trailers).
        end = self._body_ended and not self._trailers
        answers = [route_response(result, after_body=False, fallbacks=self._fallbacks())]
        answers += (
            streamed_request_body(c, end_of_stream=end and i == last) for i, c in enumerate(chunks)
        )
        if self._trailers:
            answers.append(CONTINUE_REQUEST_TRAILERS)
        return tuple(answers)

    def _fallbacks(self) -> bool:
        return self.lifecycle.config.destination_fallbacks

    @property
    def _from_browser(self) -> bool:
        """The request carries an `Origin`: llmgw's own answers say CORS_ANSWER_HEADERS."""
        return "origin" in self._headers

    # -- response ------------------------------------------------------------------------
    def _response_headers(self, message: ProcessingRequest) -> bytes:
        headers = message.response_headers
        lifecycle = self.lifecycle
        status, upstream, content_type = response_head(headers)
        self.status = status
        self._grpc = content_type is not None and content_type.startswith("application/grpc")
        served = metadata_value(message, METADATA_NAMESPACE, SERVED_KEY)
        if isinstance(served, str) and served:
            lifecycle.answered_by(served.split(",", 1)[0].strip())
        elif upstream:
            lifecycle.answered_by(upstream)
        # After answered_by: the status is the serving host's (a probe there is decided by it).
        lifecycle.response(
            status, content_type=content_type, bodies_seen=self._response_mode != NONE
        )
        # Not the first token: engines (vLLM) send the head before prefill ends. Only a
        # response body message (when Envoy is set to send bodies) marks the first byte.
        if headers.end_of_stream:
            self._response_ended = True
            self.close()
        if lifecycle.config.conformance_headers and lifecycle.endpoint is not None:
            return debug_response_headers(
                lifecycle.decision if lifecycle.config.debug_headers else None,
                lifecycle.endpoint,
                served=_served_report(message, served, upstream),
            )
        if lifecycle.config.debug_headers:
            return debug_response_headers(lifecycle.decision, lifecycle.endpoint)
        if upstream is not None:
            return STRIP_UPSTREAM_HEADER
        return CONTINUE_RESPONSE_HEADERS

    def _trailer_status(self, trailers: HttpTrailers) -> None:
        """A gRPC answer's status is in its trailers: a 200 head, then a `grpc-status` other
        than 0 when the engine failed after it (mid-generation). Charged as that error's
        HTTP equivalent, as in a head; it was charged a success."""
        for h in trailers.trailers.headers:
            if h.key == "grpc-status":
                code = (h.raw_value or h.value.encode()).strip()
                if code != b"0":
                    self.status = _GRPC_AS_HTTP.get(code, 500)
                    self.lifecycle.revise_status(self.status)
                return

    def _response_body(self, body: HttpBody) -> bytes:
        # The first chunk of a streamed body: the first token reached Envoy. A buffered body
        # comes once the whole answer (or a buffer's worth) is in: no first-token time.
        # Each later chunk of a streamed body ends an engine step there (`body_chunk`).
        if self._response_mode not in (BUFFERED, BUFFERED_PARTIAL):
            self.lifecycle.body_chunk(body.body)
        end = body.end_of_stream
        if end or self._response_mode == BUFFERED:  # a buffered body is whole (trailers follow)
            self._response_ended = True
            self.close()
        elif self._response_mode == BUFFERED_PARTIAL:
            # A buffer's worth of a longer body: the rest passes without ext_proc, so its end
            # is never seen (nor a client cutting it): the status decides, as without bodies.
            self._response_mode = NONE
        if self._response_mode == FULL_DUPLEX_STREAMED:
            return streamed_response_body(body.body, end_of_stream=end)
        return CONTINUE_RESPONSE_BODY

    def _hand_off(self) -> None:
        """The request runs on at the engine, its end unseen (NGINX Gateway Fabric). Its
        lease is held to its predicted first token, so that the queue and load terms count
        it while it is most likely waiting or prefilling there (ended at the pick, each one
        sent lowered that engine's load until the next scrape: the next picks went there
        too), then ended `unknown`: no verdict, its first token owed to the engine's count."""
        lease = self.lifecycle.lease
        delay = 0.0
        if lease is not None and lease.ready_at is not None:
            delay = min(_HAND_OFF_MAX_S, lease.ready_at - lease.registry.clock())
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): end it now
            delay = 0.0
        if delay <= 0.0:
            self.lifecycle.finish(Outcome.UNKNOWN)
            return
        loop.call_later(delay, self.lifecycle.finish, Outcome.UNKNOWN)

    def close(self, *, aborted: bool = False) -> None:
        """Release the lease: the response's outcome if seen, else the client went away
        (`unknown` from a gateway that is not Envoy, which reports no response).

        When Envoy sends response bodies, a stream that closes before the body's end (or
        trailers) was cut: the client went away mid-stream, unless the status already said
        the engine failed (a 5xx, 429), which the breaker must hear however the body ended.
        `aborted`: the stream ended while an answer was being written (Envoy reset it), not
        at a read, so the answer to the response headers may never have reached Envoy (its
        message_timeout passed: the client got Envoy's 504): cut too, in every mode.
        """
        if not self._envoy and self.status is None and not aborted:
            # A gateway that is not Envoy (no `:path`) sends no response messages: the
            # stream ends right after the pick, saying nothing of how the request went.
            # (Reset while the answer was written: it never got an endpoint, nothing ran:
            # cut, below.)
            self._hand_off()
            return
        cut = not self._response_ended and (aborted or self._response_mode != NONE)
        if cut and (self.status is None or outcome_for_status(self.status) is Outcome.SUCCESS):
            self.lifecycle.finish(Outcome.CANCELLED)
        else:
            self.lifecycle.finish()
