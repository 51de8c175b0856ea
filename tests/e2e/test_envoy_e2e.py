"""Real Envoy + real gRPC + simulated engines: the ext_proc edge end to end."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from llmgw.breaker import BreakerState
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import StackFactory, fleet_config, wait_for

pytestmark = pytest.mark.e2e


def chat(
    client: httpx.Client,
    url: str,
    session: str | None = None,
    *,
    content: str = "hello",
    stream: bool = False,
) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    body = {"model": "m1", "messages": [{"role": "user", "content": content}], "stream": stream}
    return client.post(url + "/v1/chat/completions", json=body, headers=headers)


def decided(response: httpx.Response) -> str:
    """The primary llmgw picked (from the debug header `x-llmgw-decision`)."""
    head = response.headers["x-llmgw-decision"].split()[0]
    assert head.startswith("endpoint=")
    return head.removeprefix("endpoint=")


def test_sessions_stick_to_their_replica(stack: StackFactory) -> None:
    s = stack("original-dst")
    with httpx.Client(timeout=10) as client:
        served: dict[str, set[str]] = {}
        for turn in range(4):
            for session in ("alice", "bob", "carol", "dave"):
                r = chat(client, s.url, session, content=f"{session} turn {turn}")
                assert r.status_code == 200, r.text
                served.setdefault(session, set()).add(r.headers["x-sim-replica"])
                assert s.replica_index[decided(r)] == int(r.headers["x-sim-replica"])
    assert all(len(replicas) == 1 for replicas in served.values()), served


def test_requests_without_session_spread(stack: StackFactory) -> None:
    s = stack("original-dst")
    with httpx.Client(timeout=10) as client:
        counts = Counter(chat(client, s.url).headers["x-sim-replica"] for _ in range(40))
    assert len(counts) >= 3, counts


def test_429_sends_the_session_to_its_fallback(stack: StackFactory) -> None:
    s = stack("override-host")
    with httpx.Client(timeout=10) as client:
        first = chat(client, s.url, "sticky")
        assert first.status_code == 200
        primary = int(first.headers["x-sim-replica"])
        s.fleet.set_faults(primary, status=429)
        second = chat(client, s.url, "sticky")
        assert second.status_code == 200, second.text
        assert decided(second) == s.fleet.urls[primary].removeprefix("http://")
        assert int(second.headers["x-sim-replica"]) != primary
        # The fallback is the same for every later request of the session.
        third = chat(client, s.url, "sticky")
        assert third.headers["x-sim-replica"] == second.headers["x-sim-replica"]
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "leases released")


def test_killed_replica_is_avoided_then_recovers_through_half_open(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    # The ring strategy ignores engine metrics, so only the breaker can steer away.
    config = fleet_config(sim_fleet)
    spec = config.models["m1"].model_copy(update={"strategy": "ring"})
    s = stack("override-host", config=config.model_copy(update={"models": {"m1": spec}}))
    registry = s.extproc.scheduler.registry
    with httpx.Client(timeout=10) as client:
        primary = int(chat(client, s.url, "victim").headers["x-sim-replica"])
        address = sim_fleet.urls[primary].removeprefix("http://")
        replica = sim_fleet.fleet.replicas[primary]
        sim_fleet.set_faults(primary, crash=True)
        # Envoy retries on the fallbacks: the client never sees the dead replica...
        for _ in range(2):
            r = chat(client, s.url, "victim")
            assert r.status_code == 200, r.text
            assert int(r.headers["x-sim-replica"]) != primary
        # ...and the failures charged to it open its breaker: llmgw stops picking it.
        wait_for(
            lambda: (
                s.extproc.call(lambda: registry.breaker_states()[("m1", address)])
                is not BreakerState.CLOSED
            ),
            5,
            "breaker open",
        )
        r = chat(client, s.url, "victim")
        assert r.status_code == 200
        assert decided(r) != address
        # Bring it back: after the cooldown a half-open probe succeeds and it is picked again.
        sim_fleet.reset(primary)
        sim_fleet.run(replica.stop())
        sim_fleet.run(replica.start())

        def picked_again() -> bool:
            response = chat(client, s.url, "victim")
            return response.status_code == 200 and decided(response) == address

        wait_for(picked_again, 10, "the recovered replica to be picked again")
    # The probe's success is recorded when its ext_proc stream ends, just after the reply.
    wait_for(
        lambda: (
            s.extproc.call(lambda: registry.breaker_states()[("m1", address)])
            is BreakerState.CLOSED
        ),
        5,
        "breaker closed",
    )


def test_bad_json_is_400_from_envoy_with_a_json_body(stack: StackFactory) -> None:
    s = stack("original-dst")
    r = httpx.post(
        s.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "invalid_request"
    assert "x-sim-replica" not in r.headers


def test_unknown_model_is_404(stack: StackFactory) -> None:
    s = stack("original-dst")
    r = httpx.post(
        s.url + "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("shape", ["original-dst", "override-host"])
def test_extproc_down_fail_open_still_routes(stack: StackFactory, shape: str) -> None:
    s = stack(shape, fail_open=True)
    s.extproc.stop()
    with httpx.Client(timeout=10) as client:
        r = chat(client, s.url, "anyone")
    assert r.status_code == 200, r.text
    assert "x-llmgw-decision" not in r.headers


def test_extproc_down_with_a_streamed_body_fails_closed_even_with_fail_open(
    stack: StackFactory,
) -> None:
    """Envoy applies no failure_mode_allow to a FULL_DUPLEX_STREAMED ext_proc filter: the
    README said `--fail-open` still routed (found by a review helper)."""
    s = stack("original-dst", fail_open=True, body_mode="gie")
    s.extproc.stop()
    with httpx.Client(timeout=10) as client:
        r = chat(client, s.url, "anyone")
    assert r.status_code == 500 and r.json()["error"]["code"] == "router_unavailable", r.text


def test_extproc_down_fail_closed_is_5xx(stack: StackFactory) -> None:
    s = stack("original-dst", fail_open=False)
    s.extproc.stop()
    with httpx.Client(timeout=10) as client:
        r = chat(client, s.url, "anyone")
    assert 500 <= r.status_code < 600
    assert "x-sim-replica" not in r.headers


def _events(lines: list[str]) -> list[Any]:
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_streaming_passes_through_and_holds_the_lease_until_the_end(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    config = fleet_config(sim_fleet)
    s = stack("original-dst", config=config)
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "stream please"}],
        "stream": True,
        "max_tokens": 5,
    }
    with httpx.Client(timeout=10) as client:
        sim_fleet.call(lambda: [r.set_faults(slowdown=100.0) for r in sim_fleet.fleet.replicas])
        with client.stream(
            "POST", s.url + "/v1/chat/completions", json=body, headers={"x-session-id": "st"}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # Mid-stream (a token every 200 ms): still in flight on its replica.
            assert sum(s.extproc.inflight().values()) == 1
            rest = list(lines)
        sim_fleet.call(lambda: [r.set_faults(slowdown=1.0) for r in sim_fleet.fleet.replicas])
        direct = client.post(
            sim_fleet.urls[int(r.headers["x-sim-replica"])] + "/v1/chat/completions", json=body
        )
    events = _events([first, *rest])
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if e != "[DONE]"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text  # content made it through unchanged in shape: SSE chunks, then [DONE]
    direct_events = _events(direct.text.splitlines())
    assert len(direct_events) == len(events)
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "lease released at stream end")


def test_client_abort_releases_the_lease(stack: StackFactory, sim_fleet: ThreadedFleet) -> None:
    s = stack("original-dst")
    sim_fleet.call(lambda: [r.set_faults(hang=True) for r in sim_fleet.fleet.replicas])
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": True}
    errors: list[BaseException] = []

    def impatient_client() -> None:
        try:  # the engine never answers: the client gives up and closes the connection
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=1.5)
        except httpx.TimeoutException as exc:
            errors.append(exc)

    worker = threading.Thread(target=impatient_client)
    worker.start()
    wait_for(lambda: sum(s.extproc.inflight().values()) == 1, 5, "request in flight")
    worker.join(10)
    assert errors, "the client should have timed out"
    # Envoy resets the upstream request and ends the ext_proc stream: the lease is released.
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "lease released on abort")
    states = s.extproc.call(s.extproc.scheduler.registry.breaker_states)
    assert all(state is BreakerState.CLOSED for state in states.values())
    text = s.extproc.server.telemetry.render()[0].decode()
    assert 'outcome="cancelled"} 1.0' in text


def test_a_hung_replica_without_retries_is_cut_after_upstream_read_timeout(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    """override-host without retries (num_fallback_replicas: 0, or --retries 0) set no idle
    limit (upstream_read_timeout was only the retry policy's per-try one): a hung replica
    held the request for Envoy's 300 s stream idle timeout (found by a review helper)."""
    endpoints = [f"127.0.0.1:{p}" for p in sim_fleet.ports]
    models = {"m1": {"endpoints": endpoints, "session": {"num_fallback_replicas": 0}}}
    config = fleet_config(sim_fleet, models=models, limits={"upstream_read_timeout": 1.0})
    s = stack("override-host", config=config)
    sim_fleet.call(lambda: [r.set_faults(hang=True) for r in sim_fleet.fleet.replicas])
    started = time.monotonic()
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
    reply = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 504, reply.text
    assert time.monotonic() - started < 5


def test_openai_client_through_envoy(stack: StackFactory) -> None:
    openai = pytest.importorskip("openai")
    s = stack("override-host")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-session-id": "oa"},
    )
    assert reply.choices[0].message.content
    stream = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert sum(1 for _ in stream) > 1
    client.close()
