"""Engines that break HTTP: the proxy answers the client in JSON, skips interim 1xx
answers, and never lets bytes an engine sent past a response's end reach the next request
on the pooled connection."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    MODEL,
    ScriptedUpstream,
    UpstreamRequest,
    make_config,
    outcome_count,
    serve,
)
from llmgw.config import Config

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


def proxy_for(config: Config) -> ProxyApp:
    return ProxyApp(config, scrape=False)


def _inflight(app: ProxyApp) -> int:
    return sum(s.inflight for s in app.router.registry.states(MODEL))


async def test_bytes_past_a_responses_end_never_become_the_next_requests_answer() -> None:
    """The engine's first answer carries a second, unasked-for response after its body.
    Before: the client got both content-lengths, and the next request, on the pooled
    connection, took the stray bytes for its answer or hung holding its slot."""
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
        b"HTTP/1.1 201 Created\r\ncontent-length: 6\r\n\r\nSTRAY!",
        b'HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{"n":2}',
    ]

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(answers[min(len(engine.requests), 2) - 1])
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([engine.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            first = await client.post(CHAT, content=BODY)
            second = await client.post(CHAT, content=BODY)
    finally:
        await engine.stop()
    assert first.status_code == 200 and first.content == b"{}"
    assert first.headers.get_list("content-length") == ["2"]
    assert second.status_code == 200 and second.content == b'{"n":2}'
    assert len(engine.requests) == 2 and _inflight(app) == 0


@pytest.mark.parametrize("interim", [b"100 Continue", b"103 Early Hints\r\nlink: </x>"])
async def test_an_interim_answer_is_skipped_for_the_final_one(interim: bytes) -> None:
    """A 1xx was relayed as the final answer (chunked, empty) and the real 200 lost."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 " + interim + b"\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([engine.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            reply = await client.post(CHAT, content=BODY)
    finally:
        await engine.stop()
    assert reply.status_code == 200 and reply.content == b"{}"
    assert "link" not in reply.headers


@pytest.mark.parametrize(
    "head",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 999 Odd\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * 70_000 + b"\r\ncontent-length: 0\r\n\r\n",
    ],
    ids=["not HTTP", "status 999", "a 70 KB header"],
)
async def test_a_head_that_breaks_http_is_a_json_502(head: bytes) -> None:
    """Before: uvicorn's plain-text 500 (unparsable head) or no answer at all (status 999:
    uvicorn has no status line for it)."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(head)
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([engine.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            reply = await client.post(CHAT, content=BODY)
    finally:
        await engine.stop()
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] == "upstream_unreachable" and engine.address in error["message"]
    assert outcome_count(app.telemetry, engine.address, "failure") == 1
    assert _inflight(app) == 0


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_with_a_length_is_answered_whole(status: int) -> None:
    """uvicorn took the length for a body still to come: the answer ended in its error
    (connection dropped, the outcome never recorded as a success)."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 12\r\n\r\n" % status)
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([engine.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            replies = [await client.post(CHAT, content=BODY) for _ in range(2)]
    finally:
        await engine.stop()
    assert [r.status_code for r in replies] == [status, status]
    assert outcome_count(app.telemetry, engine.address, "success") == 2
    assert _inflight(app) == 0


async def test_a_head_request_ends_with_the_answers_head() -> None:
    """The response parser does not know the request was a HEAD: it waited for the body
    the length named, until `upstream_read_timeout` (600 s)."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n")
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([engine.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            reply = await client.head("/v1/anything", headers={"x-llmgw-model": MODEL})
            # The client has its answer either way: the proxy must be done too, at once.
            async with asyncio.timeout(2.0):
                while _inflight(app):
                    await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    assert reply.status_code == 200 and reply.headers["content-length"] == "50"
    assert [r.method for r in engine.requests] == ["HEAD"]
