"""Small builders shared by the core tests: an injected clock, configs, endpoint states."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable, Mapping
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


def bytes_kept(run: Callable[[int], object], times: int = 300) -> float:
    """Bytes still allocated after `run(i)` for each i in range(times), per call (traced
    after one warm-up call, so lazy structures count once, not per call)."""
    run(-1)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(times):
            run(i)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - base) / times
    finally:
        tracemalloc.stop()


def long_session_key(i: int) -> str:
    """A distinct client-chosen session id of 40 KB (under the 60 KB head limit)."""
    return f"{i:08d}" + "k" * 40_000


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
