"""The warm-up cap does not refuse a request that only the warming replica can take."""

from __future__ import annotations

from llmgw.config import load_dict
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Endpoint, Outcome, RequestInfo

from .helpers import FakeClock

M = "m"
OLD, NEW = "10.0.0.1:8000", "10.0.0.2:8000"


def test_a_warming_replica_at_its_cap_takes_requests_when_every_other_breaker_is_open() -> None:
    """The only old replica is failing (breaker open, 60 s cooldown), so the operator adds a
    replacement. Until its first scrape it takes `warmup_inflight` requests at a time,
    'unless nothing else is left' (registry/picking). But the cap is applied before the
    healthy filter: the failing replica counts as 'something else', the healthy filter then
    drops it, and the request was refused 503 no_healthy_endpoint with Retry-After: 60
    although a healthy replica was right there (found by a review helper)."""
    clock = FakeClock()
    config = load_dict(
        {
            "models": {M: {"endpoints": [OLD]}},
            "breaker": {"failure_threshold": 1, "base_cooldown": 60, "max_cooldown": 60},
        }
    )
    sched = Scheduler(config, Registry(breaker=config.breaker.settings(), clock=clock), seed=1)
    reg = sched.registry
    reg.warmup_inflight = 2
    reg.acquire(M, OLD)
    reg.release(M, OLD, Outcome.FAILURE)  # OLD's breaker opens
    reg.set_endpoints(M, [Endpoint(OLD, M, pool=M), Endpoint(NEW, M, pool=M)])
    assert reg.warming(M) == 1
    for _ in range(2):  # NEW at its warm-up cap
        reg.acquire(M, NEW)
    decision = sched.pick(RequestInfo(model=M, request_id="r"))
    assert decision.endpoint.id == NEW
    explained = sched.explain(RequestInfo(model=M, request_id="r2"))
    assert explained.decision is not None and explained.decision.endpoint.id == NEW
    # The explanation reads as the pick went: no warm-up drop, only the failing one out.
    assert [ids for name, ids in explained.dropped if ids] == [(OLD,)]
    assert "warmup" not in [name for name, _ in explained.dropped]
