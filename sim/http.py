"""A lean HTTP/1.1 server on asyncio Protocols and httptools (keep-alive, pipelining,
chunked streaming). Starlette + uvicorn cost several times more per request, and the
simulator must never be the bottleneck of a benchmark.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

import httptools


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


class ConnectionClosedError(Exception):
    """The peer went away (or the replica dropped it) while we were answering."""


Handler = Callable[[Request, "HttpConnection"], Awaitable[Response | None]]

_REASONS = {status.value: status.phrase for status in HTTPStatus}


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode()


class HttpServerState:
    """Things shared by all connections of one listening socket."""

    def __init__(self, handler: Handler, extra_headers: list[tuple[str, str]]) -> None:
        self.handler = handler
        self.extra_headers = b"".join(f"{k}: {v}\r\n".encode() for k, v in extra_headers)
        self.connections: set[HttpConnection] = set()

    def drop_all(self) -> None:
        """Abort every open connection (a simulated crash)."""
        for connection in list(self.connections):
            connection.abort()


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, answers them strictly in order."""

    def __init__(self, state: HttpServerState) -> None:
        self._state = state
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending: deque[Request] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self._can_write: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._stream_keep_alive = True

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check.
        self._transport = cast(asyncio.Transport, transport)
        self._state.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._state.connections.discard(self)
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._send_simple(400, b'{"detail":"Upgrade not supported"}', keep_alive=False)
        except httptools.HttpParserError:
            self._send_simple(400, b'{"detail":"Invalid HTTP request"}', keep_alive=False)

    def pause_writing(self) -> None:
        self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self._url.decode("latin-1").partition("?")
        method = self._parser.get_method().decode("latin-1")
        request = Request(
            method=method,
            path=path,
            query=query,
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=bool(self._parser.should_keep_alive()),
        )
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve())

    # answering

    @property
    def closed(self) -> bool:
        return self._closed

    def abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()

    async def _serve(self) -> None:
        handler = self._state.handler
        while self._pending and not self._closed:
            request = self._pending.popleft()
            try:
                response = await handler(request, self)
            except ConnectionClosedError:
                return
            if response is not None:
                self.send(response, request.keep_alive)
            elif not self._stream_keep_alive:
                self._close()
            if not request.keep_alive:
                self._close()
                return

    def send(self, response: Response, keep_alive: bool) -> None:
        if self._closed or self._transport is None:
            return
        head = [
            _status_line(response.status),
            f"content-type: {response.content_type}\r\ncontent-length: {len(response.body)}\r\n".encode(),
            self._state.extra_headers,
        ]
        for name, value in response.headers:
            head.append(f"{name}: {value}\r\n".encode())
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        head.append(response.body)
        self._transport.write(b"".join(head))

    def _send_simple(self, status: int, body: bytes, keep_alive: bool) -> None:
        self.send(Response(status=status, body=body), keep_alive)
        if not keep_alive:
            self._close()

    def _close(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()

    # streaming (chunked transfer encoding)

    def start_stream(
        self, status: int, content_type: str, headers: list[tuple[str, str]] | None = None
    ) -> None:
        if self._closed or self._transport is None:
            raise ConnectionClosedError
        head = [
            _status_line(status),
            f"content-type: {content_type}\r\ntransfer-encoding: chunked\r\n".encode(),
            self._state.extra_headers,
        ]
        for name, value in headers or []:
            head.append(f"{name}: {value}\r\n".encode())
        head.append(b"\r\n")
        self._transport.write(b"".join(head))

    async def write_chunk(self, data: bytes) -> None:
        if self._closed or self._transport is None:
            raise ConnectionClosedError
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if self._can_write is not None:
            await self._can_write
            if self._closed:
                raise ConnectionClosedError

    def end_stream(self) -> None:
        if self._closed or self._transport is None:
            raise ConnectionClosedError
        self._transport.write(b"0\r\n\r\n")

    def cut(self) -> None:
        """Drop the connection mid-answer (a simulated crash of the stream)."""
        self._stream_keep_alive = False
        self.abort()


async def serve(
    handler: Handler,
    host: str,
    port: int,
    extra_headers: list[tuple[str, str]] | None = None,
) -> tuple[asyncio.Server, HttpServerState]:
    """Listen on host:port (0 = ephemeral); returns the server and its connection set."""
    state = HttpServerState(handler, extra_headers or [])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpConnection(state), host, port, reuse_address=True, backlog=2048
    )
    return server, state
