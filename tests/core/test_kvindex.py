"""The exact prefix index: what engines report cached, per endpoint, from KV events."""

from __future__ import annotations

import pytest

from llmgw.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    decode_batch,
    encode_events,
)
from llmgw.kvindex import ExactPrefixIndex, KvState, SeqVerdict, block_keys

BS = 4
TOKENS = tuple(range(100, 116))  # 4 blocks of 4 tokens
PROMPT = (*TOKENS, 0)  # a prompt going on past them: all their cached blocks reusable


def stored(first: int, last: int, tokens: tuple[int, ...] = TOKENS, **kw: object) -> BlockStored:
    """Blocks first..last (inclusive) of `tokens`, engine hashes 'h<i>' chained to h<first-1>."""
    return BlockStored(
        block_hashes=tuple(f"h{i}".encode() for i in range(first, last + 1)),
        parent_block_hash=f"h{first - 1}".encode() if first else None,
        token_ids=tokens[first * BS : (last + 1) * BS],
        block_size=BS,
        **kw,  # type: ignore[arg-type]
    )


def removed(*blocks: int) -> BlockRemoved:
    return BlockRemoved(tuple(f"h{i}".encode() for i in blocks))


def live_index(*events: KvEvent, **kw: float) -> ExactPrefixIndex:
    index = ExactPrefixIndex(**kw)  # type: ignore[arg-type]
    index.apply_batch("a", EventBatch(0, 0.0, tuple(events)), now=0.0)
    return index


@pytest.mark.parametrize(
    ("events", "prompt", "cached"),
    [
        ((stored(0, 3),), PROMPT, 16),
        ((stored(0, 1),), PROMPT, 8),
        ((stored(0, 1), stored(2, 3)), PROMPT, 16),  # a later batch chains to its parent
        ((stored(0, 3),), TOKENS[:10], 8),  # a partial tail block is not cached
        ((stored(0, 3), removed(2)), PROMPT, 8),  # a hole ends the prefix
        ((stored(0, 3), removed(0)), PROMPT, 0),
        ((stored(0, 3), AllBlocksCleared()), PROMPT, 0),
        ((stored(0, 3), AllBlocksCleared(), stored(0, 0)), PROMPT, 4),
        ((stored(0, 3),), (1, 2, 3, 4, *TOKENS[4:]), 0),  # another first block: nothing
        ((stored(2, 3),), PROMPT, 0),  # parent never seen: skipped
        ((stored(0, 3, medium="CPU"),), PROMPT, 0),  # offloaded tiers do not count
        ((stored(0, 3, medium="GPU"),), PROMPT, 16),
        ((stored(0, 3, lora_name="adapter"),), PROMPT, 0),  # another adapter's blocks
    ],
)
def test_longest_cached_prefix_in_tokens(
    events: tuple[KvEvent, ...], prompt: tuple[int, ...], cached: int
) -> None:
    assert live_index(*events).match(prompt, ["a"]) == {"a": cached}


def test_a_request_for_an_adapter_reads_that_adapters_blocks_and_no_others() -> None:
    """Engines tag an adapter's blocks with its name, the model name requests ask for; the
    lookup read the base model's chain for every request (an adapter's own blocks never
    matched, and the base's counted for it, which vLLM does not reuse)."""
    index = ExactPrefixIndex()
    base = stored(0, 3)
    adapter = BlockStored(
        block_hashes=tuple(f"l{i}".encode() for i in range(2)),
        parent_block_hash=None,
        token_ids=TOKENS[:8],
        block_size=BS,
        lora_name="sql-lora",
    )
    index.apply_batch("a", EventBatch(0, 0.0, (base,)), now=0.0)
    index.apply_batch("b", EventBatch(0, 0.0, (adapter,)), now=0.0)
    assert index.match(PROMPT, ["a", "b"], "sql-lora") == {"a": 0, "b": 8}
    assert index.match(PROMPT, ["a", "b"], "base-model") == {"a": 16, "b": 0}
    assert index.match(PROMPT, ["a", "b"]) == {"a": 16, "b": 0}


def test_blocks_keyed_by_more_than_tokens_are_not_indexed_nor_their_children_orphans() -> None:
    """A cache_salt (or an image) is in the engine's block hash: a request with the same
    tokens and no salt gets no hit there. Counted as cached, they were."""
    salted = stored(0, 1, keyed_from=0)  # a salt on block 0: both blocks salted
    child = stored(2, 3)  # a later batch extends the salted chain
    index = live_index(salted, child)
    assert index.match(PROMPT, ["a"]) == {"a": 0}
    e = index.endpoint("a")
    assert e is not None and e.orphans == 0 and index.size("a") == 0
    imaged = live_index(stored(0, 3, keyed_from=2))  # an image in block 2
    assert imaged.match(PROMPT, ["a"]) == {"a": 8}
    index.apply_batch("a", EventBatch(1, 0.0, (removed(0, 1, 2, 3),)), now=0.0)
    assert e.keyed == set()  # removals forget them


def test_keys_are_the_routers_own_chain_not_the_engines_hashes() -> None:
    other_hashes = BlockStored((7, 8), None, TOKENS[:8], BS)  # int hashes, any function
    index = live_index(other_hashes)
    assert index.match(PROMPT, ["a"]) == {"a": 8}
    assert list(index.endpoint("a").blocks) == block_keys(TOKENS[:8], BS)  # type: ignore[union-attr]


def test_unknown_and_unfed_endpoints_are_absent_from_matches() -> None:
    index = live_index(stored(0, 3))
    index.mark_unknown("a", "subscriber disconnected", now=1.0)
    assert index.match(PROMPT, ["a", "b"]) == {}
    assert index.size("a") == 0
    assert index.state("b") is KvState.UNKNOWN


@pytest.mark.parametrize(
    ("seqs", "verdicts", "state"),
    [
        ((0, 1, 2), ["first", "next", "next"], KvState.LIVE),
        ((0, 2), ["first", "gap"], KvState.UNKNOWN),
        ((5,), ["first"], KvState.UNKNOWN),  # joined late: history unknown
        ((0, 1, 0), ["first", "next", "restart"], KvState.LIVE),  # new engine, empty cache
        ((0, 1, 1), ["first", "next", "repeat"], KvState.LIVE),  # a resend changes nothing
        ((0, 5, 3), ["first", "gap", "restart"], KvState.UNKNOWN),  # new engine, joined late
    ],
)
def test_sequence_numbers_decide_live_or_unknown(
    seqs: tuple[int, ...], verdicts: list[str], state: KvState
) -> None:
    index = ExactPrefixIndex(resync_s=10.0)
    got = [index.apply_batch("a", EventBatch(s, 0.0, ()), now=0.0) for s in seqs]
    assert got == [SeqVerdict(v) for v in verdicts]
    assert index.state("a") is state


def test_a_gap_empties_the_endpoint_until_resync_time_has_passed() -> None:
    index = ExactPrefixIndex(resync_s=5.0)
    index.apply_batch("a", EventBatch(0, 0.0, (stored(0, 1),)), now=0.0)
    index.apply_batch("a", EventBatch(3, 0.0, (stored(0, 3),)), now=1.0)  # gap
    assert index.state("a") is KvState.UNKNOWN
    assert index.endpoint("a").gaps == 1  # type: ignore[union-attr]
    index.apply_batch("a", EventBatch(4, 0.0, ()), now=5.9)
    assert index.state("a") is KvState.UNKNOWN
    index.apply_batch("a", EventBatch(5, 0.0, ()), now=6.0)
    assert index.state("a") is KvState.LIVE
    assert index.match(PROMPT, ["a"]) == {"a": 16}  # kept what came after the gap


def test_all_blocks_cleared_is_a_sync_point_after_a_gap() -> None:
    index = ExactPrefixIndex(resync_s=60.0)
    index.apply_batch("a", EventBatch(0, 0.0, ()), now=0.0)
    index.apply_batch("a", EventBatch(9, 0.0, (AllBlocksCleared(), stored(0, 0))), now=1.0)
    assert index.state("a") is KvState.LIVE
    assert index.match(PROMPT, ["a"]) == {"a": 4}


def test_restart_empties_what_the_old_engine_held() -> None:
    index = ExactPrefixIndex()
    index.apply_batch("a", EventBatch(0, 0.0, (stored(0, 3),)), now=0.0)
    index.apply_batch("a", EventBatch(1, 0.0, ()), now=0.0)
    index.apply_batch("a", EventBatch(0, 0.0, (stored(0, 0),)), now=1.0)
    assert index.match(PROMPT, ["a"]) == {"a": 4}
    assert index.endpoint("a").restarts == 1  # type: ignore[union-attr]


def test_a_resent_batch_keeps_what_the_endpoint_holds() -> None:
    """A duplicate of the last batch emptied the index as if the engine had restarted."""
    index = ExactPrefixIndex()
    batch = EventBatch(0, 0.0, (stored(0, 3),))
    index.apply_batch("a", batch, now=0.0)
    index.apply_batch("a", batch, now=0.1)
    assert index.match(PROMPT, ["a"]) == {"a": 16} and index.endpoint("a").restarts == 0  # type: ignore[union-attr]


def test_an_engine_followed_from_the_middle_stays_unknown_while_it_extends_unseen_prefixes() -> (
    None
):
    """A router restarted beside a running engine: the engine's older prefixes were stored
    before the join, so blocks extending them cannot be keyed. Live at resync time, the
    endpoint would read as holding none of them while it held most of each prompt."""
    index = ExactPrefixIndex(resync_s=5.0)
    index.apply_batch("a", EventBatch(40, 0.0, ()), now=0.0)  # joined late
    index.apply_batch("a", EventBatch(41, 0.0, (stored(2, 3),)), now=4.0)  # extends h1: unseen
    index.apply_batch("a", EventBatch(42, 0.0, ()), now=6.0)
    assert index.state("a") is KvState.UNKNOWN  # 5 s without an orphan: not yet
    index.apply_batch("a", EventBatch(43, 0.0, (stored(0, 3, tokens=tuple(range(16))),)), now=9.5)
    assert index.state("a") is KvState.LIVE  # whole for 5 s since the last orphan


def test_a_hybrid_models_other_block_sizes_do_not_wipe_the_index() -> None:
    """vLLM's hybrid models publish each cache group's blocks with its own size."""
    other_group = BlockStored((b"g1",), None, TOKENS[:8], 8)
    index = live_index(stored(0, 3), other_group, stored(0, 0))
    assert index.match(PROMPT, ["a"]) == {"a": 16}
    assert index.endpoint("a").other_sizes == 1  # type: ignore[union-attr]


def vllm_batch(seq: int, *events: dict[str, object]) -> EventBatch:
    """A batch as vLLM puts it on the wire (tagged maps), decoded as the subscriber does."""
    return decode_batch(seq, [0.0, list(events), 0])


def stored_map(first: int, last: int, **fields: object) -> dict[str, object]:
    return {"type": "BlockStored", **encode_events([stored(first, last)])[0], **fields}


@pytest.mark.parametrize(
    "window_group",
    [
        {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"},
        {"group_idx": 1},  # engines before the kind field: group 0 is the prefix group
    ],
)
def test_a_hybrid_models_sliding_window_group_does_not_evict_the_full_attention_blocks(
    window_group: dict[str, object],
) -> None:
    """vLLM's hybrid models (full + sliding-window attention, one block size) publish each
    group's blocks under the same engine hashes, told apart by `group_idx`: the window
    group's evictions removed the full-attention blocks the engine still reuses."""
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    index = ExactPrefixIndex()
    batch = vllm_batch(0, stored_map(0, 3, **full), stored_map(0, 3, **window_group))
    index.apply_batch("a", batch, now=0.0)
    evict = {"type": "BlockRemoved", "block_hashes": [b"h0", b"h1"], "medium": "GPU"}
    index.apply_batch("a", vllm_batch(1, {**evict, "group_idx": 1}), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 16}
    index.apply_batch("a", vllm_batch(2, {**evict, "group_idx": 0}), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 0}


def test_adapter_blocks_named_only_by_lora_id_are_not_the_base_models() -> None:
    """vLLM releases before `lora_name` told a LoRA adapter's blocks by `lora_id` alone (the
    engine's hashes include the adapter): keyed as the base model's, they read as cached
    for base-model prompts the engine could not serve from them."""
    index = ExactPrefixIndex()
    index.apply_batch("a", vllm_batch(0, stored_map(0, 3, lora_id=7)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 0}
    index.apply_batch("a", vllm_batch(1, stored_map(0, 3, lora_id=None)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 16}


def test_a_restarted_engine_may_run_another_block_size() -> None:
    index = live_index(stored(0, 3))
    index.apply_batch("a", EventBatch(1, 0.0, ()), 0.5)
    index.apply_batch("a", EventBatch(0, 0.0, (BlockStored((b"x",), None, TOKENS[:8], 8),)), 1.0)
    assert index.match(PROMPT, ["a"]) == {"a": 8}


def test_the_same_tokens_under_new_engine_hashes_keep_the_hash_map_bounded() -> None:
    """A new cache salt, or a hostile publisher: the old engine hash must go with its key."""
    index = live_index()
    for n in range(200):
        event = BlockStored((f"salt{n}".encode(),), None, TOKENS[:4], BS)
        index.apply_batch("a", EventBatch(n + 1, 0.0, (event,)), now=0.0)
    kv = index.endpoint("a")
    assert kv is not None and len(kv.blocks) == 1 and len(kv.by_engine) == 1


def test_capacity_takes_the_largest_endpoints_oldest_blocks_first() -> None:
    index = ExactPrefixIndex(capacity=6)
    other = tuple(range(500, 516))
    index.apply_batch("big", EventBatch(0, 0.0, (stored(0, 3),)), now=0.0)  # 4 blocks
    index.apply_batch("small", EventBatch(0, 0.0, (stored(0, 0, other),)), now=0.0)  # 1
    index.apply_batch("stale", EventBatch(7, 0.0, (stored(0, 0, other),)), now=0.0)  # unknown
    assert index.size() == 6
    index.apply_batch("small", EventBatch(1, 0.0, (stored(1, 1, other),)), now=0.0)
    assert index.size() == 6 and index.size("big") == 3  # the largest lost a block
    index.apply_batch("small", EventBatch(2, 0.0, (stored(2, 2, other),)), now=0.0)
    assert index.size() == 6
    assert index.size("small") == 3 and index.size("stale") == 1
    assert index.size("big") == 2  # its last blocks: their chain's first two stay
    assert index.match(PROMPT, ["big"]) == {"big": 8}
    assert index.evicted == 2


def test_the_cap_keeps_a_shared_prefix_while_blocks_extending_it_stay() -> None:
    """The cap took the oldest-stored blocks: a system prompt every request reuses is
    stored once (vLLM never stores a hit again), so it went first, and every chain under it
    was unreachable (`match` walks from the root) and blocks stored later under it orphans:
    the endpoint read 0 cached tokens for every prompt, for good (found by a review
    helper)."""
    system = tuple(range(1000, 1004))
    index = ExactPrefixIndex(capacity=10)
    events = [BlockStored((b"S",), None, system, BS)]
    events += [
        BlockStored((b"c%d" % i,), b"S", tuple(range(10 * i, 10 * i + 4)), BS) for i in range(11)
    ]
    for seq, event in enumerate(events):
        index.apply_batch("a", EventBatch(seq, 0.0, (event,)), now=0.0)
    assert index.size() == 10
    hits = [index.match((*system, *range(10 * i, 10 * i + 4), 7), ["a"])["a"] for i in range(11)]
    assert hits == [4, 4] + [8] * 9  # the two oldest conversations' blocks went
    index.apply_batch(
        "a", EventBatch(12, 0.0, (BlockStored((b"new",), b"S", TOKENS[:4], BS),)), 0.0
    )
    assert index.match((*system, *TOKENS[:4], 7), ["a"]) == {"a": 8}
    kv = index.endpoint("a")
    assert kv is not None and kv.orphans == 0


def test_the_cap_takes_a_chains_last_blocks_before_its_first() -> None:
    index = live_index(stored(0, 3), capacity=4)
    other = BlockStored((b"o0", b"o1"), None, tuple(range(500, 508)), BS)
    index.apply_batch("a", EventBatch(1, 0.0, (other,)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 8}  # blocks 3 and 2 went, 0 and 1 stay
    assert index.match((*other.token_ids, 0), ["a"]) == {"a": 8}
    index.apply_batch("a", EventBatch(2, 0.0, (removed(1),)), now=0.0)  # the engine's
    more = BlockStored((b"x", b"y"), None, tuple(range(900, 908)), BS)
    index.apply_batch("a", EventBatch(3, 0.0, (more,)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 0}  # block 0 then was the oldest leaf
    assert index.match((*other.token_ids, 0), ["a"]) == {"a": 8}
    assert index.match((*more.token_ids, 0), ["a"]) == {"a": 8} and index.size() == 4
    kv = index.endpoint("a")
    assert kv is not None and set(kv.leaves) == set(kv.parents)  # nothing left behind
    assert kv.children == dict.fromkeys(kv.parents.values(), 1)


def test_an_endpoint_resyncing_after_a_gap_keeps_its_blocks_under_the_cap() -> None:
    """The cap emptied unknown endpoints first: one resyncing after a gap lost what it was
    told since, then went live on schedule reading a miss for prompts its engine served
    from cache (in a fleet at capacity, every store elsewhere emptied it) (found by a
    review helper)."""
    index = ExactPrefixIndex(capacity=4, resync_s=5.0)
    index.apply_batch("a", EventBatch(0, 0.0, ()), now=0.0)
    index.apply_batch("a", EventBatch(5, 0.0, ()), now=1.0)  # a gap: unknown
    index.apply_batch("a", EventBatch(6, 0.0, (stored(0, 1),)), now=1.5)
    other = tuple(range(500, 512))
    index.apply_batch("b", EventBatch(0, 0.0, (stored(0, 2, other),)), now=2.0)
    assert index.size("a") == 2 and index.size("b") == 2  # the largest gave one up
    index.apply_batch("a", EventBatch(7, 0.0, ()), now=6.0)
    assert index.state("a") is KvState.LIVE
    assert index.match(PROMPT, ["a"]) == {"a": 8}


def test_salted_blocks_engine_hashes_count_against_the_cap() -> None:
    """Engine hashes of salted or image blocks were kept outside the cap, up to `capacity`
    per endpoint: a vision fleet's N endpoints held N times the promised bound (found by a
    review helper)."""
    index = ExactPrefixIndex(capacity=10)
    for n, eid in enumerate("abcd"):
        hashes = tuple(f"{eid}{i}".encode() for i in range(8))
        salted = BlockStored(hashes, None, tuple(range(32)), BS, keyed_from=0)
        index.apply_batch(eid, EventBatch(0, 0.0, (salted,)), now=float(n))
    held = [len(e.keyed) + len(e.blocks) for e in index.endpoints().values()]
    assert sum(held) == 10 and max(held) - min(held) <= 1
    index.apply_batch("a", EventBatch(1, 0.0, (stored(0, 1),)), now=5.0)
    kv = index.endpoint("a")
    assert kv is not None and kv.keyed == set()  # its salted hashes went before blocks
    assert index.match(PROMPT, ["a"]) == {"a": 8}
    salted_c = index.endpoint("c")
    assert salted_c is not None and len(salted_c.keyed) == 3
    index.apply_batch("c", EventBatch(1, 0.0, (BlockRemoved(tuple(salted_c.keyed)),)), 6.0)
    assert salted_c.keyed == set()
    index.apply_batch("a", EventBatch(2, 0.0, (stored(2, 2),)), now=7.0)
    assert index.match(PROMPT, ["a"]) == {"a": 12}  # the removal made room: nothing taken


def test_a_block_cached_twice_stays_until_both_copies_are_evicted() -> None:
    """vLLM does not deduplicate its cache: two requests that compute the same blocks (a
    shared prefix past the first prefill chunk) each store a copy under the same hash and
    publish BlockStored for each; evicting one copy (BlockRemoved) leaves the other hit."""
    index = live_index(stored(0, 3), stored(0, 3))
    index.apply_batch("a", EventBatch(1, 0.0, (removed(1),)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 16}
    index.apply_batch("a", EventBatch(2, 0.0, (removed(1),)), now=0.0)
    assert index.match(PROMPT, ["a"]) == {"a": 4}
    kv = index.endpoint("a")
    assert kv is not None and b"h1" not in kv.copies and index.size() == 3


def test_removals_of_blocks_never_stored_are_ignored() -> None:
    index = live_index(stored(0, 1), removed(5, 6))
    assert index.match(PROMPT, ["a"]) == {"a": 8}
    assert index.size() == 2


def test_bad_params_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ExactPrefixIndex(capacity=0)
    with pytest.raises(ValueError, match="resync_s must be >= 0"):
        ExactPrefixIndex(resync_s=-1)


def test_a_wholly_cached_prompt_of_full_blocks_counts_the_block_the_engine_recomputes() -> None:
    """vLLM never serves a whole prompt from its cache: it computes at least the last token
    (a hit is at most num_tokens - 1 long), so a prompt of exactly k cached blocks reuses
    k - 1; the index counted all k, one block more than the engine reuses (found by a
    review helper)."""
    index = live_index(stored(0, 3))
    assert index.match(TOKENS, ["a"]) == {"a": 12}  # (16 - 1) // 4 blocks
    assert index.match((*TOKENS, 7), ["a"]) == {"a": 16}  # one token more: all 4 reused
