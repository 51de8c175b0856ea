"""Envoy closes an idle connection to a model server after `limits.upstream_idle_timeout`,
before the server would (vLLM and SGLang: uvicorn's 5 s keep-alive). Envoy's own default
is an hour: a request sent on a connection the server was closing was reset before any
answer, a 503 in the original-dst shape, which has no retry to send it on."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from llmgw.asgi.testing import DEADLINE, ScriptedUpstream, UpstreamRequest
from llmgw.config import load_dict
from llmgw.extproc.envoyconfig import SHAPES
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, loopback_bootstrap

MODEL = "m1"
CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
IDLE = 0.3
pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("shape", SHAPES)
async def test_envoy_closes_an_idle_upstream_connection_before_the_engine_would(
    shape: str, envoy_path: str
) -> None:
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[float] = loop.create_future()
    closed: asyncio.Future[tuple[float, bytes]] = loop.create_future()

    async def engine(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if request.target != CHAT:  # llmgw's scrapes: not the connection under test
            writer.write(
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
            await writer.drain()
            writer.close()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        )
        await writer.drain()
        answered.set_result(loop.time())
        leftover = await reader.read()  # kept alive: until Envoy closes it
        if not closed.done():
            closed.set_result((loop.time(), leftover))

    upstream = await ScriptedUpstream(engine).start()
    config = load_dict(
        {
            "models": {MODEL: {"endpoints": [upstream.address]}},
            "limits": {"upstream_idle_timeout": IDLE},
        }
    )
    extproc = await asyncio.to_thread(ExtProcThread, config)
    try:
        bootstrap = loopback_bootstrap(
            config, extproc.address, shape=shape, message_timeout=5.0, connect_timeout=0.5
        )
        envoy = await asyncio.to_thread(EnvoyProcess, bootstrap)
        try:
            async with httpx.AsyncClient(base_url=envoy.url, timeout=DEADLINE) as http:
                response = await http.post(CHAT, content=BODY)
                assert response.status_code == 200 and response.json() == {}
            start = await asyncio.wait_for(answered, DEADLINE)
            end, leftover = await asyncio.wait_for(closed, DEADLINE)  # an hour without it
            assert leftover == b""  # closed idle: no second request came on it
            assert end - start >= IDLE * 0.9
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await asyncio.to_thread(extproc.stop)
        await upstream.stop()
