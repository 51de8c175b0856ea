"""A lean pooled HTTP/1.1 client on asyncio Protocols and httptools, for the proxy's upstream.

Measured here against httpx and aiohttp behind the same uvicorn proxy (see
`bench/asgi_proxy.py`): it costs a fraction of either per request, because it does only
what a reverse proxy needs: one request per connection at a time, keep-alive pooling per
`host:port`, `Content-Length` request bodies (the proxy holds the body anyway, to replay it
on a fallback), and response bodies handed over chunk by chunk as they arrive.

Errors say how far the exchange got, because that decides whether a fallback is safe:
`ConnectFailed` (nothing was sent), `ResetBeforeResponse` (sent, but no response byte came
back), `UpstreamBroken` (the response was cut or broke HTTP), `UpstreamTimeout`. Interim
1xx responses are skipped; bytes past a response's end drop the connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools

_HIGH_WATER = 256 * 1024  # buffered response bytes before the socket stops being read
# A response head past these is refused (Envoy's codec limits for upstream heads too).
_MAX_HEADERS = 100
_MAX_HEAD = 60 * 1024
_HEAD_SLACK = 4096  # raw head bytes beyond the counted ones: status line, separators
_LOW_WATER = 64 * 1024


class UpstreamError(Exception):
    """An exchange with an upstream endpoint failed; `address` is the endpoint."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"{address}: {message}")
        self.address = address


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, timed out): nothing was sent."""


class PoolBusy(ConnectFailed):
    """Every pooled connection to the endpoint stayed busy past the wait: this router's own
    limit (`limits.upstream_max_connections`), not a sign the endpoint fails."""


class ResetBeforeResponse(UpstreamError):
    """The request was written but the connection closed before any response byte."""

    def __init__(self, address: str, message: str, *, reused: bool) -> None:
        super().__init__(address, message)
        self.reused = reused


class UpstreamBroken(UpstreamError):
    """The response was cut (connection lost) or broke HTTP (unparsable, a status outside
    200-599, bytes past its end)."""


class UpstreamTimeout(UpstreamError):
    """No byte arrived for `read_timeout` seconds."""


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_connections: int = 512  # per endpoint
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # longest silence between two response bytes
    # An idle keep-alive connection older than this is closed: below uvicorn's 5 s keep-alive,
    # which vLLM and SGLang serve with (past it the engine has closed its end).
    idle_timeout: float = 4.0


class UpstreamResponse:
    """One response being received. Read it with `next_chunk()` until it returns b"", then
    `release()`; or `close()` at any point (the connection is dropped if not finished)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_released",
        "_waiter",
        "complete",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.complete = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # fed by the protocol ------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self.complete and self._error is None:
            self._error = error
        self._wake()

    # read by the proxy ---------------------------------------------------------------------
    async def _wait(self) -> None:
        waiter = self._conn.loop.create_future()
        self._waiter = waiter
        await waiter

    async def _head(self) -> None:
        while self.status == 0:
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def has_buffered(self) -> bool:
        return bool(self._chunks)

    async def next_chunk(self) -> bytes:
        """What has arrived of the body since the last call (waiting for at least one
        piece); b"" at the end of the body."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.take_buffered()

    def take_buffered(self) -> bytes:
        """Everything received so far (the whole body if `complete`), without waiting."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered > _LOW_WATER:
            self._conn.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    @property
    def address(self) -> str:
        """The `host:port` it came from."""
        return self._conn.address

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def release(self) -> None:
        """Done with this response: the connection goes back to the pool if it can be reused."""
        if self._released:
            return
        self._released = True
        self._conn.finish(reusable=self.complete and self.keep_alive and self._error is None)

    def close(self) -> None:
        """Abandon the response (e.g. the client went away): drops an unfinished connection."""
        self.release()


def _delimited_by_close(headers: list[tuple[bytes, bytes]]) -> bool:
    final_coding = b""
    for name, value in headers:
        if name == b"content-length":
            return False
        if name == b"transfer-encoding":
            final_coding = value.rsplit(b",", 1)[-1].strip().lower()
    return final_coding != b"chunked"


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_expecting",
        "_head_bytes",
        "_head_only",
        "_head_raw",
        "_interim",
        "_last_activity",
        "_paused",
        "_timer",
        "address",
        "closed",
        "idle_since",
        "loop",
        "parser",
        "pool",
        "response",
        "transport",
        "uses",
    )

    def __init__(self, pool: UpstreamPool, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.address = address
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self.uses = 0
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        # From a request's write to its final response's end: any message outside that
        # window is bytes the engine sent past its own framing (the connection is dropped).
        self._expecting = False
        self._interim = False  # the message being parsed is a 1xx: the final one follows
        self._head_bytes = 0
        self._head_only = False  # the request is a HEAD: its answer ends with its head
        self._head_raw = 0  # bytes received of this request's answer before its final head

    # asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.pool._forget(self)
        response = self.response
        if response is not None and not response.complete and response._error is None:
            if response.status == 0 and not self._head_raw:
                response._fail(
                    ResetBeforeResponse(
                        self.address, "connection closed before a response", reused=self.uses > 1
                    )
                )
            elif response.status == 0:  # bytes came (an interim 1xx, part of a head): no retry
                response._fail(UpstreamBroken(self.address, "connection closed mid-head"))
            elif _delimited_by_close(response.headers) and exc is None:
                # A body without length ends when the connection closes; a reset (exc) cuts it.
                response.complete = True
                response.keep_alive = False
                response._wake()
            else:
                response._fail(UpstreamBroken(self.address, "connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        self._last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(f"bad HTTP response: {exc}")
            return
        except httptools.HttpParserUpgrade:  # a 101 (refused in on_headers_complete)
            self._broken("the engine switched protocols")
            return
        response = self.response
        if self._expecting and response is not None and response.status == 0:
            # Still in the head (or after a 1xx): counted raw, as the parser holds a header
            # until its end (one endless header line would grow without bound).
            self._head_raw += len(data)
            if self._head_raw > _MAX_HEAD + _HEAD_SLACK:
                self._broken(f"response head past {_MAX_HEAD} bytes")

    def _broken(self, reason: str) -> None:
        """The engine broke HTTP: the response fails if it is not over, the connection goes."""
        if self.response is not None:
            self.response.keep_alive = False
            self.response._fail(UpstreamBroken(self.address, reason))
        self._expecting = False
        self.abort()

    # httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if not self._expecting:
            # A response the proxy did not ask for: bytes past the last one's length (which
            # used to become the next request's response, or hang it), or sent while idle.
            self._broken("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if not self._expecting or response is None or response.status:
            return  # status set: the final head is over, this is a chunked trailer field
        response.headers.append((name.lower(), value))
        self._head_bytes += len(name) + len(value)
        if len(response.headers) > _MAX_HEADERS or self._head_bytes > _MAX_HEAD:
            self._broken(f"response head past {_MAX_HEADERS} headers or {_MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None or not self._expecting:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: not final
            self._interim = True
            response.headers.clear()
            self._head_bytes = 0
            return
        if not 200 <= status <= 599:  # 101 never asked for (no upgrade is forwarded)
            self._broken(f"status {status} is not a final HTTP status")
            return
        response.keep_alive = bool(self.parser.should_keep_alive())
        response.status = status
        if self._head_only:
            # An answer to HEAD has no body, whatever length it names; the parser does not
            # know the request was a HEAD and would wait for one: done here, and the
            # connection is not reused (its parser is mid-message).
            response.keep_alive = False
            self._complete(response)
            return
        response._wake()

    def on_body(self, body: bytes) -> None:
        if self._expecting and not self._interim and self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or not self._expecting:
            return
        if self._interim:  # the final response is still to come
            self._interim = False
            return
        self._complete(response)

    def _complete(self, response: UpstreamResponse) -> None:
        self._expecting = False
        response.complete = True
        self._cancel_timer()
        response._wake()

    # flow control and lifetime --------------------------------------------------------------
    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def send(
        self, payload: bytes, response: UpstreamResponse, read_timeout: float, *, head: bool
    ) -> None:
        assert self.transport is not None
        self.response = response
        self.uses += 1
        if self.closed:  # closed by the engine since it was connected or pooled: nothing sent
            response._fail(
                ResetBeforeResponse(
                    self.address, "connection closed before the request", reused=True
                )
            )
            return
        self._expecting = True
        self._head_only = head
        self._head_raw = 0
        self._head_bytes = 0
        self.transport.write(payload)
        self._last_activity = self.loop.time()
        self._timer = self.loop.call_at(self._last_activity + read_timeout, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timer = None
        response = self.response
        if response is None or response.complete or self.closed:
            return
        read_timeout = self.pool.limits.read_timeout
        deadline = self._last_activity + read_timeout
        now = self.loop.time()
        if self._paused:  # the reader's doing (the forwarder bounds a stalled client): look later
            self._timer = self.loop.call_at(now + read_timeout, self._check_timeout)
            return
        if now < deadline:
            self._timer = self.loop.call_at(deadline, self._check_timeout)
            return
        response._fail(UpstreamTimeout(self.address, "no byte from it for read_timeout"))
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def finish(self, *, reusable: bool) -> None:
        self._cancel_timer()
        self.response = None
        if reusable and not self.closed:
            self.resume_reading()
            self.pool._checkin(self)
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
            self.pool._forget(self)


class _HostPool:
    __slots__ = ("idle", "open", "waiters")

    def __init__(self) -> None:
        self.idle: list[_Connection] = []  # a stack: the warmest connection is reused first
        self.open = 0
        self.waiters: deque[asyncio.Future[None]] = deque()


class UpstreamPool:
    """Keep-alive connections per `host:port`, at most `limits.max_connections` each."""

    def __init__(self, limits: PoolLimits | None = None) -> None:
        self.limits = limits or PoolLimits()
        self._hosts: dict[str, _HostPool] = {}
        self._connections: set[_Connection] = set()
        self._closed = False
        # One timer for the whole pool: it closes the connections idle past `idle_timeout`.
        self._sweep_at: asyncio.TimerHandle | None = None

    def _host(self, address: str) -> _HostPool:
        host = self._hosts.get(address)
        if host is None:
            host = self._hosts[address] = _HostPool()
        return host

    async def _checkout(self, address: str) -> _Connection:
        host = self._host(address)
        now = time.monotonic()
        # One deadline for the whole wait: a waiter woken for a connection that a newer
        # request took first waits on, but not a fresh `connect_timeout` each time.
        deadline = asyncio.get_running_loop().time() + self.limits.connect_timeout
        while True:
            while host.idle:
                conn = host.idle.pop()
                if not conn.closed and now - conn.idle_since < self.limits.idle_timeout:
                    return conn
                conn.abort()
            if host.open < self.limits.max_connections:
                return await self._connect(address, host)
            waiter = asyncio.get_running_loop().create_future()
            host.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if not waiter.done():
                    waiter.cancel()
                elif not waiter.cancelled():
                    # Woken, then cancelled or timed out before taking the connection: pass
                    # the wake-up on, or the next waiter sleeps beside an idle connection.
                    self._wake_one(host)
                if isinstance(exc, TimeoutError):
                    raise PoolBusy(
                        address,
                        f"all {self.limits.max_connections} connections busy for "
                        f"{self.limits.connect_timeout:g} s (limits.upstream_max_connections)",
                    ) from None
                raise
            now = time.monotonic()

    async def _connect(self, address: str, host: _HostPool) -> _Connection:
        name, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        conn = _Connection(self, address, loop)
        host.open += 1
        self._connections.add(conn)
        try:
            async with asyncio.timeout(self.limits.connect_timeout):
                await loop.create_connection(lambda: conn, name.strip("[]"), int(port))
        except TimeoutError:
            self._forget(conn)
            raise ConnectFailed(address, "connect timed out") from None
        except OSError as exc:
            self._forget(conn)
            raise ConnectFailed(address, f"cannot connect: {exc.strerror or exc}") from None
        except BaseException:
            self._forget(conn)
            conn.abort()
            raise
        return conn

    def _checkin(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        host = self._host(conn.address)
        conn.idle_since = time.monotonic()
        host.idle.append(conn)
        self._wake_one(host)
        if self._sweep_at is None:
            self._sweep_at = conn.loop.call_later(self.limits.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for `idle_timeout` (their age was read only when a
        request took one: after a burst, or to an endpoint no request goes to any more, they
        stayed open for good where the engine does not close idle ones itself)."""
        self._sweep_at = None
        now = time.monotonic()
        limit = self.limits.idle_timeout
        oldest: float | None = None
        for host in self._hosts.values():
            if not host.idle:
                continue
            idle, host.idle = host.idle, []
            for conn in idle:
                if not conn.closed and now - conn.idle_since < limit:
                    host.idle.append(conn)
                    if oldest is None or conn.idle_since < oldest:
                        oldest = conn.idle_since
                else:
                    conn.abort()  # (`_forget`: no longer in `host.idle`, one fewer open)
        if oldest is not None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweep_at = loop.call_later(max(0.0, oldest + limit - now), self._sweep)

    def _forget(self, conn: _Connection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            host = self._host(conn.address)
            host.open -= 1
            if conn in host.idle:
                host.idle.remove(conn)
            self._wake_one(host)

    def _drop_idle(self, address: str) -> None:
        host = self._host(address)
        idle, host.idle = host.idle, []
        for conn in idle:
            conn.abort()

    @staticmethod
    def _wake_one(host: _HostPool) -> None:
        while host.waiters:
            waiter = host.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def request(
        self,
        address: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send one request and wait for the response head. `headers` must not carry
        `host`, `content-length`, `transfer-encoding` or `connection`: this sets them."""
        head = b"".join(
            [
                f"{method} {target} HTTP/1.1\r\nhost: {address}\r\ncontent-length: {len(body)}\r\n".encode(
                    "latin-1"
                ),
                *[name + b": " + value + b"\r\n" for name, value in headers],
                b"\r\n",
            ]
        )
        payload = head + body
        for _ in range(2):
            conn = await self._checkout(address)
            response = UpstreamResponse(conn)
            conn.send(payload, response, self.limits.read_timeout, head=method == "HEAD")
            try:
                await response._head()
            except ResetBeforeResponse as exc:
                response.close()
                if exc.reused:
                    # A pooled connection the server had already closed: its idle neighbours
                    # aged alike, so drop them and go once more on a fresh one.
                    self._drop_idle(address)
                    continue
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise ResetBeforeResponse(address, "connection closed before a response", reused=True)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweep_at is not None:
            self._sweep_at.cancel()
            self._sweep_at = None
        for conn in list(self._connections):
            conn.abort()
        for host in self._hosts.values():
            host.idle.clear()
            for waiter in host.waiters:
                if not waiter.done():
                    waiter.cancel()
        self._hosts.clear()

    def stats(self) -> dict[str, tuple[int, int]]:
        """{address: (open connections, idle connections)}."""
        return {a: (h.open, len(h.idle)) for a, h in self._hosts.items()}
