"""How the proxy's own HTTP/1.1 client reads an engine's answer's length and fields, where
an engine does something unusual but legal: a transfer coding spelled in capitals, a
chunked body that is not the last coding, trailer fields after a chunked body. (Found by
a review helper; each test failed before the fix.)"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    MODEL,
    Script,
    ScriptedUpstream,
    UpstreamRequest,
    make_config,
    outcome_count,
    serve,
)
from llmgw.asgi.upstream import PoolLimits, UpstreamBroken, UpstreamPool

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


def answering(head: bytes, *parts: bytes, close: bool = False) -> Script:
    """A script that writes `head` and each part (a pause between), then closes if asked."""

    async def script(
        _request: UpstreamRequest, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(head)
        for part in parts:
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(part)
        await writer.drain()
        if close:
            writer.close()

    return script


async def _pool_read(upstream: ScriptedUpstream) -> bytes:
    pool = UpstreamPool(PoolLimits(read_timeout=5))
    try:
        response = await pool.request(upstream.address, "POST", "/x", [], b"{}")
        body = await asyncio.wait_for(response.read(), 5)
        response.release()
        return body
    finally:
        await pool.aclose()
        await upstream.stop()


async def test_a_chunked_body_cut_by_a_close_is_broken_whatever_the_codings_case() -> None:
    """Transfer-coding names are case-insensitive (RFC 9112 section 7): `Chunked` cut
    mid-chunk by a clean close was read as a body that ends at the close, whole."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nTransfer-Encoding: Chunked\r\n\r\n"
    )
    upstream = await ScriptedUpstream(
        answering(head, b'20\r\n{"choices": [{"tex', close=True)
    ).start()
    with pytest.raises(UpstreamBroken):
        await _pool_read(upstream)


async def test_a_body_whose_last_coding_is_not_chunked_ends_at_the_close() -> None:
    """`chunked, gzip`: chunked is not the last coding, so the close ends the body
    (RFC 9112 section 6.3): a whole answer, not a cut one."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\nconnection: close\r\n\r\n"
    upstream = await ScriptedUpstream(answering(head, b"opaque bytes", close=True)).start()
    assert await _pool_read(upstream) == b"opaque bytes"


async def test_a_cut_capitalised_chunked_stream_is_a_failure_for_the_client_and_breaker() -> None:
    """Through the proxy: the client got a clean end of a cut stream, the engine a success."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: Chunked\r\n\r\n"
    )
    cut = b'40\r\ndata: {"choices": [{"delta": {"content": "hel'
    upstream = await ScriptedUpstream(answering(head, cut, close=True)).start()
    app = ProxyApp(make_config([upstream.address]), scrape=False)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(CHAT, content=BODY)
    finally:
        await upstream.stop()
    failures = outcome_count(app.telemetry, upstream.address, "failure")
    successes = outcome_count(app.telemetry, upstream.address, "success")
    assert (successes, failures) == (0, 1)


async def test_trailer_fields_are_not_relayed_as_response_headers() -> None:
    """httptools reports a chunked body's trailer fields like header fields, after the
    body: they became the relayed answer's headers (a trailer `set-cookie` included)."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\ntrailer: x-checksum, set-cookie\r\n\r\n"
        b"2\r\n{}\r\n0\r\nx-checksum: abc\r\nset-cookie: injected=1\r\n\r\n"
    )
    upstream = await ScriptedUpstream(answering(head)).start()
    app = ProxyApp(make_config([upstream.address]), scrape=False)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            reply = await client.post(CHAT, content=BODY)
    finally:
        await upstream.stop()
    assert reply.status_code == 200 and reply.content == b"{}"
    assert "x-checksum" not in reply.headers and "set-cookie" not in reply.headers


async def test_trailer_fields_do_not_count_toward_the_head_limit() -> None:
    """90 head fields (under the limit of 100), 20 trailer fields after a whole body: the
    pool failed a whole answer as a head past its limit."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
    head += b"".join(b"x-h%d: v\r\n" % i for i in range(90)) + b"\r\n2\r\n{}\r\n"
    trailers = b"0\r\n" + b"".join(b"x-t%d: v\r\n" % i for i in range(20)) + b"\r\n"
    upstream = await ScriptedUpstream(answering(head, trailers)).start()
    assert await _pool_read(upstream) == b"{}"
