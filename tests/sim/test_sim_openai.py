"""The official `openai` client talks to the simulator, streaming included, and a
repeated prefix visibly lowers time to first token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from llmgw.sim import SimFleet


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(replicas=1, model="m1", decode_ms=1, prefill_us_per_token=5) as fleet:
        yield fleet


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0)
    async with client:
        yield client


async def test_openai_chat_non_streaming(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5


async def test_openai_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish: list[str] = []
    usage_tokens = None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    assert len(pieces) == 6
    assert finish == ["length"]
    assert usage_tokens == 6


async def test_openai_completions_streaming(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model="m1", prompt="abc", max_tokens=3, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert len(texts) == 3


async def test_openai_errors_map_to_client_exceptions(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6
        )


async def _first_token(client: openai.AsyncOpenAI, prompt: str) -> None:
    stream = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            await stream.close()
            return
    raise AssertionError("the stream ended without a token")


async def test_repeated_prefix_skips_its_prefill() -> None:
    # 8,000 prompt tokens at 25 us each: a cold prefill costs 200 ms, 200 s once the engine
    # is slowed 1000x. The warm request must then get its first token within the bound, which
    # only the cached prefix allows (no timing is asserted: a loaded host only makes it slower).
    async with SimFleet(
        replicas=1, model="m1", decode_ms=1, prefill_us_per_token=25, max_model_len=16384
    ) as fleet:
        replica = fleet.replicas[0]
        client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0)
        async with client:
            prompt = "The quick brown fox jumps over the lazy dog. " * 720
            await asyncio.wait_for(_first_token(client, prompt), 30)
            assert replica.engine().stats.prefix_hits_tokens == 0
            replica.set_faults(slowdown=1000.0)
            await asyncio.wait_for(_first_token(client, prompt), 30)
        assert replica.engine().stats.prefix_hits_tokens > 7000
        async with httpx.AsyncClient(base_url=fleet.urls[0]) as http:
            metrics = (await http.get("/metrics")).text
        hits = next(
            line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
        )
        assert float(hits.split()[-1]) > 7000


async def test_first_sse_chunk_waits_for_prefill_but_headers_do_not() -> None:
    # 2,000 uncached tokens at 1 ms each: 2 s of prefill before the first token. As in vLLM
    # the headers come at once and the role chunk only with that token. Checked against the
    # engine's own state (no token yet when the headers arrive; one when the first chunk
    # does), not against a stopwatch.
    async with (
        SimFleet(replicas=1, model="m1", decode_ms=1, prefill_us_per_token=1000) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http,
    ):
        engine = fleet.replicas[0].engine()
        body = {
            "model": "m1",
            "messages": [{"role": "user", "content": "q" * 8000}],
            "max_tokens": 2,
            "stream": True,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            tokens_at_headers = engine.stats.generation_tokens
            first_chunk = await anext(response.aiter_raw())
            tokens_at_first_chunk = engine.stats.generation_tokens
    assert b"role" in first_chunk
    assert tokens_at_headers == 0
    assert tokens_at_first_chunk >= 1
