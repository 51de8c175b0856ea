"""The three plugin shapes: Filter drops endpoints, Scorer rates them in [0, 1], Picker orders."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from llmgw.errors import LlmgwError
from llmgw.hashring import HashRing
from llmgw.kvindex import ExactPrefixIndex
from llmgw.registry import EndpointState, fresh_metrics_of
from llmgw.types import EngineMetrics, RequestInfo


class SessionSettings(Protocol):
    @property
    def bounded_load(self) -> float | None: ...


class SaturationSettings(Protocol):
    @property
    def queue_ceiling(self) -> float: ...

    @property
    def kv_ceiling(self) -> float: ...


class ModelSettings(Protocol):
    """What a plugin may read of its model's config (a `llmgw.config.ModelSpec`): a protocol,
    so that plugins need not import the config, which checks its names against them."""

    @property
    def session(self) -> SessionSettings: ...

    @property
    def saturation(self) -> SaturationSettings: ...


class PickContext:
    """Everything a plugin may look at for one pick. Built once per request."""

    __slots__ = (
        "_fresh",
        "all_states",
        "kv",
        "now",
        "prediction",
        "request",
        "ring",
        "rng",
        "spec",
        "staleness",
    )

    def __init__(
        self,
        request: RequestInfo,
        spec: ModelSettings,
        now: float,
        staleness: float,
        ring: HashRing,
        all_states: list[EndpointState],
        rng: random.Random,
        fresh: dict[EndpointState, EngineMetrics | None] | None = None,
        kv: ExactPrefixIndex | None = None,
    ) -> None:
        self.request = request
        self.spec = spec
        self.now = now
        self.staleness = staleness
        self.ring = ring
        self.all_states = all_states
        self.rng = rng
        self._fresh = fresh or None
        self.kv = kv  # the engines' reported cache contents (KV events), if any are fed
        # (ready_at, predicted ttft, tokens to prefill) for the chosen endpoint, set by a
        # latency scorer.
        self.prediction: tuple[float, float, float] | None = None

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

    @property
    def when_empty(self) -> type[LlmgwError]:
        """The error a request gets when this filter drops every candidate."""
        ...

    @property
    def empty_message(self) -> str:
        """Its message; `{model}` is replaced by the model's name."""
        ...

    def filter(self, ctx: PickContext, candidates: list[EndpointState]) -> list[EndpointState]: ...

    # Optional: `retry_after(ctx, candidates) -> int`, the seconds until one of the
    # candidates it dropped may pass again; the error then carries `Retry-After`.


class Scorer(Protocol):
    name: str

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        """One score in [0, 1] per candidate, higher is better."""
        ...


@runtime_checkable
class NeedsPrompt(Protocol):
    """A plugin that reads the prompt: the edges must parse the body to route for it."""

    needs_prompt: bool


@runtime_checkable
class LearnsFromChoice(Protocol):
    """A scorer told which endpoint was chosen (e.g. to remember where a prefix went)."""

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None: ...


@runtime_checkable
class ForgetsEndpoints(Protocol):
    """A scorer holding per-endpoint memory that must drop an endpoint that left."""

    def forget(self, endpoint_id: str) -> None: ...


@runtime_checkable
class ExplainsScores(Protocol):
    """A scorer that can name the quantities behind its last scores (for the Decision)."""

    term_names: tuple[str, ...]

    def term_rows(self) -> Sequence[tuple[float, ...]]:
        """One row per candidate of the last `score` call, values in `term_names` order."""
        ...


class Picker(Protocol):
    name: str

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        """Indices into the candidates: the chosen one first, then fallbacks; at most `limit`."""
        ...
