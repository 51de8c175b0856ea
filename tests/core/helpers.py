"""Small builders shared by the core tests: an injected clock, configs, endpoint states."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from llmgw.breaker import BreakerSettings
from llmgw.config import Config, ModelSpec, load_dict
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState
from llmgw.scheduling.interfaces import PickContext
from llmgw.types import Endpoint, EngineMetrics, RequestInfo


class FakeClock:
    """A clock the test moves by hand: no sleeps anywhere."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def config(models: Mapping[str, Any], **top: Any) -> Config:
    return load_dict({"models": dict(models), **top})


def static_model(n: int, **fields: Any) -> dict[str, Any]:
    return {"endpoints": [f"10.0.0.{i + 1}:8000" for i in range(n)], **fields}


def model_spec(**fields: Any) -> ModelSpec:
    fields.setdefault("endpoints", ["10.0.0.1:8000"])
    return config({"m": fields}).models["m"]


def state(
    address: str,
    *,
    waiting: float | None = None,
    running: float = 0.0,
    kv: float = 0.0,
    inflight: int = 0,
    scraped_at: float = 0.0,
    weight: float = 1.0,
    serves: bool | None = None,
    breaker: BreakerSettings | None = None,
) -> EndpointState:
    """An endpoint state; `waiting=None` means never scraped (no metrics)."""
    s = EndpointState(Endpoint(address, "m", weight=weight), breaker or BreakerSettings())
    s.inflight = inflight
    s.serves_model = serves
    if waiting is not None:
        s.metrics = EngineMetrics(waiting=waiting, running=running, kv_usage=kv)
        s.scraped_at = scraped_at
    return s


def context(
    states: list[EndpointState],
    *,
    request: RequestInfo | None = None,
    spec: ModelSpec | None = None,
    now: float = 0.0,
    staleness: float = 2.0,
    seed: int = 0,
) -> PickContext:
    spec = spec or model_spec()
    return PickContext(
        request=request or RequestInfo(model="m", request_id="r-1"),
        spec=spec,
        now=now,
        staleness=staleness,
        ring=HashRing(
            sorted(s.id for s in states),
            num_virtual_nodes=spec.session.num_virtual_nodes,
            num_fallback_replicas=spec.session.num_fallback_replicas,
        ),
        all_states=states,
        rng=random.Random(seed),
    )
