"""Fixes for cases found in review: infinite metric values, endpoints leaving the pool."""

from __future__ import annotations

import pytest

from llmgw.config import load_dict
from llmgw.errors import MetricsError
from llmgw.promtext import CONTRACTS, extract
from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer, LoadScorer
from llmgw.types import (
    Endpoint,
    Engine,
    EngineMetrics,
    Outcome,
    RequestInfo,
    outcome_for_status,
)


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN"])
def test_non_finite_queue_reading_is_missing_not_a_number(value: str) -> None:
    page = (
        f'vllm:num_requests_waiting{{model_name="m"}} {value}\n'
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    with pytest.raises(MetricsError, match="vllm:num_requests_waiting"):
        extract(page, CONTRACTS[Engine.VLLM], model="m")


def test_prefix_index_forgets_an_endpoint_that_leaves_the_pool() -> None:
    config = load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}}})
    scheduler = Scheduler(config, seed=1)
    prompt = "system prompt " * 200
    chosen = scheduler.pick(RequestInfo(model="m", request_id="a", prompt=prompt)).endpoint
    prefix = next(s for s, _ in scheduler.routers["m"].scorers if isinstance(s, LatencyScorer))
    assert prefix.index.size(chosen.id) > 0
    keep = "127.0.0.1:2" if chosen.id == "127.0.0.1:1" else "127.0.0.1:1"
    scheduler.registry.set_endpoints("m", [Endpoint(address=keep, model="m", pool="m")])
    assert scheduler.pick(RequestInfo(model="m", request_id="b", prompt=prompt)).endpoint.id == keep
    assert prefix.index.size(chosen.id) == 0


def test_session_scorer_can_abstain_for_requests_without_a_session() -> None:
    config = load_dict(
        {
            "models": {
                "m": {
                    "endpoints": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
                    "strategy": {
                        "scorers": {
                            "session": {"weight": 1, "params": {"abstain_without_session": True}}
                        }
                    },
                }
            }
        }
    )
    scheduler = Scheduler(config, seed=1)
    anonymous = scheduler.pick(RequestInfo(model="m", request_id="r1")).rationale
    assert anonymous.columns[0].raw == (0.0, 0.0, 0.0)
    keyed = scheduler.pick(RequestInfo(model="m", request_id="r2", session_key="s")).rationale
    assert sorted(keyed.columns[0].raw, reverse=True)[0] == 1.0


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.SUCCESS),
        (404, Outcome.SUCCESS),
        (429, Outcome.BACKPRESSURE),
        (503, Outcome.BACKPRESSURE),
        (500, Outcome.FAILURE),
        (502, Outcome.FAILURE),
    ],
)
def test_both_edges_read_a_status_the_same_way(status: int, outcome: Outcome) -> None:
    assert outcome_for_status(status) is outcome


def test_a_replica_that_just_answered_does_not_look_busy_until_the_next_scrape() -> None:
    config = load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}}})
    scheduler = Scheduler(config, seed=1)
    registry = scheduler.registry
    for address, running in (("127.0.0.1:1", 1.0), ("127.0.0.1:2", 0.0)):
        registry.record_scrape("m", address, EngineMetrics(waiting=0, running=running, kv_usage=0))
    states = registry.states("m")
    ctx = PickContext(
        RequestInfo(model="m", request_id="r"),
        config.models["m"],
        registry.clock(),
        registry.staleness,
        scheduler.routers["m"].ring_for(states),
        states,
        scheduler.rng,
    )
    assert LoadScorer(smoothing=4).score(ctx, states) == [0.8, 1.0]  # scrape: 1 running
    registry.acquire("m", "127.0.0.1:1")
    registry.release("m", "127.0.0.1:1", Outcome.SUCCESS)  # ... which has just ended here
    ctx = PickContext(ctx.request, ctx.spec, ctx.now, ctx.staleness, ctx.ring, states, ctx.rng)
    assert LoadScorer(smoothing=4).score(ctx, states) == [1.0, 1.0]
