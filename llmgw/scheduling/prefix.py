"""Approximate prefix-cache affinity: which endpoint has probably cached a prompt's prefix.

The prompt is cut into fixed-size character blocks; block i's hash chains block i-1's, so
equal hashes mean equal prefixes. Each endpoint keeps an LRU of the block hashes routed to
it, bounded in entries, so memory stays flat however many sessions pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

from llmgw.scheduling.blockhash import BlockHasher

# A block last touched longer ago than this many times the longest recent reuse interval
# (the age of a block when a prompt hit it again) is cold: taking its place costs nothing.
COLD_REUSES = 2.0
# The longest recent reuse interval decays by this factor per hit, so one long-idle
# session coming back does not keep every block warm for ever.
REUSE_DECAY = 0.99


class PrefixIndex:
    def __init__(
        self,
        *,
        block_chars: int = 256,
        max_blocks: int = 128,
        capacity: int = 16384,
        shared_at: int = 3,
    ) -> None:
        if block_chars < 1 or max_blocks < 1 or capacity < 1 or shared_at < 1:
            raise ValueError("block_chars, max_blocks, capacity and shared_at must be positive")
        self.block_chars = block_chars
        # A block several sessions use (`shared_depth`): this many. Counting stops there,
        # so a system prompt's blocks cost one lookup each per pick, not three (A/B:
        # 16-endpoint `latency` picks ~1 µs faster, 6 of 8 blocks shared).
        self.shared_at = shared_at
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._hasher = BlockHasher(block_chars, max_blocks)
        self._owners: dict[int, set[str]] = {}
        # Per endpoint: block hash -> when it was last routed there (the caller's clock),
        # least recent first.
        self._lru: dict[str, OrderedDict[int, float]] = {}
        # Per block: how many times the key using it changed (a count of distinct sessions
        # when they interleave, up to `shared_at`), and the last key's hash (a session id
        # is the client's, up to the 60 KB head limit: kept whole, one per block was GBs).
        # Kept while any endpoint holds the block.
        self._capacity: dict[str, int] = {}  # per endpoint, where it differs from `capacity`
        self._sharers: dict[int, int] = {}
        self._last_key: dict[int, int] = {}
        # `room` per endpoint holding blocks or a capacity of its own (the others have
        # `capacity`), kept current by every change: `fits` reads it first, for about half
        # the endpoints on every pick (a dict lookup rather than counting the LRU took
        # 256-endpoint picks 4 % faster, A/B; within noise at 16). Read-only outside.
        self.rooms: dict[str, int] = {}
        # The longest recent age of a block when a prompt hit it again (seconds, decaying);
        # None until a hit.
        self.reuse_age: float | None = None
        # Told of every insert (endpoint id, hashes, key) when set: router replicas share
        # what they route (llmgw/runtime/peers.py). One attribute test per insert.
        self.on_insert: Callable[[str, list[int], str | None], None] | None = None

    def hashes(self, prompt: str) -> list[int]:
        """Chained hashes of the prompt's full blocks (a partial tail block is not cached)."""
        return self._hasher.hashes(prompt)

    def match(self, hashes: list[int], deeper_than: int = 0) -> dict[str, int]:
        """Endpoint id -> number of leading blocks it holds (only endpoints holding more than
        `deeper_than`, which are all that hold one by default)."""
        owners_of = self._owners
        # Only the holders of block `deeper_than` can hold more than `deeper_than` blocks:
        # start from them (none, or a session's home or two, where the leading blocks are
        # a system prompt every endpoint holds) and check they hold every block before it,
        # rather than narrowing every endpoint down from block 0. The same endpoints and
        # depths; picks ~2 µs faster at 16 endpoints (A/B).
        first = deeper_than if deeper_than > 0 else 0
        alive = owners_of.get(hashes[first]) if first < len(hashes) else None
        if not alive:
            return {}
        for h in islice(hashes, first):
            owners = owners_of.get(h)
            if not owners:
                return {}
            if not alive <= owners:
                alive = alive & owners
                if not alive:
                    return {}
        matched: dict[str, int] = {}
        # Each endpoint is written once, at the depth where its run ends: a system prompt
        # all of 256 endpoints hold used to be rewritten at every one of its blocks.
        depth = first + 1
        for h in islice(hashes, depth, None):
            owners = owners_of.get(h)
            if not owners:
                break
            if not alive <= owners:  # a subset test allocates nothing (a shared prompt)
                still = alive & owners
                if depth > deeper_than:
                    matched.update(dict.fromkeys(alive - still, depth))
                if not still:
                    return matched
                alive = still
            depth += 1
        if depth > deeper_than:
            matched.update(dict.fromkeys(alive, depth))
        return matched

    def held(self, endpoint_id: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` this endpoint holds (as known here)."""
        lru = self._lru.get(endpoint_id)
        if not lru:
            return 0
        depth = 0
        for h in hashes:
            if h not in lru:
                break
            depth += 1
        return depth

    def shared_depth(self, hashes: list[int]) -> int:
        """How many leading blocks `shared_at` sessions used (a system prompt, not a history)."""
        sharers, shared_at = self._sharers, self.shared_at
        depth = 0
        for h in hashes:
            if sharers.get(h, 0) < shared_at:
                break
            depth += 1
        return depth

    def insert(
        self, endpoint_id: str, hashes: list[int], key: str | None = None, now: float = 0.0
    ) -> None:
        """Blocks routed to this endpoint at `now` (seconds, the caller's clock)."""
        lru = self._lru.get(endpoint_id)
        if lru is None:
            lru = self._lru[endpoint_id] = OrderedDict()
        owners_of = self._owners
        last_key, sharers, shared_at = self._last_key, self._sharers, self.shared_at
        move_to_end = lru.move_to_end
        if hashes:
            last = lru.get(hashes[0])
            if last is not None:  # a hit: how long its prefix lay unused
                age, longest = now - last, self.reuse_age
                if longest is None or age > longest * REUSE_DECAY:
                    self.reuse_age = age
                else:
                    self.reuse_age = longest * REUSE_DECAY
        key_hash = hash(key) if key is not None else 0
        # One pass per block (this runs on every pick): sharers, then the endpoint's LRU.
        for h in hashes:
            if key is not None:
                count = sharers.get(h, 0)
                if count < shared_at and last_key.get(h) != key_hash:
                    last_key[h] = key_hash
                    sharers[h] = count + 1
            if h in lru:
                lru[h] = now
                move_to_end(h)
                continue
            lru[h] = now
            owners = owners_of.get(h)
            if owners is None:
                owners_of[h] = {endpoint_id}
            else:
                owners.add(endpoint_id)
        limit = self._capacity.get(endpoint_id, self.capacity)
        if len(lru) > limit:
            self._trim(endpoint_id, lru)
        self.rooms[endpoint_id] = limit - len(lru)
        told = self.on_insert
        if told is not None:
            told(endpoint_id, hashes, key)

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        """Hold at most `blocks` for this endpoint (its engine's KV cache, in index blocks):
        what the engine must have evicted stops counting as cached there."""
        blocks = max(1, min(blocks, self.capacity))
        if self._capacity.get(endpoint_id) != blocks:
            self._capacity[endpoint_id] = blocks
            lru = self._lru.get(endpoint_id)
            if lru is not None:
                self._trim(endpoint_id, lru)
            self.rooms[endpoint_id] = blocks - len(self._lru.get(endpoint_id, ()))

    def limit(self, endpoint_id: str) -> int:
        """The most blocks this endpoint may hold here (`set_capacity`, else `capacity`)."""
        return self._capacity.get(endpoint_id, self.capacity)

    def _trim(self, endpoint_id: str, lru: OrderedDict[int, float]) -> None:
        limit = self.limit(endpoint_id)
        while len(lru) > limit:
            old, _ = lru.popitem(last=False)
            owners = self._owners.get(old)
            if owners is not None:
                owners.discard(endpoint_id)
                if not owners:
                    self._drop(old)

    def _drop(self, h: int) -> None:
        del self._owners[h]
        self._sharers.pop(h, None)
        self._last_key.pop(h, None)

    def forget(self, endpoint_id: str) -> None:
        self._capacity.pop(endpoint_id, None)
        self.rooms.pop(endpoint_id, None)
        for h in self._lru.pop(endpoint_id, OrderedDict()):
            owners = self._owners.get(h)
            if owners is not None:
                owners.discard(endpoint_id)
                if not owners:
                    self._drop(h)

    def room(self, endpoint_id: str) -> int:
        """Blocks this endpoint's cache can still take before it must evict (as known here)."""
        return self.rooms.get(endpoint_id, self.capacity)

    def fits(self, endpoint_id: str, blocks: float, now: float) -> bool:
        """Whether `blocks` more fit in this endpoint's cache without evicting a block in
        use: in its free room, or in place of cold blocks (untouched for `COLD_REUSES` x the
        longest recent reuse interval). A router that has run a while holds a full index
        for every endpoint, mostly of traffic long gone; counting only free room, no
        session ever moved to an idle replica there (bench/routing.py's full grid, where
        each cell follows others: hot-zipf TTFT p90 1.8-2.2x the best, 1.0 on a fresh
        router)."""
        room = self.rooms.get(endpoint_id, self.capacity)
        if room >= blocks:
            return True
        longest = self.reuse_age
        lru = self._lru.get(endpoint_id)
        if longest is None or not lru:
            return False
        before = now - COLD_REUSES * longest
        for touched in lru.values():  # least recent first; stops at the first warm block
            if touched > before:
                return False
            room += 1
            if room >= blocks:
                return True
        return False

    def size(self, endpoint_id: str | None = None) -> int:
        if endpoint_id is not None:
            return len(self._lru.get(endpoint_id, ()))
        return sum(len(v) for v in self._lru.values())
