"""Edge cases of the pick and its accounting: a filtered ring replica hands its sessions on
clockwise, a subset hint narrows only the candidates, explain names every drop, an Envoy
retry to an unlisted host is charged there, and a configured batch factor calibrates."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.breaker import BreakerSettings
from llmgw.calibration import DecayedRatio
from llmgw.explain import explanation_dict
from llmgw.gateway import Gateway
from llmgw.hashring import HashRing
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock, config, static_model


def _scheduler(models: dict[str, Any], seed: int = 1) -> tuple[Scheduler, Registry, FakeClock]:
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(failure_threshold=1), clock=clock)
    return Scheduler(config(models), reg, seed=seed), reg, clock


def test_subset_hint_does_not_wipe_prefix_memory_of_other_endpoints() -> None:
    sched, reg, _ = _scheduler({"chat": static_model(4, strategy="chat")})
    prompt = "system prompt " * 200
    first = sched.pick(RequestInfo(model="chat", request_id="a", prompt=prompt))
    home = first.endpoint.id
    other = next(s.id for s in reg.states("chat") if s.id != home)
    # A request the gateway limits to one other endpoint (GIE subset hint).
    sched.pick(RequestInfo(model="chat", request_id="b", prompt="x", subset=frozenset({other})))
    again = sched.pick(RequestInfo(model="chat", request_id="c", prompt=prompt))
    prefix = {c.name: c for c in again.rationale.columns}["prefix"]
    i = again.rationale.endpoint_ids.index(home)
    assert prefix.raw[i] == 1.0  # still remembered as cached at its home


def test_envoy_retry_to_a_host_outside_the_fallbacks_is_charged_to_that_host() -> None:
    """override-host without `destination_fallbacks` (or strict affinity): Envoy's retry
    goes to its own pick among the model's endpoints; the served host must be charged and
    the primary's failed attempt recorded, as for a listed fallback."""
    sched, reg, _ = _scheduler(
        {"chat": static_model(4, strategy="ring", session={"num_fallback_replicas": 0})}
    )
    outcomes: list[tuple[str, Outcome]] = []
    lifecycle = Lifecycle(Gateway(sched), Hooks(outcome=lambda _m, e, o: outcomes.append((e, o))))
    decision = lifecycle.route(
        {"x-llmgw-model": "chat", "x-session-id": "s1"}, "/v1/chat/completions", None
    )
    assert isinstance(decision, Decision) and decision.fallbacks == ()
    served = next(s.id for s in reg.states("chat") if s.id != decision.endpoint.id)
    lifecycle.answered_by(served)
    lifecycle.response(200)
    lifecycle.finish()
    assert outcomes == [(decision.endpoint.id, Outcome.FAILURE), (served, Outcome.SUCCESS)]


def _trip(reg: Registry, model: str, address: str) -> None:
    reg.acquire(model, address)
    reg.release(model, address, Outcome.FAILURE)


def test_strict_ring_with_its_primary_open_sends_the_session_to_one_next_replica() -> None:
    """Ray Serve's ring: a replica out of the set hands its keys to the next one clockwise,
    so a session keeps one replica (and router replicas agree), never a random one per
    request."""
    sched, reg, _ = _scheduler(
        {"chat": static_model(5, strategy="ring", session={"num_fallback_replicas": 0})}
    )
    ids = [s.id for s in reg.states("chat")]
    primary = HashRing(ids, num_fallback_replicas=0).candidates("s1")[0]
    _trip(reg, "chat", primary)
    chosen = {
        sched.pick(RequestInfo(model="chat", request_id=f"r{i}", session_key="s1")).endpoint.id
        for i in range(20)
    }
    clockwise_next = HashRing(ids, num_fallback_replicas=4).candidates("s1")[1]
    assert chosen == {clockwise_next}


def test_ring_fallbacks_continue_clockwise_past_a_filtered_replica() -> None:
    sched, reg, _ = _scheduler({"chat": static_model(6, strategy="ring")})
    ids = [s.id for s in reg.states("chat")]
    walk = HashRing(ids, num_fallback_replicas=5).candidates("s1")
    _trip(reg, "chat", walk[0])
    for i in range(10):
        d = sched.pick(RequestInfo(model="chat", request_id=f"r{i}", session_key="s1"))
        assert [e.id for e in (d.endpoint, *d.fallbacks)] == walk[1:4]


def test_explain_names_the_warmup_cap_that_kept_an_endpoint_out_of_the_pick() -> None:
    """A warming endpoint at its in-flight cap is not scored: the explanation must not
    show it passing every filter."""
    sched, reg, _ = _scheduler({"chat": static_model(2, strategy="least-load")})
    reg.warmup_inflight = 2
    for s in reg.states("chat"):
        reg.record_scrape("chat", s.id, EngineMetrics(waiting=0, running=0, kv_usage=0.1))
    new = Endpoint("10.0.0.9:8000", "chat")
    reg.set_endpoints("chat", [*(s.endpoint for s in reg.states("chat")), new])
    reg.get("chat", new.id).inflight = 2  # type: ignore[union-attr]
    data = explanation_dict(sched.explain(RequestInfo(model="chat", request_id="r")))
    row = next(e for e in data["endpoints"] if e["endpoint"] == new.id)
    assert row["total"] is None  # not scored: it was kept out ...
    assert "drop" in row["filters"].values()  # ... and the explanation says by what


def test_explain_names_the_subset_hint_that_kept_endpoints_out_of_the_pick() -> None:
    sched, reg, _ = _scheduler({"chat": static_model(3, strategy="least-load")})
    allowed = reg.states("chat")[0].id
    request = RequestInfo(model="chat", request_id="r", subset=frozenset({allowed}))
    data = explanation_dict(sched.explain(request))
    assert data["pick"] == allowed
    for row in data["endpoints"]:
        if row["endpoint"] != allowed:
            assert row["total"] is None and "drop" in row["filters"].values()


def _slow_fleet() -> tuple[Scheduler, Registry, list[str]]:
    sched, reg, _ = _scheduler({"chat": static_model(2)})  # the default `latency` preset
    ids = [s.id for s in reg.states("chat")]
    for s, floor, per_token in zip(reg.states("chat"), (0.01, 0.03), (1e-4, 3e-4), strict=True):
        s.calibration.floor = floor  # the second engine runs 3x slower
        s.calibration.prefill_long = DecayedRatio()
        s.calibration.prefill_long.add(per_token * 1e5, 1e5)
    return sched, reg, ids


def test_a_subset_hinted_pick_does_not_reprice_the_next_picks_of_the_model() -> None:
    """The model's costs and slowdowns are its endpoints': a request the gateway limits to a
    few must not leave prices computed over those few for the picks after it."""

    def prefill_terms(sched: Scheduler) -> dict[str, float]:
        d = sched.pick(
            RequestInfo(model="chat", request_id="n", prompt="x" * 4000, prompt_tokens=1000)
        )
        column = next(c for c in d.rationale.columns if c.name == "latency")
        return {
            eid: column.terms_at(i)["prefill_s"] for i, eid in enumerate(d.rationale.endpoint_ids)
        }

    plain, _, ids = _slow_fleet()
    expected = prefill_terms(plain)
    assert expected[ids[1]] > 2 * expected[ids[0]]  # the slow engine is priced slower
    hinted, _, _ = _slow_fleet()
    hinted.pick(
        RequestInfo(
            model="chat",
            request_id="h",
            prompt="y" * 400,
            prompt_tokens=100,
            subset=frozenset({ids[1]}),
        )
    )
    assert prefill_terms(hinted) == expected


def test_a_configured_batch_factor_predicts_the_step_the_engine_published() -> None:
    """The calibration takes the engine's step to a batch of one and the scorer scales it
    back up by `batch_factor`: both must use the configured factor, or the predicted step
    at the very batch the engine was measured at is off."""
    latency = {"latency": {"weight": 1, "params": {"batch_factor": 0.1}}}
    sched, reg, clock = _scheduler(
        {"chat": static_model(1, strategy={"scorers": latency, "filters": ["healthy"]})}
    )
    eid = reg.states("chat")[0].id
    step_s, running = 0.03, 20.0
    sched.pick(RequestInfo(model="chat", request_id="first", prompt="x", prompt_tokens=1))
    for i in range(40):  # 10 steps a scrape, each 30 ms, at a batch of 20
        clock.advance(0.1)
        reg.record_scrape(
            "chat",
            eid,
            EngineMetrics(
                waiting=0,
                running=running,
                kv_usage=0.1,
                step_seconds_sum=i * 10 * step_s,
                step_count=i * 10.0,
            ),
        )
    d = sched.pick(RequestInfo(model="chat", request_id="r", prompt="x" * 40, prompt_tokens=10))
    column = next(c for c in d.rationale.columns if c.name == "latency")
    # This request joins the batch of 20: the step at 21, (1 + 0.1 x 20) / (1 + 0.1 x 19)
    # times the measured one (0.065 s before: the calibration took it to one at 0.02), plus
    # half a step at a batch of one in progress (no token seen: its phase is not known).
    at_load, in_progress = step_s * 3.0 / 2.9, step_s / 2.9 / 2
    assert column.terms_at(0)["step_s"] == pytest.approx(at_load + in_progress, rel=1e-3)
