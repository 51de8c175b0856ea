"""Exact prefix-cache contents per endpoint, fed by the engines' own KV-cache events (pure).

`BlockStored` carries the block's token ids, so the router keys blocks by its own chained
hash of token ids (key_i = hash((key_{i-1}, tokens of block i)), rooted at the LoRA name)
and maps the engine's hashes to those keys only to apply `BlockRemoved`: it never has to
reproduce the engine's hash function. An endpoint is *live* when its event stream is
complete (followed from sequence 0, from an `AllBlocksCleared`, or for `resync_s` since a
gap); otherwise *unknown*, and the scorer uses the approximate index there instead.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmgw.kvevents import (
    GPU_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)


class KvState(enum.StrEnum):
    LIVE = "live"
    UNKNOWN = "unknown"


class SeqVerdict(enum.StrEnum):
    NEXT = "next"  # the expected sequence number
    FIRST = "first"  # the first batch seen from this endpoint
    GAP = "gap"  # batches were missed: replay them or the index is incomplete
    RESTART = "restart"  # the sequence went back: a new engine process, empty cache
    REPEAT = "repeat"  # the last batch again (a resend): nothing new


# A hybrid model's cache groups share engine hashes (told apart by `group_idx`); a prefix
# hit is the full-attention group's, so only its blocks are followed. Before vLLM named
# the kind, group 0 was that group (as Dynamo reads it).
_PREFIX_KINDS = ("full_attention", "mla_attention", "sink_full_attention")


@dataclass
class EndpointKv:
    """One endpoint's blocks: router key -> engine hash."""

    blocks: dict[int, EngineHash] = field(default_factory=dict)
    by_engine: dict[EngineHash, int] = field(default_factory=dict)
    # Engine hash -> copies cached beyond the first (vLLM does not deduplicate its cache:
    # requests that computed the same block each store and, later, evict a copy).
    copies: dict[EngineHash, int] = field(default_factory=dict)
    # The prefix tree, for the memory cap: each block's parent (blocks after a chain's
    # first), how many cached blocks extend a key, and the blocks none extends (leaves),
    # oldest first. The cap takes leaves only: a block it keeps is reachable from the root.
    parents: dict[int, int] = field(default_factory=dict)
    children: dict[int, int] = field(default_factory=dict)
    leaves: OrderedDict[int, None] = field(default_factory=OrderedDict)
    block_size: int | None = None
    state: KvState = KvState.UNKNOWN
    unknown_since: float = 0.0
    reason: str = "no events yet"
    last_seq: int | None = None
    last_ts: float | None = None
    gaps: int = 0
    restarts: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown (skipped)
    orphan_at: float = float("-inf")  # when the last one came
    other_sizes: int = 0  # stored blocks of another block size (a hybrid model's groups)
    # Engine hashes of blocks keyed by more than their tokens (a cache salt, an image):
    # not indexed, and their children are not orphans.
    keyed: set[EngineHash] = field(default_factory=set)
    group: int | None = None  # the cache group followed, once the engine named its kind
    lag_s: float = 0.0  # last batch: received - engine timestamp (set by the subscriber)


def root_key(lora: str | int | None) -> int:
    """The chain's root: the base model (None) or a LoRA adapter (its name, else its id)."""
    return hash(("llmgw-kv-root", lora))


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    upto: int | None = None,
) -> list[int]:
    """Chained keys of the full blocks of a token sequence (a partial tail is not cached);
    `upto`: of its first that many tokens only."""
    key = root_key(lora_name)
    out: list[int] = []
    end = len(token_ids) if upto is None else min(upto, len(token_ids))
    for start in range(0, end - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start : start + block_size])))
        out.append(key)
    return out


def _followed(e: EndpointKv, group_idx: int | None, kind: str | None) -> bool:
    """Is this event's cache group the one prefix hits are read from?"""
    if kind is not None:
        if kind not in _PREFIX_KINDS:
            return False
        if e.group is None and group_idx is not None:
            e.group = group_idx
    return group_idx is None or group_idx == (0 if e.group is None else e.group)


class ExactPrefixIndex:
    """Per endpoint, the blocks its engine reported cached; bounded by `capacity` entries
    in all (blocks, and engine hashes of salted blocks): over it, the endpoint holding the
    most loses its salted hashes, then its oldest blocks no cached block extends."""

    def __init__(self, *, capacity: int = 1_000_000, resync_s: float = 10.0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        if resync_s < 0:
            raise ValueError(f"resync_s must be >= 0, got {resync_s!r}")
        self.capacity = capacity
        self.resync_s = resync_s
        self._endpoints: dict[str, EndpointKv] = {}
        self._resync: dict[str, float] = {}  # endpoint -> its model's resync_s
        self._total = 0  # blocks
        self._keyed = 0  # engine hashes of salted blocks
        self._memo: tuple[Sequence[int] | None, dict[tuple[int, str | None], list[int]]] = (
            None,
            {},
        )
        # LoRA adapters engines named in their blocks: a request for one of these models
        # looks up the adapter's chain, not the base model's (vLLM keeps them apart).
        self._loras: set[str] = set()
        self.evicted = 0

    # -- what the scorer reads -----------------------------------------------------------
    def any_live(self) -> bool:
        return any(e.state is KvState.LIVE for e in self._endpoints.values())

    def state(self, endpoint_id: str) -> KvState:
        e = self._endpoints.get(endpoint_id)
        return KvState.UNKNOWN if e is None else e.state

    def match(
        self, token_ids: Sequence[int], endpoint_ids: Iterable[str], model: str | None = None
    ) -> dict[str, int]:
        """Live endpoint id -> leading prompt tokens its engine reuses (unknown ones absent):
        whole cached blocks, short of the prompt's last token, which vLLM always computes
        (KVCacheManager.get_computed_blocks, vllm/v1/core/kv_cache_manager.py: a hit is at
        most num_tokens - 1 long), so a prompt of exactly k cached blocks reuses k - 1.
        `model`: the request's; an adapter's name (as engines tag its blocks) reads that
        adapter's blocks, any other name the base model's."""
        memo_tokens, keys_by_size = self._memo
        if memo_tokens is not token_ids:
            keys_by_size = {}
            self._memo = (token_ids, keys_by_size)
        lora = model if model in self._loras else None
        out: dict[str, int] = {}
        for eid in endpoint_ids:
            e = self._endpoints.get(eid)
            if e is None or e.state is not KvState.LIVE:
                continue
            size = e.block_size
            if size is None:
                out[eid] = 0
                continue
            keys = keys_by_size.get((size, lora))
            if keys is None:
                keys = keys_by_size[(size, lora)] = block_keys(
                    token_ids, size, lora, len(token_ids) - 1
                )
            blocks = e.blocks
            depth = 0
            for k in keys:
                if k not in blocks:
                    break
                depth += 1
            out[eid] = depth * size
        return out

    def size(self, endpoint_id: str | None = None) -> int:
        if endpoint_id is None:
            return self._total
        e = self._endpoints.get(endpoint_id)
        return 0 if e is None else len(e.blocks)

    def endpoint(self, endpoint_id: str) -> EndpointKv | None:
        return self._endpoints.get(endpoint_id)

    def endpoints(self) -> dict[str, EndpointKv]:
        return dict(self._endpoints)

    def stats(self) -> dict[str, dict[str, object]]:
        return {
            eid: {
                "state": str(e.state),
                "blocks": len(e.blocks),
                "last_seq": e.last_seq,
                "gaps": e.gaps,
                "restarts": e.restarts,
                "reason": e.reason,
            }
            for eid, e in self._endpoints.items()
        }

    # -- what the subscriber feeds -------------------------------------------------------
    def expect(self, endpoint_id: str, seq: int) -> SeqVerdict:
        """How `seq` follows what this endpoint sent before (nothing is changed)."""
        e = self._endpoints.get(endpoint_id)
        last = None if e is None else e.last_seq
        if last is None:
            return SeqVerdict.FIRST
        if seq == last + 1:
            return SeqVerdict.NEXT
        if seq == last:
            return SeqVerdict.REPEAT
        return SeqVerdict.RESTART if seq < last else SeqVerdict.GAP

    def apply_batch(self, endpoint_id: str, batch: EventBatch, now: float) -> SeqVerdict:
        """Follow the sequence (a gap or late join: unknown; a restart: empty), then apply."""
        verdict = self.expect(endpoint_id, batch.seq)
        e = self._get(endpoint_id)
        if verdict is SeqVerdict.REPEAT:
            return verdict
        if verdict is SeqVerdict.RESTART:
            e.restarts += 1
            if batch.seq == 0:  # a new engine's whole history follows
                self._clear(e, live=True)
            else:  # a new engine, its first batches missed
                self._unknown(e, f"restarted, joined at sequence {batch.seq}", now)
        elif verdict is SeqVerdict.GAP:
            e.gaps += 1
            self._unknown(
                e,
                f"missed batches {e.last_seq + 1 if e.last_seq is not None else 0}"
                f"..{batch.seq - 1}",
                now,
            )
        elif verdict is SeqVerdict.FIRST:
            if batch.seq == 0:  # the engine's whole history: exact from the start
                self._clear(e, live=True)
            else:
                self._unknown(e, f"joined at sequence {batch.seq}", now)
        e.last_seq = batch.seq
        e.last_ts = batch.ts
        self.apply(endpoint_id, batch.events, now)
        return verdict

    def apply(
        self,
        endpoint_id: str,
        events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
        now: float,
    ) -> None:
        e = self._get(endpoint_id)
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium in GPU_MEDIA and _followed(
                    e, event.group_idx, event.kv_cache_spec_kind
                ):
                    self._store(e, event, now)
            elif isinstance(event, BlockRemoved):
                if event.medium in GPU_MEDIA and _followed(e, event.group_idx, None):
                    self._remove(e, event.block_hashes)
            else:  # AllBlocksCleared: an exact sync point
                self._clear(e, live=True)
        # Live again once the stream has been whole for resync_s and stored no block on a
        # prefix this index never saw: an engine followed from the middle holds prefixes
        # cached before (a system prompt); blocks extending them cannot be keyed, and live
        # at once the endpoint would read as holding none of them.
        since = e.unknown_since if e.unknown_since > e.orphan_at else e.orphan_at
        resync_s = self._resync.get(endpoint_id, self.resync_s)
        resynced = e.last_seq is not None and now - since >= resync_s
        if e.state is KvState.UNKNOWN and resynced:
            e.state, e.reason = KvState.LIVE, "resynced"
        if self._total + self._keyed > self.capacity:
            self._trim()

    def mark_unknown(self, endpoint_id: str, reason: str, now: float) -> None:
        """The stream broke (disconnect, engine down): empty it, fall back until resync."""
        e = self._get(endpoint_id)
        e.last_seq = None
        self._unknown(e, reason, now)

    def set_resync(self, endpoint_id: str, resync_s: float) -> None:
        """This endpoint's model's `resync_s` (others keep the index's)."""
        self._resync[endpoint_id] = resync_s

    def forget(self, endpoint_id: str) -> None:
        self._resync.pop(endpoint_id, None)
        e = self._endpoints.pop(endpoint_id, None)
        if e is not None:
            self._total -= len(e.blocks)
            self._keyed -= len(e.keyed)

    # -- internals -------------------------------------------------------------------------
    def _get(self, endpoint_id: str) -> EndpointKv:
        e = self._endpoints.get(endpoint_id)
        if e is None:
            e = self._endpoints[endpoint_id] = EndpointKv()
        return e

    def _unknown(self, e: EndpointKv, reason: str, now: float) -> None:
        self._clear(e, live=False)
        e.state, e.reason, e.unknown_since = KvState.UNKNOWN, reason, now

    def _clear(self, e: EndpointKv, *, live: bool) -> None:
        self._total -= len(e.blocks)
        self._keyed -= len(e.keyed)
        e.blocks.clear()
        e.by_engine.clear()
        e.copies.clear()
        e.parents.clear()
        e.children.clear()
        e.leaves.clear()
        e.keyed.clear()
        e.block_size = None  # a restarted engine may run another block size
        e.group = None
        e.orphan_at = float("-inf")
        if live:
            e.state, e.reason = KvState.LIVE, "in sync"

    def _store(self, e: EndpointKv, event: BlockStored, now: float) -> None:
        size = event.block_size
        if e.block_size is None:
            e.block_size = size
        elif size != e.block_size:
            # A hybrid model's other cache groups publish other block sizes: follow the
            # first size seen (a new engine config comes with a restart, which clears).
            e.other_sizes += len(event.block_hashes)
            return
        parent = event.parent_block_hash
        if event.lora_name is not None:
            self._loras.add(event.lora_name)
        blocks, by_engine = e.blocks, e.by_engine
        prev: int | None = None  # the block the next one extends (a chain's first: none)
        if parent is None:
            lora = event.lora_name
            key = root_key(event.lora_id if lora is None else lora)
        else:
            found = e.by_engine.get(parent)
            if found is None:
                if parent in e.keyed:  # extends a salted prefix: as salted
                    self._keep_keyed(e, event.block_hashes)
                    return
                e.orphans += len(event.block_hashes)
                e.orphan_at = now
                return
            key = found
            if found in blocks:
                prev = found
        tokens = event.token_ids
        hashes = event.block_hashes
        if event.keyed_from is not None:
            self._keep_keyed(e, hashes[event.keyed_from :])
            hashes = hashes[: event.keyed_from]
        for i, engine_hash in enumerate(hashes):
            chunk = tokens[i * size : (i + 1) * size]
            if len(chunk) < size:
                break
            key = hash((key, chunk))
            old = blocks.get(key)
            if old is None:
                self._total += 1
                self._link(e, key, prev)
            else:
                if key in e.leaves:  # stored again: recent
                    e.leaves.move_to_end(key)
                if old == engine_hash:
                    e.copies[old] = e.copies.get(old, 0) + 1
                elif by_engine.get(old) == key:
                    # The same tokens under a new engine hash (another cache salt): the old
                    # hash maps nothing any more, and would grow the map past the bound.
                    del by_engine[old]
                    e.copies.pop(old, None)
            blocks[key] = engine_hash
            by_engine[engine_hash] = key
            prev = key

    def _link(self, e: EndpointKv, key: int, parent: int | None) -> None:
        """A new block `key` extends `parent` (None: a chain's first block)."""
        children = e.children
        if parent is not None:
            e.parents[key] = parent
            n = children.get(parent, 0)
            if n == 0:  # extended: no longer a leaf
                e.leaves.pop(parent, None)
            children[parent] = n + 1
        if key not in children:  # (blocks the engine kept after removing it may extend it)
            e.leaves[key] = None

    def _unlink(self, e: EndpointKv, key: int) -> None:
        """Block `key` is gone: its parent may be a leaf again, then the oldest one (it
        was stored before every block extending it)."""
        e.leaves.pop(key, None)
        parent = e.parents.pop(key, None)
        if parent is None:
            return
        children = e.children
        n = children[parent] - 1
        if n > 0:
            children[parent] = n
            return
        del children[parent]
        if parent in e.blocks:
            e.leaves[parent] = None
            e.leaves.move_to_end(parent, last=False)

    def _keep_keyed(self, e: EndpointKv, hashes: Iterable[EngineHash]) -> None:
        keyed = e.keyed
        before = len(keyed)
        keyed.update(hashes)
        self._keyed += len(keyed) - before

    def _remove(self, e: EndpointKv, hashes: Iterable[EngineHash]) -> None:
        blocks, by_engine, copies, keyed = e.blocks, e.by_engine, e.copies, e.keyed
        salted = len(keyed)
        for h in hashes:
            keyed.discard(h)
            extra = copies.pop(h, 0)
            if extra > 0:  # another copy of the block stays cached
                if extra > 1:
                    copies[h] = extra - 1
                continue
            key = by_engine.pop(h, None)
            if key is not None and blocks.get(key) == h:
                del blocks[key]
                self._unlink(e, key)
                self._total -= 1
        self._keyed -= salted - len(keyed)

    def _trim(self) -> None:
        """Down to capacity: the endpoint holding the most (live or not: a resyncing one's
        blocks are what it goes live on) loses its salted hashes, then its oldest leaves,
        down to the next largest. A block whose descendants stay is never taken: `match`
        walks from the root, and a shared prefix's first block (a system prompt, stored
        once and the oldest) would take every chain under it."""
        while (over := self._total + self._keyed - self.capacity) > 0:
            largest: EndpointKv | None = None
            most = second = 0
            for e in self._endpoints.values():
                held = len(e.blocks) + len(e.keyed)
                if held > most:
                    largest, most, second = e, held, most
                elif held > second:
                    second = held
            assert largest is not None  # over capacity: something is held
            take = min(over, max(1, most - second))
            keyed = largest.keyed
            salted = min(take, len(keyed))
            for _ in range(salted):
                keyed.pop()
            self._keyed -= salted
            blocks, leaves = largest.blocks, largest.leaves
            for _ in range(take - salted):
                key = leaves.popitem(last=False)[0]
                engine_hash = blocks.pop(key)
                self._unlink(largest, key)
                if largest.by_engine.get(engine_hash) == key:
                    del largest.by_engine[engine_hash]
                largest.copies.pop(engine_hash, None)
            self._total -= take - salted
            self.evicted += take
