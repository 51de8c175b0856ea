"""The proxy's upstream pool and relay under a full pool, stale keep-alive connections and a
client that stops reading: every wait is bounded, nothing is charged to a healthy engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.protocol import guarded
from llmgw.asgi.testing import (
    MODEL,
    SSE_HEAD,
    Script,
    ScriptedUpstream,
    UpstreamRequest,
    answer_ok,
    chunk,
    json_response,
    make_config,
    outcome_count,
    serve,
)
from llmgw.asgi.upstream import (
    ConnectFailed,
    PoolLimits,
    ResetBeforeResponse,
    UpstreamBroken,
    UpstreamPool,
    UpstreamResponse,
)
from llmgw.config import load_dict
from llmgw.runtime.router import Router
from llmgw.testing.controlplane import FakeControlPlane
from llmgw.testing.wait import eventually

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


@contextlib.asynccontextmanager
async def pool_on(
    script: Script, limits: PoolLimits
) -> AsyncIterator[tuple[ScriptedUpstream, UpstreamPool]]:
    """A pool with `limits` in front of an upstream answering with `script`."""
    upstream = await ScriptedUpstream(script).start()
    pool = UpstreamPool(limits)
    try:
        yield upstream, pool
    finally:
        await pool.aclose()
        await upstream.stop()


async def test_a_full_pool_fails_over_after_connect_timeout_instead_of_waiting() -> None:
    """All connections to an endpoint busy: the wait is bounded like a connect, and says why."""
    limits = PoolLimits(max_connections=1, connect_timeout=0.2)
    async with pool_on(answer_ok, limits) as (upstream, pool):
        held = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        with pytest.raises(ConnectFailed, match=r"all 1 connections busy for 0\.2 s"):
            await asyncio.wait_for(pool.request(upstream.address, "POST", "/x", [], b"{}"), 5)
        held.release()
        again = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        assert again.status == 200
        again.release()


async def test_a_waiter_cancelled_after_its_wake_up_passes_it_on() -> None:
    """b is woken for the freed connection but its client left: c must get the connection."""
    limits = PoolLimits(max_connections=1, connect_timeout=5)
    async with pool_on(answer_ok, limits) as (upstream, pool):
        first = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        b = asyncio.create_task(pool.request(upstream.address, "POST", "/x", [], b"{}"))
        c = asyncio.create_task(pool.request(upstream.address, "POST", "/x", [], b"{}"))
        await eventually(lambda: len(pool._host(upstream.address).waiters) == 2)
        first.release()  # wakes b ...
        b.cancel()  # ... whose client went away in the same turn
        await asyncio.gather(b, return_exceptions=True)
        answered = await asyncio.wait_for(c, 2)
        assert answered.status == 200
        answered.release()


async def test_stale_keep_alive_connections_are_dropped_and_the_retry_goes_fresh() -> None:
    """Two idle connections the engine has closed (its keep-alive expired together): the
    request is sent again on a new connection, not on the other stale one."""
    hold = asyncio.Event()
    served: dict[int, int] = {}

    async def script(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        n = served[id(writer)] = served.get(id(writer), 0) + 1
        if n > 1:
            writer.close()  # this connection's keep-alive ran out as the request came
            return
        await hold.wait()
        writer.write(json_response(200, b"{}"))
        await writer.drain()

    async with pool_on(script, PoolLimits(max_connections=4)) as (upstream, pool):
        warm = [
            asyncio.create_task(pool.request(upstream.address, "POST", "/x", [], b"{}"))
            for _ in range(2)
        ]
        await eventually(lambda: len(upstream.requests) == 2)
        hold.set()
        for response in await asyncio.gather(*warm):
            await response.read()
            response.release()
        assert pool.stats()[upstream.address] == (2, 2)
        response = await asyncio.wait_for(
            pool.request(upstream.address, "POST", "/x", [], b"{}"), 5
        )
        assert response.status == 200
        assert len(served) == 3  # the stale one, then a fresh connection (not the other)
        response.release()


async def test_a_paused_response_does_not_spin_the_read_timer() -> None:
    """A stalled reader pauses the socket: the read timeout looks again a read_timeout later,
    not every millisecond."""
    async with pool_on(answer_ok, PoolLimits(read_timeout=30)) as (upstream, pool):
        response = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        conn = response._conn
        conn.response = response
        response.complete = False
        conn.pause_reading()
        conn._last_activity -= 60  # silent past the read timeout, while paused
        conn._check_timeout()
        assert conn._timer is not None
        assert conn._timer.when() - conn.loop.time() > 29
        response.close()


async def test_a_client_that_stops_reading_is_dropped_after_client_write_timeout() -> None:
    """Its socket open, nothing read: the request ends (cancelled), the lease and the
    upstream connection are freed, and the engine is not blamed."""

    async def endless(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD)
        piece = chunk(b"data: " + b"x" * 16384 + b"\n\n")
        try:
            for _ in range(4000):  # far more than the socket buffers hold
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            return

    upstream = await ScriptedUpstream(endless).start()
    config = make_config([upstream.address], limits={"client_write_timeout": 0.3})
    app = ProxyApp(config, scrape=False)

    def inflight() -> int:
        return sum(s.inflight for s in app.router.registry.states(MODEL))

    async with serve(app, http=guarded(config.limits)) as base:
        port = int(base.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(
            b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\n" + b"content-length: %d\r\n\r\n" % len(BODY) + BODY
        )
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the client reads nothing more
        await eventually(lambda: inflight() == 1)
        try:
            await eventually(lambda: inflight() == 0, timeout=5)
            assert outcome_count(app.telemetry, upstream.address, "cancelled") == 1
            assert outcome_count(app.telemetry, upstream.address, "success") == 0
            assert outcome_count(app.telemetry, upstream.address, "failure") == 0
            # and its connection is reset a write timeout later (a close waited for the
            # unread answer to drain: the proxy held that socket as long as the client did)
            await eventually(lambda: sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0)
        finally:
            writer.close()
    await upstream.stop()


async def test_a_request_on_a_connection_closed_before_it_fails_at_once() -> None:
    """Closed by the engine between connect (or checkout) and the write: no timer runs on a
    closed connection, so without this the head was awaited forever."""

    async def answer_then_close(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(json_response(200, b"{}"))  # says keep-alive, then goes
        await writer.drain()
        writer.close()

    async with pool_on(answer_then_close, PoolLimits(read_timeout=30)) as (upstream, pool):
        response = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        conn = response._conn
        await response.read()
        response.release()
        await eventually(lambda: conn.closed)  # the engine's close has been seen
        late = UpstreamResponse(conn)
        conn.send(b"POST /x HTTP/1.1\r\n\r\n", late, 30, head=False)
        with pytest.raises(ResetBeforeResponse):
            await asyncio.wait_for(late._head(), 2)


async def test_a_client_that_leaves_while_its_model_starts_stops_waiting() -> None:
    """The wait for an on-demand model (up to activation_timeout) did not watch the client:
    it went on, counted among the waiters, and ended in a request sent for nobody."""
    config = load_dict(
        {
            "activation_timeout": 60,
            "models": {
                MODEL: {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}}
            },
        }
    )
    plane = FakeControlPlane()  # never released: a model still loading
    app = ProxyApp(config, router=Router(config, control_plane=plane, scrape=False))
    async with serve(app, http=guarded(config.limits)) as base:
        activator = app.router.activator
        assert activator is not None
        port = int(base.rsplit(":", 1)[1])
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\n" + b"content-length: %d\r\n\r\n" % len(BODY) + BODY
        )
        await writer.drain()
        await eventually(lambda: activator.machines[MODEL].waiters == 1)
        writer.close()
        await eventually(lambda: activator.machines[MODEL].waiters == 0, timeout=5)
        assert plane.wants == 1  # the start goes on: it is the activator's, not the client's


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_client_gone_mid_stream_cancels_the_upstream_even_with_a_request_pipelined(
    pipelined: bool,
) -> None:
    """uvicorn tells only its newest cycle of a lost connection: with a second request
    pipelined behind the stream, the stream never heard, and the engine generated its whole
    answer for nobody with the lease held."""
    release = asyncio.Event()

    async def held(
        _request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: first\n\n"))
        await writer.drain()
        eof = asyncio.ensure_future(reader.read())  # the proxy dropping the connection
        done = asyncio.ensure_future(release.wait())
        await asyncio.wait((eof, done), return_when=asyncio.FIRST_COMPLETED)
        eof.cancel()
        done.cancel()
        if release.is_set():
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            writer.close()

    upstream = await ScriptedUpstream(held).start()
    config = make_config([upstream.address])
    app = ProxyApp(config, scrape=False)
    request = (
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(BODY) + BODY
    )
    try:
        async with serve(app, http=guarded(config.limits)) as base:
            port = int(base.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request * (2 if pipelined else 1))
            await writer.drain()
            await asyncio.wait_for(reader.readuntil(b"data: first\n\n"), 5)
            writer.close()  # gone mid-stream
            await asyncio.wait_for(upstream.closed.wait(), 5)  # the engine's request dropped
            await eventually(
                lambda: sum(s.inflight for s in app.router.registry.states(MODEL)) == 0
            )
    finally:
        release.set()
        await upstream.stop()


@pytest.mark.parametrize("reset", [False, True])
async def test_a_body_without_length_ends_at_a_close_and_a_reset_cuts_it(reset: bool) -> None:
    """No length and not chunked: the connection's end is the body's end, unless it was a
    reset, which read as a whole answer."""
    headed = asyncio.Event()  # the pool has the head: the body's end is what is tested

    async def until_close(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await headed.wait()
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    async with pool_on(until_close, PoolLimits(read_timeout=5)) as (upstream, pool):
        response = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        headed.set()
        if reset:
            with pytest.raises(UpstreamBroken, match="mid-response"):
                await response.read()
        else:
            assert await response.read() == b"data: 1\n\n"
