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

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

from llmgw.config import Config
from llmgw.errors import LlmgwError, ModelNotReady
from llmgw.request import build_request, needs_body
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo, outcome_for_status

if TYPE_CHECKING:
    from llmgw.runtime.router import Router, RouterLease

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
DECISION_HEADER = "x-llmgw-decision"
# Envoy adds this response header (route `response_headers_to_add: %UPSTREAM_HOST%`) so
# the outcome is charged to the host that really answered after retries.
UPSTREAM_HEADER = "x-llmgw-upstream"

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


def debug_response_headers(decision: Decision | None) -> bytes:
    """Answer to response headers that shows the client why (`debug_headers: true`)."""
    mutation = HeaderMutation()
    if decision is not None:
        summary = f"endpoint={decision.endpoint.address} {decision.describe()}"
        mutation.set_headers.append(_set(DECISION_HEADER, summary))
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


# Returned by `Exchange.handle` when an on-demand model must be started first: the server
# awaits `Exchange.activate()` for the real answer (the waiting is I/O; it lives there).
AWAIT_ACTIVATION = b""


class InternalError(LlmgwError):
    """A bug in the router: answered as 500 rather than a broken gRPC stream."""


@dataclass(slots=True)
class Hooks:
    """What an Exchange reports to the server (metrics, logs); all optional."""

    decision: Callable[[Decision, str], object] | None = None
    error: Callable[[LlmgwError], None] | None = None
    outcome: Callable[[str, str, Outcome], None] | None = None
    stage: Callable[[str, float], None] | None = None


_NO_HOOKS = Hooks()


class Exchange:
    """The protocol state of one ext_proc stream (one HTTP request). Not thread-safe.

    `handle(message) -> bytes` answers every message; `close()` must be called when the
    stream ends for any reason, and releases the lease if the response did not end it.
    """

    __slots__ = (
        "_acquire",
        "_body",
        "_headers",
        "_outcome",
        "_path",
        "_started",
        "config",
        "decision",
        "hooks",
        "lease",
        "pending",
        "router",
        "scheduler",
        "status",
    )

    def __init__(
        self, scheduler: Scheduler, hooks: Hooks = _NO_HOOKS, router: Router | None = None
    ) -> None:
        self.scheduler = scheduler
        self.router = router
        self.config: Config = scheduler.config
        self.hooks = hooks
        # With a Router, leases also keep on-demand models alive until the response ends.
        self._acquire: Callable[..., Lease | RouterLease] = (
            router.acquire if router is not None else scheduler.acquire
        )
        self.decision: Decision | None = None
        self.lease: Lease | RouterLease | None = None
        # (request, after_body) of a request waiting for its on-demand model to start.
        self.pending: tuple[RequestInfo, bool] | None = None
        self.status: int | None = None
        self._outcome: Outcome | None = None
        self._headers: Mapping[str, str] = {}
        self._path = "/"
        self._body: list[bytes] = []
        self._started = 0.0

    def handle(self, message: ProcessingRequest) -> bytes:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message.request_headers)
        if kind == "request_body":
            body = message.request_body
            self._body.append(body.body)
            if not body.end_of_stream:
                return CONTINUE_REQUEST_BODY
            return self._decide(b"".join(self._body), after_body=True)
        if kind == "response_headers":
            return self._response_headers(message.response_headers)
        if kind == "response_body":
            if message.response_body.end_of_stream:
                self.close()
            return CONTINUE_RESPONSE_BODY
        if kind == "response_trailers":
            self.close()
            return CONTINUE_RESPONSE_TRAILERS
        if kind == "request_trailers":
            return CONTINUE_REQUEST_TRAILERS
        return CONTINUE_REQUEST_HEADERS  # unknown: never reached with a v3 Envoy

    def _request_headers(self, headers: HttpHeaders) -> bytes:
        self._started = time.perf_counter()
        self._headers = header_map(headers)
        self._path = self._headers.get(":path", "/")
        if needs_body(self.config, self._headers, self._path):
            if not headers.end_of_stream:
                return ASK_FOR_BODY
            return self._decide(b"", after_body=False)
        return self._decide(None, after_body=False)

    def _decide(self, body: bytes | None, *, after_body: bool) -> bytes:
        hooks = self.hooks
        t0 = time.perf_counter()
        try:
            request = build_request(self.config, self._headers, self._path, body)
            t1 = time.perf_counter()
            decision = self.scheduler.pick(request)
            self.lease = self._acquire(decision)
        except ModelNotReady as exc:
            activator = self.router.activator if self.router is not None else None
            if activator is None or not activator.manages(request.model):
                return self._error(exc)
            self.pending = (request, after_body)
            return AWAIT_ACTIVATION
        except LlmgwError as exc:
            if hooks.error is not None:
                hooks.error(exc)
            return immediate_response(exc)
        except Exception as exc:  # a router bug must not break the client's request
            error = InternalError(f"router error: {type(exc).__name__}: {exc}")
            if hooks.error is not None:
                hooks.error(error)
            return immediate_response(error)
        self.decision = decision
        t2 = time.perf_counter()
        if hooks.stage is not None:
            hooks.stage("parse", t1 - t0)
            hooks.stage("schedule", t2 - t1)
            hooks.stage("total", t2 - self._started)
        if hooks.decision is not None:
            hooks.decision(decision, request.request_id)
        return route_response(decision, after_body=after_body)

    def _error(self, exc: LlmgwError) -> bytes:
        if self.hooks.error is not None:
            self.hooks.error(exc)
        return immediate_response(exc)

    async def activate(self) -> bytes:
        """Wait (bounded) for the pending request's on-demand model, then answer it."""
        assert self.pending is not None and self.router is not None
        request, after_body = self.pending
        self.pending = None
        try:
            decision = await self.router.decide(request)
            self.lease = self._acquire(decision)
        except LlmgwError as exc:
            return self._error(exc)
        self.decision = decision
        if self.hooks.decision is not None:
            self.hooks.decision(decision, request.request_id)
        return route_response(decision, after_body=after_body)

    def _response_headers(self, headers: HttpHeaders) -> bytes:
        status, upstream = response_status(headers)
        self.status = status
        self._outcome = outcome_for_status(status)
        if upstream and self.decision is not None and self.lease is not None:
            self._follow_fallback(self.decision, upstream)
        if headers.end_of_stream:
            self.close()
        if self.config.debug_headers:
            return debug_response_headers(self.decision)
        if upstream is not None:
            return STRIP_UPSTREAM_HEADER
        return CONTINUE_RESPONSE_HEADERS

    def _follow_fallback(self, decision: Decision, upstream: str) -> None:
        """Envoy retried on a fallback: the primary rejected it; count the fallback instead."""
        lease = self.lease
        if lease is None or upstream == lease.endpoint_id:
            return
        target: Endpoint | None = next(
            (e for e in decision.fallbacks if e.address == upstream), None
        )
        if target is None:
            return
        self._finish(lease, Outcome.FAILURE)
        self.lease = self._acquire(decision, target)

    def _finish(self, lease: Lease | RouterLease, outcome: Outcome) -> None:
        if lease.done:
            return
        lease.finish(outcome)
        if self.hooks.outcome is not None:
            self.hooks.outcome(lease.model, lease.endpoint_id, outcome)

    def close(self) -> None:
        """Release the lease: the response's outcome if seen, else the client went away."""
        lease = self.lease
        if lease is not None and not lease.done:
            self._finish(lease, self._outcome or Outcome.CANCELLED)
