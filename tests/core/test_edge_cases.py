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


def test_a_restarted_engine_is_forgotten_by_the_prefix_index_and_relearns_its_batch() -> None:
    """A new engine process at the same address (crash, OOM kill, container restart) has
    an empty cache: once a scrape shows its counters back below the last one's, the next
    pick no longer predicts the prompts sent there before as cached, and its batch size is
    learnt again. Counters that grow, or that the engine does not publish, restart nothing."""
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    scheduler = Scheduler(load_dict({"models": {"m": {"endpoints": [a, b]}}}), seed=1)
    registry = scheduler.registry
    latency = next(s for s, _ in scheduler.routers["m"].scorers if isinstance(s, LatencyScorer))
    prompt = "system prompt " * 200

    def cached_at(endpoint: str, request_id: str) -> float:
        text = prompt + request_id
        request = RequestInfo(model="m", request_id=request_id, prompt=text, prompt_tokens=710)
        scheduler.pick(request)
        ids = [s.id for s in registry.states("m")]
        return latency.terms()["cached_tokens"][ids.index(endpoint)]

    def scrape(endpoint: str, finished: float | None, running: float = 4) -> None:
        registry.record_scrape(
            "m",
            endpoint,
            EngineMetrics(waiting=2, running=running, kv_usage=0.1, finished_total=finished),
        )

    chosen = scheduler.pick(RequestInfo(model="m", request_id="r0", prompt=prompt)).endpoint.id
    state = registry.get("m", chosen)
    assert state is not None
    for finished in (None, None, 10, 20, 30):
        scrape(chosen, finished)
    assert state.peak_is_batch and state.restarts == 0
    assert cached_at(chosen, "r1") > 0
    other = b if chosen == a else a
    for i in range(20):  # until the other endpoint holds something too
        if latency.index.size(other):
            break
        doc = f"another document {i} " * 120
        scheduler.pick(RequestInfo(model="m", request_id=f"d{i}", prompt=doc, prompt_tokens=600))
    held_elsewhere = latency.index.size(other)
    assert held_elsewhere > 0
    scrape(chosen, 2, running=1)  # counting from 0 again
    assert state.restarts == 1 and registry.restart_epoch == 1
    assert state.peak_running == 1 and not state.peak_is_batch  # the new process's, anew
    assert cached_at(chosen, "r2") == 0
    assert latency.index.size(other) >= held_elsewhere  # the other endpoint: untouched
    scrape(chosen, 5)
    assert state.restarts == 1
    # An engine that creates its counters at its first request (SGLang, TRT-LLM) shows
    # none just after a restart: the next page's low count is still a restart.
    scrape(chosen, 40)
    scrape(chosen, None)
    scrape(chosen, 1)
    assert state.restarts == 2
    scrape(chosen, None)
    scrape(chosen, 3)  # counting on: no restart
    assert state.restarts == 2


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
