"""Consistent-hash ring with exactly Ray Serve's ConsistentHashRouter semantics.

Position of a key = low 64 bits of MurmurHash3 x64 (seed 0xF9B4CA77) as unsigned;
each replica owns `num_virtual_nodes` points keyed `f"{replica_id}:{i}"`; a lookup takes
the first point strictly clockwise of the key (`bisect_right`, wrapping to 0), then walks
on to collect up to `num_fallback_replicas` more distinct replicas. Pure and
deterministic, so router replicas agree without talking.

`bounded_candidates` adds consistent hashing with bounded loads (Mirrokni, Thorup,
Zadimoghaddam 2018): a replica whose load would exceed ceil(c * mean) is skipped.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Container, Iterable, Iterator, Mapping
from fractions import Fraction

import mmh3

RING_SEED = 0xF9B4CA77
# Keys up to this many characters have their walks cached (a session id, a request id); a
# longer one (a client's, up to the 60 KB head limit) is placed each time: cached whole,
# 4,096 of them held ~245 MB per ring.
CACHED_KEY_CHARS = 256


def ring_position(key: str) -> int:
    return int(mmh3.hash64(key.encode(), seed=RING_SEED, signed=False)[0])


class HashRing:
    # Where a key sits on the ring; a subclass may place keys otherwise (`llmgw replay`
    # places a traced session by its recorded position, the trace never holds the key).
    position = staticmethod(ring_position)

    def __init__(
        self,
        replica_ids: Iterable[str],
        *,
        num_virtual_nodes: int = 100,
        num_fallback_replicas: int = 2,
    ) -> None:
        if (
            isinstance(num_virtual_nodes, bool)
            or not isinstance(num_virtual_nodes, int)
            or num_virtual_nodes < 1
        ):
            raise ValueError(f"num_virtual_nodes must be a positive int, got {num_virtual_nodes!r}")
        if (
            isinstance(num_fallback_replicas, bool)
            or not isinstance(num_fallback_replicas, int)
            or num_fallback_replicas < 0
        ):
            raise ValueError(
                f"num_fallback_replicas must be a non-negative int, got {num_fallback_replicas!r}"
            )
        ids = list(replica_ids)
        if len(set(ids)) != len(ids):
            dupes = sorted({r for r in ids if ids.count(r) > 1})
            raise ValueError(f"duplicate replica id(s): {', '.join(dupes)}")
        self.replica_ids: frozenset[str] = frozenset(ids)
        self.num_virtual_nodes = num_virtual_nodes
        self.num_fallback_replicas = num_fallback_replicas
        points = sorted(
            (ring_position(f"{rid}:{i}"), rid) for rid in ids for i in range(num_virtual_nodes)
        )
        self._positions = [p for p, _ in points]
        self._owners = [r for _, r in points]
        # Sessions come back: a C-level LRU of their walks skips the hash and the bisect
        # (scattered reads of the 100-per-replica point list) on every pick. Per ring, so
        # it dies with the replica set it was computed for.
        self._walks = functools.lru_cache(maxsize=4096)(self._candidates)

    def __len__(self) -> int:
        return len(self.replica_ids)

    def _walk(self, key: str) -> Iterator[str]:
        """Distinct replicas clockwise from the key's position, primary first."""
        n = len(self._positions)
        if n == 0:
            return
        start = bisect_right(self._positions, self.position(key))
        seen: set[str] = set()
        total = len(self.replica_ids)
        owners = self._owners
        for step in range(n):
            rid = owners[(start + step) % n]
            if rid not in seen:
                seen.add(rid)
                yield rid
                if len(seen) == total:
                    return

    def candidates(self, key: str) -> list[str]:
        """Primary first, then up to `num_fallback_replicas` distinct replicas clockwise."""
        return list(self.candidate_tuple(key))  # a new list: the cached tuple stays as is

    def candidate_tuple(self, key: str) -> tuple[str, ...]:
        """`candidates` as the cached tuple itself, without a copy (the session scorer's)."""
        if len(key) > CACHED_KEY_CHARS:
            return self._candidates(key)
        return self._walks(key)

    def _candidates(self, key: str) -> tuple[str, ...]:
        # The same walk as `_walk`, without a generator.
        positions, owners = self._positions, self._owners
        n = len(positions)
        limit = min(1 + self.num_fallback_replicas, len(self.replica_ids))
        i = bisect_right(positions, self.position(key))
        out: list[str] = []
        while len(out) < limit:
            if i == n:
                i = 0
            rid = owners[i]
            if rid not in out:
                out.append(rid)
            i += 1
        return tuple(out)

    def _first(
        self,
        key: str,
        among: Container[str] | None,
        load: Mapping[str, int] | None = None,
        capacity: int = 0,
    ) -> list[str]:
        """The first 1 + num_fallback_replicas replicas clockwise from `key` that are in
        `among` (None: any) and, with `load`, below `capacity` (checks inline: no call per
        replica on the bounded-load pick's path)."""
        limit = 1 + self.num_fallback_replicas
        out: list[str] = []
        for rid in self._walk(key):
            if (among is None or rid in among) and (load is None or load.get(rid, 0) < capacity):
                out.append(rid)
                if len(out) == limit:
                    break
        return out

    def candidates_among(self, key: str, among: Container[str]) -> list[str]:
        """`candidates` as a ring of the replicas in `among` alone would answer (Ray Serve's
        ring rebuilt without the others): one out of the set hands its keys on clockwise."""
        return self._first(key, among)

    def bounded_candidates(
        self,
        key: str,
        load: Mapping[str, int],
        c: float,
        among: Container[str] | None = None,
    ) -> list[str]:
        """Like `candidates`, but replicas at capacity ceil(c * (total + 1) / n) are passed over.

        The first replica clockwise with spare capacity becomes the primary; the fallbacks are
        the next distinct replicas with spare capacity, then, if fewer have room than there
        are slots, the others in plain ring order (every router names the same ones). If
        every replica is at capacity the plain ring order is returned (the bound can't be
        met, affinity still can). `among`: only those replicas are eligible
        (`candidates_among`), and the bound is over them alone: a replica that takes
        nothing (its breaker open) is no bin to spread over.
        """
        if c < 1.0:
            raise ValueError(f"bounded-load factor must be >= 1.0, got {c!r}")
        if not self.replica_ids:
            return []
        bins = self.replica_ids if among is None else [r for r in self.replica_ids if r in among]
        if not bins:
            return []
        total = sum(load.get(r, 0) for r in bins)
        capacity = bounded_capacity(c, total, len(bins))
        out = self._first(key, among, load, capacity)
        missing = min(1 + self.num_fallback_replicas, len(bins)) - len(out)
        if missing > 0:  # the first eligible ones in ring order hold enough not yet in `out`
            out += [rid for rid in self._first(key, among) if rid not in out][:missing]
        return out


@functools.lru_cache(maxsize=64)
def _decimal(c: float) -> Fraction:
    return Fraction(repr(c))


def bounded_capacity(c: float, total: int, n: int) -> int:
    """ceil(c x (total + 1) / n), with `c` read as the decimal it was written as: in floats,
    c = 1.1 with 49 in flight over 5 gave 11.000000000000002, a capacity of 12, and one
    request past the bound."""
    share = _decimal(c) * (total + 1)
    return -(-share.numerator // (share.denominator * n))
