"""The simulator publishes vLLM's KV events from its prefix cache; fed to the router's exact
index they predict exactly what the engine's prefix cache will hit."""

from __future__ import annotations

import random
from typing import Any

import httpx
import msgpack
import pytest

from llmgw.kvevents import EventBatch, decode_batch
from llmgw.kvindex import ExactPrefixIndex
from llmgw.sim import SimFleet
from llmgw.sim.kvcache import KVCache
from llmgw.sim.model import EngineConfig, EngineModel, SeqRequest
from llmgw.sim.tokens import block_hashes, chat_prompt, count_tokens, token_ids
from llmgw.tokenize import sim_chat_prompt, sim_token_ids, sim_tokenizer

BS = 4


def test_sim_and_router_token_schemes_are_the_same() -> None:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "be brief ✓"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
    ]
    assert sim_chat_prompt(messages) == chat_prompt(messages)
    text = chat_prompt(messages) + "odd tail"
    assert sim_token_ids(text) == token_ids(text)
    assert len(token_ids(text)) == count_tokens(text)
    assert sim_tokenizer().tokens(messages) == token_ids(chat_prompt(messages))


def test_cache_records_stored_removed_and_cleared_events() -> None:
    kv = KVCache(3, publish_events=True, block_size=BS)
    text = "x" * (BS * 4 * 2)  # two full blocks
    hashes = block_hashes(text, BS)
    alloc = kv.allocate(hashes, 2, token_ids(text))
    (event,) = kv.drain_events()
    assert event["type"] == "BlockStored"
    assert event["block_hashes"] == list(hashes)
    assert event["parent_block_hash"] is None
    assert event["token_ids"] == list(token_ids(text))
    kv.free(alloc)
    other = "y" * (BS * 4 * 2)
    kv.allocate(block_hashes(other, BS), 3, token_ids(other))  # evicts both cached blocks
    events = kv.drain_events()
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockStored"]
    assert sorted(events[0]["block_hashes"]) == sorted(hashes)
    kv.clear_cache()
    assert kv.drain_events() == [{"type": "AllBlocksCleared"}]


def test_events_off_records_nothing() -> None:
    kv = KVCache(4, block_size=BS)
    text = "x" * (BS * 4)
    kv.allocate(block_hashes(text, BS), 1, token_ids(text))
    assert kv.drain_events() == []


def test_index_fed_by_engine_events_predicts_every_prefix_hit() -> None:
    """Under eviction pressure, the index's cached tokens equal the engine's hits."""
    rng = random.Random(7)
    engine = EngineModel(EngineConfig(kv_blocks=40, block_size=BS, max_num_seqs=4, kv_events=True))
    index = ExactPrefixIndex()
    prefixes = [
        "".join(rng.choice("abcdef") for _ in range(rng.randint(16, 120))) for _ in range(6)
    ]
    index.apply_batch("e", EventBatch(0, 0.0, ()), 0.0)  # the engine's first (empty) batch
    seq_no, now, checked = 1, 0.0, 0
    for _ in range(150):
        text = rng.choice(prefixes) + "".join(rng.choice("xyz") for _ in range(rng.randint(0, 40)))
        hashes = block_hashes(text, BS)
        ids = token_ids(text)
        predicted = index.match(ids, ["e"]).get("e")
        assert predicted == engine.kv.match_prefix(hashes) * BS
        checked += 1
        engine.submit(SeqRequest(count_tokens(text), 2, hashes, token_ids=ids), now)
        while engine.has_work:
            now += engine.schedule(now)
            engine.complete(now)
            payload = msgpack.unpackb(msgpack.packb([now, engine.drain_kv_events()]))
            index.apply_batch("e", decode_batch(seq_no, payload), now)
            seq_no += 1
    assert checked == 150
    assert 0 < index.size("e") <= 40


def test_a_cache_reset_while_blocks_are_in_use_leaves_no_hit_the_events_do_not_report() -> None:
    """vLLM resets its prefix cache only when no block is in use, so after AllBlocksCleared
    nothing hits. The simulator's reset kept the hashes of blocks in use: freed, they hit
    again while its events had said the cache was empty."""
    kv = KVCache(8, publish_events=True, block_size=BS)
    index = ExactPrefixIndex()
    text = "x" * (BS * 4 * 2)  # two full blocks
    hashes, ids = block_hashes(text, BS), token_ids(text)
    alloc = kv.allocate(hashes, 2, ids)  # a request running
    kv.clear_cache()
    kv.free(alloc)
    payload = msgpack.unpackb(msgpack.packb([0.0, kv.drain_events()]))
    index.apply_batch("e", decode_batch(0, payload), 0.0)
    assert index.match(ids, ["e"])["e"] == kv.match_prefix(hashes) * BS


async def test_a_token_id_prompt_is_cached_and_published_as_its_own_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM hashes and publishes a completion prompt's own token ids, and the router looks
    such a prompt up by them (`llmgw.tokenize`: used as is). The simulator cut the ids'
    decimal text into 4-character tokens instead: its events never matched the router's
    lookup, and the prompt's blocks were those of another token count (found by a review
    helper)."""
    ids = list(range(10_000, 10_064))  # 64 tokens = 4 blocks of 16
    captured: list[dict[str, Any]] = []
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0, block_size=16, kv_events_port=0) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        publisher = fleet.replicas[0].kv_publisher
        assert publisher is not None
        monkeypatch.setattr(publisher, "publish", captured.extend)
        body = {"model": "m1", "prompt": ids, "max_tokens": 1}
        first = await client.post("/v1/completions", json=body)
        again = await client.post("/v1/completions", json=body)
    assert first.json()["usage"]["prompt_tokens"] == 64
    assert again.headers["x-sim-cached-tokens"] == "48"  # 3 whole blocks: the last computed
    stored = [e for e in captured if e["type"] == "BlockStored"]
    assert [t for e in stored for t in e["token_ids"]] == ids
    index = ExactPrefixIndex()
    index.apply_batch("e", EventBatch(0, 0.0, ()), 0.0)
    payload = msgpack.unpackb(msgpack.packb([0.0, stored, 0]))
    index.apply_batch("e", decode_batch(1, payload), 0.0)
    assert index.match(ids, ["e"])["e"] == 48  # what the engine reuses (x-sim-cached-tokens)
