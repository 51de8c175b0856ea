"""Scorers: each rates every candidate in [0, 1]; the strategy weighs and sums them."""

from __future__ import annotations

import math

from llmgw.registry import EndpointState
from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.types import RequestInfo


def relative(values: list[float], smoothing: float) -> list[float]:
    """1 for the least loaded candidate, (min + c) / (x + c) for the others.

    Relative rather than min-max: 3 vs 2 waiting is a small gap, 8 vs 0 a large one.
    """
    if not values:
        return []
    low = min(values) + smoothing
    return [low / (v + smoothing) for v in values]


def _smoothing(value: float) -> float:
    # 0 would divide 0 by 0 on idle endpoints; below 0 scores leave [0, 1].
    if not value > 0:
        raise ValueError(f"smoothing must be > 0, got {value!r}")
    return value


class NoObserve:
    """Base for scorers that do not learn from the final choice."""

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        return None


class QueueScorer(NoObserve):
    """Fewer waiting requests is better (engine metric; local inflight when stale)."""

    name = "queue"

    def __init__(self, smoothing: float = 1.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        queues: list[float] = []
        append = queues.append
        for s in candidates:
            m = fresh[s]
            if m is None:
                append(float(s.inflight))
                continue
            # Requests sent since the scrape are not in its queue yet: count the excess.
            excess = s.inflight - m.running
            append(m.waiting if m.waiting >= excess else excess)
        return relative(queues, self.smoothing)


class InflightScorer(NoObserve):
    """Fewer requests in flight from this router is better (exact, no scrape lag)."""

    name = "inflight"

    def __init__(self, smoothing: float = 1.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        return relative([float(s.inflight) for s in candidates], self.smoothing)


class LoadScorer(NoObserve):
    """Waiting + running from metrics (less what ended here since the scrape), or local
    inflight if larger: the engine's numbers include other routers' load."""

    name = "load"

    def __init__(self, smoothing: float = 2.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        loads: list[float] = []
        append = loads.append
        for s in candidates:
            m = fresh[s]
            inflight = s.inflight
            if m is None:
                append(inflight)
                continue
            # The scrape still counts requests that ended since: take those off.
            engine = m.waiting + m.running - s.released_since_scrape
            append(engine if engine > inflight else inflight)  # max() costs a call per endpoint
        return relative(loads, self.smoothing)


class KvScorer(NoObserve):
    """Free KV cache is better; at or above `ceiling` the score is 0 (hard penalty)."""

    name = "kv"

    def __init__(self, ceiling: float = 0.9) -> None:
        if not 0 < ceiling <= 1:
            raise ValueError(f"ceiling must be in (0, 1], got {ceiling}")
        self.ceiling = ceiling

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        ceiling = self.ceiling
        out: list[float] = []
        append = out.append
        for s in candidates:
            m = fresh[s]
            if m is None:
                append(0.5)  # unknown: neither reward nor punish
                continue
            usage = m.kv_usage
            append(0.0 if usage >= ceiling else 1.0 - usage)
        return out


class WeightScorer(NoObserve):
    """Configured endpoint weight, relative to the heaviest candidate."""

    name = "weight"

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        top = max((s.endpoint.weight for s in candidates), default=1.0)
        return [s.endpoint.weight / top for s in candidates]


class SessionScorer(NoObserve):
    """Ray Serve ring affinity: 1 for the primary, then 1 - i/(k+1) for fallback i.

    With `bounded_load` (from the model's session settings, or a param) the ring skips
    replicas holding more than ceil(c * mean) of the inflight requests.

    A request without a session is hashed by its request id (Ray Serve's uniform spread)
    unless `abstain_without_session`: then every candidate scores 0, so the other scorers
    decide alone instead of against a random preference.
    """

    name = "session"

    def __init__(self, bounded_load: float = 0.0, abstain_without_session: bool = False) -> None:
        if bounded_load != 0 and not bounded_load >= 1.0:
            raise ValueError(f"bounded_load must be 0 (off) or >= 1.0, got {bounded_load!r}")
        self.bounded_load = bounded_load
        self.abstain_without_session = abstain_without_session

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        if self.abstain_without_session and ctx.request.session_key is None:
            return [0.0] * len(candidates)
        key = ctx.request.routing_key
        c = self.bounded_load or ctx.spec.session.bounded_load or 0.0
        if c >= 1.0:
            loads = {s.id: s.inflight for s in ctx.all_states}
            ring_order = ctx.ring.bounded_candidates(key, loads, c)
        else:
            ring_order = ctx.ring.candidates(key)
        step = 1.0 / (len(ring_order) + 1) if ring_order else 0.0
        rank = {rid: 1.0 - i * step for i, rid in enumerate(ring_order)}
        return [rank.get(s.id, 0.0) for s in candidates]


class PrefixScorer:
    """Share of the prompt's leading blocks that the endpoint probably has cached."""

    name = "prefix"

    def __init__(
        self, block_chars: int = 256, max_blocks: int = 128, capacity: int = 16384
    ) -> None:
        self.index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks, capacity=capacity)
        self._last: tuple[RequestInfo | None, list[int]] = (None, [])

    def _hashes(self, ctx: PickContext) -> list[int]:
        # Keyed by the request object: request ids may come from clients and repeat.
        request = ctx.request
        if self._last[0] is not request:
            self._last = (request, self.index.hashes(request.prompt))
        return self._last[1]

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        hashes = self._hashes(ctx)
        if not hashes:
            return [0.0] * len(candidates)
        matched = self.index.match(hashes)
        total = len(hashes)
        return [matched.get(s.id, 0) / total for s in candidates]

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        hashes = self._hashes(ctx)
        if hashes:
            self.index.insert(chosen.id, hashes)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left the pool: drop what the index remembers about it."""
        self.index.forget(endpoint_id)


def softmax_weights(scores: list[float], temperature: float) -> list[float]:
    top = max(scores)
    return [math.exp((s - top) / temperature) for s in scores]
