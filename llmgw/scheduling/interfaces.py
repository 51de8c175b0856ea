"""The three plugin shapes: Filter drops endpoints, Scorer rates them in [0, 1], Picker orders."""

from __future__ import annotations

import random
from typing import Protocol

from llmgw.config import ModelSpec
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState, fresh_metrics_of
from llmgw.types import EngineMetrics, RequestInfo


class PickContext:
    """Everything a plugin may look at for one pick. Built once per request."""

    __slots__ = ("_fresh", "all_states", "now", "request", "ring", "rng", "spec", "staleness")

    def __init__(
        self,
        request: RequestInfo,
        spec: ModelSpec,
        now: float,
        staleness: float,
        ring: HashRing,
        all_states: list[EndpointState],
        rng: random.Random,
        fresh: dict[EndpointState, EngineMetrics | None] | None = None,
    ) -> None:
        self.request = request
        self.spec = spec
        self.now = now
        self.staleness = staleness
        self.ring = ring
        self.all_states = all_states
        self.rng = rng
        self._fresh = fresh or None

    @property
    def fresh(self) -> dict[EndpointState, EngineMetrics | None]:
        """Each endpoint's fresh metrics (None: stale or never scraped), computed once per
        pick and only if a plugin asks (session-only strategies never do)."""
        fresh = self._fresh
        if fresh is None:
            fresh = self._fresh = fresh_metrics_of(self.all_states, self.now, self.staleness)
        return fresh


class Filter(Protocol):
    name: str

    def filter(self, ctx: PickContext, candidates: list[EndpointState]) -> list[EndpointState]: ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        """One score in [0, 1] per candidate, higher is better."""
        ...

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        """Learn from the final choice (e.g. the prefix index); most scorers do nothing."""
        ...


class Picker(Protocol):
    name: str

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        """Indices into the candidates: the chosen one first, then fallbacks; at most `limit`."""
        ...
