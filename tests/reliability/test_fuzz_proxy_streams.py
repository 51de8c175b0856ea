"""Random request batches through the embedded proxy (`ProxyApp` under uvicorn, the
default `latency` strategy, a breaker that opens on one failure), several at once: engines
that answer, stream, cut a stream at any chunk, reset before their head, send a garbled
head, fail with 500 / 429 / 503 or stay silent past the read timeout; clients that read to
the end or leave at any chunk. Afterwards nothing a request held is left (in flight, queued
prefill, breaker probe slots), no request hung, no ASGI traceback was logged, and a request
whose engine answered in full reached its client whole or went to its client as a clear
error. (`test_fuzz_extproc_streams.py` does the same for the ext_proc edge.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    DEADLINE,
    MODEL,
    SSE_HEAD,
    ScriptedUpstream,
    UpstreamRequest,
    chunk,
    json_response,
    make_config,
    serve,
)
from llmgw.breaker import BreakerState

BEHAVIOUR = "x-fuzz-engine"  # the engine's part, read by every scripted engine
ENGINES = (
    "stream",  # a whole event stream
    "json",  # a whole JSON answer
    "cut-head",  # closes before any byte
    "garbled",  # a head that is not HTTP
    "cut-0",  # the stream's head, then closes
    "cut-1",  # one chunk, then closes
    "cut-3",
    "500",
    "429",
    "503",
    "silent",  # says nothing past the read timeout
)
TOKENS = 4
READ_TIMEOUT = 0.3


def _token(i: int) -> bytes:
    return b'data: {"choices": [{"index": 0, "delta": {"content": "t%d"}}]}\n\n' % i


async def engine(
    request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    kind = request.headers.get(BEHAVIOUR, "")
    if not request.target.startswith("/v1/"):  # the scraper: no metrics here
        writer.write(json_response(404, b"{}"))
        return
    if kind == "json":
        writer.write(json_response(200, b'{"choices": [{"message": {"content": "hi"}}]}'))
        return
    if kind in ("500", "429", "503"):
        writer.write(json_response(int(kind), b'{"error": "engine says no"}'))
        return
    if kind == "cut-head":
        writer.close()
        return
    if kind == "garbled":
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()
        return
    if kind == "silent":  # until the proxy gives up on it and closes the connection
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader.read(), DEADLINE)
        writer.close()
        return
    writer.write(SSE_HEAD)
    stop = int(kind.removeprefix("cut-")) if kind.startswith("cut-") else None
    for i in range(TOKENS):
        if stop is not None and i == stop:
            await writer.drain()
            writer.close()  # the engine dies mid-stream: no terminator
            return
        writer.write(chunk(_token(i)))
        await writer.drain()
    writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


@st.composite
def requests(draw: st.DrawFn) -> list[tuple[str, bool, int | None, str | None]]:
    """(engine behaviour, stream, chunks the client reads before leaving (None: all),
    session) per request of one batch."""
    n = draw(st.integers(1, 6))
    return [
        (
            draw(st.sampled_from(ENGINES)),
            draw(st.booleans()),
            draw(st.one_of(st.none(), st.integers(0, TOKENS))),
            draw(st.one_of(st.none(), st.sampled_from(["s1", "s2"]))),
        )
        for _ in range(n)
    ]


@contextmanager
def asgi_errors_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    uvicorn_errors = logging.getLogger("uvicorn.error")  # does not propagate to the root
    uvicorn_errors.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            yield
    finally:
        uvicorn_errors.removeHandler(caplog.handler)


async def one(
    client: httpx.AsyncClient, kind: str, stream: bool, leave_after: int | None, session: str | None
) -> tuple[int | None, bytes]:
    """The status and what the client read (None: the connection broke before a status)."""
    body = orjson.dumps(
        {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hi " * 50}]}
    )
    headers = {BEHAVIOUR: kind, **({"x-session-id": session} if session else {})}
    got = b""
    status = None
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", content=body, headers=headers
        ) as response:
            status = response.status_code
            chunks = 0
            async for part in response.aiter_raw():
                got += part
                chunks += 1
                if leave_after is not None and chunks > leave_after:
                    break  # the client leaves: the connection closes mid-answer
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # a cut stream reaches the client as a broken connection
    return status, got


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=requests())
def test_random_engines_and_clients_leave_nothing_held(
    batch: list[tuple[str, bool, int | None, str | None]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.clear()
    asyncio.run(_run(batch, caplog))


async def _run(
    batch: list[tuple[str, bool, int | None, str | None]], caplog: pytest.LogCaptureFixture
) -> None:
    engines = [await ScriptedUpstream(engine).start() for _ in range(3)]
    config = make_config(
        [e.address for e in engines],
        model={"strategy": "latency"},
        limits={"upstream_read_timeout": READ_TIMEOUT},
        breaker={
            "failure_threshold": 1,
            "success_threshold": 1,
            "base_cooldown": 0.001,
            "max_cooldown": 0.002,
        },
    )
    app = ProxyApp(config, scrape=False)
    try:
        with asgi_errors_logged(caplog):
            async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=5) as client:
                results = await asyncio.wait_for(
                    asyncio.gather(*(one(client, *request) for request in batch)), DEADLINE
                )
                # Every request's lease ends once its engine and client are done with it.
                states = app.router.registry.states(MODEL)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + DEADLINE
                while any(s.inflight for s in states) and loop.time() < deadline:
                    await asyncio.sleep(0.01)  # the last cut streams' tasks end
    finally:
        for e in engines:
            await e.stop()
    assert "Exception in ASGI application" not in caplog.text
    for s in states:
        assert s.inflight == 0, f"{s.id} still holds {s.inflight} request(s)"
        assert s.pending_prefill == 0.0, f"{s.id} still queues {s.pending_prefill} tokens"
        if s.breaker.state is BreakerState.HALF_OPEN:
            assert s.breaker.probes_inflight == 0, f"{s.id} holds a probe slot"
    for (kind, _stream, leave_after, _), (status, got) in zip(batch, results, strict=True):
        if leave_after is not None:
            continue  # the client left: whatever it read is all it asked for
        if kind in ("stream", "json") and status == 200:  # whole, as the engine sent it
            if kind == "stream":
                assert got.rstrip().endswith(b"data: [DONE]"), got[-200:]
                assert got.count(b"data: {") == TOKENS
            else:
                assert orjson.loads(got)["choices"]
        elif kind in ("stream", "json"):
            # Other requests' failures may have opened every breaker for a moment.
            assert status == 503, (kind, status, got[:200])
        elif kind in ("cut-head", "garbled", "500", "silent"):
            assert status is None or status >= 500, (kind, status)
        elif kind in ("429", "503"):
            assert status in (429, 503), (kind, status)
