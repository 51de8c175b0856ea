"""Two real vLLM instances behind llmgw: through real Envoy + ext_proc, and the ASGI proxy."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import openai
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import serve
from llmgw.config import Config, load_dict
from llmgw.lifecycle import Lifecycle
from llmgw.promtext import CONTRACTS, extract, parse
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, loopback_bootstrap
from llmgw.types import Engine
from tests.real_engine.conftest import PAIR_ARGS, VllmInstance, start_instance, wait_healthy

pytestmark = pytest.mark.real_engine

WORDS = [
    "router",
    "replica",
    "session",
    "prefix",
    "cache",
    "queue",
    "token",
    "model",
    "metric",
    "stream",
    "chat",
]


def config_for(pair: list[VllmInstance], strategy: str) -> Config:
    return load_dict(
        {
            "debug_headers": True,
            "breaker": {"failure_threshold": 1, "base_cooldown": 0.5, "success_threshold": 1},
            "models": {
                "tiny": {"endpoints": [i.address for i in pair], "strategy": strategy},
            },
        }
    )


def finished(inst: VllmInstance) -> float:
    m = extract(inst.metrics(), CONTRACTS[Engine.VLLM], model="tiny")
    return m.finished_total or 0.0


def prefix_hits(pair: list[VllmInstance]) -> float:
    total = 0.0
    for inst in pair:
        total += sum(
            s.value for s in parse(inst.metrics()) if s.name == "vllm:prefix_cache_hits_total"
        )
    return total


@contextmanager
def envoy_stack(
    pair: list[VllmInstance], strategy: str, shape: str = "original-dst"
) -> Iterator[str]:
    config = config_for(pair, strategy)
    # override-host retries down the destination list: send the fallbacks (ORIGINAL_DST
    # takes one address).
    config = config.model_copy(update={"destination_fallbacks": shape == "override-host"})
    extproc = ExtProcThread(config)
    try:
        envoy = EnvoyProcess(
            loopback_bootstrap(
                config,
                extproc.address,
                shape=shape,
                message_timeout=5.0,
            )
        )
        try:
            yield envoy.url
        finally:
            envoy.stop()
    finally:
        extproc.stop()


@asynccontextmanager
async def proxy_stack(pair: list[VllmInstance], strategy: str) -> AsyncIterator[str]:
    async with serve(ProxyApp(config_for(pair, strategy))) as url:
        yield url


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


async def ask(c: openai.AsyncOpenAI, messages: list[dict[str, str]], session: str | None) -> str:
    headers = {"x-session-id": session} if session else {}
    reply = await c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        extra_headers=headers,
    )
    return reply.choices[0].message.content or ""


async def check_affinity_spread_and_streaming(base: str, pair: list[VllmInstance]) -> None:
    c = client(base)
    before = [finished(i) for i in pair]
    for _ in range(6):
        await ask(c, [{"role": "user", "content": "hello there"}], "sticky-session")
    moved = [finished(i) - b for i, b in zip(pair, before, strict=True)]
    assert sorted(moved) == [0, 6], f"one session must stay on one instance, saw {moved}"

    before = [finished(i) for i in pair]
    await asyncio.gather(
        *(ask(c, [{"role": "user", "content": f"q {n}"}], None) for n in range(16))
    )
    moved = [finished(i) - b for i, b in zip(pair, before, strict=True)]
    assert sum(moved) == 16 and min(moved) > 0, f"no-session traffic must spread, saw {moved}"

    stream = await c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) >= 3 and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    await c.close()


def conversation_rounds(
    seed: int, conversations: int = 5, turns: int = 4
) -> list[list[list[dict[str, str]]]]:
    """Per turn, the growing history of each conversation; each system prompt > 128 tokens."""
    rng = random.Random(seed)
    histories = [
        [{"role": "system", "content": " ".join(rng.choices(WORDS, k=160)) + f" conv {seed}-{n}"}]
        for n in range(conversations)
    ]
    rounds = []
    for _ in range(turns):
        for h in histories:
            h.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=30))})
        rounds.append([list(h) for h in histories])
        for h in histories:
            h.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=15))})
    return rounds


async def multi_turn_hits(base: str, pair: list[VllmInstance], seed: int) -> float:
    c = client(base)
    before = prefix_hits(pair)
    for round_ in conversation_rounds(seed):
        for n, messages in enumerate(round_):
            await ask(c, messages, f"conv-{seed}-{n}")
    await c.close()
    return prefix_hits(pair) - before


async def test_through_envoy_extproc(vllm_pair: list[VllmInstance]) -> None:
    with envoy_stack(vllm_pair, "chat") as url:
        await check_affinity_spread_and_streaming(url, vllm_pair)
        chat_hits = await multi_turn_hits(url, vllm_pair, seed=1)
    with envoy_stack(vllm_pair, "round-robin") as url:
        rr_hits = await multi_turn_hits(url, vllm_pair, seed=2)
    print(
        f"\nenvoy+extproc prefix-cache hit tokens: chat {chat_hits:.0f}, round-robin {rr_hits:.0f}"
    )
    assert chat_hits > rr_hits


async def test_through_asgi_proxy(vllm_pair: list[VllmInstance]) -> None:
    async with proxy_stack(vllm_pair, "chat") as url:
        await check_affinity_spread_and_streaming(url, vllm_pair)
        chat_hits = await multi_turn_hits(url, vllm_pair, seed=3)
    async with proxy_stack(vllm_pair, "round-robin") as url:
        rr_hits = await multi_turn_hits(url, vllm_pair, seed=4)
    print(f"\nasgi proxy prefix-cache hit tokens: chat {chat_hits:.0f}, round-robin {rr_hits:.0f}")
    assert chat_hits > rr_hits


async def test_killed_instance_is_avoided_and_its_return_is_noticed(
    vllm_pair: list[VllmInstance],
) -> None:
    """Runs last: it restarts instance 1 on the same port. Both edges at once."""
    victim = vllm_pair[1]
    with envoy_stack(vllm_pair, "least-load", shape="override-host") as envoy_url:
        async with proxy_stack(vllm_pair, "least-load") as proxy_url:
            via_envoy, via_proxy = client(envoy_url), client(proxy_url)
            victim.kill()
            envoy_failures = proxy_failures = 0
            for n in range(12):
                try:
                    await ask(via_envoy, [{"role": "user", "content": f"after kill {n}"}], None)
                except openai.APIError:
                    envoy_failures += 1
                try:
                    await ask(via_proxy, [{"role": "user", "content": f"after kill {n}"}], None)
                except openai.APIError:
                    proxy_failures += 1
            # Envoy (override-host shape) retries on the pick's fallback, the proxy falls
            # back before any byte reached the client: no request fails on either edge.
            assert (envoy_failures, proxy_failures) == (0, 0)

            reborn = start_instance(1, *PAIR_ARGS, port=victim.port)
            vllm_pair[1] = reborn
            wait_healthy(reborn)
            before = finished(reborn)

            async def until_served_again(c: openai.AsyncOpenAI, base: float) -> None:
                for n in range(200):
                    await ask(c, [{"role": "user", "content": f"back {n}"}], None)
                    if finished(reborn) > base:
                        return
                raise AssertionError("the restarted instance never got traffic back")

            await asyncio.wait_for(until_served_again(via_envoy, before), 120)
            await asyncio.wait_for(until_served_again(via_proxy, finished(reborn)), 120)
            await via_envoy.close()
            await via_proxy.close()


async def test_the_first_token_is_the_first_chunk_that_holds_one(
    vllm_pair: list[VllmInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real vLLM 0.32 through the proxy: the Responses API streams `response.created` and
    `response.in_progress` before the prefill, the chat API its role alone after it, the
    first token right behind. The router's first token is the first chunk after the
    prefill in both."""
    marked: list[bytes] = []
    chunks: list[bytes] = []
    body_chunk = Lifecycle.body_chunk

    def spy(self: Lifecycle, data: bytes) -> None:
        before = self.lease is not None and self.lease.first_token_seen
        body_chunk(self, data)
        chunks.append(data)
        if not before and self.lease is not None and self.lease.first_token_seen:
            marked.append(data)

    monkeypatch.setattr(Lifecycle, "body_chunk", spy)
    async with proxy_stack(vllm_pair, "latency") as url:
        c = client(url)
        stream = await c.responses.create(
            model="tiny", input="say something about routers", max_output_tokens=8, stream=True
        )
        kinds = [event.type async for event in stream]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert "response.output_text.delta" in kinds
        assert len(marked) == 1 and b"response.output_text.delta" in marked[0], chunks[:4]
        assert b"response.created" in chunks[0] and not chunks[0].count(b".delta")
        marked.clear()
        chunks.clear()
        chat = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        pieces = [piece async for piece in chat]
        await c.close()
    assert pieces[0].choices[0].delta.role == "assistant"
    # vLLM sends the role alone after the prefill, the first token right behind it: either
    # marks the first token (the role only when it came apart from the head).
    assert len(marked) == 1, marked
    assert marked[0] == chunks[0] or re.search(rb'"content"\s*:\s*"[^"]', marked[0]), marked
