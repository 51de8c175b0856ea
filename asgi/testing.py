"""Test helpers for the ASGI edge (used by tests/asgi and usable by any app's tests): a
config builder, uvicorn on a pre-bound loopback socket in the caller's event loop, a
scripted HTTP/1.1 upstream, and outcome counters."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import uvicorn

from llmgw.asgi.types import ASGIApp
from llmgw.config import Config, load_dict
from llmgw.runtime.ports import free_port

if TYPE_CHECKING:
    from llmgw.runtime.telemetry import Telemetry

MODEL = "m1"
DEADLINE = 10.0  # seconds: the bound of every wait in these tests


def make_config(addresses: list[str], **overrides: Any) -> Config:
    """One model `m1` on `addresses` (host:port), strategy `ring` unless overridden."""
    model: dict[str, Any] = {"endpoints": addresses, "strategy": "ring"}
    model.update(overrides.pop("model", {}))
    config: Config = load_dict({"models": {MODEL: model}, **overrides})
    return config


def address_of(url: str) -> str:
    return url.removeprefix("http://")


def refused_address() -> str:
    """A loopback host:port nothing listens on (`free_port`: outside the ephemeral range,
    where another test's `bind(0)` listener cannot take it meanwhile; never one twice)."""
    return f"127.0.0.1:{free_port()}"


@contextlib.asynccontextmanager
async def serve(
    app: ASGIApp,
    *,
    lifespan: Literal["auto", "on", "off"] = "on",
    http: str | type[asyncio.Protocol] = "httptools",
) -> AsyncIterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1:<ephemeral> in this loop; yields the base URL.
    `http`: the protocol (`llmgw.asgi.protocol.guarded(limits)` is the proxy's own).

    The socket is bound and listening before uvicorn starts, so a client may connect at
    once: the connection waits in the backlog until the server accepts it (no polling).
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        loop="none",
        http=http,
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, DEADLINE)
        sock.close()


@dataclass
class UpstreamRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


Script = Callable[[UpstreamRequest, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class ScriptedUpstream:
    """An HTTP/1.1 server whose answers a test writes by hand (one request per connection
    is enough here: each answer closes or keeps its connection as the script decides)."""

    script: Script
    requests: list[UpstreamRequest] = field(default_factory=list)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    address: str = ""
    # Seconds a kept-alive connection waits for its next request before the server closes
    # it (uvicorn's keep-alive rule); None: as long as the client keeps it open.
    keep_alive: float | None = None
    idle_closes: int = 0  # connections closed so

    async def start(self) -> ScriptedUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            wait = None  # a new connection's first request: no keep-alive limit yet
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
                except TimeoutError:
                    self.idle_closes += 1
                    break
                wait = self.keep_alive
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = UpstreamRequest(method, target, headers, body)
                self.requests.append(request)
                self.received.set()
                await self.script(request, reader, writer)
                if writer.is_closing():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


def json_response(status: int, body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def answer_ok(
    _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A script that answers every request 200 `{}` and keeps the connection alive."""
    writer.write(json_response(200, b"{}"))
    await writer.drain()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def held_stream(release: asyncio.Event, path: str = "/v1/chat/completions") -> Script:
    """A script that answers `path` with one SSE chunk, then holds the stream open until
    `release` is set (an in-flight stream on a pod that turns NotReady); 404 elsewhere (the
    scraper's /metrics)."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if request.target != path:
            writer.write(json_response(404, b"{}"))
            return
        writer.write(SSE_HEAD + chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'))
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return script


def outcome_count(telemetry: Telemetry, endpoint: str, outcome: str) -> float:
    value: float | None = telemetry.registry.get_sample_value(
        "llmgw_outcomes_total", {"model": MODEL, "endpoint": endpoint, "outcome": outcome}
    )
    return value or 0.0
