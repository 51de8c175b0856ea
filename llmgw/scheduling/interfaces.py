"""The three plugin shapes: Filter drops endpoints, Scorer rates them in [0, 1], Picker orders."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from llmgw.config import ModelSpec
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState, fresh_metrics_of
from llmgw.types import EngineMetrics, RequestInfo


@dataclass(slots=True)
class PickContext:
    """Everything a plugin may look at for one pick. Built once per request."""

    request: RequestInfo
    spec: ModelSpec
    now: float
    staleness: float
    ring: HashRing
    all_states: list[EndpointState]
    rng: random.Random
    # Each endpoint's fresh metrics (None: stale or never scraped), computed once per pick.
    fresh: dict[EndpointState, EngineMetrics | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.fresh:
            self.fresh = fresh_metrics_of(self.all_states, self.now, self.staleness)


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
