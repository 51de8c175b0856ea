"""KV block pool with a chained-hash prefix cache and LRU eviction (pure, no I/O).

Blocks are either in use (reference count > 0), cached-but-free (evictable, in LRU
order), or empty. A full prompt block is identified by the hash of its content chained
to the hash of the block before it, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Allocation:
    """Blocks held by one sequence; `cached_blocks` of them were prefix-cache hits."""

    block_ids: list[int]
    cached_blocks: int


@dataclass
class KVCache:
    """A fixed pool of `num_blocks` blocks; hashes map to the block holding that prefix."""

    num_blocks: int
    enable_prefix_caching: bool = True
    # Opt-in: record vLLM KV-cache events (tagged maps, as vLLM encodes them) in `events`.
    publish_events: bool = False
    block_size: int = 16
    events: list[dict[str, Any]] = field(default_factory=list)
    _refcount: list[int] = field(init=False)
    _block_hash: list[bytes | None] = field(init=False)
    _by_hash: dict[bytes, int] = field(init=False)
    _evictable: OrderedDict[int, None] = field(init=False)
    _empty: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self._refcount = [0] * self.num_blocks
        self._block_hash = [None] * self.num_blocks
        self._by_hash = {}
        self._evictable = OrderedDict()
        # Popped from the end, so block 0 is handed out first.
        self._empty = list(range(self.num_blocks - 1, -1, -1))

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._empty) - len(self._evictable)

    @property
    def cached_free_blocks(self) -> int:
        return len(self._evictable)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (what vLLM reports as KV usage)."""
        return self.used_blocks / self.num_blocks

    def match_prefix(self, block_hashes: tuple[bytes, ...]) -> int:
        """How many leading blocks of this prompt are already cached (read-only)."""
        if not self.enable_prefix_caching:
            return 0
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._by_hash:
                break
            matched += 1
        return matched

    def can_allocate(
        self, block_hashes: tuple[bytes, ...], total_blocks: int, max_hits: int | None = None
    ) -> bool:
        matched = self.match_prefix(block_hashes[:max_hits])
        matched_evictable = sum(
            1 for h in block_hashes[:matched] if self._by_hash[h] in self._evictable
        )
        free = len(self._empty) + len(self._evictable) - matched_evictable
        return total_blocks - matched <= free

    def allocate(
        self,
        block_hashes: tuple[bytes, ...],
        total_blocks: int,
        token_ids: tuple[int, ...] = (),
        max_hits: int | None = None,
    ) -> Allocation:
        """Take `total_blocks` blocks, reusing at most `max_hits` cached prefix blocks (the
        others are computed again in blocks of their own); caller checked room.
        `token_ids` (the prompt's) go into the BlockStored events when they are on."""
        matched = self.match_prefix(block_hashes[:max_hits])
        stored: list[int] = []  # indexes of prompt blocks newly cached by this call
        block_ids: list[int] = []
        for block_hash in block_hashes[:matched]:
            block_id = self._by_hash[block_hash]
            self._evictable.pop(block_id, None)
            self._refcount[block_id] += 1
            block_ids.append(block_id)
        for index in range(matched, total_blocks):
            block_id = self._take_free_block()
            self._refcount[block_id] = 1
            if self.enable_prefix_caching and index < len(block_hashes):
                # The prompt block is computed by this step's prefill, so it is cacheable.
                self._block_hash[block_id] = block_hashes[index]
                if self._by_hash.setdefault(block_hashes[index], block_id) == block_id:
                    stored.append(index)
            block_ids.append(block_id)
        if self.publish_events and stored:
            self._stored_events(block_hashes, stored, token_ids)
        return Allocation(block_ids=block_ids, cached_blocks=matched)

    def grow(self, allocation: Allocation) -> bool:
        """One more block for a sequence's next tokens (uncached: it is not full yet);
        False when none is free or evictable."""
        if not (self._empty or self._evictable):
            return False
        block_id = self._take_free_block()
        self._refcount[block_id] = 1
        allocation.block_ids.append(block_id)
        return True

    def _stored_events(
        self, block_hashes: tuple[bytes, ...], stored: list[int], token_ids: tuple[int, ...]
    ) -> None:
        """One BlockStored per run of consecutive newly cached blocks (vLLM groups them)."""
        size = self.block_size
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hashes[i] for i in run],
                    "parent_block_hash": block_hashes[first - 1] if first else None,
                    "token_ids": list(token_ids[first * size : (last + 1) * size]),
                    "block_size": size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )

    def free(self, allocation: Allocation) -> None:
        """Release a sequence's blocks; hashed ones stay cached, most recent last."""
        # Reverse order so a prompt's tail is evicted before its head, as in vLLM.
        for block_id in reversed(allocation.block_ids):
            self._refcount[block_id] -= 1
            if self._refcount[block_id] > 0:
                continue
            block_hash = self._block_hash[block_id]
            if block_hash is not None and self._by_hash.get(block_hash) == block_id:
                self._evictable[block_id] = None
            else:
                self._forget(block_id)
                self._empty.append(block_id)
        allocation.block_ids = []

    def clear_cache(self) -> None:
        """Drop every cached block. Blocks in use lose their hashes too (freed, they are not
        cached): AllBlocksCleared says nothing hits afterwards, as after vLLM's reset."""
        publish, self.publish_events = self.publish_events, False  # one event says it all
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(block_id)
            self._empty.append(block_id)
        for block_id in list(self._by_hash.values()):
            self._forget(block_id)
        self.publish_events = publish
        if publish:
            self.events.append({"type": "AllBlocksCleared"})

    def drain_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def _take_free_block(self) -> int:
        if self._empty:
            return self._empty.pop()
        block_id, _ = self._evictable.popitem(last=False)
        self._forget(block_id)
        return block_id

    def _forget(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None and self._by_hash.get(block_hash) == block_id:
            del self._by_hash[block_hash]
            if self.publish_events:
                last = self.events[-1] if self.events else None
                if last is not None and last["type"] == "BlockRemoved":
                    last["block_hashes"].append(block_hash)  # evictions of one step: one event
                else:
                    self.events.append(
                        {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU"}
                    )
        self._block_hash[block_id] = None
