"""A real vLLM's KV-cache events through llmgw's subscriber: the exact index predicts the
engine's own prefix-cache hits, and a stopped engine empties its endpoint within a second."""

from __future__ import annotations

import asyncio
import json
import random
import shlex
from collections.abc import Callable

import httpx
import pytest

from llmgw.config import KvEventsSpec
from llmgw.kvindex import KvState
from llmgw.promtext import parse
from llmgw.registry import Registry
from llmgw.runtime.kvevents import KvEventSubscriber
from llmgw.runtime.ports import free_port
from llmgw.tokenize import hf_tokenizer
from tests.real_engine.conftest import ROOT, start_instance, wait_healthy

pytestmark = pytest.mark.real_engine

TOKENIZER = ROOT / ".scratch" / "vllm" / "tiny-llama" / "tokenizer.json"
WORDS = ["router", "replica", "session", "prefix", "cache", "queue", "token", "model"]


async def until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Wait for a condition fed by the subscriber task (polled, bounded); False on timeout."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        return False
    return True


def stored(registry: Registry, eid: str, tokens: tuple[int, ...]) -> Callable[[], bool]:
    full = (len(tokens) - 1) // 128 * 128  # the index counts what vLLM reuses: not the last
    return lambda: registry.kv_index.match(tokens, [eid]).get(eid, 0) >= full


def hits(metrics_text: str) -> float:
    return sum(s.value for s in parse(metrics_text) if s.name == "vllm:prefix_cache_hits_total")


async def test_exact_index_agrees_with_the_engines_prefix_hits(vllm_ready: None) -> None:
    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    inst = start_instance(
        0,
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "24",  # 24 blocks of 128 tokens: 8 growing sessions evict
        "--kv-events-config",
        shlex.quote(json.dumps(events)),  # the serve command line is re-split by shlex
    )
    registry = Registry()
    tokenizer = hf_tokenizer(str(TOKENIZER))
    sub = KvEventSubscriber(registry, inst.address, KvEventsSpec(discover=True), retry_s=0.2)
    task: asyncio.Task[None] | None = None
    try:
        wait_healthy(inst)
        task = asyncio.create_task(sub.run())
        await asyncio.wait_for(sub.connected.wait(), 10)
        rng = random.Random(3)
        systems = [" ".join(rng.choices(WORDS, k=150)) for _ in range(3)]
        sessions: dict[int, list[dict[str, str]]] = {}
        agree = total = 0
        async with httpx.AsyncClient(base_url=inst.url, timeout=60) as client:
            for _ in range(40):
                key = rng.randrange(8)  # 8 sessions, each on one of 3 shared system prompts
                history = sessions.setdefault(
                    key, [{"role": "system", "content": systems[key % 3]}]
                )
                history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=40))})
                tokens = tokenizer.tokens(list(history), f"s{key}")
                assert tokens is not None
                before = hits((await client.get("/metrics")).text)
                predicted = registry.kv_index.match(tokens, [inst.address]).get(inst.address, 0)
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": history, "max_tokens": 4},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["usage"]["prompt_tokens"] == len(tokens), "tokenized unlike vLLM"
                history.append(
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
                )
                observed = hits((await client.get("/metrics")).text) - before
                # vLLM recomputes at least the last token (a whole cached prompt hits a block
                # less): the index's match counts so too.
                agree += predicted == observed
                total += 1
                # Wait for this request's blocks to be reported (they are on the wire).
                await until(stored(registry, inst.address, tokens), timeout=2.0)
        print(f"exact index vs vLLM prefix hits: {agree}/{total} equal, {sub.stats}")
        assert registry.kv_index.state(inst.address) is KvState.LIVE
        assert sub.stats.batches > 0 and sub.stats.bad_messages == 0
        assert agree >= 0.95 * total, f"{agree}/{total} predictions equal the engine's hits"
        inst.kill()
        assert await until(lambda: registry.kv_index.size(inst.address) == 0, timeout=1.0)
    finally:
        if task is not None:
            task.cancel()
        inst.kill()
