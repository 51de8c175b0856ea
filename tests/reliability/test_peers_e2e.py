"""Two `llmgw proxy` processes in front of one fleet, a conversation's turns alternating
between them: with `peers:` each turn after the first goes where the history is cached;
without, the second router has never seen the conversation and places it as new."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.runtime.ports import free_port
from llmgw.sim import SimFleet, ThreadedFleet
from llmgw.testing.extproc import wait_for

from .conftest import Child, SpawnFn
from .test_extproc_restart import envoy_for

pytestmark = pytest.mark.e2e

SESSIONS = 8


@pytest.fixture(scope="module")
def sim() -> Iterator[ThreadedFleet]:
    """Prefill at 200 µs a token: a ~600-token history costs ~120 ms to recompute, so
    staying home is right whatever load a scrape catches (at the shared fleet's 5 µs a
    token a move cost ~3 ms, and a stale scrape's queue could outweigh it)."""
    fleet = SimFleet.start_in_thread(
        replicas=4, model="m1", seed=5, decode_ms=2.0, prefill_us_per_token=200.0,
        default_output_tokens=(4, 8),
    )  # fmt: skip
    try:
        yield fleet
    finally:
        fleet.stop()


NOTES = "These are my notes on the migration plan, pasted in for context. " * 30


def config_for(sim: ThreadedFleet, peers: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": {"m1": {"endpoints": [u.removeprefix("http://") for u in sim.urls]}},
        "debug_headers": True,
        "scrape": {"interval": 0.05},
    }
    if peers is not None:
        config["peers"] = peers
    return config


def metric(child: Child, name: str) -> float:
    """The sum of a metric's samples on the child's /metrics (`metrics` port, else `http`)."""
    port = "metrics" if "metrics" in child.ports else "http"
    text = httpx.get(child.url(port) + "/metrics", timeout=2).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{.*\}})? (\S+)$", text, re.M))


def received(*children: Child) -> float:
    return sum(metric(c, "llmgw_peer_records_received_total") for c in children)


def applied(n: int, *children: Child) -> bool:
    return received(*children) >= n


def every_worker_peers(child: Child) -> bool:
    return all(
        metric(child, "llmgw_peers") == 1
        for _ in range(6)  # `metric` opens a new connection each time
    )


def turn(
    client: httpx.Client,
    url: str,
    session: str,
    messages: list[dict[str, str]],
    headers: dict[str, str] | None = None,
) -> str:
    r = client.post(
        url + "/v1/chat/completions",
        json={"model": "m1", "messages": messages, "max_tokens": 4},
        headers={"x-session-id": session, **(headers or {})},
    )
    assert r.status_code == 200, r.text
    m = re.match(r"endpoint=(\S+)", r.headers["x-llmgw-decision"])
    assert m is not None
    return m.group(1)


def conversations(a: Child, b: Child, peered: bool) -> int:
    """Turn 1 of each conversation through `a`, turn 2 through `b`: how many stayed home."""
    home = 0
    with httpx.Client(timeout=10) as client:
        for k in range(SESSIONS):
            session = f"conv-{k}"
            first = [{"role": "user", "content": f"{session}: {NOTES} What is step one?"}]
            where = turn(client, a.url("http"), session, first)
            if peered:  # the datagram is on its way; no turn 2 before it is applied
                wait_for(functools.partial(applied, k + 1, b), 5, "the peer's insert at b")
            second = [*first, {"role": "assistant", "content": "Step one is the inventory."},
                      {"role": "user", "content": "And step two?"}]  # fmt: skip
            home += turn(client, b.url("http"), session, second) == where
    return home


def test_turns_through_either_router_find_their_history_with_peers(
    sim: ThreadedFleet, spawn_proxy: SpawnFn
) -> None:
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    a, b = (
        spawn_proxy(
            config_for(sim, {"listen": f"127.0.0.1:{p}", "addresses": addresses}), name=f"p{p}"
        )
        for p in ports
    )
    assert conversations(a, b, peered=True) == SESSIONS
    # b's turns went back to a: both indexes hold both turns of every conversation.
    wait_for(lambda: received(a) == SESSIONS, 5, "b's inserts at a")
    # The same two routers without peers: b places each second turn as new.
    c, d = (spawn_proxy(config_for(sim, None), name=f"alone{k}") for k in range(2))
    assert conversations(c, d, peered=False) < SESSIONS


def test_two_extproc_replicas_behind_one_envoy_send_every_turn_home_with_peers(
    sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    """Envoy spreads ext_proc streams over both replicas, so a conversation's turns meet
    both: each must know where the other sent the history."""
    grpc, listen = [free_port(), free_port()], [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in listen]
    configs = [
        config_for(sim, {"listen": f"127.0.0.1:{p}", "addresses": addresses}) for p in listen
    ]
    replicas = [
        spawn_extproc(c, grpc_port=g, name=f"x{g}") for c, g in zip(configs, grpc, strict=True)
    ]
    home = 0
    with (
        envoy_for(configs[0], grpc, shape="override-host", fail_open=False) as envoy,
        httpx.Client(timeout=10) as client,
    ):
        for k in range(SESSIONS):
            session = f"env-{k}"
            first = [{"role": "user", "content": f"{session}: {NOTES} What is step one?"}]
            where = turn(client, envoy.url, session, first)
            # Every turn so far, told to the other replica, before this one's second turn.
            wait_for(functools.partial(applied, 2 * k + 1, *replicas), 5, "the peers' inserts")
            second = [*first, {"role": "assistant", "content": "Step one is the inventory."},
                      {"role": "user", "content": "And step two?"}]  # fmt: skip
            home += turn(client, envoy.url, session, second) == where
            wait_for(functools.partial(applied, 2 * k + 2, *replicas), 5, "the peers' inserts")
    assert home == SESSIONS
    # Envoy sent streams to both replicas: each routed some turns, and heard of the others'.
    assert all(metric(r, "llmgw_decisions_total") > 0 for r in replicas)
    assert all(received(r) > 0 for r in replicas)


def test_the_workers_of_one_proxy_share_what_they_route(
    sim: ThreadedFleet, spawn_proxy: SpawnFn, tmp_path: Path
) -> None:
    """`llmgw proxy --workers 2`: each connection lands on either worker process, so a
    conversation's turns meet both; they peer on loopback without any `peers:` config."""
    config = config_for(sim, None)
    config["trace"] = {"path": str(tmp_path / "trace.{pid}.jsonl")}  # one file per worker
    proxy = spawn_proxy(config, workers=2)
    # /healthz answered from one worker; wait until the workers know each other (six
    # scrapes on fresh connections, which land on either worker, all say one peer).
    wait_for(functools.partial(every_worker_peers, proxy), 10, "both workers peering")
    home = 0
    sessions = 2 * SESSIONS  # alone, all home by luck: ~(5/8)^16 < 0.1 %
    with httpx.Client(timeout=10) as client:
        close = {"connection": "close"}  # a new connection per request: either worker
        for k in range(sessions):
            session = f"w-{k}"
            first = [{"role": "user", "content": f"{session}: {NOTES} What is step one?"}]
            where = turn(client, proxy.url("http"), session, first, close)
            # (The pick's datagram leaves before the request goes upstream; the turn's
            # ~100 ms prefill is far longer than its trip over loopback.)
            second = [*first, {"role": "assistant", "content": "Step one is the inventory."},
                      {"role": "user", "content": "And step two?"}]  # fmt: skip
            home += turn(client, proxy.url("http"), session, second, close) == where
    assert home == sessions
    served = [len(f.read_text().splitlines()) for f in tmp_path.glob("trace.*.jsonl")]
    assert len(served) == 2 and min(served) > 0, served  # both workers routed turns


def test_a_request_in_flight_through_one_router_counts_at_the_other(
    sim: ThreadedFleet, spawn_proxy: SpawnFn
) -> None:
    """Between scrapes a router sees only its own requests: with `peers:` the other's
    count too, from the moment one is sent until it ends."""
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    a, b = (
        spawn_proxy(
            config_for(sim, {"listen": f"127.0.0.1:{p}", "addresses": addresses}), name=f"l{p}"
        )
        for p in ports
    )
    wait_for(lambda: metric(a, "llmgw_peers") == 1 == metric(b, "llmgw_peers"), 5, "peering")
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": NOTES}],
        "max_tokens": 1500,  # ~3 s of decode at 2 ms a token
        "stream": True,
    }
    with (
        httpx.Client(timeout=20) as client,
        client.stream("POST", a.url("http") + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        endpoint = re.match(r"endpoint=(\S+)", r.headers["x-llmgw-decision"])
        assert endpoint is not None
        series = f'llmgw_peer_inflight{{endpoint="{endpoint.group(1)}",model="m1"}}'
        wait_for(lambda: f"{series} 1.0" in httpx.get(b.url("http") + "/metrics").text, 5,
                 "b counting a's request there")  # fmt: skip
        assert metric(a, "llmgw_peer_inflight") == 0  # a's own is not a peer's
        assert metric(b, "llmgw_inflight") == 0
        for _ in r.iter_bytes():
            pass
    wait_for(lambda: metric(b, "llmgw_peer_inflight") == 0, 5, "b seeing it end")
    assert metric(b, "llmgw_peer_load_updates_received_total") >= 2
