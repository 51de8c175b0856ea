"""What a config reload keeps: the prefix index when only the endpoint list changes, a
draining endpoint's count and settings, the proxy's pool limits (found by a review)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.breaker import BreakerSettings, BreakerState
from llmgw.config import load_dict
from llmgw.gateway import Gateway
from llmgw.kvevents import BlockStored, EventBatch
from llmgw.lifecycle import Lifecycle
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import ModelRouter, Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

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


def test_a_new_process_at_a_crashed_ones_address_gets_a_closed_breaker() -> None:
    """An on-demand model crashed with a request in flight and its breaker open; the
    restart at the same address revived that state, breaker and all: the control plane had
    just checked the new process, yet its waiters got 503 (found by a review helper). A
    reload that brings an endpoint back keeps its breaker (it is the same server)."""
    registry = Registry(clock=lambda: 0.0)
    registry.configure(breaker=BreakerSettings(failure_threshold=1), staleness=2)
    registry.set_endpoints("m1", [Endpoint(A, "m1")])
    registry.acquire("m1", A)  # still in flight at the crash
    registry.acquire("m1", A)
    registry.release("m1", A, Outcome.FAILURE)  # open
    for fresh in (False, True):
        registry.set_endpoints("m1", [])  # gone: drains with its request
        registry.set_endpoints("m1", [Endpoint(A, "m1")], fresh=fresh)
        state = registry.get("m1", A)
        assert state is not None and state.inflight == 1
        assert state.breaker.state is (BreakerState.CLOSED if fresh else BreakerState.OPEN)


def test_a_reload_that_shortens_max_cooldown_shortens_an_open_breakers_cooldown() -> None:
    """An endpoint opened with a 300 s cooldown stayed refused for all of it after a reload
    to `max_cooldown: 5` (found by a review helper)."""
    now = [100.0]
    registry = Registry(clock=lambda: now[0])
    long = BreakerSettings(failure_threshold=1, base_cooldown=300, max_cooldown=300)
    registry.configure(breaker=long, staleness=2)
    registry.set_endpoints("m1", [Endpoint(A, "m1")])
    registry.acquire("m1", A)
    registry.release("m1", A, Outcome.FAILURE)
    state = registry.get("m1", A)
    assert state is not None
    before = state.breaker.state
    short = BreakerSettings(failure_threshold=1, base_cooldown=1, max_cooldown=5)
    registry.configure(breaker=short, staleness=2)
    now[0] += 6.0
    available = state.breaker.available(now[0])
    assert (before, available, state.breaker.state) == (
        BreakerState.OPEN,
        True,
        BreakerState.HALF_OPEN,
    )


def test_a_retry_on_a_fallback_gone_and_back_is_not_charged_to_a_new_request_there() -> None:
    """A reload removed an idle fallback (its state dropped, not drained); Envoy, holding
    the old list, retried there and said so: the lease moved without any state counting
    it. The endpoint came back (a new state) and took a new request: the old request's
    end took that one's count, and the endpoint showed 0 in flight while serving it
    (found by a review helper)."""

    def config(endpoints: list[str]) -> Any:
        spec = {"endpoints": endpoints, "strategy": "round-robin"}
        return load_dict(
            {
                "models": {"m": {**spec, "session": {"num_fallback_replicas": 1}}},
                "destination_fallbacks": True,
            }
        )

    gateway = Gateway(Scheduler(config([A, B]), Registry(), seed=1))
    old = Lifecycle(gateway)
    decision = old.route({"x-llmgw-model": "m"}, "/v1/chat/completions", None)
    assert isinstance(decision, Decision)
    primary, fallback = decision.endpoint.id, decision.fallbacks[0].id
    gateway.reload(config([primary]))  # the fallback leaves, nothing in flight there
    old.answered_by(fallback)  # Envoy's retry there answered: a long stream
    gateway.reload(config([A, B]))  # it is back
    registry = gateway.scheduler.registry
    new = Lifecycle(gateway)
    for _ in range(4):  # round-robin: until a new request lands there
        d = new.route({"x-llmgw-model": "m"}, "/v1/chat/completions", None)
        assert isinstance(d, Decision)
        if d.endpoint.id == fallback:
            break
        new.finish(Outcome.SUCCESS)
        new = Lifecycle(gateway)
    state = registry.get("m", fallback)
    assert state is not None and state.inflight == 1
    old.response(200)
    old.finish()  # the old stream ends
    assert state.inflight == 1, "the new request there is still running"
    new.finish(Outcome.SUCCESS)
    assert state.inflight == 0


@pytest.mark.parametrize(("before", "after"), [("a", "b"), ("b", "a")])
def test_a_reload_renaming_a_model_keeps_its_engines_kv_index(before: str, after: str) -> None:
    """The reload set models in set order: where the old name came first, the endpoint was
    listed by no model for a moment and its exact KV index was forgotten (unknown until a
    resync), in some processes and not others (string hashes). Both orders run here
    (found by a review helper)."""

    def config(name: str) -> Any:
        return load_dict({"models": {name: {"endpoints": [A], "served_name": "chat"}}})

    registry = Registry()
    gateway = Gateway(Scheduler(config(before), registry))
    stored = BlockStored(
        block_hashes=(b"h0",), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4
    )
    registry.kv_index.apply_batch(A, EventBatch(0, 0.0, (stored,)), now=0.0)
    gateway.reload(config(after))
    assert registry.kv_index.size(A) == 1 and str(registry.kv_index.state(A)) == "live"
    gateway.reload(load_dict({"models": {"other": {"endpoints": [B]}}}))
    assert registry.kv_index.size(A) == 0  # listed by no model now: forgotten


def test_envoys_own_retry_pick_on_a_draining_endpoint_is_charged_there() -> None:
    """Envoy's own pick on a retry (no fallback list sent) answered from an endpoint a
    reload removed while it still served a request: the primary, which failed, kept the
    answer's outcome as a success, and the draining endpoint did not count the request
    (found by a review helper)."""
    config: dict[str, Any] = {
        "models": {
            "m": {
                "endpoints": [A, B],
                "strategy": "round-robin",
                "session": {"num_fallback_replicas": 0},
            }
        },
        "breaker": {"failure_threshold": 1},
    }
    gateway = Gateway(Scheduler(load_dict(config), Registry(), seed=1))
    registry = gateway.scheduler.registry
    running = Lifecycle(gateway)
    first = running.route({"x-llmgw-model": "m"}, "/v1/chat/completions", None)
    retried = Lifecycle(gateway)
    second = retried.route({"x-llmgw-model": "m"}, "/v1/chat/completions", None)
    assert isinstance(first, Decision) and isinstance(second, Decision)
    assert not second.fallbacks and first.endpoint.id != second.endpoint.id
    gone, primary = first.endpoint.id, second.endpoint.id
    config["models"]["m"]["endpoints"] = [primary]
    gateway.reload(load_dict(config))  # `gone` drains
    retried.answered_by(gone)  # Envoy retried the second request there itself
    draining = registry.find("m", gone)
    assert draining is not None and draining.inflight == 2
    state = registry.get("m", primary)
    assert state is not None and state.inflight == 0
    assert state.breaker.state is BreakerState.OPEN  # its attempt failed
    retried.response(200)
    retried.finish()
    running.finish(Outcome.SUCCESS)
    assert registry.find("m", gone) is None  # drained, dropped
