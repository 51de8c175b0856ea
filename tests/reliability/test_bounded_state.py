"""Per-session state stays bounded however many sessions pass (what the soak measures as
RSS, checked here by size): the prefix index per endpoint, telemetry label sets (no
per-session label), the cached route answers of the ext_proc edge."""

from __future__ import annotations

from llmgw.config import load_dict
from llmgw.extproc import translate
from llmgw.runtime.telemetry import Telemetry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import PrefixScorer
from llmgw.types import Outcome, RequestInfo

SESSIONS = 5_000  # x 8 prompt blocks each: far past the caps below
CAPACITY = 512


def test_state_is_bounded_across_many_distinct_sessions() -> None:
    prefix_spec = {"weight": 1, "params": {"capacity": CAPACITY}}
    config = load_dict(
        {
            "models": {
                "m1": {
                    "endpoints": [f"127.0.0.1:{9100 + i}" for i in range(4)],
                    "strategy": {"scorers": {"session": 2, "prefix": prefix_spec}},
                }
            }
        }
    )
    scheduler = Scheduler(config, seed=1)
    telemetry = Telemetry()
    telemetry.bind(scheduler.registry)
    prefix = next(
        s for s, _ in scheduler.routers["m1"].scorers if isinstance(s, PrefixScorer)
    ).index
    for i in range(SESSIONS):
        session = f"sess-{i}"
        request = RequestInfo(
            model="m1", request_id=f"r{i}", session_key=session, prompt=f"{session} " * 200
        )
        decision = scheduler.pick(request)
        telemetry.decision(decision)
        translate.route_response(decision, after_body=True)
        lease = scheduler.acquire(decision)
        lease.finish(Outcome.SUCCESS)
        telemetry.outcome("m1", lease.endpoint_id, Outcome.SUCCESS)
    assert all(prefix.size(s.id) <= CAPACITY for s in scheduler.registry.states("m1"))
    assert prefix.size() <= 4 * CAPACITY
    assert len(prefix._owners) <= 4 * CAPACITY
    # Labels name models, endpoints and reasons, never a session.
    assert len(telemetry._decision_children) <= 4 * 8
    assert len(telemetry._outcome_children) <= 4
    text = telemetry.render()[0].decode()
    assert "sess-" not in text
    assert len(translate._ROUTE_CACHE) <= translate._ROUTE_CACHE_LIMIT
    assert sum(s.inflight for s in scheduler.registry.states("m1")) == 0
