"""What llmgw's ext_proc costs behind a real Envoy, against Envoy alone and a bare ext_proc.

One run, one machine, one load tool (h2load, HTTP/1.1, `-c` clients), one fast upstream
(a second Envoy answering with `direct_response` on 4 ports, plus a static vLLM
`/metrics` page so llmgw's scraper runs as in production):

  1 envoy            Envoy -> upstream (no ext_proc)
  2 bare             + bench/bare_extproc.py: a fixed destination, pre-serialized answers
  2b bare+body       the same, asking for the buffered body first (the floor for 4)
  3 llmgw headers    llmgw ext_proc, model + session from headers (`ring` strategy)
  4 llmgw body       llmgw ext_proc, model + prompt from the JSON body (`chat` strategy)
  4e llmgw body fdx  the same with the request body FULL_DUPLEX_STREAMED (`--body-mode
                     envoy-gateway`): sent without waiting for the headers answer
  2f bare fdx        the bare ext_proc in GIE's FULL_DUPLEX_STREAMED mode (bodies both ways
                     streamed through ext_proc, trailers sent): the floor for 5
  5 llmgw body fdx   llmgw ext_proc (`chat`) in that mode (`envoy-config --body-mode gie`)
  6 latency, sim     llmgw ext_proc (`latency`) in front of 4 simulated engines
                     (`python -m llmgw.sim --kv-events`, zero prefill/decode time), a 2 KB prompt
  7 latency exact    the same with exact matching: `tokenizer: sim` + `kv_events: {discover:
                     true}` (the subscribers follow the engines' events; checked live on
                     llmgw's /metrics before measuring); its floor is 6, so "x CPU of floor"
                     is exact / approximate. h2load repeats one body: the prompt is tokenized
                     once and cached, so 7 - 6 is the per-request lookup, the events and the
                     cache look-up; tokenizing a new prompt is `bench/pick_latency.py`'s row.

Every scenario uses the same generated Envoy config (`llmgw envoy-config`, original-dst
shape, request + response headers sent to ext_proc; 2f and 5 with `--body-mode gie`). For each: req/s, latency p50/p99
(from h2load's per-request log), the ext_proc process's CPU-µs per request (from
/proc/PID/stat before/after) and ratios to (1) and (2)/(2b).

    .venv/bin/python bench/envoy_overhead.py [--duration 6] [--clients 32] [--workers 1]

Prints a table and writes bench/results/envoy_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._tools import find_load_tool, format_table, parse_h2load, write_results  # noqa: E402
from llmgw.config import Config, load_dict  # noqa: E402
from llmgw.runtime.ports import free_port  # noqa: E402
from llmgw.sim.fleet import SimProcess, spawn  # noqa: E402
from llmgw.testing.extproc import EnvoyProcess, loopback_bootstrap, wait_for  # noqa: E402

BODY = json.dumps(
    {
        "model": "m1",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarise the plot of Hamlet in two sentences."},
        ],
        "max_tokens": 64,
    }
).encode()
# Scenarios 6-7: a prompt long enough for several KV blocks (16 tokens of 4 characters).
LONG_BODY = json.dumps(
    {
        "model": "m1",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 70},
            {"role": "user", "content": "Summarise the plot of Hamlet in two sentences."},
        ],
        "max_tokens": 4,
    }
).encode()
HEADERS = {"x-llmgw-model": "m1", "x-session-id": "bench-session-1"}
METRICS_PAGE = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="m1"} 0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m1"} 1\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{model_name="m1"} 0.1\n'
)
TICKS = os.sysconf("SC_CLK_TCK")
# Children import this checkout's llmgw (not whichever one the venv has installed).
_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
}


def upstream_bootstrap(ports: list[int], admin_port: int) -> dict[str, Any]:
    """An Envoy that answers every request itself: the fastest upstream there is."""

    def listener(port: int) -> dict[str, Any]:
        routes = [
            {
                "match": {"path": "/metrics"},
                "direct_response": {"status": 200, "body": {"inline_string": METRICS_PAGE}},
            },
            {
                "match": {"prefix": "/"},
                "direct_response": {
                    "status": 200,
                    "body": {"inline_string": '{"object":"chat.completion","choices":[]}'},
                },
            },
        ]
        hcm = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"up{port}",
            "route_config": {"virtual_hosts": [{"name": "up", "domains": ["*"], "routes": routes}]},
            "http_filters": [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                }
            ],
        }
        return {
            "name": f"up{port}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": hcm,
                        }
                    ]
                }
            ],
        }

    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": [listener(p) for p in ports]},
    }


def llmgw_config(upstreams: list[str], strategy: str, exact: bool = False) -> Config:
    model: dict[str, Any] = {
        "endpoints": upstreams,
        "strategy": strategy,
        "saturation": {"queue_ceiling": 1e9},
    }
    if exact:  # the latency preset, matching on the engines' KV events (README)
        model["kv_events"] = {"discover": True, "resync": 1.0}  # a late join: live in 1 s
        model["strategy"] = {
            "name": "latency-exact",
            "scorers": {
                "latency": {"weight": 1.0, "params": {"tokenizer": "sim"}},
            },
            "filters": ["healthy", "model-serves"],
        }
    return load_dict({"models": {"m1": model}})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime (all threads)


def children_cpu_seconds(pid: int) -> float:
    """CPU of `pid` plus its direct children (the --workers processes)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split() if (task / "children").exists() else []
        total += sum(cpu_seconds(int(c)) for c in children)
    return total


def wait_port(port: int, timeout: float = 15.0) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, timeout, f"port {port}")


@dataclass
class Scenario:
    key: str
    label: str
    extproc: str | None  # None | "bare" | "bare-body" | "bare-fdx" | "llmgw"
    strategy: str = "ring"
    body_mode: str = "override"  # envoy-config --body-mode
    sim: bool = False  # simulated engines (with KV events) instead of the Envoy upstream
    exact: bool = False  # exact matching on the engines' KV events


SCENARIOS = [
    Scenario("1", "envoy -> upstream", None),
    Scenario("2", "+ bare ext_proc (headers)", "bare"),
    Scenario("2b", "+ bare ext_proc (body)", "bare-body"),
    Scenario("3", "+ llmgw headers-only (ring)", "llmgw", "ring"),
    Scenario("4", "+ llmgw body (chat)", "llmgw", "chat"),
    Scenario("2f", "+ bare ext_proc (full duplex)", "bare-fdx", body_mode="gie"),
    Scenario("5", "+ llmgw body (chat, full duplex)", "llmgw", "chat", body_mode="gie"),
    Scenario("4e", "+ llmgw body (chat, req body fdx)", "llmgw", "chat", body_mode="envoy-gateway"),
    Scenario("6", "+ llmgw body (latency), sim engines", "llmgw", "latency", sim=True),
    Scenario("7", "+ llmgw body (latency exact), sim", "llmgw", "latency", sim=True, exact=True),
]
# The floor each scenario is compared with (the bare ext_proc in the same mode; for exact
# matching, the same router without it).
FLOORS = {"2b": "2b", "4": "2b", "4e": "2b", "2f": "2f", "5": "2f", "6": "2b", "7": "6"}


def h2load(
    url: str, duration: float, clients: int, log: Path | None = None, data: bytes = BODY
) -> dict[str, Any]:
    tool = find_load_tool(("h2load",))
    if tool is None:
        raise SystemExit("h2load not found (apt-get install nghttp2-client)")
    with tempfile.NamedTemporaryFile(prefix="bench-body-") as body:
        body.write(data)
        body.flush()
        command = [tool.path, "--h1", "-c", str(clients), "-t", "1", "-D", f"{duration:g}"]
        command += ["-d", body.name, "-H", "content-type: application/json"]
        for name, value in HEADERS.items():
            command += ["-H", f"{name}: {value}"]
        if log is not None:
            command += ["--log-file", str(log)]
        command.append(url + "/v1/chat/completions")
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=duration + 60, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"h2load failed: {done.stderr or done.stdout}")
    return parse_h2load(done.stdout)


def percentiles(log: Path) -> tuple[float, float]:
    """p50, p99 in ms from h2load's log (start µs, status, duration µs per line)."""
    durations = sorted(
        int(line.split()[2]) / 1000.0 for line in log.read_text().splitlines() if line.strip()
    )
    if not durations:
        return float("nan"), float("nan")
    q = statistics.quantiles(durations, n=100, method="inclusive")
    return q[49], q[98]


@contextlib.contextmanager
def scenario_upstreams(scenario: Scenario, shared: list[str]) -> Iterator[list[str]]:
    """The shared direct-response upstreams, or for a `sim` scenario fresh simulated
    engines (their event streams start at sequence 0, so they are live at once)."""
    if not scenario.sim:
        yield shared
        return
    with start_sim(len(shared)) as sim:
        yield [f"{sim.host}:{port}" for port in sim.ports]


def run_scenario(
    scenario: Scenario,
    upstreams: list[str],
    *,
    duration: float,
    clients: int,
    workers: int,
    loop: str,
    scratch: Path,
) -> dict[str, Any]:
    config = llmgw_config(upstreams, scenario.strategy, scenario.exact)
    data = LONG_BODY if scenario.sim else BODY
    grpc_port = free_port()
    metrics_port = free_port()
    process: subprocess.Popen[bytes] | None = None
    if scenario.extproc in ("bare", "bare-body", "bare-fdx"):
        command = [
            sys.executable, str(ROOT / "bench" / "bare_extproc.py"), "--port", str(grpc_port),
            "--destination", upstreams[0],
        ]  # fmt: skip
        if scenario.extproc == "bare-body":
            command.append("--body")
        if scenario.extproc == "bare-fdx":
            command.append("--full-duplex")
        process = subprocess.Popen(command, cwd=ROOT, env=_ENV)
    elif scenario.extproc == "llmgw":
        config_file = scratch / f"llmgw-{scenario.strategy}.yaml"
        config_file.write_text(json.dumps(config.model_dump(mode="json")))
        command = [
            sys.executable, "-m", "llmgw.cli", "extproc", "--config", str(config_file),
            "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--plaintext",
            "--grpc-health-port", "0", "--health-port", str(free_port()),
            "--metrics-port", str(metrics_port), "--log-level", "warning",
            "--workers", str(workers), "--loop", loop,
        ]  # fmt: skip
        process = subprocess.Popen(command, cwd=ROOT, env=_ENV)
    try:
        if process is not None:
            wait_port(grpc_port)
        bootstrap = loopback_bootstrap(
            config,
            f"127.0.0.1:{grpc_port}",
            shape="original-dst",
            body_mode=scenario.body_mode,
        )
        if process is None:  # Envoy alone: drop the ext_proc filter
            hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            filters = hcm["typed_config"]["http_filters"]
            hcm["typed_config"]["http_filters"] = [
                f for f in filters if f["name"] != "envoy.filters.http.ext_proc"
            ]
        with EnvoyProcess(bootstrap) as envoy:
            h2load(envoy.url, min(2.0, duration), clients, data=data)  # warm-up
            if scenario.exact:  # measure only once every engine's events are followed

                def all_live() -> bool:
                    for upstream in upstreams:  # direct requests: every engine publishes
                        _post(f"http://{upstream}/v1/chat/completions", data)
                    return _kv_live(metrics_port) == len(upstreams)

                wait_for(all_live, 20.0, "every engine's KV events live")
            if scenario.extproc == "llmgw":
                time.sleep(0.3)  # let the scraper see the upstream's /metrics at least once
            log = scratch / f"{scenario.key}.log"
            envoy_cpu0 = cpu_seconds(envoy.process.pid)
            cpu0 = children_cpu_seconds(process.pid) if process else 0.0
            result = h2load(envoy.url, duration, clients, log, data=data)
            cpu1 = children_cpu_seconds(process.pid) if process else 0.0
            envoy_cpu1 = cpu_seconds(envoy.process.pid)
        if scenario.exact and _kv_live(metrics_port) != len(upstreams):
            raise RuntimeError("an engine's KV events stopped being live during the run")
        p50, p99 = percentiles(log)
        done = max(1, result["succeeded"])
        return {
            "scenario": scenario.key,
            "label": scenario.label,
            "rps": result["rps"],
            "succeeded": result["succeeded"],
            "failed": result["failed"],
            "non_2xx": result["status_non_2xx"],
            "p50_ms": p50,
            "p99_ms": p99,
            "extproc_cpu_us_per_req": (cpu1 - cpu0) / done * 1e6 if process else 0.0,
            "envoy_cpu_us_per_req": (envoy_cpu1 - envoy_cpu0) / done * 1e6,
        }
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _kv_live(metrics_port: int) -> int:
    """Endpoints whose KV events llmgw follows (`llmgw_kv_events_live` = 1)."""
    import urllib.request  # noqa: PLC0415 (scenario 7 only)

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            page = r.read().decode()
    except OSError:
        return 0
    return sum(
        1
        for line in page.splitlines()
        if line.startswith("llmgw_kv_events_live{") and float(line.rsplit(" ", 1)[1]) == 1.0
    )


def _post(url: str, data: bytes) -> None:
    import urllib.request  # noqa: PLC0415 (scenario 7 only)

    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


def start_sim(replicas: int) -> SimProcess:
    """Simulated engines publishing KV events, as fast as the simulator goes."""
    return spawn(
        ["--replicas", str(replicas), "--base-port", "0", "--kv-events", "--model", "m1",
         "--prefill-us-per-token", "0", "--decode-ms", "0", "--kv-blocks", "4096"]
    )  # fmt: skip


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-field median of several rounds of one scenario (rounds kept alongside)."""
    out = dict(results[0])
    for name, value in results[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = statistics.median(r[name] for r in results)
    out["rounds"] = results
    return out


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key = {r["scenario"]: r for r in runs}
    direct = by_key.get("1")
    rows = []
    for r in runs:
        floor = by_key.get(FLOORS.get(r["scenario"], "2"))
        rows.append(
            {
                "#": r["scenario"],
                "scenario": r["label"],
                "req/s": round(r["rps"]),
                "p50 ms": round(r["p50_ms"], 2),
                "p99 ms": round(r["p99_ms"], 2),
                "+p50 vs 1 ms": round(r["p50_ms"] - direct["p50_ms"], 2) if direct else None,
                "x rps of 1": round(r["rps"] / direct["rps"], 2) if direct else None,
                "x rps of floor": round(r["rps"] / floor["rps"], 2) if floor else None,
                "ext_proc CPU-µs/req": round(r["extproc_cpu_us_per_req"]),
                "x CPU of floor": (
                    round(r["extproc_cpu_us_per_req"] / floor["extproc_cpu_us_per_req"], 2)
                    if floor and floor["extproc_cpu_us_per_req"]
                    else None
                ),
                "envoy CPU-µs/req": round(r["envoy_cpu_us_per_req"]),
                "errors": r["failed"],  # h2load's: network errors and 4xx / 5xx answers
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Envoy + ext_proc overhead benchmark")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per scenario")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="llmgw extproc --workers")
    parser.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    parser.add_argument("--only", default="", help="comma-separated scenario keys (default: all)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over all scenarios; the median is kept"
    )
    parser.add_argument("--name", default="envoy_overhead", help="results file name")
    args = parser.parse_args(argv)
    wanted = {k for k in args.only.split(",") if k}
    ports = [free_port() for _ in range(4)]
    upstreams = [f"127.0.0.1:{p}" for p in ports]
    rounds: dict[str, list[dict[str, Any]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="llmgw-bench-") as scratch,
        EnvoyProcess(upstream_bootstrap(ports, free_port())),
    ):
        # Rounds interleave the scenarios, so a burst of load from elsewhere hits all of them.
        for _ in range(args.repeat):
            for scenario in SCENARIOS:
                if wanted and scenario.key not in wanted:
                    continue
                print(f"running {scenario.key}: {scenario.label}", file=sys.stderr, flush=True)
                with scenario_upstreams(scenario, upstreams) as targets:
                    result = run_scenario(
                        scenario,
                        targets,
                        duration=args.duration,
                        clients=args.clients,
                        workers=args.workers,
                        loop=args.loop,
                        scratch=Path(scratch),
                    )
                rounds.setdefault(scenario.key, []).append(result)
    runs = [median_run(results) for results in rounds.values()]
    rows = table(runs)
    print(format_table(rows))
    path = write_results(
        args.name,
        {
            "tool": "h2load --h1",
            "clients": args.clients,
            "duration_s": args.duration,
            "workers": args.workers,
            "repeat": args.repeat,
            "loop": args.loop,
            "cpus": os.cpu_count(),
            "runs": runs,
            "table": rows,
        },
    )
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
