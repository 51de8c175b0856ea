"""`SchedulerMiddleware`: the scheduler core as pure ASGI middleware.

    app.add_middleware(SchedulerMiddleware, config=config)        # Starlette / FastAPI
    app = SchedulerMiddleware(any_asgi_app, config=config)        # anything ASGI

For each routed HTTP request (an OpenAI inference path, or any path carrying the model
header) it:

1. reads the JSON body only when `llmgw.request.needs_body` says routing needs it, and then
   replays it to the inner app unchanged (the inner app reads the same bytes);
2. drives the request's `llmgw.lifecycle.Lifecycle` (parse, pick, wait once for an
   on-demand model, lease), the same object the Envoy edge drives, so both make the same
   Decision for the same request;
3. answers the core's typed errors itself (`error.status`, `error.body()`,
   `error.response_headers()`: the same bodies as the Envoy edge);
4. hands the Decision to the inner app:
   - `scope["state"]["llmgw_decision"]`: the `Decision` (Starlette: `request.state.llmgw_decision`);
   - `scope["state"]["llmgw_dispatch"]`: the `Lifecycle` (the live lease; an app that
     forwards and falls back calls `dispatch.fall_back(outcome)`; the middleware
     reports each body chunk it sends on, `dispatch.body_chunk(data)`, which finds the
     first token in them: an app that calls `dispatch.first_byte()` itself says the first
     token came then, a chat role chunk sent ahead of it or not);
   - request headers `x-gateway-destination-endpoint: host:port` (the primary) and
     `x-llmgw-decision: <rationale summary>`; internal headers sent by the client
     (`llmgw.lifecycle.INTERNAL_HEADERS`) are removed;
5. counts the request in flight on the chosen endpoint until the last byte of the response
   body has been sent (streams included), then feeds the outcome to the breaker: failure on
   5xx / 429 or an exception, cancelled (no breaker verdict) when the client went away.

The response is never buffered: `send` is wrapped, messages pass straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from llmgw.asgi.types import ASGIApp, Message, Receive, Scope, Send
from llmgw.config import Config
from llmgw.errors import LlmgwError, RequestTimeout
from llmgw.lifecycle import (
    DECISION_HEADER,
    DESTINATION_HEADER,
    INTERNAL_HEADERS,
    AwaitActivation,
    Hooks,
    Lifecycle,
)
from llmgw.request import (
    BODY_PATHS,
    CORS_ANSWER_HEADERS,
    check_body_size,
    cors_preflight,
    needs_body,
    on_paths,
    wrong_method,
)
from llmgw.runtime.driver import activate
from llmgw.runtime.router import Router, router_for
from llmgw.runtime.trace import close_trace, traced
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Outcome, outcome_for_status

if TYPE_CHECKING:
    from llmgw.runtime.telemetry import Telemetry

DECISION_KEY = "llmgw_decision"
DISPATCH_KEY = "llmgw_dispatch"
INTERNAL_HEADER_NAMES = frozenset(name.encode("latin-1") for name in INTERNAL_HEADERS)
_DESTINATION = DESTINATION_HEADER.encode("latin-1")
_DECISION = DECISION_HEADER.encode("latin-1")


_CORS_ANSWER = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in CORS_ANSWER_HEADERS.items()]


def from_browser(scope: Scope) -> bool:
    """The request carries an `Origin` (a browser's): llmgw's own answers to it say
    `CORS_ANSWER_HEADERS`, as vLLM's do, or the page cannot read them."""
    return _has_header(scope, b"origin")


def _has_header(scope: Scope, wanted: bytes) -> bool:
    """`wanted` (lower case) among the request's header names, in any case."""
    return any(name.lower() == wanted for name, _ in scope["headers"])


async def send_error(send: Send, error: LlmgwError, *, cors: bool = False) -> None:
    """Answer `error` (its status, JSON body and headers); `cors`: to a browser's request
    (`from_browser`), with `CORS_ANSWER_HEADERS`."""
    headers = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in error.response_headers().items()
    ]
    if cors:
        headers += _CORS_ANSWER
    body = error.body()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def route_path(scope: Scope) -> str:
    """The path below the app's mount: ASGI's `path` includes `root_path` (uvicorn's
    `--root-path`, Starlette's `Mount`), as Starlette's own routing strips it. Matched
    whole, an app mounted at `/llm` was never routed (its handler found no Decision)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _preflight(scope: Scope) -> bool:
    """A browser's CORS preflight: OPTIONS with `Access-Control-Request-Method`."""
    return scope["method"] == "OPTIONS" and _has_header(scope, b"access-control-request-method")


class Disconnected(Exception):
    """The client went away while the request body was being read."""


async def read_body(receive: Receive, max_bytes: int, timeout: float) -> bytes:
    """The whole request body; raises BodyTooLarge past `max_bytes`, RequestTimeout after
    `timeout` s without a byte, Disconnected."""
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Disconnected
                chunk: bytes = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    check_body_size(size, max_bytes, complete=not message.get("more_body", False))
                    parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                deadline.reschedule(loop.time() + timeout)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body stopped arriving: nothing for {timeout:g} s after {size} bytes "
            "(limits.client_body_timeout); send the whole body"
        ) from None


async def _activate_while_connected(
    lifecycle: Lifecycle, pending: AwaitActivation, receive: Receive
) -> Decision | LlmgwError | None:
    """`activate`, unless the client disconnects first (None): a wait of up to
    `activation_timeout` must not end in a request sent for nobody. The body has been
    read, so the next receive() is the disconnect."""
    activation = asyncio.ensure_future(activate(lifecycle, pending))
    gone = asyncio.ensure_future(receive())
    try:
        try:
            await asyncio.wait((activation, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not gone.done():
                gone.cancel()
        if activation.done():
            return activation.result()
        if gone.result().get("type") != "http.disconnect":  # not a disconnect: wait it out
            return await activation
    except BaseException:
        # This request was cancelled (an outer timeout, a server shutting down): the
        # waiter must not pick later for nobody and hold a lease that never ends.
        _abandon(lifecycle, activation)
        raise
    activation.cancel()  # the start goes on (it is the activator's); this waiter goes
    with contextlib.suppress(asyncio.CancelledError):
        await activation
    return None


def _abandon(lifecycle: Lifecycle, activation: asyncio.Future[Decision | LlmgwError]) -> None:
    """Nobody waits for `activation` any more: stop it, or end the request it routed."""
    if not activation.done():
        activation.cancel()
    elif (
        not activation.cancelled()
        and activation.exception() is None
        and isinstance(activation.result(), Decision)
    ):
        lifecycle.finish(Outcome.CANCELLED)


def split_headers(
    scope: Scope,
) -> tuple[list[tuple[bytes, bytes]], dict[str, str]]:
    """One pass: the headers passed on (internal ones from the client dropped) and the
    {lower-case name: value} map the lifecycle reads (values decoded as UTF-8, as Envoy's
    are, so a non-ASCII session id hashes to the same replica through either edge)."""
    raw_headers: list[tuple[bytes, bytes]] = []
    headers: dict[str, str] = {}
    for given, value in scope["headers"]:
        name = given.lower()
        if name in INTERNAL_HEADER_NAMES:
            continue
        raw_headers.append((name, value))
        headers[name.decode("latin-1")] = value.decode("utf-8", "replace")
    return raw_headers, headers


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
    - `buffer_body`: read the whole body before routing even when routing does not need it
      (an inner app that holds the body anyway, as the proxy's forwarder: a stalled upload
      then holds no in-flight slot, and the pick sees the load when the request is whole).
    - `cors`: its error answers to a browser's request (with `Origin`) carry
      `llmgw.request.CORS_ANSWER_HEADERS` (the proxy, which answers CORS as vLLM does);
      off, an app's own CORS middleware decides.

    The config is read from the router's current snapshot per request (a reload applies).
    """

    def __init__(
        self,
        app: ASGIApp,
        config: Config,
        scheduler: Scheduler | None = None,
        router: Router | None = None,
        telemetry: Telemetry | None = None,
        paths: tuple[str, ...] = BODY_PATHS,
        buffer_body: bool = False,
        cors: bool = False,
    ) -> None:
        self.app = app
        self.cors = cors
        self.router = router_for(config, scheduler=scheduler, router=router)
        owned = scheduler is None and router is None
        self._owned_router = self.router if owned else None
        self.gateway = self.router.gateway
        hooks = telemetry.hooks("asgi") if telemetry is not None else Hooks("asgi")
        self.hooks = traced(hooks, config.trace)  # the decision trace, if the config asks
        self.paths = paths
        self.buffer_body = buffer_body
        self._header_of: tuple[Config, bytes] | None = None

    @property
    def config(self) -> Config:
        return self.gateway.config

    @property
    def scheduler(self) -> Scheduler:
        return self.gateway.scheduler

    def _model_header(self) -> bytes:
        config = self.gateway.config
        cached = self._header_of
        if cached is None or cached[0] is not config:
            cached = self._header_of = (config, config.model_header.encode("latin-1"))
        return cached[1]

    def _routed(self, scope: Scope) -> bool:
        path = route_path(scope)
        if on_paths(path, self.paths):
            return True
        return _has_header(scope, self._model_header())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if kind != "http" or not self._routed(scope):
            await self.app(scope, receive, send)
            return
        if _preflight(scope):
            # `cors` off, the app's own CORS middleware answers it (refused 405 here, a
            # browser page could never POST to the app); on, llmgw answers it as vLLM does.
            if not self.cors:
                await self.app(scope, receive, send)
                return
            if await self._answer_preflight(scope, send):
                return
        await self._route(scope, receive, send)

    async def _answer_preflight(self, scope: Scope, send: Send) -> bool:
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in scope["headers"]}
        answer = cors_preflight("OPTIONS", route_path(scope), headers)
        if answer is None:
            return False
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.items()]
        raw += [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": b"OK", "more_body": False})
        return True

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The inner app's lifespan, with this middleware's router started and stopped in
        it. An app that does not speak lifespan (Django's raises for it, many return at
        once) never reads its messages: the middleware then answers them itself (its
        router never started: no scrape, discovery or activator ran, silently)."""
        read = False

        async def counted() -> Message:
            nonlocal read
            read = True
            return await wrapped()

        wrapped = self._lifespan_receive(receive)
        try:
            await self.app(scope, counted, send)
        except Exception:
            if read:
                raise
        if read:
            return
        while True:
            message = await wrapped()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _lifespan_receive(self, receive: Receive) -> Receive:
        """Start and stop the router this middleware built; at shutdown, close the trace
        file (its buffered lines would be lost)."""
        router = self._owned_router

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup" and router is not None:
                await router.start()
            elif message["type"] == "lifespan.shutdown":
                if router is not None:
                    await router.stop()
                close_trace(self.hooks)
            return message

        return wrapped

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = Lifecycle(self.gateway, self.hooks)
        raw_headers, headers = split_headers(scope)
        path = route_path(scope)
        body: bytes | None = None
        limits = lifecycle.config.limits
        needed = needs_body(lifecycle.config, headers, path)
        try:
            refused = wrong_method(scope["method"], path)
            if refused is not None:
                raise refused
            length = headers.get("content-length")
            if length is not None and length.isdigit():
                check_body_size(int(length), limits.max_body_bytes, complete=True)
            if needed or self.buffer_body:
                body = await read_body(receive, limits.max_body_bytes, limits.client_body_timeout)
        except Disconnected:
            return
        except LlmgwError as error:
            cors = self.cors and from_browser(scope)
            await send_error(send, lifecycle.refuse(error), cors=cors)
            return
        result = lifecycle.route(headers, path, body if needed else None)
        if isinstance(result, AwaitActivation):
            if body is None:  # the body is still to come: receive() is the app's
                result = await activate(lifecycle, result)
            else:
                waited = await _activate_while_connected(lifecycle, result, receive)
                if waited is None:
                    return  # the client left while the model started: nothing to send
                result = waited
        if isinstance(result, LlmgwError):
            await send_error(send, result, cors=self.cors and from_browser(scope))
            return
        decision = result
        raw_headers.append((_DESTINATION, decision.endpoint.address.encode("latin-1")))
        raw_headers.append((_DECISION, decision.describe().encode("latin-1", "replace")))
        # In place: middleware layers share `scope["state"]` (Starlette's `request.state`)
        # by reference; a copy hid what the handler set, and the Decision, from outer ones.
        state = scope.setdefault("state", {})
        state[DECISION_KEY] = decision
        state[DISPATCH_KEY] = lifecycle
        inner_scope = dict(scope)
        inner_scope["headers"] = raw_headers
        await self._call_inner(inner_scope, body, lifecycle, receive, send)

    async def _call_inner(
        self,
        scope: Scope,
        body: bytes | None,
        lifecycle: Lifecycle,
        receive: Receive,
        send: Send,
    ) -> None:
        """Run the inner app; the outcome comes from what it sends (or how it fails)."""
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
            if message["type"] == "http.disconnect" and not lifecycle.done:
                disconnected = True
            return message

        async def wrapped_send(message: Message) -> None:
            nonlocal status
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
                if lifecycle.status != status:  # else the app said it (the proxy's forwarder)
                    content_type = None
                    for name, value in message.get("headers", ()):
                        if name.lower() == b"content-type":
                            content_type = value.decode("latin-1")
                            break
                    lifecycle.response(status, content_type=content_type)
            elif kind == "http.response.body":
                lifecycle.body_chunk(message.get("body", b""))
            try:
                await send(message)
            except OSError:
                lifecycle.finish(Outcome.CANCELLED)
                raise
            if kind == "http.response.body" and not message.get("more_body", False):
                lifecycle.finish()

        try:
            await self.app(scope, wrapped_receive, wrapped_send)
        except asyncio.CancelledError:
            # Shutdown or a client gone without an http.disconnect: not the replica's fault.
            lifecycle.finish(Outcome.CANCELLED)
            raise
        except BaseException:
            lifecycle.finish(Outcome.CANCELLED if disconnected else Outcome.FAILURE)
            raise
        if not lifecycle.done:
            # The app returned without finishing the response body.
            if disconnected:
                lifecycle.finish(Outcome.CANCELLED)
            else:
                lifecycle.finish(outcome_for_status(status) if status else Outcome.FAILURE)
