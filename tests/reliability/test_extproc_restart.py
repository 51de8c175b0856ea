"""The ext_proc server crashes (SIGKILL) and comes back under load, behind a real Envoy;
two ext_proc replicas behind one Envoy make the same decision for a session."""

from __future__ import annotations

import re
import signal
import threading
from typing import Any

import httpx
import pytest

from llmgw.config import load_dict
from llmgw.hashring import HashRing
from llmgw.runtime.ports import free_port
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import EnvoyProcess, loopback_bootstrap, wait_for

from .conftest import Child, SpawnFn

pytestmark = pytest.mark.e2e


def config_for(sim: ThreadedFleet) -> dict[str, Any]:
    return {
        "models": {
            "m1": {
                "endpoints": [u.removeprefix("http://") for u in sim.urls],
                "strategy": "ring",
                "session": {"num_fallback_replicas": 1},
            }
        },
        "debug_headers": True,
        "scrape": {"interval": 0.05},
    }


def envoy_for(
    config: dict[str, Any], grpc_ports: list[int], *, shape: str, fail_open: bool
) -> EnvoyProcess:
    bootstrap = loopback_bootstrap(
        load_dict(config),
        ",".join(f"127.0.0.1:{p}" for p in grpc_ports),
        shape=shape,
        fail_open=fail_open,
        message_timeout=2.0,
        connect_timeout=0.25,
    )
    return EnvoyProcess(bootstrap)


class Recorder(threading.Thread):
    """Sequential requests until stopped (bounded); records (status, routed by llmgw)."""

    def __init__(self, url: str, limit: int = 5000) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.limit = limit
        self.stopped = threading.Event()
        self.results: list[tuple[int, bool]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=10) as client:
            for i in range(self.limit):
                if self.stopped.is_set():
                    return
                try:
                    r = client.post(
                        self.url + "/v1/chat/completions",
                        json=body,
                        headers={"x-session-id": f"s{i}"},
                    )
                    self.results.append((r.status_code, "x-llmgw-decision" in r.headers))
                except httpx.HTTPError as exc:  # a timeout would be a hang: never expected
                    self.errors.append(repr(exc))

    def count(self) -> int:
        return len(self.results)

    def seen_since(self, start: int, want: tuple[int | None, bool]) -> bool:
        status, routed = want
        return any((status is None or s == status) and r is routed for s, r in self.results[start:])

    def stop(self) -> None:
        self.stopped.set()
        self.join(15)


@pytest.mark.parametrize(
    ("shape", "fail_open"),
    [("original-dst", True), ("override-host", True), ("original-dst", False)],
)
def test_extproc_crash_and_restart_under_load(
    sim: ThreadedFleet, spawn_extproc: SpawnFn, shape: str, fail_open: bool
) -> None:
    config = config_for(sim)
    port = free_port()
    extproc = spawn_extproc(config, grpc_port=port)
    with envoy_for(config, [port], shape=shape, fail_open=fail_open) as envoy:
        load = Recorder(envoy.url)
        load.start()
        try:
            wait_for(lambda: load.seen_since(0, (200, True)), 10, "routed by llmgw")
            extproc.process.send_signal(signal.SIGKILL)
            extproc.process.wait(5)
            down = load.count()
            # Down: fail-open routes without a pick (the fail-open route / least-request),
            # fail-closed answers 5xx; nothing hangs either way.
            if fail_open:
                wait_for(lambda: load.seen_since(down, (200, False)), 10, "fail-open routing")
            else:
                wait_for(lambda: load.seen_since(down, (500, False)), 10, "fail-closed 5xx")
            wait_for(lambda: load.count() > down + 5, 10, "requests while down")
            spawn_extproc(config, grpc_port=port, name="extproc-again")
            back = load.count()
            wait_for(lambda: load.seen_since(back, (200, True)), 15, "llmgw routes again")
            settled = load.count()
            wait_for(lambda: load.count() > settled + 10, 10, "requests after the restart")
        finally:
            load.stop()
    assert load.errors == []
    statuses = {s for s, _ in load.results}
    if fail_open:
        assert statuses == {200}, statuses
    else:
        assert statuses <= {200, 500}, statuses
        assert all(s == 200 for s, routed in load.results if routed)
    # Once back, every request is routed by llmgw again.
    assert all(routed for _, routed in load.results[settled:])


def _decisions(child: Child) -> float:
    text = httpx.get(child.url("metrics") + "/metrics", timeout=5).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^llmgw_decisions_total\{[^}]*\} (\S+)$", text, re.M)
    )


def test_two_extproc_replicas_give_identical_decisions(
    sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    config = config_for(sim)
    first = spawn_extproc(config, name="a")
    second = spawn_extproc(config, name="b")
    ports = [first.ports["grpc"], second.ports["grpc"]]
    ring = HashRing(sorted(u.removeprefix("http://") for u in sim.urls))
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    picked: dict[str, set[str]] = {}
    with (
        envoy_for(config, ports, shape="override-host", fail_open=False) as envoy,
        httpx.Client(timeout=10) as client,
    ):
        for _turn in range(3):
            for n in range(30):
                session = f"user-{n}"
                r = client.post(
                    envoy.url + "/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": session},
                )
                assert r.status_code == 200, r.text
                head = r.headers["x-llmgw-decision"].split()[0].removeprefix("endpoint=")
                picked.setdefault(session, set()).add(head)
    assert all(len(p) == 1 for p in picked.values()), picked
    assert all(p == {ring.candidates(s)[0]} for s, p in picked.items())
    # Envoy spread the streams over both replicas: each decided on its own.
    assert _decisions(first) > 0 and _decisions(second) > 0
    assert _decisions(first) + _decisions(second) == 90


def test_a_killed_replica_of_two_stops_getting_requests(
    sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    """Envoy health-checks each ext_proc replica and ejects one whose streams fail: a dead
    replica of two costs a few requests, not half of them from then on (fail-closed)."""
    config = config_for(sim)
    first = spawn_extproc(config, name="a")
    second = spawn_extproc(config, name="b")
    ports = [first.ports["grpc"], second.ports["grpc"]]
    with envoy_for(config, ports, shape="override-host", fail_open=False) as envoy:
        load = Recorder(envoy.url)
        load.start()
        try:
            wait_for(lambda: _decisions(first) > 0 and _decisions(second) > 0, 10, "both decide")
            second.process.send_signal(signal.SIGKILL)
            second.process.wait(5)
            down = load.count()

            def settled() -> bool:
                since = load.results[down:]
                return len(since) >= 40 and all(r == (200, True) for r in since[-30:])

            wait_for(settled, 15, "the live replica routing every request")
            after = load.count()
            wait_for(lambda: load.count() > after + 50, 10, "requests after the ejection")
        finally:
            load.stop()
    assert load.errors == []
    assert all(r == (200, True) for r in load.results[after:])
    lost = [r for r in load.results[down:after] if r != (200, True)]
    assert all(r == (500, False) for r in lost)  # fail-closed, never a hang or a 200 unrouted
