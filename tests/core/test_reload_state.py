"""What a config reload keeps: the prefix index when only the endpoint list changes, a
draining endpoint's count and settings, the proxy's pool limits (found by a review)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.breaker import BreakerSettings
from llmgw.config import load_dict
from llmgw.gateway import Gateway
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import ModelRouter, Scheduler
from llmgw.types import Endpoint, Outcome, RequestInfo

A, B, C, D = (f"127.0.0.1:{9300 + i}" for i in range(4))
PROMPT = "You are a careful assistant. " * 200  # many prefix blocks


def _held(router: ModelRouter, endpoint_id: str) -> int:
    sizes = [s.index.size(endpoint_id) for s, _ in router.scorers if hasattr(s, "index")]
    assert sizes, "the strategy has no prefix index"
    return sum(sizes)


@pytest.mark.parametrize("strategy", ["latency", "chat"])
def test_a_reload_that_only_adds_an_endpoint_keeps_the_prefix_index(strategy: str) -> None:
    """The model's router was rebuilt whenever its spec changed, endpoints included: the
    commonest reload (a replica added) sent every session home cold."""
    data: dict[str, Any] = {"models": {"m1": {"endpoints": [A, B, C], "strategy": strategy}}}
    gateway = Gateway(Scheduler(load_dict(data)))
    request = RequestInfo(model="m1", request_id="r", session_key="s1", prompt=PROMPT)
    decision = gateway.scheduler.pick(request)
    gateway.scheduler.acquire(decision).end(Outcome.SUCCESS)
    home = decision.endpoint.id
    data["models"]["m1"]["endpoints"] = [A, B, C, D]
    gateway.reload(load_dict(data))
    router = gateway.scheduler.routers["m1"]
    assert _held(router, home) > 0
    assert [s.id for s in gateway.scheduler.registry.states("m1")] == [A, B, C, D]
    data["models"]["m1"]["strategy"] = "ring"
    gateway.reload(load_dict(data))  # another strategy: new plugins
    assert gateway.scheduler.routers["m1"] is not router


def test_a_draining_endpoint_counts_a_retry_on_it_and_takes_new_breaker_settings() -> None:
    """Envoy may retry on a fallback listed before a reload removed it: that request was
    not counted there, and its release took the count of another still running. And one
    that came back kept the breaker settings of before."""
    registry = Registry()
    registry.set_endpoints("m1", [Endpoint(A, "m1"), Endpoint(B, "m1")])
    registry.acquire("m1", B)  # a request running on B
    registry.set_endpoints("m1", [Endpoint(A, "m1")])  # B removed: draining
    registry.acquire("m1", B)  # a retry on B, routed before the reload
    registry.release("m1", B, Outcome.SUCCESS)  # the retry ends
    assert [(s.id, s.inflight) for s in registry.draining("m1")] == [(B, 1)]
    registry.configure(breaker=BreakerSettings(failure_threshold=9), staleness=2)
    registry.set_endpoints("m1", [Endpoint(A, "m1"), Endpoint(B, "m1")])  # back
    state = registry.get("m1", B)
    assert state is not None and state.inflight == 1
    assert state.breaker.settings.failure_threshold == 9
