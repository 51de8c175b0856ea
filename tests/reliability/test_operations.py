"""Operations with real processes: SIGTERM drain and config reload, for both servers.

`llmgw extproc` behind a real Envoy, and `llmgw proxy`, each a child process:
- SIGTERM: readiness goes false first, the stream in flight completes, new requests are
  refused once the drain delay is over, and the process exits within its deadline;
- reload on SIGHUP and on a change of the file, under load, drops no request; an invalid
  file is rejected (its path-indexed problem logged) and the running config kept;
- `--workers N`: SIGTERM and SIGHUP reach every worker, a dead extproc worker stops the
  server, and the workers exit with a SIGKILLed parent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmgw.config import load_dict
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import EnvoyProcess, loopback_bootstrap, request_headers, wait_for

from .conftest import Child, SpawnFn, http_status

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
# Long enough that a request sent once readiness is seen false lands inside the delay even
# on a loaded host (the order is asserted, never how long the flip took).
DRAIN_DELAY = 3.0


def addresses(sim: ThreadedFleet, indexes: list[int]) -> list[str]:
    return [sim.urls[i].removeprefix("http://") for i in indexes]


def config_for(sim: ThreadedFleet, indexes: list[int]) -> dict[str, Any]:
    return {
        "models": {
            "m1": {
                "endpoints": addresses(sim, indexes),
                "strategy": "ring",
                "session": {"num_fallback_replicas": 1},
            }
        },
        "debug_headers": True,
        "scrape": {"interval": 0.05},
    }


def envoy_for(config: dict[str, Any], extproc: Child) -> EnvoyProcess:
    return EnvoyProcess(
        loopback_bootstrap(
            load_dict(config),
            f"127.0.0.1:{extproc.ports['grpc']}",
            shape="original-dst",
            message_timeout=5.0,
            connect_timeout=0.5,
        )
    )


def chat(
    client: httpx.Client, url: str, session: str, *, stream: bool = False, tokens: int = 2
) -> httpx.Response:
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": session}],
        "stream": stream,
        "max_tokens": tokens,
    }
    return client.post(url + CHAT, json=body, headers={"x-session-id": session})


def served_by(response: httpx.Response) -> str:
    """The endpoint that answered, from the debug header both edges send."""
    fields = dict(f.split("=", 1) for f in response.headers["x-llmgw-decision"].split()[:2])
    return fields.get("answered", fields["endpoint"])


class SlowStream(threading.Thread):
    """One streamed request that takes a while; `.first_chunk` is set once it is flowing."""

    def __init__(self, url: str, tokens: int = 8) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.tokens = tokens
        self.first_chunk = threading.Event()
        self.status = 0
        self.body = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": "m1",
            "messages": [{"role": "user", "content": "drain me"}],
            "stream": True,
            "max_tokens": self.tokens,
        }
        try:
            with (
                httpx.Client(timeout=15) as client,
                client.stream("POST", self.url + CHAT, json=body) as r,
            ):
                self.status = r.status_code
                for piece in r.iter_bytes():
                    self.body += piece
                    self.first_chunk.set()
        except BaseException as exc:
            self.error = exc
            self.first_chunk.set()


class Load(threading.Thread):
    """Requests one after another (bounded) until stopped; every status is counted."""

    def __init__(self, url: str, limit: int = 5000) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.limit = limit
        self.stopped = threading.Event()
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            for i in range(self.limit):
                if self.stopped.is_set():
                    return
                try:
                    r = chat(client, self.url, f"load-{i}")
                    self.statuses[r.status_code] += 1
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self.stopped.set()
        self.join(15)


@pytest.fixture
def slow_sim(sim: ThreadedFleet) -> Iterator[ThreadedFleet]:
    """Every replica 100x slower (a token every 200 ms) for the drain tests."""
    sim.call(lambda: [r.set_faults(slowdown=100.0) for r in sim.fleet.replicas])
    yield sim
    for i in range(len(sim.urls)):
        sim.reset(i)


# -- SIGTERM drain ------------------------------------------------------------------------
def test_extproc_sigterm_drains_behind_envoy(
    slow_sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    config = config_for(slow_sim, [0, 1, 2, 3])
    extproc = spawn_extproc(config, drain_delay=DRAIN_DELAY, drain_timeout=8, no_scrape=True)
    readyz = extproc.url("health") + "/readyz"
    with envoy_for(config, extproc) as envoy:
        stream = SlowStream(envoy.url)
        stream.start()
        assert stream.first_chunk.wait(10) and stream.error is None
        extproc.process.send_signal(signal.SIGTERM)
        wait_for(lambda: http_status(readyz) == 503, 5, "readiness false")

        def late_status() -> int:
            with httpx.Client(timeout=10) as client:
                return chat(client, envoy.url, "late", tokens=1).status_code

        # The order, not a stopwatch: with readiness already false, streams are still taken.
        assert late_status() == 200, "readiness must go false before streams are refused"
        wait_for(lambda: late_status() >= 500, 5 + DRAIN_DELAY, "new requests refused")
        stream.join(15)
        assert stream.error is None and stream.status == 200
        assert stream.body.rstrip().endswith(b"data: [DONE]")  # completed, not cut
        assert extproc.process.wait(10) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_proxy_sigterm_drains(slow_sim: ThreadedFleet, spawn_proxy: SpawnFn, workers: int) -> None:
    """`--workers N` too: each worker turns readiness false and closes its listener only
    after the delay (the workers closed it at once, readiness never false: the option was
    ignored)."""
    config = config_for(slow_sim, [0, 1, 2, 3])
    proxy = spawn_proxy(config, drain_delay=DRAIN_DELAY, drain_timeout=8, workers=workers)
    base = proxy.url("http")
    stream = SlowStream(base)
    stream.start()
    assert stream.first_chunk.wait(10) and stream.error is None
    proxy.process.send_signal(signal.SIGTERM)
    wait_for(lambda: http_status(base + "/readyz") == 503, 5, "readiness false")
    # The order, not a stopwatch: with readiness already false, new connections are taken.
    assert http_status(base + "/healthz") == 200, "readiness must go false before the close"
    wait_for(lambda: http_status(base + "/healthz") == 0, 5 + DRAIN_DELAY, "connections refused")
    stream.join(15)
    assert stream.error is None and stream.status == 200
    assert stream.body.rstrip().endswith(b"data: [DONE]")
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully.
    assert proxy.process.wait(10) in (0, -signal.SIGTERM)


class Waiting(threading.Thread):
    """One request whose answer the test awaits; `.status`, `.headers` and `.body` once done."""

    def __init__(self, url: str, *, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stream = stream
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        try:
            with httpx.Client(timeout=20) as client:
                r = client.post(self.url + CHAT, json={**body, "stream": self.stream})
                self.status, self.headers, self.body = r.status_code, dict(r.headers), r.content
        except BaseException as exc:
            self.error = exc


def inflight(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_inflight{")
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_proxy_drain_timeout_answers_503_draining_and_logs_no_traceback(
    sim: ThreadedFleet, spawn_proxy: SpawnFn, workers: int
) -> None:
    """Requests still waiting on a hung engine when `--drain-timeout` ends get 503
    `router_draining` (+ Retry-After) in llmgw's JSON shape. Before, uvicorn's cancellation
    passed through: a plain-text 500 "Internal Server Error" and a traceback in the log per
    request, on a routine rolling restart with one slow engine (found by a review helper).
    With the default --drain-delay 0, a worker of `--workers N` never marked itself
    draining, so it still answered that 500 (found by a review helper)."""
    sim.call(lambda: [r.set_faults(hang=True) for r in sim.fleet.replicas])
    try:
        proxy = spawn_proxy(config_for(sim, [0, 1]), drain_timeout=1, workers=workers)
        base = proxy.url("http")
        # One request with workers: each counts its own in flight, and both may take it.
        waiting = [Waiting(base, stream=i % 2 == 0) for i in range(3 - workers)]
        for w in waiting:
            w.start()
        wait_for(lambda: inflight(base) == len(waiting), 10, "the requests at the hung engines")
        proxy.process.send_signal(signal.SIGTERM)
        for w in waiting:
            w.join(20)
            assert w.error is None, w.error
            assert w.status == 503, (w.status, w.body)
            assert json.loads(w.body)["error"]["code"] == "router_draining"
            assert w.headers["retry-after"] == "1"
        assert proxy.process.wait(10) in (0, -signal.SIGTERM)
        assert "Traceback" not in proxy.log(), proxy.log()[-2000:]
    finally:
        for i in range(len(sim.urls)):
            sim.reset(i)


def test_proxy_drain_timeout_cuts_a_begun_stream_without_a_traceback(
    slow_sim: ThreadedFleet, spawn_proxy: SpawnFn
) -> None:
    """A stream whose answer began is cut when the drain timeout ends (uvicorn closes the
    connection; no error body can follow its 200), with no traceback logged."""
    proxy = spawn_proxy(config_for(slow_sim, [0]), drain_delay=0.1, drain_timeout=1)
    stream = SlowStream(proxy.url("http"), tokens=200)
    stream.start()
    assert stream.first_chunk.wait(10) and stream.error is None
    proxy.process.send_signal(signal.SIGTERM)
    stream.join(20)
    assert stream.status == 200
    assert not stream.body.rstrip().endswith(b"data: [DONE]")  # cut, not completed
    assert proxy.process.wait(10) in (0, -signal.SIGTERM)
    assert "Traceback" not in proxy.log(), proxy.log()[-2000:]


def test_proxy_ctrl_c_exits_cleanly(slow_sim: ThreadedFleet, spawn_proxy: SpawnFn) -> None:
    """SIGINT (Ctrl+C): a shutdown, exit 0, no KeyboardInterrupt traceback."""
    proxy = spawn_proxy(config_for(slow_sim, [0, 1]))
    proxy.process.send_signal(signal.SIGINT)
    assert proxy.process.wait(10) == 0
    assert "Traceback" not in proxy.log()


@pytest.mark.parametrize("workers", [1, 2])
def test_proxy_process_bounds_request_heads_with_or_without_workers(
    sim: ThreadedFleet, spawn_proxy: SpawnFn, workers: int
) -> None:
    """`llmgw proxy` serves with llmgw's protocol (`--workers N`: each worker sets the
    limits from its config): a head cut short gets 408 in the configured time, too many
    headers 431, and a normal request still goes through."""
    config = {**config_for(sim, [0]), "limits": {"client_header_timeout": 0.5}}
    base = spawn_proxy(config, workers=workers).url("http")
    port = int(base.rsplit(":", 1)[1])
    for head, status in (
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n", b"408"),
        (b"GET /healthz HTTP/1.1\r\n" + b"x-h: v\r\n" * 100 + b"\r\n", b"431"),
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            answer = b""
            while chunk := sock.recv(65536):  # to the proxy's close
                answer += chunk
        assert answer.split(b" ", 2)[1] == status, answer[:200]
    with httpx.Client(timeout=10) as client:
        assert chat(client, base, "s1").status_code == 200


# -- reload -------------------------------------------------------------------------------
def _only(url: str, expected: set[str], what: str) -> None:
    """Wait until llmgw routes only to `expected`, then check 20 more requests."""
    with httpx.Client(timeout=10) as client:

        def switched() -> bool:
            return served_by(chat(client, url, f"probe-{time.monotonic()}")) in expected

        wait_for(switched, 10, what)
        seen = {served_by(chat(client, url, f"check-{i}")) for i in range(20)}
    assert seen <= expected, (what, seen)


def _reload_under_load(sim: ThreadedFleet, child: Child, url: str) -> None:
    load = Load(url)
    load.start()
    try:
        child.write_config(config_for(sim, [2, 3]))
        child.process.send_signal(signal.SIGHUP)
        _only(url, set(addresses(sim, [2, 3])), "reload on SIGHUP")

        bad = config_for(sim, [2, 3])
        bad["models"]["m1"]["endpoints"] = ["no-port-here"]
        child.write_config(bad)  # picked up by the mtime poll
        wait_for(lambda: "models.m1.endpoints.0.address" in child.log(), 10, "the rejection logged")
        _only(url, set(addresses(sim, [2, 3])), "old config kept")

        child.write_config(config_for(sim, [0]))  # no signal: the file change is enough
        _only(url, set(addresses(sim, [0])), "reload on file change")
    finally:
        load.stop()
    assert load.errors == []
    assert set(load.statuses) == {200}, load.statuses
    assert sum(load.statuses.values()) > 0
    assert "config reload rejected, keeping the running config" in child.log()


def test_extproc_reload_on_sighup_and_file_change_drops_nothing(
    sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    config = config_for(sim, [0, 1])
    extproc = spawn_extproc(config, reload_interval=0.1)
    with envoy_for(config, extproc) as envoy:
        _only(envoy.url, set(addresses(sim, [0, 1])), "initial config")
        _reload_under_load(sim, extproc, envoy.url)
    ready = json.loads(httpx.get(extproc.url("health") + "/readyz", timeout=5).text)
    assert ready["ready"] is True


def test_proxy_reload_on_sighup_and_file_change_drops_nothing(
    sim: ThreadedFleet, spawn_proxy: SpawnFn
) -> None:
    proxy = spawn_proxy(config_for(sim, [0, 1]), reload_interval=0.1)
    url = proxy.url("http")
    _only(url, set(addresses(sim, [0, 1])), "initial config")
    _reload_under_load(sim, proxy, url)


# -- --workers N: one signal to the parent reaches every worker -------------------------
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def listeners(port: int) -> int:
    """LISTEN sockets on `port` (one a worker with SO_REUSEPORT), from /proc/net/tcp{,6}."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
                count += 1
    return count


def group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def fresh_channel(port: int) -> grpc.Channel:
    """A channel of its own connection: the kernel spreads connections over the workers."""
    return grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )


def extproc_models(port: int) -> set[str]:
    """GET /v1/models through ext_proc on a fresh connection: the model ids answered."""
    with fresh_channel(port) as channel:
        method = channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )
        headers = {":method": "GET", ":path": "/v1/models", ":authority": "gw", "x-request-id": "r"}
        answer = next(iter(method(iter([request_headers(headers, end_of_stream=True)]), timeout=5)))
        return {m["id"] for m in json.loads(answer.immediate_response.body)["data"]}


def extproc_health(port: int) -> int:
    """grpc.health.v1 Check("") on the ext_proc port, on a fresh connection."""
    with fresh_channel(port) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def two_models(sim: ThreadedFleet) -> dict[str, Any]:
    config = config_for(sim, [0, 1])
    config["models"]["m2"] = {"endpoints": addresses(sim, [2]), "strategy": "ring"}
    return config


def test_extproc_workers_all_reload_on_sighup(sim: ThreadedFleet, spawn_extproc: SpawnFn) -> None:
    """`--workers 2`: the SIGHUP reached worker 0 (the parent) only; the forked worker kept
    answering with the old config on the shared port (found by a review helper)."""
    extproc = spawn_extproc(config_for(sim, [0, 1]), workers=2, reload_interval=0, no_scrape=True)
    port = extproc.ports["grpc"]
    wait_for(lambda: listeners(port) == 2, 15, "both workers listening")
    assert extproc_models(port) == {"m1"}
    extproc.write_config(two_models(sim))
    extproc.process.send_signal(signal.SIGHUP)
    # 16 connections: both workers (the kernel's hash) but with odds of 2**-15
    wait_for(lambda: all("m2" in extproc_models(port) for _ in range(16)), 10, "every worker")


def test_extproc_workers_all_drain_on_sigterm(sim: ThreadedFleet, spawn_extproc: SpawnFn) -> None:
    """`--workers 2`: the SIGTERM drained worker 0 alone; the forked worker answered SERVING
    and took new streams until worker 0's drain was over (found by a review helper)."""
    extproc = spawn_extproc(config_for(sim, [0]), workers=2, drain_delay=5, no_scrape=True)
    port = extproc.ports["grpc"]
    wait_for(lambda: listeners(port) == 2, 15, "both workers listening")
    serving = health_pb2.HealthCheckResponse.SERVING
    assert {extproc_health(port) for _ in range(8)} == {serving}
    extproc.process.send_signal(signal.SIGTERM)
    readyz = extproc.url("health") + "/readyz"
    wait_for(lambda: http_status(readyz) == 503, 5, "worker 0 draining")
    # Within the 5 s drain delay: the worker has its SIGTERM by the time worker 0 drains.
    wait_for(lambda: serving not in {extproc_health(port) for _ in range(16)}, 3, "all drain")
    assert extproc.process.wait(15) == 0


def test_extproc_a_dead_worker_stops_the_server_non_zero(
    sim: ThreadedFleet, spawn_extproc: SpawnFn
) -> None:
    """A forked worker that died went unnoticed: the server went on at half its workers,
    nothing in the log (found by a review helper). Now the parent logs it, drains every
    worker and exits 1, for its supervisor to restart it whole."""
    extproc = spawn_extproc(config_for(sim, [0]), workers=2, no_scrape=True)
    port = extproc.ports["grpc"]
    wait_for(lambda: listeners(port) == 2, 15, "both workers listening")
    parent = extproc.process.pid
    (worker,) = [p for p in group(parent) if p != parent]
    os.kill(worker, signal.SIGKILL)
    assert extproc.process.wait(15) == 1
    assert f"worker 1 (pid {worker}) ended (signal 9)" in extproc.log()
    assert group(parent) == []


@pytest.mark.parametrize("edge", ["proxy", "extproc"])
def test_workers_exit_when_their_parent_is_killed(
    sim: ThreadedFleet, spawn_proxy: SpawnFn, spawn_extproc: SpawnFn, edge: str
) -> None:
    """`--workers 2` with the parent SIGKILLed (the OOM killer, `kill -9`): its workers
    served on as orphans nobody stops, and a restarted instance shared the port with them
    (SO_REUSEPORT) (found by a review helper). Now they drain and exit."""
    config = config_for(sim, [0])
    if edge == "proxy":
        child = spawn_proxy(config, workers=2, no_scrape=True)
        port, processes = child.ports["http"], 3  # uvicorn's parent holds the one socket
    else:
        child = spawn_extproc(config, workers=2, no_scrape=True)
        port, processes = child.ports["grpc"], 2
    parent = child.process.pid
    wait_for(lambda: len(group(parent)) >= processes and listeners(port) > 0, 15, "workers up")
    child.process.kill()  # the parent alone
    child.process.wait(5)
    wait_for(lambda: group(parent) == [], 10, "the workers gone")
    assert listeners(port) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_proxy_sighup_reloads_each_worker_in_place(
    slow_sim: ThreadedFleet, spawn_proxy: SpawnFn, workers: int
) -> None:
    """`--workers 2`: SIGHUP went to uvicorn's supervisor, which replaced every worker: a
    stream longer than --drain-timeout was cut, and each worker's state started over
    (found by a review helper). Now each worker reloads, as one process does."""
    proxy = spawn_proxy(
        config_for(slow_sim, [0, 1]), workers=workers, drain_timeout=1, reload_interval=0
    )
    base = proxy.url("http")
    stream = SlowStream(base, tokens=25)  # 200 ms a token: well past the 1 s drain timeout
    stream.start()
    assert stream.first_chunk.wait(10) and stream.error is None
    proxy.write_config(two_models(slow_sim))
    proxy.process.send_signal(signal.SIGHUP)

    def models() -> set[str]:
        with httpx.Client(timeout=5) as client:  # a connection of its own: any worker
            return {m["id"] for m in client.get(base + "/v1/models").json()["data"]}

    wait_for(lambda: all("m2" in models() for _ in range(16)), 10, "every worker reloaded")
    stream.join(15)
    assert stream.error is None and stream.status == 200
    assert stream.body.rstrip().endswith(b"data: [DONE]")  # completed, not cut
