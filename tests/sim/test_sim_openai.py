"""The official `openai` client talks to the simulator, streaming included, and a
repeated prefix visibly lowers time to first token."""

from __future__ import annotations

import time
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


async def _ttft(client: openai.AsyncOpenAI, prompt: str) -> float:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True
    )
    first: float | None = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    assert first is not None
    return first


async def test_repeated_prefix_lowers_ttft() -> None:
    # 8,000 prompt tokens at 25 us each: a cold prefill costs about 200 ms.
    async with SimFleet(
        replicas=1, model="m1", decode_ms=1, prefill_us_per_token=25, max_model_len=16384
    ) as fleet:
        client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0)
        async with client:
            prompt = "The quick brown fox jumps over the lazy dog. " * 720
            cold = await _ttft(client, prompt)
            warm = await _ttft(client, prompt)
        assert cold > 0.15
        assert warm < cold / 4
        async with httpx.AsyncClient(base_url=fleet.urls[0]) as http:
            metrics = (await http.get("/metrics")).text
        hits = next(
            line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
        )
        assert float(hits.split()[-1]) > 7000


async def test_first_sse_chunk_waits_for_prefill_but_headers_do_not() -> None:
    # 2,000 uncached tokens at 100 us each: 200 ms of prefill before the first token. The
    # role chunk must come with that token, as in vLLM (headers 16 ms, first chunk 41 ms).
    prefill_s = 2000 * 100e-6
    async with (
        SimFleet(replicas=1, model="m1", decode_ms=1, prefill_us_per_token=100) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as http,
    ):
        body = {
            "model": "m1",
            "messages": [{"role": "user", "content": "q" * 8000}],
            "max_tokens": 2,
            "stream": True,
        }
        start = time.monotonic()
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            headers_s = time.monotonic() - start
            first_chunk_s = None
            async for _ in response.aiter_raw():
                first_chunk_s = time.monotonic() - start
                break
    assert first_chunk_s is not None
    assert first_chunk_s >= prefill_s * 0.99
    assert headers_s < first_chunk_s
