"""Engines that break HTTP: the proxy answers the client in JSON, skips interim 1xx
answers, and never lets bytes an engine sent past a response's end reach the next request
on the pooled connection; and engines that use its odd corners (a transfer coding in
capitals, trailer fields) get their answers read right."""

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
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


def _inflight(app: ProxyApp) -> int:
    return sum(s.inflight for s in app.router.registry.states(MODEL))


def _writes(*answers: list[bytes]) -> Script:
    """An engine that writes `answers[i]` (its parts 50 ms apart) to its i-th request (the
    last again after that)."""
    served = 0

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal served
        parts = answers[min(served, len(answers) - 1)]
        served += 1
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(0.05)  # the engine's own pace between parts
            writer.write(part)
            await writer.drain()

    return script


async def _post(script: Script, count: int = 1) -> tuple[list[httpx.Response], str, ProxyApp]:
    """`count` chat requests through a proxy to one engine: (replies, its address, app)."""
    engine = await ScriptedUpstream(script).start()
    app = ProxyApp(make_config([engine.address]), scrape=False)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            replies = [await client.post(CHAT, content=BODY) for _ in range(count)]
    finally:
        await engine.stop()
    return replies, engine.address, app


async def test_bytes_past_a_responses_end_never_become_the_next_requests_answer() -> None:
    """The engine's first answer carries a second, unasked-for response after its body.
    Before: the client got both content-lengths, and the next request, on the pooled
    connection, took the stray bytes for its answer or hung holding its slot."""
    stray = OK + b"HTTP/1.1 201 Created\r\ncontent-length: 6\r\n\r\nSTRAY!"
    second = b'HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{"n":2}'
    (first, then), _, app = await _post(_writes([stray], [second]), count=2)
    assert first.status_code == 200 and first.content == b"{}"
    assert first.headers.get_list("content-length") == ["2"]
    assert then.status_code == 200 and then.content == b'{"n":2}'
    assert _inflight(app) == 0


@pytest.mark.parametrize("interim", [b"100 Continue", b"103 Early Hints\r\nlink: </x>"])
async def test_an_interim_answer_is_skipped_for_the_final_one(interim: bytes) -> None:
    """A 1xx was relayed as the final answer (chunked, empty) and the real 200 lost."""
    (reply,), _, _ = await _post(_writes([b"HTTP/1.1 " + interim + b"\r\n\r\n", OK]))
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
    (reply,), address, app = await _post(_writes([head]))
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] == "upstream_unreachable" and address in error["message"]
    assert outcome_count(app.telemetry, address, "failure") == 1
    assert _inflight(app) == 0


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_with_a_length_is_answered_whole(status: int) -> None:
    """uvicorn took the length for a body still to come: the answer ended in its error
    (connection dropped, the outcome never recorded as a success)."""
    head = b"HTTP/1.1 %d X\r\ncontent-length: 12\r\n\r\n" % status
    replies, address, app = await _post(_writes([head]), count=2)
    assert [r.status_code for r in replies] == [status, status]
    assert outcome_count(app.telemetry, address, "success") == 2
    assert _inflight(app) == 0


async def test_a_head_request_ends_with_the_answers_head() -> None:
    """The response parser does not know the request was a HEAD: it waited for the body
    the length named, until `upstream_read_timeout` (600 s)."""
    engine = await ScriptedUpstream(
        _writes([b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n"])
    ).start()
    app = ProxyApp(make_config([engine.address]), scrape=False)
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


async def test_an_answer_without_length_that_stalls_is_a_failure_not_a_clean_end() -> None:
    """The read timeout drops the connection: an answer delimited by the close must not
    take that close for its end (a truncated body passed as whole, a success), whichever
    of the two the reader sees first."""

    async def stall(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"partial')
        await writer.drain()
        await reader.read()  # until the proxy gives up on it

    engine = await ScriptedUpstream(stall).start()
    config = make_config([engine.address], limits={"upstream_read_timeout": 0.3})
    app = ProxyApp(config, scrape=False)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(CHAT, content=BODY)
    finally:
        await engine.stop()
    assert outcome_count(app.telemetry, engine.address, "failure") == 1
    assert outcome_count(app.telemetry, engine.address, "success") == 0


async def test_an_engine_that_closes_after_an_interim_answer_is_not_sent_the_request_again() -> (
    None
):
    """After a 1xx the request had visibly arrived; the close used to read as a stale
    pooled connection's, and the request went to the same engine once more."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(engine.requests) == 1:
            writer.write(OK)  # the connection goes back to the pool
        else:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.close()
        await writer.drain()

    engine = await ScriptedUpstream(script).start()
    app = ProxyApp(make_config([engine.address]), scrape=False)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
            replies = [await client.post(CHAT, content=BODY) for _ in range(2)]
    finally:
        await engine.stop()
    assert [r.status_code for r in replies] == [200, 502]
    assert len(engine.requests) == 2


async def test_a_head_that_never_ends_is_refused_past_the_limit_not_held() -> None:
    """httptools keeps a header until its end: one endless header line grew in memory
    until the read timeout (each byte re-arming it)."""

    async def endless(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-long: ")
        for _ in range(200):  # 200 x 1 KB, well past the 60 KB head limit
            writer.write(b"a" * 1024)
            await writer.drain()
        await reader.read()

    (reply,), _, _ = await _post(endless)
    assert reply.status_code == 502
    assert "response head past" in reply.json()["error"]["message"]


# How the proxy's own HTTP/1.1 client reads an engine's answer's length and fields, where an
# engine does something unusual but legal: a transfer coding spelled in capitals, a chunked
# body that is not the last coding, trailer fields after a chunked body. (Found by a review
# helper in session 50; each test failed before the fix.)


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
