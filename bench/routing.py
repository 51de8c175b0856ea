"""Routing quality as a regime grid: every llmgw preset through the real Envoy, `llmgw
proxy`, the Rust peer routers and client-side routing, on the same simulated replicas,
over a named list of cells that spans load x prompt mix x sessions x cache pressure.

    .venv/bin/python bench/routing.py                  # 12 cells, ~25 min on 2 cores
    .venv/bin/python bench/routing.py --quick          # 3 cells, 8 contenders, < 5 min
    .venv/bin/python bench/routing.py --cells chat-history,docs-shared --only envoy:chat
    .venv/bin/python bench/routing.py --list           # the cells and contenders
    .venv/bin/python bench/routing.py --seeds 1,2,3    # three runs, requests pooled per cell

Cells (`bench/workloads/grid.py`, `REGIMES`): load 0.3 / 0.6 / 0.85 of a capacity
computed from the simulator's parameters (`EngineSpeed`: prefill cost per uncached
token, decode step, batch and KV limits, with ideal prefix reuse), prompt mixes (short
chat, long growing histories, long documents, prefill-heavy, decode-heavy), sessions
(none / many cold / few hot Zipf) and cache pressure (working set 0.4x or ~2.5x the
fleet's KV cache). Low- and high-pressure cells run on two fleets that differ only in
KV blocks (`KV_BLOCKS`), so pressure is the working set over the cache in earnest.

What runs: 4 simulated vLLM replicas (`llmgw sim`, chunked prefill, prefix cache with
LRU eviction, vLLM metric names; `SIM_ARGS`), then one contender at a time: llmgw
through Envoy (`envoy-config --shape override-host`) with every preset in
`llmgw.scheduling.strategies.PRESETS` (minus `SKIPPED_PRESETS`; a new preset such as
`latency` appears by itself), `llmgw proxy` with the default strategy, vllm-router
(consistent_hash, cache_aware, sticky_least_loaded), sglang-router (cache_aware), and
client-side routing (`client:ring`: the load client hashes the session id on the
Ray-compatible ring straight to a replica; `client:round-robin`).

Load: `bench/loadclient.py` replays each cell open loop (Poisson conversation starts,
multi-turn with think times); TTFT is timed on the client at the first chunk carrying
content (the role chunk does not count). Before each run the replicas drain and reset
(prefix caches cleared); a replica still busy after 60 s, or one that refuses the reset,
skips the contender (printed with why). Per cell and contender: TTFT p50/p90/p99, e2e p90, output
tokens/s, prefix hit rate (simulator counters), requests per replica max/mean, errors
and 429s; each p90 with a 95 % interval (order statistics: a cell of ~160 requests
cannot tell 1.05x apart, so `--seeds` pools several runs' requests per cell). Writes
bench/results/routing_grid.json and routing_grid_heatmap.png (TTFT p90 over the best
contender of the cell). Compare contenders within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import aiohttp  # noqa: E402
import yaml  # noqa: E402

from bench._tools import FAIL, format_table, write_results  # noqa: E402
from bench.loadclient import (  # noqa: E402
    CHAT_PATH,
    RequestRecord,
    UrlPicker,
    ring_picker,
    round_robin_picker,
    run,
)
from bench.peers import (  # noqa: E402
    PEER_POLICIES,
    Service,
    add_install_option,
    ensure_peers,
    peer_command,
)
from bench.workloads import Workload, percentile, quantile_interval  # noqa: E402
from bench.workloads.grid import (  # noqa: E402
    QUICK_REGIMES,
    REGIMES,
    EngineSpeed,
    Regime,
    regime_workload,
)
from llmgw.extproc.envoyconfig import BODY_MODES  # noqa: E402
from llmgw.runtime.ports import free_port  # noqa: E402
from llmgw.scheduling.strategies import PRESETS  # noqa: E402
from llmgw.sim.fleet import spawn  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
MODEL = "m1"
REPLICAS = 4

# Simulated engine, wall time (time scale 1): 60 us a prefill token (3,000 uncached tokens
# = 180 ms), 25 ms decode steps (+3 % per extra sequence), 8 sequences a replica, chunked
# prefill at 2,048 tokens a step. Small enough rates for 2 cores: ~15-75 req/s at capacity.
PREFILL_US, DECODE_MS, BATCH_FACTOR, MAX_SEQS, BLOCK = 60.0, 25.0, 0.03, 8, 16
# KV blocks a replica per pressure level: 4096 (65k tokens) holds a 0.4x working set;
# 768 (12k tokens) puts the ~2.5x cells' working set well above the fleet's cache.
KV_BLOCKS = {"low": 4096, "high": 768}


def _stem(contender: str) -> str:
    """A contender's name as a file name (`envoy:latency/gie` -> `envoy-latency-gie`)."""
    return re.sub(r"[:/]", "-", contender)


def records_file(folder: Path, contender: str, cell: str) -> Path:
    """Where a contender's requests on a cell are written (`--trace`, pooled seeds), named
    as its trace is (`_stem`)."""
    return folder / f"{_stem(contender)}@{cell}.records.jsonl"


def pressure_level(regime: Regime) -> str:
    return "high" if regime.pressure > 1 else "low"


def sim_args(level: str, base_port: int) -> list[str]:
    return [
        "--replicas", str(REPLICAS), "--base-port", str(base_port), "--model", MODEL,
        "--time-scale", "1", "--prefill-us-per-token", str(PREFILL_US),
        "--decode-ms", str(DECODE_MS), "--decode-batch-factor", str(BATCH_FACTOR),
        "--max-num-seqs", str(MAX_SEQS), "--max-queue", "4096",
        "--kv-blocks", str(KV_BLOCKS[level]), "--block-size", str(BLOCK),
        "--max-model-len", "16384", "--max-num-batched-tokens", "2048",
    ]  # fmt: skip


def engine_speed(level: str) -> EngineSpeed:
    return EngineSpeed(
        replicas=REPLICAS,
        prefill_s_per_token=PREFILL_US / 1e6,
        decode_step_s=DECODE_MS / 1e3,
        decode_batch_factor=BATCH_FACTOR,
        max_num_seqs=MAX_SEQS,
        kv_tokens_per_replica=KV_BLOCKS[level] * BLOCK,
    )


def base_port(count: int = REPLICAS) -> int:
    """Fixed ports for `count` replicas when all are free: ring positions hash the
    addresses, so fixed ports keep the ring's placement (and its imbalance) the same
    every run."""
    for base in (18100, 28100, 38100):
        if all(_port_free(base + i) for i in range(count)):
            return base
    return 0


def _port_free(port: int) -> bool:
    import socket  # noqa: PLC0415

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Contender:
    name: str
    edge: str  # envoy | envoy2 | asgi | asgi2 | vllm-router | sglang-router | client
    strategy: str | dict[str, Any] | None = None
    policy: str | None = None
    body_mode: str = "override"  # envoy: `llmgw envoy-config --body-mode`


# Edges that run two llmgw replicas (a deployment question: their contenders run when named).
REPLICATED = frozenset({"asgi2", "envoy2"})

# Presets that are not routing policies for this traffic (throughput / long-context
# tunings) or only noise (`random`); every other preset is a contender automatically.
SKIPPED_PRESETS = frozenset({"batch", "long-context", "random"})


def add_body_mode_option(parser: argparse.ArgumentParser) -> None:
    """`--body-mode MODE` (repeatable): extra `envoy:latency/MODE` contenders."""
    parser.add_argument(
        "--body-mode",
        dest="body_modes",
        action="append",
        default=[],
        choices=[m for m in BODY_MODES if m != "override"],
        help="extra contender: the default strategy through Envoy with this ext_proc body "
        "mode (`envoy:latency/MODE`; the others use `override`)",
    )


def body_mode_contenders(modes: list[str]) -> list[Contender]:
    return [Contender(f"envoy:latency/{m}", "envoy", "latency", body_mode=m) for m in modes]


def add_try_option(parser: argparse.ArgumentParser) -> None:
    """`--try [EDGE:]NAME=JSON` (repeatable): an llmgw contender with an explicit strategy."""
    parser.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="[EDGE:]NAME=JSON",
        help="extra llmgw contender with an explicit strategy, through Envoy (`envoy:`, the "
        "default) or `llmgw proxy` (`asgi:`); the JSON is a strategy as in the config (one "
        "preset's scorers alone: that preset tuned, its filters and picker unless given), "
        'e.g. x={"scorers": {"load": 1}} or asgi:nophase={"scorers": {"latency": '
        '{"params": {"step_phase": false}}}}',
    )


def try_contenders(parser: argparse.ArgumentParser, specs: list[str]) -> list[Contender]:
    """`--try` specs as contenders named `EDGE:NAME`; a malformed one, or a name a built-in
    contender or another `--try` has, is a usage error."""
    out: list[Contender] = []
    taken = {c.name for c in all_contenders()} | {
        c.name for c in body_mode_contenders(list(BODY_MODES))
    }
    for spec in specs:
        label, eq, strategy = spec.partition("=")
        edge, colon, name = label.rpartition(":")
        edge = edge if colon else "envoy"
        if not eq or not name or edge not in ("envoy", "asgi"):
            parser.error(f"--try {spec!r}: write [envoy:|asgi:]NAME=JSON")
        if f"{edge}:{name}" in taken:
            parser.error(f"--try {edge}:{name}: that name is taken; give the strategy another")
        taken.add(f"{edge}:{name}")
        try:
            parsed = json.loads(strategy)
        except json.JSONDecodeError as e:
            parser.error(f"--try {label}: the strategy is not JSON ({e})")
        if not isinstance(parsed, dict):
            parser.error(f"--try {label}: the strategy must be a JSON object, got {strategy}")
        out.append(Contender(f"{edge}:{name}", edge, parsed))
    return out


def all_contenders() -> list[Contender]:
    out = [
        Contender(f"envoy:{name}", "envoy", name) for name in PRESETS if name not in SKIPPED_PRESETS
    ]
    out.append(Contender("asgi:default", "asgi", None))
    # Two `llmgw proxy` replicas behind a balancer that picks one per request at random
    # (an HA deployment), alone or sharing what they route (`peers:`). Run when named.
    out.append(Contender("asgi2:default", "asgi2", None))
    out.append(Contender("asgi2:peers", "asgi2", None, policy="peers"))
    # Two `llmgw extproc` replicas behind one Envoy (its ext_proc cluster balances the
    # streams over both): the Kubernetes example's shape. Run when named.
    out.append(Contender("envoy2:default", "envoy2", None))
    out.append(Contender("envoy2:peers", "envoy2", None, policy="peers"))
    for policy in ("consistent_hash", "cache_aware", "sticky_least_loaded"):
        out.append(Contender(f"vllm-router:{policy}", "vllm-router", policy=policy))
    out.append(Contender("sglang-router:cache_aware", "sglang-router", policy="cache_aware"))
    # The same policies with the values their documentation recommends (`peers.DOCS_ARGS`).
    out.append(Contender("vllm-router:cache_aware-docs", "vllm-router", policy="cache_aware-docs"))
    out.append(
        Contender("sglang-router:cache_aware-docs", "sglang-router", policy="cache_aware-docs")
    )
    out.append(Contender("client:ring", "client", policy="ring"))
    out.append(Contender("client:round-robin", "client", policy="round-robin"))
    return out


QUICK_CONTENDERS = (
    "envoy:chat",
    "envoy:latency",
    "envoy:ring",
    "envoy:round-robin",
    "asgi:default",
    "vllm-router:consistent_hash",
    "sglang-router:cache_aware",
    "client:ring",
)


# -- the llmgw side ------------------------------------------------------------------------


def llmgw_config(
    upstreams: list[str], strategy: str | dict[str, Any] | None, trace: Path | None = None
) -> dict[str, Any]:
    """The config a new user writes; `strategy` None = the default strategy; `trace`: write
    llmgw's decision trace (JSONL, every request) there."""
    model: dict[str, Any] = {
        "engine": "vllm",
        "endpoints": [u.removeprefix("http://") for u in upstreams],
        "session": {"headers": ["x-session-id"]},
    }
    if strategy is not None:
        model["strategy"] = strategy
    return {
        "models": {MODEL: model},
        # No `scrape` stanza: llmgw's defaults (every 0.1 s, stale after 2 s), as users run
        # it; this grid scraped every 0.05 s (stale after 1 s) until session 6.
        "debug_headers": True,
        "seed": 7,
        "destination_fallbacks": True,  # override-host: Envoy retries down the list
        **({"trace": {"path": str(trace)}} if trace is not None else {}),
    }


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _envoy() -> str:
    found = Path(_python()).with_name("envoy")
    return str(found) if found.exists() else shutil.which("envoy") or "envoy"


@contextlib.contextmanager
def _envoy_with_extprocs(
    configs: list[Path], body_mode: str, port: int, scratch: Path
) -> Iterator[None]:
    """Envoy listening on `port`, its ext_proc cluster balancing over one `llmgw extproc`
    per config (round robin per stream: per request)."""
    python = _python()
    grpc = [free_port() for _ in configs]
    admin = free_port()
    envoy_yaml = scratch / "envoy.yaml"
    subprocess.run(
        [python, "-m", "llmgw.cli", "envoy-config", "--config", str(configs[0]),
         "--shape", "override-host", "--listen", f"127.0.0.1:{port}",
         "--admin", f"127.0.0.1:{admin}",
         "--extproc", ",".join(f"127.0.0.1:{g}" for g in grpc),
         "--body-mode", body_mode, "--out", str(envoy_yaml)],
        check=True, cwd=ROOT,
    )  # fmt: skip
    envoy = [_envoy(), "-c", str(envoy_yaml), "--disable-hot-restart"]
    envoy += ["--concurrency", "1", "-l", "warning"]
    with contextlib.ExitStack() as stack:
        for k, (config, g) in enumerate(zip(configs, grpc, strict=True)):
            health, metrics = free_port(), free_port()
            extproc = [python, "-m", "llmgw.cli", "extproc", "--config", str(config)]
            extproc += ["--host", "127.0.0.1", "--grpc-port", str(g), "--grpc-health-port"]
            extproc += ["0", "--health-port", str(health), "--metrics-port", str(metrics)]
            extproc += ["--log-level", "warning"]
            ready = f"http://127.0.0.1:{health}/readyz"
            stack.enter_context(Service(extproc, ready, name=f"llmgw-extproc-{k}"))
        stack.enter_context(Service(envoy, f"http://127.0.0.1:{admin}/ready", name="envoy"))
        yield


@contextlib.contextmanager
def start_contender(
    contender: Contender,
    upstreams: list[str],
    peers: dict[str, str],
    scratch: Path,
    trace_dir: Path | None = None,
) -> Iterator[str]:
    """Run the contender; yield its base URL (no trailing slash; "" = client-side). llmgw
    contenders write their decision trace to `trace_dir`/<contender>.jsonl if given."""
    python = _python()
    port = free_port()
    if contender.edge == "client":
        yield ""
        return
    if contender.edge in REPLICATED:
        listen = [free_port(), free_port()]
        configs: list[Path] = []
        for k in range(2):
            replica = llmgw_config(upstreams, contender.strategy)
            if contender.policy == "peers":
                replica["peers"] = {
                    "listen": f"127.0.0.1:{listen[k]}",
                    "addresses": [f"127.0.0.1:{p}" for p in listen],
                }
            configs.append(scratch / f"{contender.edge}-{k}.yaml")
            configs[k].write_text(yaml.safe_dump(replica))
        if contender.edge == "asgi2":
            ports = [port, free_port()]
            with contextlib.ExitStack() as stack:
                for k, proxy_port in enumerate(ports):
                    cmd = [python, "-m", "llmgw.cli", "proxy", "--config", str(configs[k])]
                    cmd += ["--port", str(proxy_port)]
                    ready = f"http://127.0.0.1:{proxy_port}/readyz"
                    stack.enter_context(Service(cmd, ready, name=f"llmgw-proxy-{k}"))
                yield " ".join(f"http://127.0.0.1:{p}" for p in ports)
            return
        with _envoy_with_extprocs(configs, contender.body_mode, port, scratch):
            yield f"http://127.0.0.1:{port}"
        return
    if contender.edge in ("envoy", "asgi"):
        stem = _stem(contender.name)
        config = scratch / f"{stem}.yaml"
        trace = trace_dir / f"{stem}.jsonl" if trace_dir is not None else None
        config.write_text(yaml.safe_dump(llmgw_config(upstreams, contender.strategy, trace)))
        if contender.edge == "asgi":
            cmd = [python, "-m", "llmgw.cli", "proxy", "--config", str(config)]
            cmd += ["--port", str(port)]
            with Service(cmd, f"http://127.0.0.1:{port}/readyz", name="llmgw-proxy"):
                yield f"http://127.0.0.1:{port}"
            return
        with _envoy_with_extprocs([config], contender.body_mode, port, scratch):
            yield f"http://127.0.0.1:{port}"
        return
    assert contender.policy is not None
    cmd = peer_command(contender.edge, peers, port, upstreams, policy=contender.policy)
    with Service(cmd, f"http://127.0.0.1:{port}/health", name=contender.edge, timeout=60):
        yield f"http://127.0.0.1:{port}"


# -- the simulators' side ------------------------------------------------------------------

_SAMPLE = re.compile(rb"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)", re.MULTILINE)
_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)


def parse_metrics(text: bytes) -> dict[str, float]:
    """Sum of each vllm: sample over its labels (enough: one model, one engine)."""
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        key = name.decode()
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _in_engine(m: dict[str, float]) -> float:
    """Requests running or waiting on one replica's scrape."""
    return m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)


def _went_down(now: dict[str, float], then: dict[str, float]) -> bool:
    """A counter is below its earlier value: the replica restarted in between."""
    return any(now.get(k, 0.0) < then.get(k, 0.0) for k in _COUNTERS)


async def scrape_all(
    http: aiohttp.ClientSession, upstreams: list[str], path: str = "/metrics"
) -> list[dict[str, float]]:
    """Every replica's metrics; `path` where the bench reads them (the xsim engine serves
    them at `/xsim/metrics` whatever it publishes to routers)."""

    async def one(url: str) -> dict[str, float]:
        async with http.get(url + path) as response:
            return parse_metrics(await response.read())

    return list(await asyncio.gather(*(one(u) for u in upstreams)))


async def reset_all(
    http: aiohttp.ClientSession, upstreams: list[str], path: str = "/metrics"
) -> None:
    """Wait until every replica is idle, then clear faults and prefix caches. RuntimeError
    (the caller skips the contender) when replicas are still busy after 60 s or one
    refuses the reset (xsim answers 409 while busy): a run would start on the previous
    one's cache and queue."""
    deadline = time.monotonic() + 60
    while True:
        snapshot = await scrape_all(http, upstreams, path)
        busy = {u: _in_engine(m) for u, m in zip(upstreams, snapshot, strict=True)}
        busy = {u: n for u, n in busy.items() if n}
        if not busy:
            break
        if time.monotonic() > deadline:
            where = ", ".join(f"{u}: {n:g} request(s)" for u, n in busy.items())
            raise RuntimeError(f"replicas still busy after 60 s: {where}; not reset")
        await asyncio.sleep(0.1)  # draining stragglers of the previous run
    for url in upstreams:
        async with http.post(url + "/admin/reset") as response:
            body = await response.read()
            if not 200 <= response.status < 300:
                text = body[:200].decode("utf-8", "replace")
                raise RuntimeError(f"{url}/admin/reset answered {response.status}: {text}")


@dataclass
class LoadSampler:
    """Polls running + waiting per replica every `interval` s while a run goes on; a replica
    that does not answer counts as idle (it is down), one whose counters went down since
    its last sample restarted (`restarted`)."""

    upstreams: list[str]
    path: str = "/metrics"
    interval: float = 0.25
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    restarted: bool = False
    _last: dict[int, dict[str, float]] = field(default_factory=dict)

    async def _scrape(self, http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            return (await scrape_all(http, [url], self.path))[0]
        return None

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            snapshot = await asyncio.gather(*(self._scrape(http, u) for u in self.upstreams))
            busy = []
            for i, m in enumerate(snapshot):
                if m is None:
                    busy.append(0)
                    continue
                self.restarted |= _went_down(m, self._last.get(i, {}))
                self._last[i] = m
                busy.append(int(_in_engine(m)))
            self.samples.append((round(time.perf_counter() - t0, 3), busy))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


# -- one run -------------------------------------------------------------------------------


def _ms(value: float) -> float | None:
    """Milliseconds; None when there is no value or it falls on a failed request (+inf)."""
    return None if math.isnan(value) or math.isinf(value) else round(value * 1e3, 1)


def _censored(times: list[float], failed: int) -> list[float]:
    """`times` with each failed request (error, 429, timeout, no content) as +inf: a
    request that got no answer is slower than every one that did. Dropping them would let
    a contender that times out its slowest requests read a lower p90."""
    return times + [math.inf] * failed


def _ttfts(records: Iterable[RequestRecord]) -> tuple[list[float], int]:
    """The first-token times of the requests that got one, censored (`_censored`) by the
    streamed requests that got none; and how many got none. A stream that failed after
    its first token keeps that token's time (it still counts among the errors)."""
    ttfts: list[float] = []
    failed = 0
    for r in records:
        if r.ttft_s is not None:
            ttfts.append(r.ttft_s)
        elif r.stream:
            failed += 1
    return _censored(ttfts, failed), failed


def _busy_max_mean(samples: list[tuple[float, list[int]]]) -> float | None:
    """Max over replicas of time-averaged running + waiting, over its mean across replicas."""
    if not samples:
        return None
    per_replica = [sum(col) / len(samples) for col in zip(*(s[1] for s in samples), strict=True)]
    mean = sum(per_replica) / len(per_replica)
    return round(max(per_replica) / mean, 2) if mean else None


def summarize(
    records: list[RequestRecord],
    wall: float,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    samples: list[tuple[float, list[int]]],
    restarted: bool = False,
) -> dict[str, Any]:
    """`restarted`: some replica restarted during the run (the sampler saw its counters go
    down); also seen here when its counters end below where they started."""
    ok = [r for r in records if r.ok]
    ttfts, failed_streamed = _ttfts(records)
    e2es = _censored([r.e2e_s for r in ok if r.e2e_s is not None], len(records) - len(ok))

    def delta(key: str) -> list[float]:
        # A counter that went down means its replica restarted during the run: count from
        # zero, as Prometheus' increase() does (what it did before the restart is lost).
        return [
            a.get(key, 0.0) - b.get(key, 0.0)
            if a.get(key, 0.0) >= b.get(key, 0.0)
            else a.get(key, 0.0)
            for a, b in zip(after, before, strict=True)
        ]

    restarted = restarted or any(_went_down(a, b) for a, b in zip(after, before, strict=True))

    queries, hits = sum(delta(_COUNTERS[0])), sum(delta(_COUNTERS[1]))
    served = [int(v) for v in delta(_COUNTERS[2])]
    mean_served = sum(served) / len(served) if served else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    # Tokens the engines generated that no client read (answers of clients that stopped
    # early and were not aborted; retried attempts): counted when the run ends; unknown
    # if a replica restarted (its count before the restart is gone).
    generated = 0.0 if restarted else sum(delta(_COUNTERS[3]))
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.status else (r.error or "error").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "rejected_429": errors.get("429", 0),
        "error_kinds": errors,
        "wall_s": round(wall, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        # Where the p90 of this workload's requests could have fallen (95 %): a
        # contender's lead inside the others' intervals is not a finding.
        "ttft_p90_ci_ms": [_ms(v) for v in quantile_interval(ttfts, 90)],
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "e2e_p50_ms": _ms(percentile(e2es, 50)),
        "e2e_p90_ms": _ms(percentile(e2es, 90)),
        "output_tok_s": round(out_tokens / wall, 1) if wall else 0.0,
        "unread_tokens": round(1 - out_tokens / generated, 3) if generated else None,
        "req_s": round(len(ok) / wall, 1) if wall else 0.0,
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "prefill_tokens": int(queries - hits),
        "served_per_replica": served,  # since its restart, for a replica that restarted
        "restarted": restarted,
        "load_max_mean": round(max(served) / mean_served, 2) if mean_served else None,
        "busy_max_mean": _busy_max_mean(samples),
        "ttft_quantiles_ms": [_ms(percentile(ttfts, q)) for q in range(0, 101, 2) if ttfts],
        "ttft_failed": failed_streamed,  # in the percentiles above as +inf
        "load_samples": samples,
    }


async def run_one(
    base_url: str,
    upstreams: list[str],
    workload: Workload,
    timeout_s: float,
    pick_url: UrlPicker | None = None,
    metrics_path: str = "/metrics",
    records_to: Path | None = None,
) -> dict[str, Any]:
    """One workload against one contender: the summary; with `records_to`, each request's
    record as a JSON line there too (turn, replica, TTFT: where the tail comes from)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await reset_all(http, upstreams, metrics_path)
        before = await scrape_all(http, upstreams, metrics_path)
        sampler = LoadSampler(upstreams, metrics_path)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(http, stop))
        try:
            records, wall = await run(
                base_url + "/v1/chat/completions",
                MODEL,
                workload,
                timeout_s=timeout_s,
                pick_url=pick_url,
            )
        finally:
            stop.set()
            await sampling
        await asyncio.sleep(0.3)  # let the last counters settle (responses end before steps)
        after = await scrape_all(http, upstreams, metrics_path)
    summary = summarize(records, wall, before, after, sampler.samples, sampler.restarted)
    if records_to is not None:
        with records_to.open("w") as out:
            out.writelines(json.dumps(r.to_json()) + "\n" for r in records)
    decisions = [r.decision for r in records if r.decision]
    if decisions:
        summary["decision_examples"] = decisions[:3]
    return summary


async def warm_up(base_url: str) -> None:
    """One tiny request until the contender routes (Envoy + ext_proc connect lazily); each
    of several space-separated base URLs."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as http:
        for url in base_url.split():
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} never answered 200")
                await asyncio.sleep(0.2)  # the contender is still connecting upstream


# -- report --------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("contender", "contender"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p90_ms", "TTFT p90"),
    ("ttft_p90_ci_ms", "p90 95% CI"),
    ("ttft_p99_ms", "TTFT p99"),
    ("e2e_p90_ms", "e2e p90"),
    ("output_tok_s", "out tok/s"),
    ("req_s", "req/s"),
    ("prefix_hit_rate", "hit rate"),
    ("load_max_mean", "served max/mean"),
    ("busy_max_mean", "busy max/mean"),
    ("errors", "errors"),
    ("rejected_429", "429s"),
    ("vs_best", "p90/best"),
)


def table(rows: dict[str, dict[str, Any]]) -> str:
    """One cell's contenders; a TTFT percentile that fell on a failed request reads `fail`
    (an e2e percentile on one that never ended too)."""
    best = best_p90(rows)
    out = []
    for name, r in rows.items():
        row = {label: name if key == "contender" else r.get(key) for key, label in TABLE_COLUMNS}
        for key, label in TABLE_COLUMNS:
            counted = "errors" if key.startswith("e2e_") else "ttft_failed"
            if key.endswith("_ms") and r.get(key) is None and r.get(counted):
                row[label] = FAIL
        row["p90/best"] = vs_best(r, best)
        bounds = r.get("ttft_p90_ci_ms")
        row["p90 95% CI"] = (
            "-".join("fail" if v is None else f"{v:.0f}" for v in bounds) if bounds else None
        )
        out.append(row)
    return format_table(out)


def best_p90(rows: dict[str, dict[str, Any]]) -> float | None:
    values = [r["ttft_p90_ms"] for r in rows.values() if r.get("ttft_p90_ms") and not r["errors"]]
    values = values or [r["ttft_p90_ms"] for r in rows.values() if r.get("ttft_p90_ms")]
    return min(values) if values else None


def above_best(row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> bool:
    """`row`'s p90 interval lies wholly above that of the cell's best contender (a loss
    the requests measured, not the noise of which ones ran)."""
    best = best_p90(rows)
    if best is None or not row.get("ttft_p90_ci_ms"):
        return False
    # A None bound fell on a failed request (+inf in the percentiles).
    lo = row["ttft_p90_ci_ms"][0]
    lo = math.inf if lo is None else lo
    highs = [
        math.inf if r["ttft_p90_ci_ms"][1] is None else r["ttft_p90_ci_ms"][1]
        for r in rows.values()
        if r.get("ttft_p90_ms") == best and r.get("ttft_p90_ci_ms")
    ]
    return bool(highs) and lo > max(highs)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def fell_on_failure(row: dict[str, Any]) -> bool:
    """`row`'s TTFT p90 fell on a failed request (+inf in the percentiles, written None):
    slower than any answer, where None with nothing failed means no TTFT to read."""
    return row.get("ttft_p90_ms") is None and bool(row.get("ttft_failed"))


def vs_best(row: dict[str, Any] | None, best: float | None) -> float | str | None:
    """A row's TTFT p90 over the cell's best: None where it did not run (tables print
    `-`), `fail` where it fell on a failed request."""
    if row is None:
        return None
    return FAIL if fell_on_failure(row) else _ratio(row.get("ttft_p90_ms"), best)


HEAT_MAX = 4.0  # the heat map's top colour: this many times the best, or more, or `fail`


def heat_cells(
    results: dict[str, dict[str, dict[str, Any]]],
) -> tuple[list[str], list[str], list[list[float]], list[list[str]]]:
    """The heat map's cells (columns), contenders (rows), their values (p90 over the cell's
    best; NaN blank: not run; `HEAT_MAX` for a p90 on a failed request) and labels."""
    cells = [c for c in results if results[c]]
    contenders = list(dict.fromkeys(name for c in cells for name in results[c]))
    values: list[list[float]] = []
    labels: list[list[str]] = []
    for name in contenders:
        value_row: list[float] = []
        label_row: list[str] = []
        for cell in cells:
            ratio = vs_best(results[cell].get(name), best_p90(results[cell]))
            if ratio == FAIL:
                value_row.append(HEAT_MAX)
                label_row.append(FAIL)
            elif isinstance(ratio, float | int):
                value_row.append(ratio)
                label_row.append(f"{ratio:.2f}")
            else:
                value_row.append(math.nan)
                label_row.append("-")
        values.append(value_row)
        labels.append(label_row)
    return cells, contenders, values, labels


def heatmap(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path | None:
    """Rows contenders, columns cells: TTFT p90 over the cell's best contender."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.colors import LogNorm  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no heat map (.venv/bin/pip install matplotlib)")
        return None
    cells, contenders, grid, labels = heat_cells(results)
    if not cells or not contenders:
        return None
    fig, ax = plt.subplots(figsize=(1.0 * len(cells) + 3, 0.42 * len(contenders) + 1.8))
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=LogNorm(vmin=1.0, vmax=HEAT_MAX), aspect="auto")
    ax.set_xticks(range(len(cells)), cells, rotation=40, ha="right", fontsize=8)
    ax.set_yticks(range(len(contenders)), contenders, fontsize=8)
    for i, row in enumerate(labels):
        for j, label in enumerate(row):
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
    ax.set_title("TTFT p90 / best contender of the cell (1.00 = best)")
    bar = fig.colorbar(image, ax=ax, fraction=0.03)
    bar.set_ticks([1.0, 1.5, 2.0, 3.0, HEAT_MAX])
    bar.set_ticklabels(["1", "1.5", "2", "3", ">=4, fail"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# -- main ----------------------------------------------------------------------------------


def _selected(names: str | None, known: list[str], what: str) -> list[str]:
    if not names:
        return known
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return wanted


def select_contenders(
    parser: argparse.ArgumentParser, args: argparse.Namespace, contenders: list[Contender]
) -> list[Contender]:
    """The built-in contenders `--only` names (else the quick set, else all but replicated
    edges), then the `--try` and `--body-mode` ones, which always run and `--only` may name."""
    extra = try_contenders(parser, args.tries) + body_mode_contenders(args.body_modes)
    if args.only:
        known = [c.name for c in contenders] + [c.name for c in extra]
        wanted = _selected(args.only, known, "contenders")
        chosen = [c for c in contenders if c.name in wanted]
    elif args.quick:
        chosen = [c for c in contenders if c.name in QUICK_CONTENDERS]
    else:  # router replicas are a deployment question, asked by name
        chosen = [c for c in contenders if c.edge not in REPLICATED]
    return chosen + extra


def _picker(contender: Contender, upstreams: list[str], base: str = "") -> UrlPicker | None:
    """Client-side routing, or the balancer in front of several router replicas (`base`
    lists their URLs): one at random per request, seeded."""
    if contender.edge == "asgi2":
        urls = base.split()
        rng = random.Random(11)
        return lambda conv, turn: rng.choice(urls) + CHAT_PATH
    if contender.edge != "client":
        return None
    return ring_picker(upstreams) if contender.policy == "ring" else round_robin_picker(upstreams)


def _run_group(
    level: str,
    cells: dict[str, tuple[Regime, Workload]],
    contenders: list[Contender],
    peers: dict[str, str],
    timeout_s: float,
    results: dict[str, dict[str, dict[str, Any]]],
    records_dir: Path | None = None,
    trace_dir: Path | None = None,
) -> None:
    """All `cells` of one pressure level on one fleet; each contender started once (its
    state, calibration and prefix index carry from one cell to the next, as in a router
    that has run a while). Requests' records go to `records_dir`, llmgw's decision trace
    to `trace_dir` (`--trace` only: pooling's records turned the trace on, a cost only
    llmgw's contenders paid)."""
    port = base_port()
    with (
        tempfile.TemporaryDirectory(prefix="bench-routing-") as scratch_dir,
        spawn(sim_args(level, port), stdout=subprocess.DEVNULL) as sim,
    ):
        scratch = Path(scratch_dir)
        upstreams = list(sim.urls)
        for contender in contenders:
            t = time.monotonic()
            try:
                with start_contender(contender, upstreams, peers, scratch, trace_dir) as base:
                    if base:
                        asyncio.run(warm_up(base))
                    for name, (_, workload) in cells.items():
                        summary = asyncio.run(
                            run_one(
                                base,
                                upstreams,
                                workload,
                                timeout_s,
                                _picker(contender, upstreams, base),
                                records_to=None
                                if records_dir is None
                                else records_file(records_dir, contender.name, name),
                            )
                        )
                        summary["offered_req_s"] = workload.params["offered_req_s"]
                        results[name][contender.name] = summary
                        print(
                            f"  {contender.name:30s} {name:20s} TTFT p90 "
                            f"{summary['ttft_p90_ms']} ms, hit {summary['prefix_hit_rate']}, "
                            f"load {summary['load_max_mean']}, errors {summary['errors']} "
                            f"({summary['wall_s']} s)",
                            flush=True,
                        )
            except RuntimeError as exc:
                print(f"  {contender.name}: failed: {exc}")
                continue
            print(f"  ({contender.name}, {level} pressure: {time.monotonic() - t:.0f} s)")


def _run_seed(
    args: argparse.Namespace,
    seed: int,
    cell_names: list[str],
    contenders: list[Contender],
    peers: dict[str, str],
    records: Path | None,
    trace: Path | None = None,
) -> tuple[dict[str, tuple[Regime, Workload]], dict[str, dict[str, dict[str, Any]]], list[Any]]:
    """One seed's grid: (its cells' workloads, results per cell and contender, the rows of
    TTFT p90 / best); prints each cell's table and the summary."""
    window = args.window or (5.0 if args.quick else None)
    groups: dict[str, dict[str, tuple[Regime, Workload]]] = {}
    for name in cell_names:
        regime = REGIMES[name]
        if window is not None:
            regime = Regime(**{**regime.__dict__, "window_s": window})
        level = pressure_level(regime)
        workload = regime_workload(regime, engine_speed(level), seed=seed)
        groups.setdefault(level, {})[name] = (regime, workload)
        print(f"cell {name}: {workload.description}; {workload.requests} requests")
    results: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in cell_names}
    for level, cells in groups.items():
        print(f"== fleet with {KV_BLOCKS[level]} KV blocks a replica ({level} pressure) ==")
        _run_group(level, cells, contenders, peers, args.timeout, results, records, trace)
    print()
    every = {n: w for cells in groups.values() for n, w in cells.items()}
    for name in cell_names:
        regime, workload = every[name]
        print(f"== {name}: {workload.description} ({workload.requests} requests) ==")
        print(table(results[name]))
        print()
    summary_rows = []
    for c in contenders:
        row: dict[str, Any] = {"contender": c.name}
        for name in cell_names:
            row[name] = vs_best(results[name].get(c.name), best_p90(results[name]))
        summary_rows.append(row)
    print("== TTFT p90 / best contender, per cell (`fail`: on a failed request; `-`: not run) ==")
    print(format_table(summary_rows))
    return every, results, summary_rows


def seeds_of(args: argparse.Namespace) -> list[int]:
    """`--seeds a,b,c` (each once, in order), else `--seed`."""
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    return list(dict.fromkeys(seeds))  # a seed twice would pool its requests twice


@contextlib.contextmanager
def seed_records(seeds: list[int], given: Path | None = None) -> Iterator[list[Path | None]]:
    """Where each seed's run writes its requests' records: `given` itself for one seed;
    for several (pooling reads them) a folder `s<seed>` each under `given`, or under a
    temporary folder removed on exit."""
    if len(seeds) < 2:
        yield [given]
        return
    with contextlib.ExitStack() as stack:
        root = given or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pool-")))
        folders: list[Path | None] = []
        for seed in seeds:
            folder = root / f"s{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            # An earlier run's records would be pooled as this one's where a contender
            # fails to start now (`pool` leaves out only what is missing).
            for stale in folder.glob("*.records.jsonl"):
                stale.unlink()
            folders.append(folder)
        yield folders


def pool(
    records: Path, seeds: list[int], cell_names: list[str], contenders: list[Contender]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each cell's requests of every seed together, per contender: TTFT p90, its 95 %
    interval and each seed's p90 (`pooled_text` writes the tables). The interval treats
    requests as independent, and runs differ by more (one seed's hot sessions piled on one
    replica, the next's did not): a contender is a `loss` only when its interval lies
    wholly above the best contender's and it was slower than that one in every seed. A
    contender missing a seed's records (it failed to start) is left out of that cell."""
    out: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in cell_names}
    for cell in cell_names:
        for c in contenders:
            paths = [records_file(records / f"s{seed}", c.name, cell) for seed in seeds]
            if not all(p.exists() for p in paths):
                print(f"  {c.name} on {cell}: a seed's records are missing; left out")
                continue
            ttfts: list[float] = []
            per_seed: list[float | None] = []
            requests = errors = failed = 0
            for path in paths:
                lines = path.read_text().splitlines()
                seed = [RequestRecord(**json.loads(line)) for line in lines]
                seed_ttfts, seed_failed = _ttfts(seed)
                per_seed.append(_ms(percentile(seed_ttfts, 90)) if seed_ttfts else None)
                requests += len(seed)
                failed += seed_failed
                errors += sum(not r.ok for r in seed)
                ttfts += seed_ttfts
            if ttfts:
                lo, hi = quantile_interval(ttfts, 90)
                out[cell][c.name] = {
                    "ttft_p90_ms": _ms(percentile(ttfts, 90)),
                    "ttft_p90_ci_ms": [_ms(lo), _ms(hi)],
                    "seed_p90_ms": per_seed,
                    "requests": requests,
                    "errors": errors,
                    "ttft_failed": failed,  # in the p90 as +inf
                }
    for rows in out.values():
        best = best_p90(rows)
        for mine in rows.values():
            mine["loss"] = above_best(mine, rows) and any(
                r["ttft_p90_ms"] == best and _slower_every_seed(mine, r) for r in rows.values()
            )
    return out


def pooled_text(
    pooled: dict[str, dict[str, dict[str, Any]]], seeds: list[int], contenders: list[Contender]
) -> str:
    """`pool`'s result as two tables: each p90 over the cell's best, then the intervals."""
    ratios, intervals = [], []
    for c in contenders:
        ratio: dict[str, Any] = {"contender": c.name}
        interval: dict[str, Any] = {"contender": c.name}
        for cell, rows in pooled.items():
            mine = rows.get(c.name)
            ratio[cell] = vs_best(mine, best_p90(rows))
            if mine is None:
                interval[cell] = None
                continue
            lo, hi = mine["ttft_p90_ci_ms"]
            text = "-".join("fail" if v is None else f"{v:.0f}" for v in (lo, hi))
            errs = f" ({mine['errors']} err)" if mine["errors"] else ""
            interval[cell] = text + ("*" if mine["loss"] else "") + errs
        ratios.append(ratio)
        intervals.append(interval)
    return (
        f"== seeds {','.join(map(str, seeds))} pooled: TTFT p90 / best contender "
        "(`fail`: the p90 fell on a failed request; `-`: not run) ==\n"
        + format_table(ratios)
        + "\n\n== pooled TTFT p90, 95 % interval in ms (* a loss: wholly above the best "
        "contender's, and slower than it in every seed; `fail` a bound on a failed request, "
        "counted as slower than any; (N err) failed requests) ==\n" + format_table(intervals)
    )


def _slower_every_seed(row: dict[str, Any], best: dict[str, Any]) -> bool:
    """None in `row`: that seed's p90 fell on a failed request, slower than any value."""
    pairs = zip(row["seed_p90_ms"], best["seed_p90_ms"], strict=True)
    return all(b is not None and (a is None or a > b) for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 cells, 8 contenders, < 5 min")
    parser.add_argument("--cells", help="comma-separated cell names (see --list)")
    parser.add_argument("--only", help="comma-separated contender names (see --list)")
    parser.add_argument("--list", action="store_true", help="print cells and contenders")
    parser.add_argument("--window", type=float, help="arrival window per cell, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds: the grid once per seed, then each cell's requests of "
        "all seeds pooled (p90 with a 95%% interval); instead of --seed",
    )
    add_install_option(parser)
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--out", default="routing_grid", help="bench/results/NAME.json")
    add_try_option(parser)
    add_body_mode_option(parser)
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="write each llmgw contender's decision trace to DIR/<contender>.jsonl "
        "(appended: one file per contender, both pressure levels), and every contender's "
        "requests (turn, replica, TTFT) to DIR/<contender>@<cell>.records.jsonl (: and / as -)",
    )
    args = parser.parse_args(argv)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)

    contenders = all_contenders()
    if args.list:
        for regime in REGIMES.values():
            print(
                f"{regime.name:20s} load {regime.load:<4g} mix {regime.mix:13s} sessions "
                f"{regime.sessions:4s} pressure {regime.pressure:g} {regime.note}"
            )
        print("contenders:", ", ".join(c.name for c in contenders))
        return 0
    cell_names = _selected(args.cells, list(REGIMES), "cells")
    if args.quick and not args.cells:
        cell_names = list(QUICK_REGIMES)
    contenders = select_contenders(parser, args, contenders)

    peers = ensure_peers(install=args.install_peers)
    for c in list(contenders):
        if c.edge in PEER_POLICIES and (
            c.edge not in peers or c.policy not in PEER_POLICIES[c.edge]
        ):
            print(f"skipping {c.name}: not installed")
            contenders.remove(c)

    loop_policy = None
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: PLC0415

        loop_policy = uvloop.EventLoopPolicy()
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)

    seeds = seeds_of(args)
    started = time.monotonic()
    with seed_records(seeds, args.trace) as folders:
        runs = []
        for seed, folder in zip(seeds, folders, strict=True):
            if len(seeds) > 1:
                print(f"\n######## seed {seed} ########")
            trace = folder if args.trace is not None else None
            runs.append(_run_seed(args, seed, cell_names, contenders, peers, folder, trace))
        root = folders[0].parent if len(seeds) > 1 and folders[0] is not None else None
        pooled = pool(root, seeds, cell_names, contenders) if root is not None else None
    if pooled is not None:
        print("\n" + pooled_text(pooled, seeds, contenders))
    elapsed = time.monotonic() - started
    print(f"\ntotal {elapsed:.0f} s")
    every, results, summary_rows = runs[0]
    levels = sorted({pressure_level(regime) for regime, _ in every.values()})
    data = {
        "benchmark": "routing_grid",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "quick": args.quick,
        "seed": seeds[0],
        "seeds": seeds,
        "sim_args": {level: sim_args(level, 0) for level in levels},
        "cells": {
            n: {
                "regime": regime.__dict__,
                "description": w.description,
                "requests": w.requests,
                "params": w.params,
                "fingerprint": w.fingerprint(),
            }
            for n, (regime, w) in every.items()
        },
        "contenders": [c.name for c in contenders],
        "results": results,
        "ttft_p90_over_best": summary_rows,
        "elapsed_s": round(elapsed, 1),
    }
    if pooled is not None:
        data["results_by_seed"] = {str(seed): run[1] for seed, run in zip(seeds, runs, strict=True)}
        data["pooled"] = pooled
        results = pooled  # the heat map: the pooled p90s
    path = write_results(args.out, data)
    print(f"wrote {path}")
    png = heatmap(results, RESULTS / f"{args.out}_heatmap.png")
    if png is not None:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
