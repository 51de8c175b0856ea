"""Plain value types shared by the core and the edges (no I/O, no framework types)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Engine(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server replica as configured: `address` is `host:port` and is also its id."""

    address: str
    model: str
    pool: str = "default"
    engine: Engine = Engine.VLLM
    weight: float = 1.0

    @property
    def id(self) -> str:
        return self.address


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The three numbers routing needs from an engine's /metrics, plus a finished counter."""

    waiting: float
    running: float
    kv_usage: float  # 0..1
    finished_total: float | None = None


class Outcome(enum.StrEnum):
    """How a dispatched request ended, as seen by the edge."""

    SUCCESS = "success"
    FAILURE = "failure"  # 5xx, connection reset, upstream timeout
    BACKPRESSURE = "backpressure"  # 429 / 503 from the engine
    CANCELLED = "cancelled"  # the client went away: says nothing about the replica


def outcome_for_status(status: int) -> Outcome:
    """What a response status says about the replica that produced it (both edges)."""
    if status in (429, 503):
        return Outcome.BACKPRESSURE
    if status >= 500:
        return Outcome.FAILURE
    return Outcome.SUCCESS


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What an edge learned about one request; the only input of `Scheduler.pick`."""

    model: str
    request_id: str
    session_key: str | None = None
    path: str = "/v1/chat/completions"
    prompt: str = ""
    stream: bool = False
    body_size: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def routing_key(self) -> str:
        # No session: a per-request key spreads uniformly through the same ring code path.
        return self.session_key if self.session_key is not None else self.request_id


@dataclass(frozen=True, slots=True)
class ScorerColumn:
    """One scorer's raw scores, aligned with `Rationale.endpoint_ids`."""

    name: str
    weight: float
    raw: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Rationale:
    """Why a Decision was made: per-scorer values per endpoint and per-filter drop counts."""

    strategy: str
    picker: str
    endpoint_ids: tuple[str, ...]
    columns: tuple[ScorerColumn, ...]
    totals: tuple[float, ...]
    filter_drops: tuple[tuple[str, int], ...]
    considered: int

    def scores_for(self, endpoint_id: str) -> dict[str, tuple[float, float]]:
        """{scorer: (raw, weighted)} for one endpoint."""
        i = self.endpoint_ids.index(endpoint_id)
        return {c.name: (c.raw[i], c.raw[i] * c.weight) for c in self.columns}

    def total_for(self, endpoint_id: str) -> float:
        return self.totals[self.endpoint_ids.index(endpoint_id)]

    def summary(self, endpoint_id: str) -> str:
        """One short line, fit for a response header or a log field."""
        parts = [f"strategy={self.strategy}", f"picker={self.picker}"]
        if self.columns:  # (one index lookup; a name given twice shows its last value)
            i = self.endpoint_ids.index(endpoint_id)
            parts.append(f"total={self.totals[i]:.3f}")
            scores = {c.name: c.raw[i] for c in self.columns}
            parts.extend([f"{n}={raw:.3f}" for n, raw in scores.items()])
        dropped = [f"{name}:{n}" for name, n in self.filter_drops if n]
        if dropped:
            parts.append("dropped=" + ",".join(dropped))
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "picker": self.picker,
            "considered": self.considered,
            "filter_drops": dict(self.filter_drops),
            "scores": {
                eid: {
                    "total": self.totals[i],
                    **{
                        c.name: {"raw": c.raw[i], "weighted": c.raw[i] * c.weight}
                        for c in self.columns
                    },
                }
                for i, eid in enumerate(self.endpoint_ids)
            },
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """The scheduler's answer: where to send a request, where to go next, and why."""

    model: str
    endpoint: Endpoint
    fallbacks: tuple[Endpoint, ...]
    rationale: Rationale

    @property
    def destinations(self) -> tuple[str, ...]:
        """Primary then fallbacks, as `host:port` (the GIE destination-endpoint list order)."""
        return (self.endpoint.address, *(e.address for e in self.fallbacks))

    def describe(self) -> str:
        return self.rationale.summary(self.endpoint.id)
