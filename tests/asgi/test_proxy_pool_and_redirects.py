"""The proxy's pool and relay: an engine's redirect points at the proxy, a wait for a full
pool is bounded by connect_timeout in all, idle connections close on their own."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
from fastapi import FastAPI

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    MODEL,
    ScriptedUpstream,
    UpstreamRequest,
    address_of,
    json_response,
    make_config,
    serve,
)
from llmgw.asgi.upstream import PoolBusy, PoolLimits, UpstreamPool
from llmgw.testing.wait import eventually

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


async def test_an_engines_redirect_points_at_the_proxy_not_at_the_engine() -> None:
    """vLLM is a FastAPI app: a POST to `/v1/chat/completions/` (trailing slash) is a 307
    whose Location Starlette builds from the request's Host. The proxy sends the engine's
    own address as Host, so the client is redirected straight to the engine (bypassing the
    router, or to a pod IP it cannot reach); the OpenAI SDK follows 307s. Through Envoy the
    client's Host is kept and the Location names the gateway."""
    engine = FastAPI()

    @engine.post(CHAT)
    async def chat() -> dict[str, int]:
        return {"ok": 1}

    async with serve(engine, lifespan="off") as engine_url:
        app = ProxyApp(make_config([address_of(engine_url)]), scrape=False)
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            headers = {"content-type": "application/json"}
            reply = await client.post(CHAT + "/", content=BODY, headers=headers)
            followed = await client.post(
                CHAT + "/", content=BODY, headers=headers, follow_redirects=True
            )
    assert reply.status_code == 307
    location = reply.headers["location"]
    assert address_of(engine_url) not in location, location  # the engine's own address
    assert location == CHAT, location
    assert followed.status_code == 200 and str(followed.url) == base + CHAT


async def test_a_waiter_for_a_full_pool_gives_up_within_connect_timeout() -> None:
    """README: when all `upstream_max_connections` are busy a request waits at most
    `upstream_connect_timeout` for one, then falls back. A waiter woken by a released
    connection that a newer request took first (it was scheduled ahead of the waiter: a
    request arriving in the same loop turn) waits again with a fresh timeout, every time:
    the oldest request waits unbounded, behind newer ones."""

    async def answer(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(json_response(200, b"{}"))
        await writer.drain()

    connect_timeout = 0.5
    upstream = await ScriptedUpstream(answer).start()
    pool = UpstreamPool(PoolLimits(max_connections=1, connect_timeout=connect_timeout))
    try:
        held = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        await held.read()  # the only connection, busy until released

        async def waiter() -> float:
            started = time.monotonic()
            try:
                response = await pool.request(upstream.address, "POST", "/x", [], b"{}")
                response.close()
            except PoolBusy:
                pass
            return time.monotonic() - started

        waiting = asyncio.create_task(waiter())
        await eventually(lambda: bool(pool._hosts[upstream.address].waiters))
        for _ in range(5):  # newer requests arrive as connections come back
            newer = asyncio.create_task(pool.request(upstream.address, "POST", "/x", [], b"{}"))
            held.release()  # wakes the waiter, but the newer request runs first
            held = await newer
            await held.read()
            await asyncio.sleep(0.3)
            if waiting.done():
                break
        held.release()
        waited = await asyncio.wait_for(waiting, 5)
    finally:
        await pool.aclose()
        await upstream.stop()
    assert waited < connect_timeout + 0.25, f"waited {waited:.2f} s for a pooled connection"


async def test_idle_connections_are_closed_after_upstream_idle_timeout() -> None:
    """README: idle connections are kept `limits.upstream_idle_timeout` (4 s), "as the
    generated Envoy config's idle timeout does". The pool only checks an idle connection's
    age when a request takes it: after a burst, the connections to an engine that does not
    close idle ones itself (TGI, Ollama, anything behind a sidecar) stay open for good, as
    do those to an endpoint no request goes to any more (removed by a reload or discovery)."""

    async def answer(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await asyncio.sleep(0.05)  # the burst overlaps: one connection each
        writer.write(json_response(200, b"{}"))
        await writer.drain()

    upstream = await ScriptedUpstream(answer).start()  # keeps idle connections open
    pool = UpstreamPool(PoolLimits(idle_timeout=0.2))
    try:
        replies = await asyncio.gather(
            *(pool.request(upstream.address, "POST", "/x", [], b"{}") for _ in range(3))
        )
        for reply in replies:
            await reply.read()
            reply.release()
        assert pool.stats()[upstream.address] == (3, 3)
        # No request comes: each closes once idle for idle_timeout.
        await eventually(lambda: pool.stats()[upstream.address] == (0, 0), timeout=3)
    finally:
        await pool.aclose()
        await upstream.stop()
