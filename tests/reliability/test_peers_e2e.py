"""Two `llmgw proxy` processes in front of one fleet, a conversation's turns alternating
between them: with `peers:` each turn after the first goes where the history is cached;
without, the second router has never seen the conversation and places it as new."""

from __future__ import annotations

import functools
import re
from typing import Any

import httpx
import pytest

from llmgw.runtime.ports import free_port
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import wait_for

from .conftest import Child, SpawnFn

pytestmark = pytest.mark.e2e

SESSIONS = 8
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


def received(child: Child) -> float:
    text = httpx.get(child.url("http") + "/metrics", timeout=2).text
    m = re.search(r"^llmgw_peer_records_received_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def applied(child: Child, n: int) -> bool:
    return received(child) >= n


def turn(client: httpx.Client, child: Child, session: str, messages: list[dict[str, str]]) -> str:
    r = client.post(
        child.url("http") + "/v1/chat/completions",
        json={"model": "m1", "messages": messages, "max_tokens": 4},
        headers={"x-session-id": session},
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
            where = turn(client, a, session, first)
            if peered:  # the datagram is on its way; no turn 2 before it is applied
                wait_for(functools.partial(applied, b, k + 1), 5, "the peer's insert at b")
            second = [*first, {"role": "assistant", "content": "Step one is the inventory."},
                      {"role": "user", "content": "And step two?"}]  # fmt: skip
            home += turn(client, b, session, second) == where
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
