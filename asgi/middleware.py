"""`SchedulerMiddleware`: the scheduler core as pure ASGI middleware.

    app.add_middleware(SchedulerMiddleware, config=config)        # Starlette / FastAPI
    app = SchedulerMiddleware(any_asgi_app, config=config)        # anything ASGI

For each routed HTTP request (an OpenAI inference path, or any path carrying the model
header) it:

1. reads the JSON body only when `llmgw.request.needs_body` says routing needs it, and then
   replays it to the inner app unchanged (the inner app reads the same bytes);
2. builds the RequestInfo with `llmgw.request.build_request` and asks `Scheduler.pick`, so
   this edge and the Envoy edge make the same Decision for the same request;
3. answers the core's typed errors itself (`error.status`, `error.body()`,
   `error.response_headers()`: the same bodies as the Envoy edge);
4. hands the Decision to the inner app:
   - `scope["state"]["llmgw_decision"]`: the `Decision` (Starlette: `request.state.llmgw_decision`);
   - `scope["state"]["llmgw_dispatch"]`: the `Dispatch` (the live lease; an app that forwards
     and falls back calls `dispatch.fall_back(outcome)`);
   - request headers `x-gateway-destination-endpoint: host:port` (the primary) and
     `x-llmgw-decision: <rationale summary>`; copies sent by the client are removed;
5. counts the request in flight on the chosen endpoint until the last byte of the response
   body has been sent (streams included), then feeds the outcome to the breaker: failure on
   5xx / 429 or an exception, cancelled (no breaker verdict) when the client went away.

The response is never buffered: `send` is wrapped, messages pass straight through.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import TYPE_CHECKING, Protocol

from asgi.types import ASGIApp, Message, Receive, Scope, Send
from llmgw.config import Config
from llmgw.errors import LlmgwError
from llmgw.request import BODY_PATHS, build_request, check_body_size, needs_body
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo, outcome_for_status

if TYPE_CHECKING:
    from llmgw.runtime.router import Router
    from llmgw.runtime.telemetry import Telemetry

DECISION_KEY = "llmgw_decision"
DISPATCH_KEY = "llmgw_dispatch"
DESTINATION_HEADER = b"x-gateway-destination-endpoint"
DECISION_HEADER = b"x-llmgw-decision"
_OWN_HEADERS = (DESTINATION_HEADER, DECISION_HEADER)


class LeaseLike(Protocol):
    @property
    def done(self) -> bool: ...

    def finish(self, outcome: Outcome) -> None: ...


class Routing(Protocol):
    """What the middleware needs from the core: `Router` (activation, scraping) or a bare
    `Scheduler` wrapped in `SchedulerRouting`."""

    async def decide(self, request: RequestInfo) -> Decision: ...

    def acquire(self, decision: Decision, endpoint: Endpoint | None = None) -> LeaseLike: ...


class SchedulerRouting:
    """A bare Scheduler as `Routing`: no on-demand activation, no scraping of its own."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def decide(self, request: RequestInfo) -> Decision:
        return self.scheduler.pick(request)

    def acquire(self, decision: Decision, endpoint: Endpoint | None = None) -> LeaseLike:
        return self.scheduler.acquire(decision, endpoint)


class Dispatch:
    """One routed request in flight: its Decision and the lease on the endpoint it is on."""

    __slots__ = ("_next", "_routing", "_telemetry", "decision", "endpoint", "lease", "request")

    def __init__(
        self,
        routing: Routing,
        request: RequestInfo,
        decision: Decision,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._routing = routing
        self._telemetry = telemetry
        self.request = request
        self.decision = decision
        self.endpoint: Endpoint = decision.endpoint
        self.lease = routing.acquire(decision)
        self._next = 0

    @property
    def attempts(self) -> int:
        """How many endpoints this request has been sent to so far (1 = no fallback yet)."""
        return self._next + 1

    @property
    def done(self) -> bool:
        return self.lease.done

    def fall_back(self, outcome: Outcome) -> Endpoint | None:
        """Finish the current attempt with `outcome` and lease the next fallback endpoint.

        Returns it, or None when the Decision has no fallback left (the lease then stays on
        the current endpoint). The Decision carries at most `num_fallback_replicas` of them.
        """
        fallbacks = self.decision.fallbacks
        if self._next >= len(fallbacks):
            return None
        self.finish(outcome)
        self.endpoint = fallbacks[self._next]
        self._next += 1
        self.lease = self._routing.acquire(self.decision, self.endpoint)
        return self.endpoint

    def finish(self, outcome: Outcome) -> None:
        if self.lease.done:
            return
        self.lease.finish(outcome)
        if self._telemetry is not None:
            self._telemetry.outcome(self.decision.model, self.endpoint.id, outcome)


# Request ids for requests that come without `x-request-id`: a random per-process prefix
# and a counter, 32 hex digits like `uuid4().hex` (which costs a getrandom call each).
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def next_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFFFFFFFFFF:016x}"


async def send_error(send: Send, error: LlmgwError) -> None:
    headers = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in error.response_headers().items()
    ]
    body = error.body()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Disconnected(Exception):
    """The client went away while the request body was being read."""


async def read_body(receive: Receive, max_bytes: int) -> bytes:
    """The whole request body; raises BodyTooLarge past `max_bytes`, _Disconnected."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk: bytes = message.get("body", b"")
        if chunk:
            size += len(chunk)
            check_body_size(size, max_bytes, complete=not message.get("more_body", False))
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


class SchedulerMiddleware:
    """Pure ASGI middleware that routes each inference request with the llmgw scheduler.

    - `scheduler`: use this Scheduler (its registry, breakers, ring, seed) directly; no
      on-demand activation and no scraping (tests, parity, an app that scrapes itself).
    - `router`: a `llmgw.runtime.router.Router` (scraper + on-demand activation).
    - neither: a Router is built from `config`; the middleware starts and stops it on the
      ASGI lifespan events (Starlette/FastAPI run them; so does uvicorn).
    - `paths`: path prefixes that are routed (default: the OpenAI inference paths); a request
      on another path is routed only if it carries the model header (`config.model_header`).
    - `telemetry`: a `llmgw.runtime.telemetry.Telemetry` to count decisions, errors, outcomes.
    """

    def __init__(
        self,
        app: ASGIApp,
        config: Config,
        scheduler: Scheduler | None = None,
        router: Router | None = None,
        telemetry: Telemetry | None = None,
        paths: tuple[str, ...] = BODY_PATHS,
    ) -> None:
        if scheduler is not None and router is not None:
            raise ValueError("pass a scheduler or a router, not both")
        self.app = app
        self.config = config
        self.telemetry = telemetry
        self.paths = paths
        self._owned_router: Router | None = None
        self.routing: Routing
        if scheduler is not None:
            self.scheduler = scheduler
            self.routing = SchedulerRouting(scheduler)
        else:
            if router is None:
                from llmgw.runtime.router import Router  # noqa: PLC0415 (runtime is optional)

                router = self._owned_router = Router(config)
            self.scheduler = router.scheduler
            self.routing = router
        self._model_header = config.model_header.encode("latin-1")
        self._max_body = config.limits.max_body_bytes

    def reconfigure(self, config: Config) -> None:
        """Use `config` for requests that arrive from now on (the router reloads itself)."""
        self.config = config
        self._model_header = config.model_header.encode("latin-1")
        self._max_body = config.limits.max_body_bytes

    def _routed(self, scope: Scope) -> bool:
        path: str = scope["path"]
        if path.startswith(self.paths):
            return True
        return any(name.lower() == self._model_header for name, _ in scope["headers"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan" and self._owned_router is not None:
            await self.app(scope, self._lifespan_receive(receive), send)
            return
        if kind != "http" or not self._routed(scope):
            await self.app(scope, receive, send)
            return
        await self._route(scope, receive, send)

    def _lifespan_receive(self, receive: Receive) -> Receive:
        router = self._owned_router
        assert router is not None

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await router.start()
            elif message["type"] == "lifespan.shutdown":
                await router.stop()
            return message

        return wrapped

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        telemetry = self.telemetry
        started = time.perf_counter()
        # One pass: the headers passed on (own headers from the client dropped) and the
        # {name: value} map `build_request` reads (values decoded as UTF-8, as Envoy's are).
        raw_headers: list[tuple[bytes, bytes]] = []
        headers: dict[str, str] = {}
        for given, value in scope["headers"]:
            name = given.lower()
            if name in _OWN_HEADERS:
                continue
            raw_headers.append((name, value))
            headers[name.decode("latin-1").lower()] = value.decode("utf-8", "replace")
        path: str = scope["path"]
        body: bytes | None = None
        try:
            length = headers.get("content-length")
            if length is not None and length.isdigit():
                check_body_size(int(length), self._max_body, complete=True)
            if needs_body(self.config, headers, path):
                try:
                    body = await read_body(receive, self._max_body)
                except _Disconnected:
                    return
            request = build_request(
                self.config,
                headers,
                path,
                body,
                request_id=None if "x-request-id" in headers else next_request_id(),
            )
            parsed = time.perf_counter()
            decision = await self.routing.decide(request)
            dispatch = Dispatch(self.routing, request, decision, telemetry)
        except LlmgwError as error:
            if telemetry is not None:
                telemetry.error(error)
            await send_error(send, error)
            return
        if telemetry is not None:
            done = time.perf_counter()
            telemetry.decision(decision)
            telemetry.stage("parse", parsed - started)
            telemetry.stage("schedule", done - parsed)
            telemetry.stage("total", done - started)

        raw_headers.append((DESTINATION_HEADER, decision.endpoint.address.encode("latin-1")))
        raw_headers.append((DECISION_HEADER, decision.describe().encode("latin-1", "replace")))
        state = dict(scope.get("state") or {})
        state[DECISION_KEY] = decision
        state[DISPATCH_KEY] = dispatch
        inner_scope = dict(scope)
        inner_scope["headers"] = raw_headers
        inner_scope["state"] = state

        status = 0
        disconnected = False
        replay: Message | None = (
            {"type": "http.request", "body": body, "more_body": False} if body is not None else None
        )

        async def wrapped_receive() -> Message:
            nonlocal replay, disconnected
            if replay is not None:
                message, replay = replay, None
                return message
            message = await receive()
            if message["type"] == "http.disconnect" and not dispatch.done:
                disconnected = True
            return message

        async def wrapped_send(message: Message) -> None:
            nonlocal status
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
            try:
                await send(message)
            except OSError:
                dispatch.finish(Outcome.CANCELLED)
                raise
            if kind == "http.response.body" and not message.get("more_body", False):
                dispatch.finish(outcome_for_status(status))

        try:
            await self.app(inner_scope, wrapped_receive, wrapped_send)
        except asyncio.CancelledError:
            # Shutdown or a client gone without an http.disconnect: not the replica's fault.
            dispatch.finish(Outcome.CANCELLED)
            raise
        except BaseException:
            dispatch.finish(Outcome.CANCELLED if disconnected else Outcome.FAILURE)
            raise
        if not dispatch.done:
            # The app returned without finishing the response body.
            if disconnected:
                dispatch.finish(Outcome.CANCELLED)
            else:
                dispatch.finish(outcome_for_status(status) if status else Outcome.FAILURE)
