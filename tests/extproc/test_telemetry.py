"""Telemetry: decision reasons, the registry-backed gauges, one registry per instance."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.registry import Registry
from llmgw.runtime.telemetry import Telemetry, decision_reason
from llmgw.types import Decision, Endpoint, Outcome, Rationale, ScorerColumn


def decision(columns: tuple[ScorerColumn, ...], chosen: str = "a") -> Decision:
    ids = ("a", "b", "c")
    totals = tuple(sum(c.raw[i] * c.weight for c in columns) for i in range(3))
    rationale = Rationale("chat", "max-score", ids, columns, totals, (), 3)
    return Decision("m1", Endpoint(chosen, "m1"), (), rationale)


def test_reason_is_the_scorer_that_gave_the_lead_not_the_largest_weight() -> None:
    columns = (
        ScorerColumn("queue", 2.0, (1.0, 1.0, 0.5)),  # large, but equal for a and b
        ScorerColumn("session", 1.0, (1.0, 0.66, 0.33)),  # what separates a from b
    )
    assert decision_reason(decision(columns)) == "session"


def test_reason_is_the_picker_on_a_tie_or_without_scorers() -> None:
    tie = (ScorerColumn("queue", 1.0, (1.0, 1.0, 1.0)),)
    assert decision_reason(decision(tie)) == "max-score"
    assert decision_reason(decision(())) == "max-score"


def test_a_sampling_pickers_choice_that_scored_worse_is_the_pickers() -> None:
    """A random or softmax pick below the best other total was credited to the scorer it
    led on ('kv' for a draw the scores argued against). Found by a review helper."""
    columns = (
        ScorerColumn("queue", 1.0, (0.2, 1.0, 0.5)),
        ScorerColumn("kv", 1.0, (0.9, 0.2, 0.5)),  # a leads on kv, b on the total
    )
    d = decision(columns)
    d = Decision(d.model, d.endpoint, (), dataclasses.replace(d.rationale, picker="random"))
    assert decision_reason(d) == "random"


def test_each_instance_has_its_own_registry() -> None:
    first, second = Telemetry(), Telemetry()
    first.decision(decision((ScorerColumn("queue", 1.0, (1.0, 0.5, 0.5)),)))
    assert b'reason="queue"' in first.render()[0]
    assert b"reason=" not in second.render()[0]
    assert first.render()[1].startswith("text/plain")


def test_ttft_buckets_are_vllms_to_the_last() -> None:
    """The comment said vLLM's buckets and they stopped at 80 s: slower first tokens (a
    cold engine, a queue) all fell in +Inf, unlike the engine's own histogram beside it."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "metrics-vllm-0.32.0-busy.txt"
    engine = re.findall(
        r'vllm:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"', fixture.read_text()
    )
    telemetry = Telemetry()
    telemetry.ttft("chat", 1.0, None)
    ours = re.findall(
        r'llmgw_ttft_observed_seconds_bucket\{le="([^"]+)"', telemetry.render()[0].decode()
    )
    assert ours == list(dict.fromkeys(engine))


def test_ttft_prediction_error_is_exported_per_model() -> None:
    telemetry = Telemetry()
    telemetry.ttft("chat", 0.30, 0.20)  # 100 ms later than predicted
    telemetry.ttft("chat", 0.05, None)  # a fallback answered: observed only
    text = telemetry.render()[0].decode()
    assert 'llmgw_ttft_observed_seconds_count{model="chat"} 2.0' in text
    assert 'llmgw_ttft_prediction_error_seconds_count{model="chat"} 1.0' in text
    assert 'llmgw_ttft_prediction_error_seconds_bucket{le="0.05",model="chat"} 0.0' in text
    assert 'llmgw_ttft_prediction_error_seconds_bucket{le="0.1",model="chat"} 1.0' in text


def test_an_endpoint_that_left_takes_its_counters_with_it() -> None:
    """Pods under new IPs each left their series behind: 600 outcome series after 300
    rollouts of two pods. They go once the endpoint has left and drained."""
    registry = Registry()
    registry.set_endpoints("m1", [Endpoint("a", "m1"), Endpoint("b", "m1")])
    telemetry = Telemetry()
    telemetry.bind(registry)
    telemetry.decision(decision((ScorerColumn("queue", 1.0, (1.0, 0.5, 0.5)),), chosen="a"))
    telemetry.outcome("m1", "a", Outcome.SUCCESS)
    telemetry.outcome("m1", "b", Outcome.SUCCESS)
    registry.acquire("m1", "a")  # a request still in flight there
    registry.set_endpoints("m1", [Endpoint("b", "m1")])
    assert 'endpoint="a"' in telemetry.render()[0].decode()  # draining: kept
    registry.release("m1", "a", Outcome.SUCCESS)
    text = telemetry.render()[0].decode()
    assert 'endpoint="a"' not in text and 'endpoint="b",model="m1",outcome="success"' in text


def test_model_state_lists_on_demand_models_only_not_discovered_ones() -> None:
    status: dict[str, dict[str, object]] = {
        "big": {"state": "ready", "starts": 2, "last_start_seconds": 41.5},
        # Router.models_status also lists discovered models: they have no on-demand state.
        "llama": {"discovery": {"source": "service llmgw/vllm", "endpoints": []}},
    }
    telemetry = Telemetry()
    telemetry.bind(Registry(), models=lambda: status)
    sample = telemetry.registry.get_sample_value
    assert sample("llmgw_model_state", {"model": "big", "state": "ready"}) == 1.0
    assert sample("llmgw_model_state", {"model": "big", "state": "off"}) == 0.0
    assert sample("llmgw_model_starts_total", {"model": "big"}) == 2.0
    assert sample("llmgw_model_last_start_seconds", {"model": "big"}) == 41.5
    for state in ("off", "starting", "ready", "idle", "failed"):
        assert sample("llmgw_model_state", {"model": "llama", "state": state}) is None


def test_kv_index_series_per_endpoint_only_when_events_are_fed() -> None:
    from llmgw.kvevents import BlockStored, EventBatch  # noqa: PLC0415
    from llmgw.registry import Registry  # noqa: PLC0415

    registry = Registry()
    telemetry = Telemetry()
    telemetry.bind(registry)
    assert b"kv_index_blocks" not in telemetry.render()[0]
    stored = BlockStored((1, 2), None, tuple(range(8)), 4)
    registry.kv_index.apply_batch("a:1", EventBatch(0, 0.0, (stored,)), 0.0)
    registry.kv_index.apply_batch("b:1", EventBatch(5, 0.0, ()), 0.0)  # joined late
    page = telemetry.render()[0].decode()
    assert 'llmgw_kv_index_blocks{endpoint="a:1"} 2.0' in page
    assert 'llmgw_kv_events_live{endpoint="a:1"} 1.0' in page
    assert 'llmgw_kv_events_live{endpoint="b:1"} 0.0' in page
    assert 'llmgw_kv_event_gaps_total{endpoint="a:1"} 0.0' in page
    assert 'llmgw_kv_event_lag_seconds{endpoint="a:1"}' in page


def two_endpoints() -> tuple[Registry, Callable[[str, dict[str, str]], float | None]]:
    """A registry of model m1 on a:1 and b:1, and a reader of the bound telemetry's samples."""
    registry = Registry()
    registry.set_endpoints("m1", [Endpoint("a:1", "m1"), Endpoint("b:1", "m1")])
    telemetry = Telemetry()
    telemetry.bind(registry)
    return registry, telemetry.registry.get_sample_value


def test_prefix_hits_confirmed_per_endpoint_once_the_engine_counted_hits() -> None:
    registry, sample = two_endpoints()
    assert sample("llmgw_prefix_hits_confirmed", {"model": "m1", "endpoint": "a:1"}) is None
    state = registry.get("m1", "a:1")
    assert state is not None
    state.calibration.hits.add(300.0, 1200.0)  # the engine found a quarter of the tokens
    state.calibration.predicted_hits.add(600.0, 1200.0)  # where the index predicted half
    assert sample("llmgw_prefix_hits_confirmed", {"model": "m1", "endpoint": "a:1"}) == 0.5
    assert sample("llmgw_prefix_hits_confirmed", {"model": "m1", "endpoint": "b:1"}) is None


def test_endpoint_slowdown_once_two_endpoints_show_their_speed() -> None:
    registry, sample = two_endpoints()
    a, b = registry.get("m1", "a:1"), registry.get("m1", "b:1")
    assert a is not None and b is not None
    a.calibration.floor, b.calibration.floor = 0.02, 0.05
    a.calibration.prefill_long.add(1.0, 10_000.0)
    assert sample("llmgw_endpoint_slowdown", {"model": "m1", "endpoint": "b:1"}) is None
    b.calibration.prefill_long.add(2.0, 10_000.0)  # 2x the prefill, 2.5x the step: 2x
    assert sample("llmgw_endpoint_slowdown", {"model": "m1", "endpoint": "b:1"}) == 2.0
    assert sample("llmgw_endpoint_slowdown", {"model": "m1", "endpoint": "a:1"}) == 1.0


def test_endpoint_slowdown_from_first_tokens_where_engines_publish_no_speed() -> None:
    registry, sample = two_endpoints()
    for eid, per_token in (("a:1", 20e-6), ("b:1", 50e-6)):
        for k in range(12):  # (tokens ahead, its own, seconds): a step + its own prefill
            tokens = 100.0 * (k + 1)
            registry.first_token(
                "m1", eid, 0.0, tokens, waited=(0.0, tokens, per_token * (250 + tokens))
            )
    assert sample("llmgw_endpoint_slowdown", {"model": "m1", "endpoint": "b:1"}) == (
        pytest.approx(2.5)
    )
    assert sample("llmgw_endpoint_slowdown", {"model": "m1", "endpoint": "a:1"}) == 1.0
