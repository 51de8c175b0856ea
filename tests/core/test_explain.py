"""Scheduler.explain and llmgw.explain: the next pick, per-endpoint verdicts, no side effects."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.breaker import BreakerSettings
from llmgw.errors import BadRequest, ModelNotFound
from llmgw.explain import explain_request, explanation_dict, render_table
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.types import EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock, config, static_model

ADDRS = [f"10.0.0.{i + 1}:8000" for i in range(4)]
LONG = "You are a helpful assistant. " * 200  # ~1,400 tokens: several prefix blocks


def setup(strategy: Any = "latency", seed: int = 3) -> tuple[Scheduler, Registry, FakeClock]:
    cfg = config({"chat": static_model(4, strategy=strategy)}, admin={"explain": True})
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(failure_threshold=1), clock=clock)
    for i, address in enumerate(ADDRS):
        reg.record_scrape(
            "chat", address, EngineMetrics(waiting=float(i % 2), running=1.0, kv_usage=0.2)
        )
    return Scheduler(cfg, reg, seed=seed), reg, clock


def req(rid: str, session: str | None = None, prompt: str = LONG) -> RequestInfo:
    return RequestInfo(
        model="chat",
        request_id=rid,
        session_key=session,
        prompt=prompt,
        prompt_tokens=len(prompt) // 4,
    )


@pytest.mark.parametrize(
    "strategy",
    ["latency", "chat", "round-robin", "random", {"scorers": {"queue": 1}, "picker": "p2c"}],
)
def test_explained_pick_is_the_next_real_pick(strategy: Any) -> None:
    sched, _, clock = setup(strategy)
    for i in range(12):
        request = req(f"r{i}", session=f"s{i % 3}", prompt=LONG + f"turn {i}" * i)
        explanation = sched.explain(request)
        assert explanation.decision is not None
        decision = sched.pick(request)
        assert explanation.decision.destinations == decision.destinations
        assert explanation.decision.rationale.totals == decision.rationale.totals
        sched.acquire(decision).finish(Outcome.SUCCESS)
        clock.advance(0.05)


def test_explain_charges_nothing_and_learns_nothing() -> None:
    sched, reg, _ = setup("latency")
    scorer = next(s for s, _ in sched.routers["chat"].scorers if isinstance(s, LatencyScorer))
    request = req("r1", session="alice")
    before = [(s.inflight, s.busy_until, s.pending_prefill) for s in reg.states("chat")]
    for _ in range(3):
        assert sched.explain(request).decision is not None
    assert [(s.inflight, s.busy_until, s.pending_prefill) for s in reg.states("chat")] == before
    assert scorer.index.size() == 0  # a real pick would have indexed the prompt's blocks
    sched.pick(request)
    assert scorer.index.size() > 0


def test_explain_after_an_engine_restart_is_the_next_real_pick() -> None:
    """The explain shadow priced the prefix cache of an engine that had restarted (only the
    next real pick forgot it), so explain named another endpoint (found by a review helper)."""
    cfg = config({"chat": static_model(2)}, admin={"explain": True})
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(), clock=clock)
    sched = Scheduler(cfg, reg, seed=1)

    def scrape(address: str, finished: float, waiting: float = 0.0) -> None:
        metrics = EngineMetrics(waiting=waiting, running=1, kv_usage=0.1, finished_total=finished)
        reg.record_scrape("chat", address, metrics)

    for address in ADDRS[:2]:
        scrape(address, 100.0)
    home = sched.pick(req("r0", session="alice")).endpoint.id
    other = ADDRS[1] if home == ADDRS[0] else ADDRS[0]
    scrape(other, 101.0)  # the home is a little busier, still cheaper for its cache...
    clock.advance(0.5)
    scrape(home, 3.0, waiting=1.0)  # ...until its counter goes back: restarted, cache empty
    assert reg.restart_epoch == 1
    clock.advance(0.5)
    request = req("r1", session="alice", prompt=LONG + " and more")
    explained = sched.explain(request).decision
    real = sched.pick(request)
    assert explained is not None
    assert explained.rationale.totals == real.rationale.totals
    assert explained.destinations == real.destinations == (other, home)


def test_explain_shows_each_filters_verdict_per_endpoint() -> None:
    sched, reg, _ = setup("chat")  # filters: healthy, model-serves, not-saturated, ...
    reg.acquire("chat", ADDRS[1])
    reg.release("chat", ADDRS[1], Outcome.FAILURE)  # trips: failure_threshold 1
    data = explanation_dict(sched.explain(req("r1")))
    rows = {row["endpoint"]: row for row in data["endpoints"]}
    assert rows[ADDRS[1]]["filters"] == {"healthy": "drop"}  # later filters never saw it
    assert rows[ADDRS[1]]["role"] == "" and rows[ADDRS[1]]["total"] is None
    assert all(rows[a]["filters"]["healthy"] == "pass" for a in (ADDRS[0], ADDRS[2], ADDRS[3]))
    picked = rows[data["pick"]]
    assert picked["role"] == "pick"
    assert picked["total"] == pytest.approx(sum(s["weighted"] for s in picked["scores"].values()))
    assert [rows[f]["role"] for f in data["fallbacks"]] == ["fallback 1", "fallback 2"]


def test_explain_reports_a_refusal_instead_of_raising() -> None:
    sched, reg, _ = setup("chat")
    for address in ADDRS:
        reg.acquire("chat", address)
        reg.release("chat", address, Outcome.FAILURE)
    data = explanation_dict(sched.explain(req("r1")))
    assert data["pick"] is None
    assert data["error"]["status"] == 503 and data["error"]["code"] == "no_healthy_endpoint"
    assert all(row["filters"] == {"healthy": "drop"} for row in data["endpoints"])
    assert "refused: 503 no_healthy_endpoint" in render_table(data)


def test_explain_of_an_unknown_model_raises_404() -> None:
    sched, _, _ = setup()
    with pytest.raises(ModelNotFound):
        sched.explain(req("r1").__class__(model="nope", request_id="r1"))


def test_table_shows_weighted_scores_total_and_predicted_ttft() -> None:
    sched, _, _ = setup("latency")
    data = explanation_dict(sched.explain(req("r1", session="alice")))
    table = render_table(data)
    assert "latency x1" in table and "ttft ms" in table
    assert f"pick {data['pick']}" in table
    for row in data["endpoints"]:
        assert row["predicted_ttft_ms"] > 0
        assert row["endpoint"] in table


def test_explain_request_puts_the_session_in_the_models_session_header() -> None:
    cfg = config(
        {"chat": static_model(2, session={"headers": ["x-user", "x-session-id"]})},
        admin={"explain": True},
    )
    request = explain_request(cfg, {"model": "chat", "session": "u1", "prompt": "hello"})
    assert (request.session_key, request.model) == ("u1", "chat")
    assert request.prompt.endswith("hello")
    body = {"model": "other", "messages": [{"role": "user", "content": "x" * 400}]}
    request = explain_request(cfg, {"model": "chat", "body": body})
    assert request.model == "chat" and request.prompt_tokens >= 100


@pytest.mark.parametrize(
    ("query", "fix"),
    [
        ([], "JSON object"),
        ({"prompt": "hi"}, "give 'model'"),
        ({"model": "chat", "prompt": 3}, "'prompt' must be a string"),
        ({"model": "chat", "body": "x"}, "'body' must be a JSON object"),
        ({"model": "chat", "session": 5}, "'session' must be a string"),
        ({"model": "chat", "headers": {"a": 1}}, "'headers'"),
        ({"model": "chat", "path": "v1"}, "'path'"),
    ],
)
def test_bad_explain_queries_are_400_naming_the_field(query: Any, fix: str) -> None:
    cfg = config({"chat": static_model(2)})
    with pytest.raises(BadRequest, match=fix) as info:
        explain_request(cfg, query)
    assert info.value.status == 400
