"""`Forwarder`: the proxy's inner ASGI app, sending a routed request to its endpoint.

The request body is held (it is bounded by `limits.max_body_bytes` and needed to replay on
a fallback) and sent with the client's headers minus hop-by-hop and llmgw's internal ones
over pooled HTTP/1.1 keep-alive connections (`llmgw.asgi.upstream`, limits from
`limits.upstream_*`). If the endpoint refuses before any response byte reached the client
(connect error, reset, 429, 503), the request goes to the Decision's next fallback, at
most `num_fallback_replicas` times (a 429 or 503 is held meanwhile: the client gets it if
no endpoint after it answers); once the response head has been sent nothing is retried.
Status, headers (minus hop-by-hop) and the body pass through chunk by chunk (SSE is never
buffered). A client that goes away cancels the upstream exchange (its connection
is dropped) and the lease ends CANCELLED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from llmgw.asgi.middleware import (
    DISPATCH_KEY,
    INTERNAL_HEADER_NAMES,
    Disconnected,
    from_browser,
    read_body,
    send_error,
)
from llmgw.asgi.types import Message, Receive, Scope, Send
from llmgw.asgi.upstream import (
    ConnectFailed,
    PoolBusy,
    PoolLimits,
    ResetBeforeResponse,
    UpstreamBroken,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.config import Config
from llmgw.errors import LlmgwError, NoCapacity, RouteNotFound, UpstreamUnreachable
from llmgw.gateway import ConfigSource
from llmgw.lifecycle import DECISION_HEADER, Lifecycle, debug_summary
from llmgw.types import Endpoint, Outcome

log = logging.getLogger("llmgw.proxy")

# Headers that describe one hop, not the message: never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers never forwarded: hop-by-hop, the ones the upstream client sets itself,
# and llmgw's internal ones (the middleware adds them for the inner app, not the engine).
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"} | INTERNAL_HEADER_NAMES


def _passed_on(
    headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """`headers` without `drop` and without those a `Connection` header names: they are
    this hop's too (RFC 9110 7.6.1)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(t.strip().lower() for t in value.split(b","))
    if named:
        return [(n, v) for n, v in headers if n not in drop and n not in named]
    return [(n, v) for n, v in headers if n not in drop]


_REFUSING = (429, 503)  # an engine saying "not now": another replica may take it
# An endpoint that gave no answer (a broken head included): nothing reached the client.
_NO_ANSWER = (ConnectFailed, ResetBeforeResponse, UpstreamTimeout, UpstreamBroken)
_WATCH_AFTER = 0.02  # seconds before a slow exchange starts watching for a disconnect
_DEBUG_HEADER = DECISION_HEADER.encode("latin-1")


_LOCATIONS = (b"location", b"content-location")


def _own_locations(headers: list[tuple[bytes, bytes]], address: str) -> list[tuple[bytes, bytes]]:
    """A Location naming the engine itself becomes relative (its path on this proxy), as
    nginx's `proxy_redirect default` does. The engine builds it from the Host it was sent,
    its own address: vLLM (FastAPI) answers `/v1/chat/completions/` with a 307 there, and
    the client, the OpenAI SDK following it, went around the router to a pod address."""
    origin = b"http://" + address.encode("latin-1")
    out = []
    for name, value in headers:
        rest = value[len(origin) :]
        if name in _LOCATIONS and value.startswith(origin) and (not rest or rest[:1] in b"/?#"):
            out.append((name, rest if rest[:1] == b"/" else b"/" + rest))
        else:
            out.append((name, value))
    return out


def pool_limits(config: Config) -> PoolLimits:
    limits = config.limits
    return PoolLimits(
        max_connections=limits.upstream_max_connections,
        connect_timeout=limits.upstream_connect_timeout,
        read_timeout=limits.upstream_read_timeout,
        idle_timeout=limits.upstream_idle_timeout,
    )


class Forwarder:
    """The inner ASGI app: forwards a routed request to `scope["state"]["llmgw_dispatch"]`."""

    def __init__(
        self,
        pool: UpstreamPool,
        config: ConfigSource,
        on_error: Callable[[LlmgwError], object] | None = None,
    ) -> None:
        self.pool = pool
        self._config = config  # read per request: a reload applies to the next one
        self.on_error = on_error  # told of an error answered without a request routed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state") or {}
        dispatch: Lifecycle | None = state.get(DISPATCH_KEY)
        if dispatch is None:
            error = RouteNotFound(f"no route for {scope['method']} {scope['path']}")
            if self.on_error is not None:
                self.on_error(error)
            await send_error(send, error, cors=from_browser(scope))
            return
        limits = dispatch.config.limits
        try:
            body = await read_body(receive, limits.max_body_bytes, limits.client_body_timeout)
        except Disconnected:
            return
        except LlmgwError as error:  # 413 or 408: the endpoint was never asked
            dispatch.finish(Outcome.CANCELLED)
            await send_error(send, dispatch.refuse(error), cors=from_browser(scope))
            return
        query: bytes = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        if query:
            target = target + b"?" + query
        headers = _passed_on(scope["headers"], REQUEST_DROP)

        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(receive, task, limits.client_write_timeout)
        response: UpstreamResponse | None = None
        try:
            response = await self._exchange(
                dispatch, scope["method"], target.decode("latin-1"), headers, body
            )
            await self._relay(dispatch, response, send, watch)
        except (UpstreamUnreachable, NoCapacity) as error:
            await send_error(send, dispatch.refuse(error), cors=from_browser(scope))
        except UpstreamError as error:
            # Cut after the head went out (engine died mid-stream): nothing can be retried.
            # A failure for the breaker; uvicorn closes the client connection unfinished.
            log.warning("upstream broke mid-response: %s", error)
            dispatch.finish(Outcome.FAILURE)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            task.uncancel()  # the client went away: the middleware records CANCELLED
            if watch.stalled:  # no disconnect for the middleware to see: ended here
                log.info("client accepted no response byte for client_write_timeout: dropped")
                dispatch.finish(Outcome.CANCELLED)
        finally:
            watch.stop()
            if response is not None:
                response.close()

    async def _exchange(
        self,
        dispatch: Lifecycle,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """The first acceptable response head, trying fallbacks while nothing was sent.

        An endpoint's refusal (429, 503) is held, unread, while the next one is tried: if
        every one after it fails to answer, the client gets that refusal (its Retry-After
        included), not a 502 saying no endpoint answered."""
        refused: UpstreamResponse | None = None  # the last refusal, while a fallback runs
        refused_by: Endpoint | None = None  # the endpoint that gave it
        try:
            while True:
                endpoint = dispatch.endpoint
                assert endpoint is not None  # the middleware hands over a dispatched request
                address = endpoint.address
                try:
                    response = await self.pool.request(address, method, target, headers, body)
                except _NO_ANSWER as exc:
                    # Nothing went to the client yet: try a fallback.
                    log.debug("upstream %s failed before answering: %s", address, exc)
                    # A pool at its limit says the endpoint is busy, not failing: no breaker
                    # verdict (three of them opened a healthy, busy endpoint's breaker).
                    busy = isinstance(exc, PoolBusy)
                    outcome = Outcome.CANCELLED if busy else Outcome.FAILURE
                    if dispatch.fall_back(outcome) is not None:
                        continue
                    if refused is not None and refused_by is not None:
                        # The refusal goes to the client, credited to the endpoint that gave
                        # it; the endpoint that failed last is charged its own outcome.
                        dispatch.passed_on(refused_by, refused.status, outcome)
                        response, refused = refused, None
                        return response
                    if busy:
                        dispatch.finish(Outcome.CANCELLED)
                        raise NoCapacity(
                            f"every endpoint of model {endpoint.model!r} tried has all its "
                            f"connections busy (tried {dispatch.attempts}; last: {exc})",
                            retry_after=1,
                        ) from None
                    raise UpstreamUnreachable(
                        f"no endpoint of model {endpoint.model!r} answered "
                        f"(tried {dispatch.attempts}; last: {exc})"
                    ) from None
                if response.status in _REFUSING and dispatch.fall_back(Outcome.BACKPRESSURE):
                    log.debug("upstream %s answered %d; falling back", address, response.status)
                    if refused is not None:
                        refused.close()
                    refused, refused_by = response, endpoint
                    continue
                return response
        finally:
            if refused is not None:  # another endpoint answered, or the client left
                refused.close()

    async def _relay(
        self, dispatch: Lifecycle, response: UpstreamResponse, send: Send, watch: DisconnectWatch
    ) -> None:
        """Each send is timed (`watch.sending()` before, `sending_since = None` after) inline:
        a wrapping coroutine cost 250 ns a send, and a stream sends hundreds."""
        # Before the first byte: an error is no first token, nor is a whole answer's.
        content_type = response.header(b"content-type")
        dispatch.response(
            response.status,
            content_type=content_type.decode("latin-1") if content_type is not None else None,
        )
        headers = _passed_on(response.headers, HOP_BY_HOP)
        if 300 <= response.status < 400 or response.status == 201:
            headers = _own_locations(headers, response.address)
        if response.status in (204, 304):  # no body follows: a length would make uvicorn
            headers = [(n, v) for n, v in headers if n != b"content-length"]  # wait for one
        if dispatch.config.debug_headers and dispatch.decision is not None:
            summary = debug_summary(dispatch.decision, dispatch.endpoint)
            headers.append((_DEBUG_HEADER, summary.encode("latin-1", "replace")))
        start: Message = {
            "type": "http.response.start",
            "status": response.status,
            "headers": headers,
        }
        if response.complete:  # the whole body came with the head: one send each
            body = response.take_buffered()
            response.release()
            dispatch.first_byte()
            watch.sending()
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            watch.sending_since = None
            return
        watch.sending()
        await send(start)
        watch.sending_since = None
        # Each chunk reaches `dispatch.body_chunk` through the middleware's send: the first
        # token is the first chunk that holds one (a role chunk sent ahead of it does not).
        while True:
            data = await response.next_chunk()
            done = response.complete and not response.has_buffered
            if not data or done:
                response.release()
                watch.sending()
                await send({"type": "http.response.body", "body": data, "more_body": False})
                watch.sending_since = None
                return
            watch.sending()
            await send({"type": "http.response.body", "body": data, "more_body": True})
            watch.sending_since = None


class DisconnectWatch:
    """Cancels the forwarding task when the client disconnects, or stops reading: a send
    to it that has not returned after `write_timeout` seconds (a client that keeps its
    socket open and reads nothing would hold the engine's slot and the upstream connection).

    Waiting on `receive()` takes a task of its own; most exchanges are over before
    `_WATCH_AFTER`, so the watcher is only started when one takes longer (a timer handle
    costs far less than a task). Uvicorn remembers a disconnect, so none is missed. Sends
    are timed by one timer a `write_timeout`, not one per send (a stream sends hundreds).
    """

    __slots__ = (
        "_loop",
        "_receive",
        "_task",
        "_timer",
        "_watcher",
        "_write_timeout",
        "_write_timer",
        "gone",
        "sending_since",
        "stalled",
    )

    def __init__(self, receive: Receive, task: asyncio.Task[None], write_timeout: float) -> None:
        self._receive = receive
        self._task = task
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False
        self.stalled = False  # gone because a send stalled for write_timeout
        self._loop = loop = asyncio.get_running_loop()
        self._write_timeout = write_timeout
        self.sending_since: float | None = None  # when the send in progress began
        self._write_timer: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = loop.call_later(_WATCH_AFTER, self._start)

    def sending(self) -> None:
        """A send to the client starts (set `sending_since = None` when it returns)."""
        self.sending_since = since = self._loop.time()
        if self._write_timer is None:
            self._write_timer = self._loop.call_at(since + self._write_timeout, self._check_write)

    def _check_write(self) -> None:
        self._write_timer = None
        since = self.sending_since
        if since is None or self.gone:  # between sends: the next one arms it again
            return
        due = since + self._write_timeout
        if self._loop.time() < due:
            self._write_timer = self._loop.call_at(due, self._check_write)
            return
        self.gone = self.stalled = True
        self._task.cancel()

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._task.cancel()
                return

    def stop(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
