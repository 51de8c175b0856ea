"""Pure translation between Envoy ext_proc v3 messages and the core's plain objects.

Protobuf in (upb-backed classes from `xds-protos`), RequestInfo/Decision in the middle,
serialized `ProcessingResponse` bytes out. No I/O, no gRPC: `extproc/server.py` owns the
stream, `Exchange` here owns the per-request protocol state.

The protocol (Gateway API Inference Extension endpoint picker):

1. `request_headers`: if the body is needed to route (`llmgw.request.needs_body`), answer
   with an empty HeadersResponse and `mode_override` asking for the BUFFERED body; else
   decide now.
2. `request_body` (end of stream): decide.
3. The routing answer: header `x-gateway-destination-endpoint: ip:port` (primary),
   dynamic metadata `envoy.lb` {`x-gateway-destination-endpoint`: "primary,fb1,fb2"},
   `clear_route_cache`. Errors become an ImmediateResponse with the error's status, OpenAI-style JSON body and headers.
4. `response_headers`: the status (and which host answered, from the `x-llmgw-upstream`
   header Envoy adds) decide the outcome; the lease is released when the response ends
   (`response_trailers`, a response body with end of stream, or the stream closing).
   With `debug_headers`, the response carries `x-llmgw-decision` (endpoint + rationale).
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct  # type: ignore[import-untyped]

from llmgw.errors import LlmgwError
from llmgw.gateway import Gateway
from llmgw.lifecycle import (
    DECISION_HEADER,
    DESTINATION_HEADER,
    METADATA_NAMESPACE,
    NO_HOOKS,
    UPSTREAM_HEADER,
    AwaitActivation,
    Hooks,
    Lifecycle,
    debug_summary,
)
from llmgw.request import needs_body
from llmgw.types import Decision, Endpoint

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
# Ask for the whole request body; keep the response headers (for the outcome).
ASK_FOR_BODY = _serialize(
    ProcessingResponse(
        request_headers=HeadersResponse(),
        mode_override=ProcessingMode(
            request_header_mode=ProcessingMode.SEND,
            response_header_mode=ProcessingMode.SEND,
            request_body_mode=ProcessingMode.BUFFERED,
            response_body_mode=ProcessingMode.NONE,
            request_trailer_mode=ProcessingMode.SKIP,
            response_trailer_mode=ProcessingMode.SKIP,
        ),
    )
)
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


def response_status(headers: HttpHeaders) -> tuple[int, str | None]:
    """`:status` and the `x-llmgw-upstream` value, without building a dict of every header."""
    status, upstream = 0, None
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
    return status, upstream


def _set(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


_ROUTE_CACHE: dict[tuple[tuple[str, ...], bool], bytes] = {}
_ROUTE_CACHE_LIMIT = 4096


def route_response(decision: Decision, *, after_body: bool) -> bytes:
    """The routing answer to request headers (or, after a buffered body, to the body).

    It depends only on the destination list, and a pool has few distinct lists: the
    serialized bytes are cached (building the message costs more than the routing).
    """
    key = (decision.destinations, after_body)
    cached = _ROUTE_CACHE.get(key)
    if cached is None:
        if len(_ROUTE_CACHE) >= _ROUTE_CACHE_LIMIT:
            _ROUTE_CACHE.clear()
        cached = _ROUTE_CACHE[key] = _build_route_response(key[0], after_body=after_body)
    return cached


def _build_route_response(destinations: tuple[str, ...], *, after_body: bool) -> bytes:
    common = CommonResponse(
        header_mutation=HeaderMutation(set_headers=[_set(DESTINATION_HEADER, destinations[0])]),
        clear_route_cache=True,
    )
    metadata = Struct()
    metadata.fields[METADATA_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = ",".join(destinations)
    if after_body:
        message = ProcessingResponse(
            request_body=BodyResponse(response=common), dynamic_metadata=metadata
        )
    else:
        message = ProcessingResponse(
            request_headers=HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return _serialize(message)


def debug_response_headers(decision: Decision | None, endpoint: Endpoint | None = None) -> bytes:
    """Answer to response headers that shows the client why (`debug_headers: true`)."""
    mutation = HeaderMutation(remove_headers=[UPSTREAM_HEADER])
    if decision is not None:
        mutation.set_headers.append(_set(DECISION_HEADER, debug_summary(decision, endpoint)))
    return _serialize(
        ProcessingResponse(
            response_headers=HeadersResponse(response=CommonResponse(header_mutation=mutation))
        )
    )


def immediate_response(error: LlmgwError) -> bytes:
    """A local reply from Envoy with the error's status, JSON body and headers."""
    headers = HeaderMutation(set_headers=[_set(k, v) for k, v in error.response_headers().items()])
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


class Exchange:
    """The protocol state of one ext_proc stream (one HTTP request). Not thread-safe.

    `handle(message)` answers every message with bytes, or with `AwaitActivation` when an
    on-demand model must start first: the server awaits `llmgw.runtime.driver.activate`
    and sends `answer(result)`. `close()` must be called when the stream ends for any
    reason; it releases the lease if the response did not end it.
    """

    __slots__ = ("_after_body", "_body", "_headers", "_path", "lifecycle", "status")

    def __init__(self, gateway: Gateway, hooks: Hooks = NO_HOOKS) -> None:
        self.lifecycle = Lifecycle(gateway, hooks)
        self.status: int | None = None
        self._headers: dict[str, str] = {}
        self._path = "/"
        self._body: list[bytes] = []
        self._after_body = False

    @property
    def decision(self) -> Decision | None:
        return self.lifecycle.decision

    def handle(self, message: ProcessingRequest) -> bytes | AwaitActivation:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message.request_headers)
        if kind == "request_body":
            body = message.request_body
            self._body.append(body.body)
            if not body.end_of_stream:
                return CONTINUE_REQUEST_BODY
            self._after_body = True
            return self._route(b"".join(self._body))
        if kind == "response_headers":
            return self._response_headers(message.response_headers)
        if kind == "response_body":
            self.lifecycle.first_byte()
            if message.response_body.end_of_stream:
                self.close()
            return CONTINUE_RESPONSE_BODY
        if kind == "response_trailers":
            self.close()
            return CONTINUE_RESPONSE_TRAILERS
        if kind == "request_trailers":
            return CONTINUE_REQUEST_TRAILERS
        return CONTINUE_REQUEST_HEADERS  # unknown: never reached with a v3 Envoy

    def _request_headers(self, headers: HttpHeaders) -> bytes | AwaitActivation:
        self._headers = header_map(headers)
        self._path = self._headers.get(":path", "/")
        if needs_body(self.lifecycle.config, self._headers, self._path):
            if not headers.end_of_stream:
                return ASK_FOR_BODY
            return self._route(b"")
        return self._route(None)

    def _route(self, body: bytes | None) -> bytes | AwaitActivation:
        result = self.lifecycle.route(self._headers, self._path, body)
        if isinstance(result, AwaitActivation):
            return result
        return self.answer(result)

    def answer(self, result: Decision | LlmgwError) -> bytes:
        """The routing answer (after headers or body), or the error as a local reply."""
        if isinstance(result, LlmgwError):
            return immediate_response(result)
        return route_response(result, after_body=self._after_body)

    def _response_headers(self, headers: HttpHeaders) -> bytes:
        lifecycle = self.lifecycle
        status, upstream = response_status(headers)
        self.status = status
        lifecycle.response(status)
        if upstream:
            lifecycle.answered_by(upstream)
        # Not the first token: engines (vLLM) send the head before prefill ends. Only a
        # response body message (when Envoy is set to send bodies) marks the first byte.
        if headers.end_of_stream:
            self.close()
        if lifecycle.config.debug_headers:
            return debug_response_headers(lifecycle.decision, lifecycle.endpoint)
        if upstream is not None:
            return STRIP_UPSTREAM_HEADER
        return CONTINUE_RESPONSE_HEADERS

    def close(self) -> None:
        """Release the lease: the response's outcome if seen, else the client went away."""
        self.lifecycle.finish()
