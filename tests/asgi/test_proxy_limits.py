"""The proxy's answers to clients that send too much, too slowly, or the wrong thing: a clear
status and JSON error, the connection closed where it cannot carry another request, and no
in-flight slot held by a request that never finishes arriving."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.protocol import guarded
from llmgw.asgi.testing import (
    DEADLINE,
    MODEL,
    SSE_HEAD,
    ScriptedUpstream,
    UpstreamRequest,
    chunk,
    make_config,
    refused_address,
    serve,
)
from llmgw.breaker import BreakerState
from llmgw.config import Config, LimitsSpec, load_dict
from llmgw.request import CLIENT_MAX_HEADERS, CLIENT_MAX_HEADERS_KB

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
QUICK = {"client_header_timeout": 0.3, "client_body_timeout": 0.3}
STATUS_LINE = re.compile(rb"HTTP/1\.1 \d{3} ")


async def _answers(
    request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
    await writer.drain()


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedUpstream]:
    """One engine that answers `{}`; its `requests` are what reached it."""
    upstream = await ScriptedUpstream(_answers).start()
    try:
        yield upstream
    finally:
        await upstream.stop()


def _proxy(config: Config) -> tuple[ProxyApp, type[asyncio.Protocol]]:
    return ProxyApp(config, scrape=False), guarded(config.limits)


def _inflight(app: ProxyApp) -> int:
    return sum(s.inflight for s in app.router.registry.states(MODEL))


async def _connect(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _exchange(base: str, data: bytes) -> tuple[bytes, bool]:
    """Send `data` raw; the server's whole answer and whether it then closed the connection
    (read until EOF, bounded by DEADLINE)."""
    reader, writer = await _connect(base)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), DEADLINE)  # to EOF: the server closed
        return answer, True
    finally:
        writer.close()


def _status_and_error(answer: bytes) -> tuple[int, dict[str, str], dict[bytes, bytes]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), orjson.loads(body)["error"], headers


def _head(extra: list[tuple[str, str]], length: int = len(BODY)) -> bytes:
    lines = [f"POST {CHAT} HTTP/1.1", "host: llm", f"content-length: {length}"]
    lines += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    "extra",
    [
        [(f"x-extra-{i}", "v") for i in range(CLIENT_MAX_HEADERS)],
        [("x-big", "a" * (CLIENT_MAX_HEADERS_KB * 1024))],
        [("x-huge", "a" * (4 << 20))],  # refused after one read past the limit, not at its end
    ],
    ids=["too many", "one too large", "4 MB"],
)
async def test_headers_past_the_limits_get_431_and_a_closed_connection(
    engine: ScriptedUpstream, extra: list[tuple[str, str]]
) -> None:
    app, protocol = _proxy(make_config([engine.address]))
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, _head(extra) + BODY)
    status, error, headers = _status_and_error(answer)
    assert (status, error["code"]) == (431, "headers_too_large")
    assert f"at most {CLIENT_MAX_HEADERS} headers" in error["message"]
    assert closed and headers[b"connection"] == b"close"
    assert engine.requests == []


async def test_headers_just_under_the_limits_pass(engine: ScriptedUpstream) -> None:
    app, protocol = _proxy(make_config([engine.address]))
    many = {f"x-extra-{i}": "v" for i in range(CLIENT_MAX_HEADERS - 10)}
    large = {"x-big": "a" * (CLIENT_MAX_HEADERS_KB * 1024 - 2048)}
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        for headers in (many, large):
            assert (await client.post(CHAT, content=BODY, headers=headers)).status_code == 200


async def test_a_head_that_stops_arriving_gets_408_and_an_idle_connection_is_closed(
    engine: ScriptedUpstream,
) -> None:
    app, protocol = _proxy(make_config([engine.address], limits=QUICK))
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, f"POST {CHAT} HTTP/1.1\r\nhost: l".encode())
        status, error, _ = _status_and_error(answer)
        assert (status, error["code"]) == (408, "request_timeout")
        assert "limits.client_header_timeout" in error["message"] and closed
        # A connection that never sends a byte is closed without an answer.
        assert await _exchange(base, b"") == (b"", True)
        # A kept-alive connection gets the deadline again for its next request's head.
        reader, writer = await _connect(base)
        writer.write(_head([]) + BODY)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
        assert first.startswith(b"HTTP/1.1 200")
        writer.write(f"POST {CHAT} HTTP/1.1\r\n".encode())  # half a second head, then silence
        rest = await asyncio.wait_for(reader.read(), DEADLINE)
        writer.close()
        assert b"HTTP/1.1 408" in rest
    assert len(engine.requests) == 1


async def test_an_idle_kept_alive_connection_is_closed_after_client_idle_timeout(
    engine: ScriptedUpstream,
) -> None:
    """The proxy, not uvicorn (5 s), decides how long an idle client connection stays: a
    client pool keeping connections longer than the server raced the server's close."""
    idle = 0.3
    app, protocol = _proxy(make_config([engine.address], limits={"client_idle_timeout": idle}))
    async with serve(app, http=protocol) as base:
        reader, writer = await _connect(base)
        writer.write(_head([]) + BODY)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"{}"
        answered = asyncio.get_running_loop().time()
        # Closed, unasked, after `idle` (uvicorn's own 5 s is past this bound).
        assert await asyncio.wait_for(reader.read(), idle * 8) == b""
        assert asyncio.get_running_loop().time() - answered >= idle * 0.9
        writer.close()
    assert guarded(LimitsSpec()).keep_alive == 75.0  # the default: past clients' pools


async def _answered_once(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A kept-alive connection that has had one request answered (the engine's `{}`)."""
    reader, writer = await _connect(base)
    writer.write(_head([]) + BODY)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
    assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"{}"
    return reader, writer


@pytest.mark.parametrize("then", [b"\r\n", b"\r\n\r\n"], ids=["one CRLF", "two CRLFs"])
async def test_an_empty_line_after_an_answer_does_not_keep_the_connection_open(
    engine: ScriptedUpstream, then: bytes
) -> None:
    """An empty line after an answer (skipped before a request line, RFC 9112 2.2) stopped
    uvicorn's idle timer but started no head deadline: the connection stayed open for ever
    (found by a review helper)."""
    limits = {"client_header_timeout": 0.3, "client_idle_timeout": 0.3}
    app, protocol = _proxy(make_config([engine.address], limits=limits))
    async with serve(app, http=protocol) as base:
        reader, writer = await _answered_once(base)
        try:
            writer.write(then)
            # Closed without an answer: nothing of a request arrived.
            assert await asyncio.wait_for(reader.read(), DEADLINE) == b""
        finally:
            writer.close()


async def test_a_head_after_an_empty_line_gets_its_whole_head_deadline(
    engine: ScriptedUpstream,
) -> None:
    """An empty line while idle starts the head deadline (a connection sending only those is
    closed); the head that followed did not start it again, so it got 408 sooner than
    client_header_timeout after its own first byte (found by a review helper)."""
    timeout = 1.0
    app, protocol = _proxy(make_config([engine.address], limits={"client_header_timeout": timeout}))
    loop = asyncio.get_running_loop()
    async with serve(app, http=protocol) as base:
        reader, writer = await _answered_once(base)
        try:
            writer.write(b"\r\n")
            await asyncio.sleep(timeout * 0.3)  # a part of the empty line's deadline passes
            began = loop.time()
            writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: l".encode())  # then silence
            answer = await asyncio.wait_for(reader.read(), DEADLINE)
            took = loop.time() - began
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert took >= timeout * 0.95, f"408 {took:.2f} s after the head's first byte"


@pytest.mark.parametrize("model_header", [False, True], ids=["body routes", "header routes"])
async def test_a_body_that_stops_arriving_gets_408_and_is_never_routed(
    engine: ScriptedUpstream, model_header: bool
) -> None:
    """Even with the model in a header and a strategy that reads no prompt, the proxy reads
    the body before it routes: a stalled upload is never routed, so it holds no in-flight
    slot while it stalls."""
    app, protocol = _proxy(make_config([engine.address], limits=QUICK))
    extra = [("x-llmgw-model", MODEL)] if model_header else []
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, _head(extra) + BODY[:10])
        status, error, headers = _status_and_error(answer)
        assert (status, error["code"]) == (408, "request_timeout")
        assert "after 10 bytes" in error["message"]
        assert "limits.client_body_timeout" in error["message"]
        assert closed and headers[b"connection"] == b"close"
        assert _inflight(app) == 0
        assert "llmgw_decisions_total{" not in app.telemetry.render()[0].decode()
    assert engine.requests == []


async def test_wrong_method_long_model_name_and_off_models_get_clear_answers(
    engine: ScriptedUpstream,
) -> None:
    config = load_dict(
        {
            "models": {
                MODEL: {"endpoints": [engine.address], "strategy": "ring"},
                "dormant": {"endpoints": [engine.address], "scaling": {"min": 0, "max": 0}},
            }
        }
    )
    app, protocol = _proxy(config)
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        wrong = await client.get(CHAT)
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        assert "send the request with POST" in wrong.json()["error"]["message"]
        assert (await client.get("/v1/completions?x=1")).status_code == 405
        catalog = await client.post("/v1/models", content=BODY)
        assert catalog.status_code == 405 and catalog.headers["allow"] == "GET, HEAD"
        name = "z" * 100_000
        missing = await client.post(CHAT, content=orjson.dumps({"model": name}))
        assert missing.status_code == 404 and len(missing.content) < 1000
        assert "(100000 characters)" in missing.json()["error"]["message"]
        status = (await client.get("/models/status")).json()
        assert status["dormant"]["state"] == "off"
    assert engine.requests == []


async def test_a_client_still_sending_a_refused_body_gets_the_413_not_a_reset(
    engine: ScriptedUpstream,
) -> None:
    """`Connection: close` and a 4 MB body written whole before reading: uvicorn alone closed
    with the body unread, the kernel reset the connection and the client lost the 413."""
    app, protocol = _proxy(make_config([engine.address], limits={"max_body_bytes": 1 << 20}))
    body = b"x" * (4 << 20)
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, _head([("connection", "close")], len(body)) + body)
    status, error, _ = _status_and_error(answer)
    assert (status, error["code"]) == (413, "body_too_large") and closed
    assert engine.requests == []


async def _send_until_closed(base: str, lines: list[str], piece: bytes, budget: int) -> bytes:
    """Send a head, then `piece` after `piece` (a client that goes on sending) until the
    proxy closes its side or `budget` bytes are out; the answer, read to that close."""
    reader, writer = await _connect(base)
    reading = asyncio.create_task(reader.read())  # to EOF: the proxy closed its side
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        sent = 0
        while not reading.done() and sent < budget:
            writer.write(piece)
            sent += len(piece)
            await asyncio.wait_for(writer.drain(), DEADLINE)
            await asyncio.sleep(0)  # the reader's turn
        assert reading.done(), f"{sent} bytes sent past the answer, the connection still open"
        return reading.result()
    finally:
        reading.cancel()
        writer.close()


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_413_before_the_bodys_end_closes_the_connection(
    engine: ScriptedUpstream, framing: str
) -> None:
    """After a 413 sent while the body was still arriving (a chunked body past the limit, or
    a content-length far past it, refused at once), the proxy kept the connection and read
    the rest of the body, with no end and no timer (found by a review helper)."""
    limit = 1 << 20
    app, protocol = _proxy(make_config([engine.address], limits={"max_body_bytes": limit}))
    piece = b"x" * (64 * 1024)
    if framing == "chunked":
        framed, piece = [("transfer-encoding", "chunked")], b"%x\r\n%s\r\n" % (len(piece), piece)
    else:
        framed = [("content-length", str(10**10))]
    lines = [f"POST {CHAT} HTTP/1.1", "host: llm"] + [f"{k}: {v}" for k, v in framed]
    async with serve(app, http=protocol) as base:
        answer = await _send_until_closed(base, lines, piece, 32 * limit)
    status, error, headers = _status_and_error(answer)
    assert (status, error["code"]) == (413, "body_too_large")
    assert headers[b"connection"] == b"close"
    assert engine.requests == []


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (
            [f"OPTIONS {CHAT} HTTP/1.1", "origin: http://a", "access-control-request-method: POST"],
            200,
        ),
        ([f"GET {CHAT} HTTP/1.1"], 405),
        (["POST /not/a/route HTTP/1.1"], 404),
    ],
    ids=["CORS preflight", "405", "404 route_not_found"],
)
async def test_an_answer_sent_before_the_bodys_end_closes_the_connection(
    engine: ScriptedUpstream, head: list[str], status: int
) -> None:
    """A preflight, a 405 or a 404 route_not_found is answered before the body is read;
    then the connection stayed open while the proxy read and dropped whatever the client
    sent, with no timer: a chunked body with no end held it for as long as the client sent
    (only a 413, or an answer to an expect-100 request, closed it) (found by a review
    helper)."""
    app, protocol = _proxy(make_config([engine.address], limits=QUICK))
    piece = b"x" * (64 * 1024)
    framed = b"%x\r\n%s\r\n" % (len(piece), piece)
    lines = [*head, "host: llm", "transfer-encoding: chunked"]
    async with serve(app, http=protocol) as base:
        answer = await _send_until_closed(base, lines, framed, 64 << 20)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert engine.requests == []


async def test_a_pipelined_head_refused_mid_answer_never_splits_that_answer() -> None:
    """Request 1 is still being answered when request 2's head, pipelined behind it, passes
    the header limit: request 1's answer goes out whole, then the connection closes (a 431
    written at once would land in the middle of it)."""
    release = asyncio.Event()

    async def slow(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: one\n\n"))
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"data: two\n\n") + chunk(b""))
        await writer.drain()

    upstream = await ScriptedUpstream(slow).start()
    app, protocol = _proxy(make_config([upstream.address]))
    too_many = [(f"x-extra-{i}", "v") for i in range(CLIENT_MAX_HEADERS + 5)]
    try:
        async with serve(app, http=protocol) as base:
            reader, writer = await _connect(base)
            writer.write(_head([]) + BODY)
            await asyncio.wait_for(upstream.received.wait(), DEADLINE)
            writer.write(_head(too_many) + BODY)  # pipelined behind the running answer
            first = await asyncio.wait_for(reader.readuntil(b"data: one\n\n"), DEADLINE)
            release.set()
            rest = await asyncio.wait_for(reader.read(), DEADLINE)  # to the proxy's close
            writer.close()
    finally:
        await upstream.stop()
    assert first.startswith(b"HTTP/1.1 200")
    assert b"431" not in first + rest and b"data: two" in rest
    assert rest.endswith(b"0\r\n\r\n")  # the first answer's last chunk, then the close
    assert len(upstream.requests) == 1


MALFORMED = {
    "garbage request line": b"GARBAGE\r\n\r\n",
    "content-length and chunked": _head([("transfer-encoding", "chunked")]) + b"0\r\n\r\n",
    "bad chunk size": (
        f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ntransfer-encoding: chunked\r\n\r\nZZ\r\n".encode()
    ),
    "space in a header name": _head([("bad name", "1")]) + BODY,
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_request_gets_a_json_400_and_a_closed_connection(
    engine: ScriptedUpstream, data: bytes
) -> None:
    """uvicorn's own answer was `Invalid HTTP request received.` in plain text."""
    app, protocol = _proxy(make_config([engine.address]))
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, data)
    status, error, headers = _status_and_error(answer)
    assert (status, error["code"]) == (400, "invalid_request"), answer[:200]
    assert "not valid HTTP/1.1" in error["message"]
    assert closed and headers[b"connection"] == b"close"
    assert engine.requests == [] and _inflight(app) == 0


async def test_a_malformed_request_after_a_good_one_never_costs_the_good_ones_answer(
    engine: ScriptedUpstream,
) -> None:
    """uvicorn wrote its 400 and closed at once, the good request's answer unsent."""
    app, protocol = _proxy(make_config([engine.address]))
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, _head([]) + BODY + b"GARBAGE\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"{}"), answer[:300]
    assert closed and len(engine.requests) == 1


@pytest.mark.parametrize(
    ("data", "status", "said"),
    [
        (
            f"POST {CHAT} HTTP/1.0\r\ncontent-length: {len(BODY)}\r\n\r\n".encode() + BODY,
            426,
            "HTTP/1.0 is not served",
        ),
        (
            f"POST {CHAT} HTTP/1.1\r\ncontent-length: {len(BODY)}\r\n\r\n".encode() + BODY,
            400,
            "needs a Host header",
        ),
        (
            _head([("connection", "Upgrade, HTTP2-Settings"), ("upgrade", "h2c")]) + BODY,
            400,
            "does not switch protocols (Upgrade: h2c)",
        ),
    ],
    ids=["HTTP/1.0", "no Host", "Upgrade: h2c"],
)
async def test_requests_in_another_protocol_are_refused_as_envoy_does(
    engine: ScriptedUpstream, data: bytes, status: int, said: str
) -> None:
    """HTTP/1.0 streams came back chunked (which 1.0 clients cannot read); an Upgrade
    request's body was handed to the parser as the new protocol's bytes (the app read an
    empty body: 400 'not valid JSON')."""
    app, protocol = _proxy(make_config([engine.address]))
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, data)
    got, error, headers = _status_and_error(answer)
    assert (got, error["code"]) == (status, "invalid_request") and said in error["message"]
    assert closed and headers[b"connection"] == b"close" and engine.requests == []
    assert headers.get(b"upgrade") == (b"http/1.1" if status == 426 else None)  # lowered


async def test_an_early_answer_to_an_expect_100_request_closes_the_connection(
    engine: ScriptedUpstream,
) -> None:
    """The body was never asked for: the client may skip it, and its next request on the
    connection would be read as that body."""
    app, protocol = _proxy(make_config([engine.address]))
    head = f"PUT {CHAT} HTTP/1.1\r\nhost: llm\r\ncontent-length: 10\r\nexpect: 100-continue\r\n\r\n"
    async with serve(app, http=protocol) as base:
        reader, writer = await _connect(base)
        writer.write(head.encode())
        # At once, not at uvicorn's keep-alive timeout (5 s) for an idle connection.
        answer = await asyncio.wait_for(reader.read(), 2.0)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 405")


async def test_an_empty_model_header_leaves_the_model_to_the_body(
    engine: ScriptedUpstream,
) -> None:
    app, protocol = _proxy(make_config([engine.address]))
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        r = await client.post(CHAT, content=BODY, headers={"x-llmgw-model": ""})
    assert r.status_code == 200, r.text


async def test_a_queued_request_with_a_broken_body_never_splits_the_answer_before_it(
    engine: ScriptedUpstream,
) -> None:
    """The 400 went to whichever request was parsed last: written at once, it landed
    ahead of the earlier request's answer (and cut it off)."""
    app, protocol = _proxy(make_config([engine.address]))
    broken = f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ntransfer-encoding: chunked\r\n\r\nZZ\r\n"
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, _head([]) + BODY + broken.encode())
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"{}"), answer[:300]
    assert len(STATUS_LINE.findall(answer)) == 1 and closed and len(engine.requests) == 1


async def test_two_refusals_in_one_read_answer_once(
    engine: ScriptedUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """No Host, then garbage in the same read: the second refusal wrote after the first
    had shut the connection's write side (a fatal transport error, no lingering close)."""
    app, protocol = _proxy(make_config([engine.address]))
    data = f"POST {CHAT} HTTP/1.1\r\ncontent-length: 0\r\n\r\nGARBAGE\r\n\r\n".encode()
    async with serve(app, http=protocol) as base:
        answer, closed = await _exchange(base, data)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    status, error, _ = _status_and_error(answer)
    assert status == 400 and "Host" in error["message"] and closed
    assert len(STATUS_LINE.findall(answer)) == 1 and engine.requests == []


@pytest.mark.parametrize(
    ("explain", "data", "want"),
    [
        (True, b'{"model": "m1"', 408),  # a query that stops arriving: 408, not a held task
        (True, None, 413),  # a Content-Length past the limit: refused before it is read
        (False, b'{"model": "m1"', 404),  # off: answered before the body is read
    ],
    ids=["stalled", "too large", "off"],
)
async def test_an_explain_query_is_read_like_a_request_body(
    engine: ScriptedUpstream, explain: bool, data: bytes | None, want: int
) -> None:
    config = make_config([engine.address], limits=QUICK, admin={"explain": explain})
    app, protocol = _proxy(config)
    length = len(data) + 10 if data is not None else 64 << 20
    head = f"POST /admin/explain HTTP/1.1\r\nhost: llm\r\ncontent-length: {length}\r\n\r\n"
    async with serve(app, http=protocol) as base:
        reader, writer = await _connect(base)
        try:
            writer.write(head.encode() + (data or b""))
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), DEADLINE)
        finally:
            writer.close()
    assert line.split()[1] == str(want).encode()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_the_proxy_command_gives_uvicorn_the_client_idle_timeout(
    http: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both HTTP implementations get `limits.client_idle_timeout`: the httptools protocol
    sets its own (above); h11, used where httptools is missing, reads uvicorn's option."""
    from llmgw.asgi import proxy  # noqa: PLC0415

    path = tmp_path / "llmgw.yaml"
    path.write_text(
        "models: {m1: {endpoints: ['127.0.0.1:1']}}\nlimits: {client_idle_timeout: 42}\n"
    )
    seen: list[uvicorn.Config] = []

    class _NotRun:
        started = True

        def run(self) -> None:  # the options are the test, not serving
            pass

    def capture(config: uvicorn.Config, app: object, delay: float) -> _NotRun:
        seen.append(config)
        return _NotRun()

    monkeypatch.setattr(proxy, "event_loop_and_parser", lambda: ("asyncio", http))
    monkeypatch.setattr(proxy, "draining_server", capture)
    assert proxy.main(["--config", str(path), "--no-scrape"]) == 0
    (config,) = seen
    assert config.timeout_keep_alive == 42
    if http == "httptools":
        assert config.http.keep_alive == 42  # type: ignore[union-attr]


def test_a_reload_changes_the_upstream_pools_limits() -> None:
    """Accepted and shown in app.config, they were ignored until a restart."""
    config = load_dict({"models": {"m1": {"endpoints": ["127.0.0.1:9"]}}})
    app = ProxyApp(config, scrape=False)
    changed = load_dict(
        {
            "models": {"m1": {"endpoints": ["127.0.0.1:9"]}},
            "limits": {"upstream_read_timeout": 5, "upstream_max_connections": 3},
        }
    )
    app.reload(changed)
    assert (app.pool.limits.read_timeout, app.pool.limits.max_connections) == (5.0, 3)


async def test_a_busy_pool_is_no_endpoint_failure_and_answers_429_with_retry_after() -> None:
    """Waiting past upstream_connect_timeout for one of the endpoint's pooled connections
    counted as the endpoint failing: three opened the breaker of a healthy, busy engine (and
    the client got 502 upstream_unreachable). Now no verdict, and a 429 with Retry-After."""
    release = asyncio.Event()

    async def holds(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    upstream = await ScriptedUpstream(holds).start()
    config = make_config(
        [upstream.address],
        limits={"upstream_max_connections": 1, "upstream_connect_timeout": 0.05},
    )
    app, protocol = _proxy(config)
    try:
        async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
            first = asyncio.create_task(client.post(CHAT, content=BODY, timeout=DEADLINE))
            while not upstream.requests:  # the one connection is taken
                await asyncio.wait_for(upstream.received.wait(), DEADLINE)
            for _ in range(4):  # past failure_threshold (3)
                busy = await client.post(CHAT, content=BODY, timeout=DEADLINE)
                assert busy.status_code == 429, busy.text
                assert busy.json()["error"]["code"] == "all_saturated"
                assert "connections busy" in busy.json()["error"]["message"]
                assert busy.headers["retry-after"] == "1"
            (breaker,) = app.router.registry.breaker_states().values()
            assert breaker is BreakerState.CLOSED
            release.set()
            assert (await first).status_code == 200
            assert _inflight(app) == 0
    finally:
        release.set()
        await upstream.stop()


async def test_a_cors_preflight_is_answered_as_vllm_answers_it(engine: ScriptedUpstream) -> None:
    """vLLM answers a browser's preflight `OPTIONS` with 200 and access-control-allow-*
    (Starlette's CORSMiddleware, everything allowed); the proxy answered 405, so a browser
    app that talks to vLLM could not talk to it (found by a review helper). The model list,
    answered by the proxy itself, says any origin may read it."""
    app, protocol = _proxy(make_config([engine.address]))
    asked = {
        "origin": "http://localhost:3000",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        preflight = await client.options(CHAT, headers=asked)
        listed = await client.get("/v1/models", headers={"origin": "http://localhost:3000"})
        plain = await client.options(CHAT)
    assert preflight.status_code == 200 and preflight.text == "OK"
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert engine.requests == []  # answered by the proxy
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
    assert plain.status_code == 405  # an OPTIONS that is no preflight


async def test_llmgw_own_error_answers_to_a_browser_carry_cors() -> None:
    """vLLM's CORSMiddleware puts access-control-allow-origin on every answer to a request
    with an Origin, errors included; llmgw's own errors had none, so a browser app read a
    network error instead of the JSON error and its Retry-After (found by a review helper).
    The middleware's (404 model_not_found, 405), the forwarder's (502, 404 route_not_found)
    and the app's (405 on the model list) carry it; without an Origin, none does."""
    app, protocol = _proxy(make_config([refused_address()]))
    browser = {"origin": "http://localhost:3000"}
    unknown = orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        answers = [
            await client.post(CHAT, content=unknown, headers=browser),  # the middleware's
            await client.get(CHAT, headers=browser),
            await client.post(CHAT, content=BODY, headers=browser),  # the forwarder's
            await client.post("/not/a/route", content=b"{}", headers=browser),
            await client.post("/v1/models", headers=browser),  # the app's
        ]
        plain = await client.post(CHAT, content=unknown)
    assert [a.status_code for a in answers] == [404, 405, 502, 404, 405]
    for answer in answers:
        assert answer.headers.get("access-control-allow-origin") == "*", answer.headers
        assert answer.headers["vary"] == "Origin" and "error" in answer.json()
    assert plain.status_code == 404 and "access-control-allow-origin" not in plain.headers


@pytest.mark.parametrize(
    ("explain", "query", "status"), [(False, b"{}", 404), (True, b"not json", 400)]
)
async def test_explain_answers_to_a_browser_carry_cors(
    explain: bool, query: bytes, status: int
) -> None:
    """`POST /admin/explain`'s 404 (explain off) and 400 (a query that is not JSON) went out
    without the CORS headers every other error of the proxy carries to a browser (found by
    a review helper)."""
    app, protocol = _proxy(make_config([refused_address()], admin={"explain": explain}))
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        answer = await client.post(
            "/admin/explain", content=query, headers={"origin": "http://localhost:3000"}
        )
    assert answer.status_code == status
    assert answer.headers.get("access-control-allow-origin") == "*", answer.headers


async def test_a_get_of_the_explain_path_is_a_405_that_says_allow_post(
    engine: ScriptedUpstream,
) -> None:
    """Every other 405 of the proxy named its method in `Allow` (RFC 9110 wants it); this
    one had no header (found by a review helper)."""
    app, protocol = _proxy(make_config([engine.address], admin={"explain": True}))
    async with serve(app, http=protocol) as base, httpx.AsyncClient(base_url=base) as client:
        wrong = await client.get("/admin/explain")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
