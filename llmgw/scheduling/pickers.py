"""Pickers: turn weighted totals into an order (chosen first, then fallbacks)."""

from __future__ import annotations

from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.scorers import softmax_weights

_EPS = 1e-9


def _best_first(ctx: PickContext, totals: list[float], limit: int, exclude: int = -1) -> list[int]:
    """Highest totals first; ties broken at random so equal endpoints share the load."""
    # A C-level stable sort, then random draws only for runs of equal totals that reach the
    # first `limit` places (a uniform ordered sample of the run), not one per endpoint.
    order = sorted(range(len(totals)), key=totals.__getitem__, reverse=True)
    if exclude >= 0:
        order.remove(exclude)
    n = len(order)
    i = 0
    while i < limit and i < n:
        top = totals[order[i]]
        j = i + 1
        while j < n and totals[order[j]] == top:
            j += 1
        if j - i > 1:
            k = min(j - i, limit - i)  # k < j - i only when i + k == limit: the rest is cut
            order[i : i + k] = ctx.rng.sample(order[i:j], k)
        i = j
    return order[:limit]


class MaxScorePicker:
    name = "max-score"

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        return _best_first(ctx, totals, limit)


class PowerOfTwoPicker:
    """Two candidates at random, the better one wins (less herding than max-score)."""

    name = "p2c"

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        n = len(totals)
        if n == 1:
            return [0]
        a, b = ctx.rng.sample(range(n), 2)
        chosen = a if totals[a] >= totals[b] else b
        return [chosen, *_best_first(ctx, totals, limit - 1, exclude=chosen)]


class SoftmaxPicker:
    """Samples with p ~ exp(score / temperature); temperature 0 is argmax."""

    name = "softmax"

    def __init__(self, temperature: float = 0.0) -> None:
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        self.temperature = temperature

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        if self.temperature <= _EPS or len(totals) == 1:
            return _best_first(ctx, totals, limit)
        weights = softmax_weights(totals, self.temperature)
        chosen = ctx.rng.choices(range(len(totals)), weights=weights)[0]
        return [chosen, *_best_first(ctx, totals, limit - 1, exclude=chosen)]


class RoundRobinPicker:
    """Cycles through the candidates in config order, ignoring scores."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0  # an int, not itertools.count: a copy (explain) must not share it

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        n = len(totals)
        start = self._next % n
        self._next += 1
        return [(start + k) % n for k in range(min(limit, n))]


class RandomPicker:
    name = "random"

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        return ctx.rng.sample(range(len(totals)), min(limit, len(totals)))
