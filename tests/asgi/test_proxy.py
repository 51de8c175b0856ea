"""The embedded proxy on real uvicorn (loopback, ephemeral ports) in front of simulated
replicas and scripted upstreams."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.middleware import SchedulerMiddleware
from llmgw.asgi.testing import (
    DEADLINE,
    MODEL,
    SSE_HEAD,
    ScriptedUpstream,
    UpstreamRequest,
    address_of,
    answer_ok,
    chunk,
    json_response,
    make_config,
    outcome_count,
    refused_address,
    serve,
)
from llmgw.config import Config
from llmgw.lifecycle import Lifecycle
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.sim import SimFleet
from llmgw.types import Outcome

JSON = {"content-type": "application/json"}  # engines (vLLM) refuse bodies sent as anything else

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(replicas=3, model=MODEL, time_scale=0, seed=3) as fleet:
        yield fleet


def proxy_for(config: Config) -> ProxyApp:
    return ProxyApp(config, scrape=False)


def inflight(app: ProxyApp) -> int:
    return sum(s.inflight for s in app.router.registry.states(MODEL))


def first_token_marks(app: ProxyApp) -> list[str]:
    """The endpoint of each first token the proxy's leases mark, in order."""
    marks: list[str] = []
    acquire = app.router.scheduler.acquire

    def acquire_with_hook(*args: Any, **kwargs: Any) -> Lease:
        lease = acquire(*args, **kwargs)
        lease.on_first_token = lambda: marks.append(lease.endpoint_id)
        return lease

    app.router.scheduler.acquire = acquire_with_hook  # type: ignore[method-assign]
    return marks


async def test_non_streaming_passes_status_headers_and_body(fleet: SimFleet) -> None:
    app = proxy_for(make_config([address_of(u) for u in fleet.urls]))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": "s1"})
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/json"
        assert "x-sim-replica" in reply.headers
        assert reply.json()["object"] == "chat.completion"
        again = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": "s1"})
        assert again.headers["x-sim-replica"] == reply.headers["x-sim-replica"]
        bad = await client.post(CHAT, content=orjson.dumps({"model": MODEL, "max_tokens": "x"}))
        assert bad.status_code == 400  # the engine's own 400 passes through
    assert inflight(app) == 0


async def test_openai_client_streams_through_the_proxy(fleet: SimFleet) -> None:
    app = proxy_for(make_config([address_of(u) for u in fleet.urls]))
    async with serve(app) as base:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[0].completion_tokens == 12
    assert inflight(app) == 0


async def test_sse_is_relayed_chunk_by_chunk_not_buffered() -> None:
    release = asyncio.Event()

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: first\n\n"))
        await writer.drain()
        await asyncio.wait_for(release.wait(), DEADLINE)  # only once the client saw "first"
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            async with client.stream("POST", CHAT, content=BODY, headers=JSON) as reply:
                assert reply.headers["content-type"] == "text/event-stream"
                pieces = reply.aiter_raw()
                first = await asyncio.wait_for(anext(pieces), DEADLINE)
                assert first == b"data: first\n\n"
                assert inflight(app) == 1  # the lease lasts until the stream's end
                release.set()
                rest = b"".join([p async for p in pieces])
            assert rest == b"data: [DONE]\n\n"
    finally:
        await upstream.stop()
    assert inflight(app) == 0


async def test_internal_headers_are_not_forwarded_upstream() -> None:
    upstream = await ScriptedUpstream(answer_ok).start()
    app = proxy_for(make_config([upstream.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            reply = await client.post(
                CHAT,
                content=BODY,
                headers={
                    **JSON,
                    "x-gateway-destination-endpoint": "10.9.9.9:1",
                    "x-llmgw-decision": "forged",
                    "x-llmgw-upstream": "10.9.9.9:1",
                    "x-session-id": "s1",
                },
            )
            assert reply.status_code == 200
    finally:
        await upstream.stop()
    sent = upstream.requests[0].headers
    assert sent["x-session-id"] == "s1"  # ordinary headers pass
    for name in ("x-gateway-destination-endpoint", "x-llmgw-decision", "x-llmgw-upstream"):
        assert name not in sent, f"{name} leaked upstream"


async def test_headers_a_connection_header_names_stay_on_their_hop_both_ways() -> None:
    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        extra = "connection: x-engine-hop\r\nx-engine-hop: 1\r\nx-kept: 2\r\n"
        writer.write(json_response(200, b"{}", extra))
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address]))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            headers = {"connection": "keep-alive, X-Client-Hop", "x-client-hop": "1", "x-s": "s"}
            reply = await client.post(CHAT, content=BODY, headers=headers)
            assert reply.status_code == 200
            assert "x-engine-hop" not in reply.headers and reply.headers["x-kept"] == "2"
    finally:
        await upstream.stop()
    sent = upstream.requests[0].headers
    assert "x-client-hop" not in sent and sent["x-s"] == "s"


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


@pytest.mark.parametrize(
    ("first", "rest", "marked_at_first"),
    [
        (b"data: first\n\n", [b"data: [DONE]\n\n"], True),
        # An engine that sends the chat role chunk with its headers, before the prefill
        # (some OpenAI-compatible servers do; vLLM sends it with the first token): the
        # first token is the chunk after it.
        (ROLE, [TOKEN, b"data: [DONE]\n\n"], False),
    ],
)
async def test_the_first_chunk_holding_a_token_marks_the_first_token_once(
    first: bytes, rest: list[bytes], marked_at_first: bool
) -> None:
    release = asyncio.Event()

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(first))
        await writer.drain()
        await asyncio.wait_for(release.wait(), DEADLINE)
        writer.write(b"".join(chunk(piece) for piece in rest) + b"0\r\n\r\n")
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address]))
    marks = first_token_marks(app)
    streamed = orjson.dumps({**orjson.loads(BODY), "stream": True})
    try:
        async with (
            serve(app) as base,
            httpx.AsyncClient(base_url=base) as client,
            client.stream("POST", CHAT, content=streamed, headers=JSON) as reply,
        ):
            pieces = reply.aiter_raw()
            assert await asyncio.wait_for(anext(pieces), DEADLINE) == first
            # Marked before the stream ended; a role alone reached the client, no token.
            assert marks == ([upstream.address] if marked_at_first else [])
            release.set()
            assert b"".join([p async for p in pieces]) == b"".join(rest)
    finally:
        await upstream.stop()
    assert marks == [upstream.address]


async def test_each_streamed_chunk_marks_a_step_end_on_its_endpoint() -> None:
    """Every chunk of a token stream on its way to the client marks the end of an engine
    step there (the latency scorer's step phase), not only the first."""
    steps = [asyncio.Event(), asyncio.Event()]

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.wait_for(steps[0].wait(), DEADLINE)
        writer.write(chunk(b"data: 2\n\n"))
        await writer.drain()
        await asyncio.wait_for(steps[1].wait(), DEADLINE)
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address]))
    marks: list[float] = []
    streamed = orjson.dumps({**orjson.loads(BODY), "stream": True})
    try:
        async with (
            serve(app) as base,
            httpx.AsyncClient(base_url=base) as client,
            client.stream("POST", CHAT, content=streamed, headers=JSON) as reply,
        ):
            (state,) = app.router.scheduler.registry.states(MODEL)
            pieces = reply.aiter_raw()
            for step, want in zip(steps, (b"data: 1\n\n", b"data: 2\n\n"), strict=True):
                assert await asyncio.wait_for(anext(pieces), DEADLINE) == want
                marks.append(state.token_at)
                step.set()
            assert b"".join([p async for p in pieces]) == b"data: [DONE]\n\n"
    finally:
        await upstream.stop()
    assert float("-inf") < marks[0] < marks[1]


async def test_an_error_answer_is_no_first_token() -> None:
    """An engine's immediate 400 (a prompt over the context length) reaches the client
    unchanged, but is no first token: no TTFT observation, no calibration point."""
    error = b'{"error": {"message": "prompt is longer than the context"}}'

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        writer.write(head + b"content-length: %d\r\n\r\n" % len(error) + error)
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address], model={"strategy": "latency"}))
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            streamed = {
                "model": MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
            reply = await client.post(CHAT, json=streamed)
    finally:
        await upstream.stop()
    assert (reply.status_code, reply.content) == (400, error)
    (state,) = app.router.scheduler.registry.states(MODEL)
    assert not state.reports_first_token and state.calibration.observed.n == 0
    assert (state.inflight, state.pending_prefill) == (0, 0.0)


@pytest.mark.parametrize(
    ("content_type", "observed"), [("application/json", 0), ("text/event-stream", 1)]
)
async def test_a_header_routed_generation_is_timed_only_if_its_answer_streams(
    content_type: str, observed: int
) -> None:
    """The model in a header and a strategy that reads no prompt: the body is not parsed,
    so the answer's content type tells a whole answer (its first byte is its last, no TTFT)
    from a stream."""

    async def script(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: 2\r\n\r\n"
        writer.write(head.encode() + b"{}")
        await writer.drain()

    upstream = await ScriptedUpstream(script).start()
    app = proxy_for(make_config([upstream.address]))  # ring: reads no prompt
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-llmgw-model": MODEL})
            assert reply.status_code == 200
    finally:
        await upstream.stop()
    count = app.telemetry.registry.get_sample_value(
        "llmgw_ttft_observed_seconds_count", {"model": MODEL}
    )
    assert (count or 0) == observed


async def test_429_falls_back_to_the_next_replica(fleet: SimFleet) -> None:
    addresses = [address_of(u) for u in fleet.urls]
    app = proxy_for(make_config(addresses))
    primary = app.router.scheduler.pick  # find the session's primary without routing it
    request = build_request(app.config, {"x-session-id": "s429"}, CHAT, BODY)
    decision = primary(request)
    refusing = addresses.index(decision.endpoint.address)
    fleet.replicas[refusing].set_faults(status=429)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": "s429"})
    assert reply.status_code == 200
    fallback = addresses.index(decision.fallbacks[0].address)
    assert reply.headers["x-sim-replica"] == str(fallback)
    assert outcome_count(app.telemetry, decision.endpoint.address, "backpressure") == 1
    assert outcome_count(app.telemetry, decision.fallbacks[0].address, "success") == 1
    assert inflight(app) == 0


async def test_429_passes_through_when_no_fallback_is_allowed(fleet: SimFleet) -> None:
    for replica in fleet.replicas:
        replica.set_faults(status=429)
    config = make_config(
        [address_of(u) for u in fleet.urls], model={"session": {"num_fallback_replicas": 1}}
    )
    app = proxy_for(config)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        reply = await client.post(CHAT, content=BODY, headers=JSON)
    assert reply.status_code == 429  # tried the primary and one fallback, then passed it on
    refused = sum(outcome_count(app.telemetry, address_of(u), "backpressure") for u in fleet.urls)
    assert refused == 2


async def _refusing_primary_dead_fallback(
    refusal: bytes, **config: Any
) -> tuple[ScriptedUpstream, str, ProxyApp, str]:
    """An engine that answers 429 (Retry-After: 7) and a fallback that refuses connections;
    the proxy, and a session key whose primary is the refusing engine."""

    async def busy(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(json_response(429, refusal, "retry-after: 7\r\n"))
        await writer.drain()

    upstream = await ScriptedUpstream(busy).start()
    dead = refused_address()
    app = proxy_for(make_config([upstream.address, dead], **config))
    return upstream, dead, app, _session_with_primary(app, upstream.address)


async def test_a_refusal_is_answered_when_the_fallback_after_it_is_down() -> None:
    """The primary answered 429 with Retry-After, the only fallback refused the connection:
    the client got 502 `upstream_unreachable` ("an answer from none of the endpoints")
    instead of the engine's 429 (found by a review helper)."""
    refusal = b'{"error": {"message": "busy", "type": "RateLimitError", "code": 429}}'
    upstream, dead, app, key = await _refusing_primary_dead_fallback(refusal)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": key})
    finally:
        await upstream.stop()
    assert len(upstream.requests) == 1
    assert reply.status_code == 429, reply.text
    assert reply.headers["retry-after"] == "7" and reply.content == refusal
    assert outcome_count(app.telemetry, upstream.address, "backpressure") == 1
    assert outcome_count(app.telemetry, dead, "failure") == 1
    assert inflight(app) == 0


async def test_a_refusal_passed_on_is_credited_to_the_endpoint_that_gave_it() -> None:
    """The primary answers 429, its fallback refuses the connection, the 429 is passed on:
    x-llmgw-decision said `answered=<fallback>` and the trace line credited the 429 to the
    fallback that never answered, as a failure (found by a review helper)."""
    refusal = b'{"error": {"message": "busy"}}'
    upstream, dead, app, key = await _refusing_primary_dead_fallback(refusal, debug_headers=True)
    ended: list[tuple[str | None, int | None, Outcome]] = []

    def finished(lifecycle: Lifecycle, outcome: Outcome) -> None:
        address = lifecycle.endpoint.address if lifecycle.endpoint is not None else None
        ended.append((address, lifecycle.status, outcome))

    app.routed.hooks = dataclasses.replace(app.routed.hooks, finished=finished)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": key})
    finally:
        await upstream.stop()
    assert reply.status_code == 429 and reply.content == refusal
    decision = reply.headers["x-llmgw-decision"]
    assert decision.startswith(f"endpoint={upstream.address} ") and "answered=" not in decision
    assert ended == [(upstream.address, 429, Outcome.BACKPRESSURE)]
    # Each attempt is charged its own outcome: the refusal to its endpoint, the failure to
    # the fallback that failed.
    assert outcome_count(app.telemetry, upstream.address, "backpressure") == 1
    assert outcome_count(app.telemetry, dead, "failure") == 1
    assert outcome_count(app.telemetry, dead, "backpressure") == 0
    assert inflight(app) == 0


async def test_connect_error_falls_back_and_all_refused_is_502(fleet: SimFleet) -> None:
    dead = refused_address()
    app = proxy_for(make_config([dead, address_of(fleet.urls[0])]))
    key = _session_with_primary(app, dead)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        reply = await client.post(CHAT, content=BODY, headers={**JSON, "x-session-id": key})
    assert reply.status_code == 200
    assert outcome_count(app.telemetry, dead, "failure") == 1
    assert outcome_count(app.telemetry, address_of(fleet.urls[0]), "success") == 1
    app = proxy_for(make_config([refused_address(), refused_address()]))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        reply = await client.post(CHAT, content=BODY, headers=JSON)
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "upstream_unreachable"


async def test_no_retry_after_the_first_byte_reached_the_client() -> None:
    async def cut_after_one_chunk(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(b"data: partial\n\n"))
        await writer.drain()
        writer.transport.abort()

    broken = await ScriptedUpstream(cut_after_one_chunk).start()
    spare = await ScriptedUpstream(answer_ok).start()
    app = proxy_for(make_config([broken.address, spare.address]))
    key = _session_with_primary(app, broken.address)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream(
                    "POST", CHAT, content=BODY, headers={**JSON, "x-session-id": key}
                ) as reply:
                    assert reply.status_code == 200
                    async for _ in reply.aiter_raw():
                        pass
    finally:
        await broken.stop()
        await spare.stop()
    assert len(broken.requests) == 1
    assert spare.requests == []  # never retried once bytes were sent
    assert outcome_count(app.telemetry, broken.address, "failure") == 1
    assert inflight(app) == 0


async def test_client_disconnect_cancels_upstream_and_releases_inflight() -> None:
    async def never_answers(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.read()  # until the proxy drops the connection

    upstream = await ScriptedUpstream(never_answers).start()
    app = proxy_for(make_config([upstream.address]))
    try:
        async with serve(app) as base:
            client = httpx.AsyncClient(base_url=base)
            pending = asyncio.create_task(client.post(CHAT, content=BODY, headers=JSON))
            await asyncio.wait_for(upstream.received.wait(), DEADLINE)
            assert inflight(app) == 1
            pending.cancel()  # the client goes away
            await asyncio.gather(pending, return_exceptions=True)
            await client.aclose()
            await asyncio.wait_for(upstream.closed.wait(), DEADLINE)  # upstream dropped too
            await asyncio.wait_for(_until(lambda: inflight(app) == 0), DEADLINE)
    finally:
        await upstream.stop()
    assert outcome_count(app.telemetry, upstream.address, "cancelled") == 1


async def test_errors_and_fixed_routes(fleet: SimFleet) -> None:
    app = ProxyApp(
        make_config([address_of(u) for u in fleet.urls], limits={"max_body_bytes": 1024}),
        scrape=False,
    )
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.post(CHAT, content=b"{oops")).status_code == 400
        missing = await client.post(CHAT, content=orjson.dumps({"model": "gone"}))
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        big = await client.post(CHAT, content=b"x" * 4096)
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "body_too_large"
        assert (await client.get("/nowhere")).status_code == 404
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        await client.post(CHAT, content=BODY, headers=JSON)
        metrics = (await client.get("/metrics")).text
        assert "llmgw_decisions_total" in metrics
        assert 'llmgw_errors_total{code="body_too_large",status="413"}' in metrics
        assert "llmgw_inflight" in metrics


async def test_a_stored_response_is_fetched_and_cancelled_with_the_model_header() -> None:
    """vLLM serves `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` without a
    body. With a strategy that reads the prompt the proxy parsed the empty body: 400 "not
    valid JSON" even with the model header (found by a review helper)."""

    async def stored(
        request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(json_response(200, b'{"id": "resp_1", "object": "response"}'))
        await writer.drain()

    upstream = await ScriptedUpstream(stored).start()
    app = proxy_for(make_config([upstream.address], model={"strategy": "latency"}))
    named = {"x-llmgw-model": MODEL}
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            got = await client.get("/v1/responses/resp_1", headers=named)
            cancel = await client.post("/v1/responses/resp_1/cancel", headers=named)
            unnamed = await client.get("/v1/responses/resp_1")
    finally:
        await upstream.stop()
    assert got.status_code == 200 and got.json()["id"] == "resp_1", got.text
    assert cancel.status_code == 200, cancel.text
    # Unnamed too: the config serves one model, so a request naming none is its.
    assert unnamed.status_code == 200, unnamed.text
    assert [(r.method, r.target) for r in upstream.requests] == [
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/responses/resp_1/cancel"),
        ("GET", "/v1/responses/resp_1"),
    ]


async def test_fastapi_app_forwarding_itself_on_real_uvicorn(fleet: SimFleet) -> None:
    config = make_config([address_of(u) for u in fleet.urls])
    api = FastAPI()
    api.add_middleware(SchedulerMiddleware, config=config, scheduler=Scheduler(config))

    @api.post(CHAT)
    async def chat(request: FastAPIRequest) -> dict[str, str]:
        destination = request.headers["x-gateway-destination-endpoint"]
        async with httpx.AsyncClient() as upstream:
            reply = await upstream.post(f"http://{destination}{CHAT}", content=await request.body())
        return {"destination": destination, "replica": reply.headers["x-sim-replica"]}

    async with serve(api) as base, httpx.AsyncClient(base_url=base) as client:
        reply = (await client.post(CHAT, content=BODY, headers=JSON)).json()
    index = [address_of(u) for u in fleet.urls].index(reply["destination"])
    assert reply["replica"] == str(index)


def _session_with_primary(app: ProxyApp, address: str) -> str:
    for i in range(1000):
        key = f"k{i}"
        request = build_request(app.config, {"x-session-id": key}, CHAT, BODY)
        if app.router.scheduler.pick(request).endpoint.address == address:
            return key
    raise AssertionError(f"no session key maps to {address}")


async def _until(predicate: object) -> None:
    assert callable(predicate)
    while not predicate():
        await asyncio.sleep(0.005)  # polling a counter; bounded by the caller's wait_for
