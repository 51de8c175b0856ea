"""An engine that dies mid-stream behind the embedded proxy: a clear failure, no traceback."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    MODEL,
    SSE_HEAD,
    ScriptedUpstream,
    UpstreamRequest,
    chunk,
    make_config,
    outcome_count,
    serve,
)
from llmgw.runtime.telemetry import Telemetry

BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


async def test_stream_cut_after_the_head_is_a_failure_without_an_unhandled_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: first\n\n"))
        await writer.drain()
        writer.close()  # the engine dies: no last chunk, no terminator

    upstream = await ScriptedUpstream(script).start()
    telemetry = Telemetry()
    app = ProxyApp(make_config([upstream.address]), scrape=False, telemetry=telemetry)
    uvicorn_errors = logging.getLogger("uvicorn.error")  # does not propagate to the root
    try:
        with caplog.at_level(logging.WARNING):
            async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
                uvicorn_errors.addHandler(caplog.handler)  # after uvicorn set its logging up
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream("POST", "/v1/chat/completions", content=BODY) as r:
                        assert r.status_code == 200
                        await r.aread()
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
        await upstream.stop()
    assert "Exception in ASGI application" not in caplog.text
    assert "broke mid-response" in caplog.text
    assert outcome_count(telemetry, upstream.address, "failure") == 1
    assert sum(s.inflight for s in app.router.registry.states(MODEL)) == 0
