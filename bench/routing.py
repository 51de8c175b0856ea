"""Routing quality through the real Envoy: llmgw strategies vs round-robin, pure consistent
hashing and the Rust peer routers, on the same simulated replicas and seeded workloads.

    .venv/bin/python bench/routing.py            # full: < 10 min on 2 cores
    .venv/bin/python bench/routing.py --quick    # < 2 min: 5 contenders, 2 workloads
    .venv/bin/python bench/routing.py --only envoy:chat,envoy:round-robin --workloads chat

What runs (one process each, one contender at a time, same 8 replicas):
- 8 simulated vLLM replicas (`llmgw sim`, time-scaled, prefix cache and continuous
  batching on, `max_num_seqs` small so queues form, prefill of uncached tokens the main
  cost of TTFT), `SIM_ARGS` below;
- llmgw through Envoy: `llmgw extproc` + `envoy` with the config from `llmgw envoy-config
  --shape override-host`, strategies round-robin, random, ring (pure Ray ring),
  bounded-ring, chat, and chat's scorers with a softmax picker at a few temperatures;
- llmgw's ASGI proxy (`llmgw proxy`) with chat;
- `vllm-router` (consistent_hash, cache_aware) and `sglang-router` (cache_aware), from
  `.venv-peers` (bench/peers.py installs them there).

Load: `bench/loadclient.py` (our own aiohttp client, see its docstring for why) replays
`bench/workloads` (chat, hot, prefix, mixed) open loop at each workload's nominal rate;
before every run the replicas are reset (`POST /admin/reset`: prefix caches cleared),
so every contender starts cold. A throughput sweep replays each workload at higher
offered rate (x3) for the saturation contenders. Reported per workload and
contender: client TTFT p50/p90/p99, end-to-end p50/p90, output tokens/s, prefix-cache
hit rate (deltas of the simulators' `vllm:prefix_cache_*` counters), requests served
per replica max/mean (deltas of `vllm:request_success`), errors. Writes
bench/results/routing.json and PNG plots (matplotlib) in bench/results/.

Everything shares the machine: compare contenders within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import aiohttp  # noqa: E402
import yaml  # noqa: E402

from bench._tools import format_table, write_results  # noqa: E402
from bench.loadclient import RequestRecord, run  # noqa: E402
from bench.peers import PEER_POLICIES, Service, ensure_peers, free_port, peer_command  # noqa: E402
from bench.workloads import Workload, build, percentile  # noqa: E402
from llmgw.sim.fleet import SimProcess, spawn  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
MODEL = "m1"
REPLICAS = 8

# Simulated engine: 200 us/token prefill and 40 ms decode steps, run at 0.2x wall time
# (40 us/token, 8 ms/step). A 3,000-token uncached history costs 120 ms of prefill that
# blocks its replica's batch; 8 sequences a replica at most, so queues form under load.
# 8192 blocks of 16 tokens (131k tokens) a replica: room for the histories a replica
# owns under sticky routing, not for every history (what round-robin asks of each).
SIM_ARGS = [
    "--replicas", str(REPLICAS), "--base-port", "0", "--model", MODEL,
    "--time-scale", "0.2", "--prefill-us-per-token", "200", "--decode-ms", "40",
    "--decode-batch-factor", "0.03", "--max-num-seqs", "8", "--max-queue", "4096",
    "--kv-blocks", "8192", "--block-size", "16", "--max-model-len", "16384",
]  # fmt: skip


def sim_args() -> list[str]:
    """SIM_ARGS on fixed ports when they are free: ring positions hash the addresses, so
    fixed ports make the pure ring's placement (and its imbalance) the same every run."""
    for base in (18100, 28100, 38100):
        if all(_port_free(base + i) for i in range(REPLICAS)):
            return _with_base(base)
    return SIM_ARGS


def _with_base(base: int) -> list[str]:
    args = list(SIM_ARGS)
    args[args.index("--base-port") + 1] = str(base)
    return args


def _port_free(port: int) -> bool:
    import socket  # noqa: PLC0415

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


SOFTMAX_TEMPERATURES = (0.05, 0.2, 1.0)


@dataclass(frozen=True)
class Contender:
    name: str
    edge: str  # envoy | asgi | vllm-router | sglang-router
    strategy: str | dict[str, Any] | None = None
    policy: str | None = None


def _softmax(temperature: float) -> dict[str, Any]:
    return {
        "scorers": {"session": 1.0, "prefix": 2.0, "queue": 2.0, "kv": 1.0},
        "picker": {"type": "softmax", "temperature": temperature},
    }


def all_contenders() -> list[Contender]:
    out = [
        Contender(f"envoy:{s}", "envoy", s)
        for s in ("round-robin", "random", "ring", "bounded-ring", "chat")
    ]
    out += [Contender(f"envoy:softmax-{t:g}", "envoy", _softmax(t)) for t in SOFTMAX_TEMPERATURES]
    out.append(Contender("asgi:chat", "asgi", "chat"))
    out.append(Contender("vllm-router:consistent_hash", "vllm-router", policy="consistent_hash"))
    out.append(Contender("vllm-router:cache_aware", "vllm-router", policy="cache_aware"))
    out.append(Contender("sglang-router:cache_aware", "sglang-router", policy="cache_aware"))
    return out


QUICK_CONTENDERS = (
    "envoy:round-robin",
    "envoy:ring",
    "envoy:bounded-ring",
    "envoy:chat",
    "vllm-router:cache_aware",
)
# Contenders replayed at higher offered rates for throughput at saturation.
SWEEP_CONTENDERS = (
    "envoy:chat",
    "vllm-router:consistent_hash",
    "vllm-router:cache_aware",
    "sglang-router:cache_aware",
)
SWEEP_FACTORS = (3.0,)


# -- the llmgw side ------------------------------------------------------------------------


def llmgw_config(upstreams: list[str], strategy: str | dict[str, Any]) -> dict[str, Any]:
    return {
        "models": {
            MODEL: {
                "engine": "vllm",
                "endpoints": [u.removeprefix("http://") for u in upstreams],
                "session": {"headers": ["x-session-id"]},
                "strategy": strategy,
            }
        },
        "scrape": {"interval": 0.05, "timeout": 0.5, "staleness": 1.0},
        "debug_headers": True,
        "seed": 7,
    }


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _envoy() -> str:
    found = Path(_python()).with_name("envoy")
    return str(found) if found.exists() else shutil.which("envoy") or "envoy"


@contextlib.contextmanager
def start_contender(
    contender: Contender, upstreams: list[str], peers: dict[str, str], scratch: Path
) -> Iterator[str]:
    """Run the contender; yield its base URL (no trailing slash)."""
    python = _python()
    port = free_port()
    if contender.edge in ("envoy", "asgi"):
        assert contender.strategy is not None
        config = scratch / f"{contender.name.replace(':', '-')}.yaml"
        config.write_text(yaml.safe_dump(llmgw_config(upstreams, contender.strategy)))
        if contender.edge == "asgi":
            cmd = [python, "-m", "llmgw.cli", "proxy", "--config", str(config)]
            cmd += ["--port", str(port)]
            with Service(cmd, f"http://127.0.0.1:{port}/readyz", name="llmgw-proxy"):
                yield f"http://127.0.0.1:{port}"
            return
        grpc, health, metrics, admin = free_port(), free_port(), free_port(), free_port()
        extproc = [python, "-m", "llmgw.cli", "extproc", "--config", str(config)]
        extproc += ["--host", "127.0.0.1", "--grpc-port", str(grpc), "--health-port"]
        extproc += [str(health), "--metrics-port", str(metrics), "--log-level", "warning"]
        envoy_yaml = scratch / "envoy.yaml"
        subprocess.run(
            [python, "-m", "llmgw.cli", "envoy-config", "--config", str(config),
             "--shape", "override-host", "--listen", f"127.0.0.1:{port}",
             "--admin", f"127.0.0.1:{admin}", "--extproc", f"127.0.0.1:{grpc}",
             "--out", str(envoy_yaml)],
            check=True, cwd=ROOT,
        )  # fmt: skip
        envoy = [_envoy(), "-c", str(envoy_yaml), "--disable-hot-restart"]
        envoy += ["--concurrency", "1", "-l", "warning"]
        with (
            Service(extproc, f"http://127.0.0.1:{health}/readyz", name="llmgw-extproc"),
            Service(envoy, f"http://127.0.0.1:{admin}/ready", name="envoy"),
        ):
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


async def scrape_all(http: aiohttp.ClientSession, upstreams: list[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with http.get(url + "/metrics") as response:
            return parse_metrics(await response.read())

    return list(await asyncio.gather(*(one(u) for u in upstreams)))


async def reset_all(http: aiohttp.ClientSession, upstreams: list[str]) -> None:
    """Wait until every replica is idle, then clear faults and prefix caches."""
    deadline = time.monotonic() + 60
    while True:
        snapshot = await scrape_all(http, upstreams)
        busy = sum(
            m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
            for m in snapshot
        )
        if busy == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)  # draining stragglers of the previous run
    for url in upstreams:
        async with http.post(url + "/admin/reset") as response:
            await response.read()


@dataclass
class LoadSampler:
    """Polls running + waiting per replica every `interval` s while a run goes on."""

    upstreams: list[str]
    interval: float = 0.25
    samples: list[tuple[float, list[int]]] = field(default_factory=list)

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                snapshot = await scrape_all(http, self.upstreams)
                self.samples.append(
                    (
                        round(time.perf_counter() - t0, 3),
                        [
                            int(
                                m.get("vllm:num_requests_running", 0)
                                + m.get("vllm:num_requests_waiting", 0)
                            )
                            for m in snapshot
                        ],
                    )
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


# -- one run -------------------------------------------------------------------------------


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value * 1e3, 1)


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
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]

    def delta(key: str) -> list[float]:
        return [a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True)]

    queries, hits = sum(delta(_COUNTERS[0])), sum(delta(_COUNTERS[1]))
    served = [int(v) for v in delta(_COUNTERS[2])]
    mean_served = sum(served) / len(served) if served else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.status else (r.error or "error").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "wall_s": round(wall, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "e2e_p50_ms": _ms(percentile(e2es, 50)),
        "e2e_p90_ms": _ms(percentile(e2es, 90)),
        "output_tok_s": round(out_tokens / wall, 1) if wall else 0.0,
        "req_s": round(len(ok) / wall, 1) if wall else 0.0,
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "prefill_tokens": int(queries - hits),
        "served_per_replica": served,
        "load_max_mean": round(max(served) / mean_served, 2) if mean_served else None,
        "busy_max_mean": _busy_max_mean(samples),
        "ttft_quantiles_ms": [_ms(percentile(ttfts, q)) for q in range(0, 101, 2) if ttfts],
        "load_samples": samples,
    }


async def run_one(
    base_url: str, upstreams: list[str], workload: Workload, timeout_s: float
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await reset_all(http, upstreams)
        before = await scrape_all(http, upstreams)
        sampler = LoadSampler(upstreams)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(http, stop))
        try:
            records, wall = await run(
                base_url + "/v1/chat/completions", MODEL, workload, timeout_s=timeout_s
            )
        finally:
            stop.set()
            await sampling
        await asyncio.sleep(0.3)  # let the last counters settle (responses end before steps)
        after = await scrape_all(http, upstreams)
    summary = summarize(records, wall, before, after, sampler.samples)
    decisions = [r.decision for r in records if r.decision]
    if decisions:
        summary["decision_examples"] = decisions[:3]
    return summary


async def warm_up(base_url: str) -> None:
    """One tiny request until the contender routes (Envoy + ext_proc connect lazily)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(base_url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url} never answered 200")
            await asyncio.sleep(0.2)  # the contender is still connecting upstream


# -- report --------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("contender", "contender"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p90_ms", "TTFT p90"),
    ("ttft_p99_ms", "TTFT p99"),
    ("e2e_p50_ms", "e2e p50"),
    ("e2e_p90_ms", "e2e p90"),
    ("output_tok_s", "out tok/s"),
    ("prefix_hit_rate", "hit rate"),
    ("load_max_mean", "served max/mean"),
    ("busy_max_mean", "busy max/mean"),
    ("errors", "errors"),
)


def table(rows: dict[str, dict[str, Any]]) -> str:
    return format_table(
        [
            {label: name if key == "contender" else r.get(key) for key, label in TABLE_COLUMNS}
            for name, r in rows.items()
        ]
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def targets(results: dict[str, dict[str, dict[str, Any]]], sweep: dict[str, Any]) -> list[str]:
    """The issue's targets, measured: one line each (missing contenders say so)."""
    lines = []
    chat = results.get("chat", {})
    rr, best = chat.get("envoy:round-robin"), chat.get("envoy:chat")
    if rr and best:
        ratio = _ratio(rr["ttft_p90_ms"], best["ttft_p90_ms"])
        lines.append(f"chat: TTFT p90 round-robin / chat = {ratio}x (target >= 3x)")
    hot = results.get("hot", {})
    ring, chat_hot, bounded = (
        hot.get("envoy:ring"),
        hot.get("envoy:chat"),
        hot.get("envoy:bounded-ring"),
    )
    if ring and chat_hot:
        ratio = _ratio(ring["ttft_p90_ms"], chat_hot["ttft_p90_ms"])
        lines.append(f"hot: TTFT p90 ring / chat = {ratio}x (target >= 2x)")
    if ring and bounded:
        ratio = _ratio(ring["ttft_p90_ms"], bounded["ttft_p90_ms"])
        lines.append(f"hot: TTFT p90 ring / bounded-ring = {ratio}x (target >= 2x)")
    if bounded:
        lines.append(
            f"hot: bounded-ring max/mean replica load = {bounded['load_max_mean']} by requests "
            f"served, {bounded['busy_max_mean']} by time-averaged running+waiting "
            "(target <= 1.25)"
        )
    for workload, per in sweep.items():
        peak = per.get("saturation_tok_s", {})
        ours = max((v for k, v in peak.items() if k.startswith(("envoy:", "asgi:"))), default=None)
        theirs = {k: v for k, v in peak.items() if not k.startswith(("envoy:", "asgi:"))}
        if ours and theirs:
            top = max(theirs, key=lambda k: theirs[k])
            lines.append(
                f"{workload}: saturation out tok/s llmgw {ours:.0f} vs best peer {top} "
                f"{theirs[top]:.0f} = {ours / theirs[top]:.2f}x (target >= 1x)"
            )
    return lines


def plots(data: dict[str, Any]) -> list[Path]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from cycler import cycler  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plots (.venv/bin/pip install matplotlib)")
        return []
    # Twelve-odd contenders: tab10 would repeat colours; tab20 keeps every line apart.
    tab20 = plt.get_cmap("tab20")
    plt.rcParams["axes.prop_cycle"] = cycler(color=[tab20(i) for i in range(20)])
    written: list[Path] = []
    results: dict[str, dict[str, dict[str, Any]]] = data["results"]
    names = list(results)
    cols = 2 if len(names) > 1 else 1
    rows_n = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 3.6 * rows_n), squeeze=False)
    for ax, workload in zip(axes.flat, names, strict=False):
        for contender, r in results[workload].items():
            q = r.get("ttft_quantiles_ms") or []
            xs = [v for v in q if v is not None]
            if xs:
                ax.plot(xs, [i / (len(xs) - 1) for i in range(len(xs))], label=contender, lw=1.2)
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF: {workload}")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = RESULTS / "routing_ttft_cdf.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    written.append(path)

    sweep: dict[str, Any] = data.get("sweep", {})
    if sweep:
        fig, axes = plt.subplots(1, len(sweep), figsize=(4.5 * len(sweep), 3.4), squeeze=False)
        for ax, (workload, per) in zip(axes.flat, sweep.items(), strict=True):
            for contender, points in per["points"].items():
                pts = sorted(points, key=lambda p: p["offered_req_s"])
                ax.plot(
                    [p["offered_req_s"] for p in pts],
                    [p["output_tok_s"] for p in pts],
                    marker="o",
                    label=contender,
                )
            ax.set_title(f"throughput: {workload}")
            ax.set_xlabel("offered req/s")
            ax.set_ylabel("output tok/s")
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        path = RESULTS / "routing_throughput.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    hot = results.get("hot") or results.get(names[0], {})
    shown = [c for c in ("envoy:ring", "envoy:bounded-ring", "envoy:chat") if c in hot]
    if shown:
        fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.2), squeeze=False)
        for ax, contender in zip(axes.flat, shown, strict=True):
            samples = hot[contender]["load_samples"]
            if samples:
                ts = [s[0] for s in samples]
                for i in range(len(samples[0][1])):
                    ax.plot(ts, [s[1][i] for s in samples], lw=1, label=f"replica {i}")
            ax.set_title(f"{contender} (hot)")
            ax.set_xlabel("s")
            ax.set_ylabel("running + waiting")
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = RESULTS / "routing_load.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="< 2 min: fewer, smaller runs")
    parser.add_argument("--only", help="comma-separated contender names")
    parser.add_argument("--workloads", help="comma-separated: chat,hot,prefix,mixed")
    parser.add_argument("--scale", type=float, help="workload size multiplier")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-install", action="store_true", help="do not pip-install peers")
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--out", default="routing", help="results name (bench/results/NAME.json)")
    parser.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='extra Envoy contender with an explicit strategy, e.g. x={"scorers": {"load": 1}}',
    )
    args = parser.parse_args(argv)

    names = args.workloads.split(",") if args.workloads else ["chat", "hot", "prefix", "mixed"]
    if args.quick and not args.workloads:
        names = ["chat", "hot"]
    scale = args.scale or (0.4 if args.quick else 0.65)
    workloads = {n: build(n, seed=args.seed, scale=scale) for n in names}
    contenders = all_contenders()
    if args.only:
        wanted = args.only.split(",")
        contenders = [c for c in contenders if c.name in wanted]
    elif args.quick:
        contenders = [c for c in contenders if c.name in QUICK_CONTENDERS]
    for spec in args.tries:
        label, _, strategy = spec.partition("=")
        contenders.append(Contender(f"envoy:{label}", "envoy", json.loads(strategy)))
    do_sweep = not (args.no_sweep or args.quick)

    peers = ensure_peers(install=not args.no_install)
    for c in list(contenders):
        if c.edge in PEER_POLICIES and (
            c.edge not in peers or c.policy not in PEER_POLICIES[c.edge]
        ):
            print(f"skipping {c.name}: not installed")
            contenders.remove(c)

    for w in workloads.values():
        print(f"workload {w.name}: {w.description}; {w.requests} requests, "
              f"{w.offered_request_rate():.0f} req/s offered over {w.duration_s:.1f} s")  # fmt: skip
    results: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in workloads}
    sweep: dict[str, Any] = {}
    started = time.monotonic()
    loop_policy = None
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: PLC0415

        loop_policy = uvloop.EventLoopPolicy()
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)

    sim: SimProcess
    with (
        tempfile.TemporaryDirectory(prefix="bench-routing-") as scratch_dir,
        spawn(sim_args(), stdout=subprocess.DEVNULL) as sim,
    ):
        scratch = Path(scratch_dir)
        upstreams = list(sim.urls)
        for contender in contenders:
            t = time.monotonic()
            try:
                with start_contender(contender, upstreams, peers, scratch) as base:
                    asyncio.run(warm_up(base))
                    for name, workload in workloads.items():
                        summary = asyncio.run(run_one(base, upstreams, workload, args.timeout))
                        summary["offered_req_s"] = round(workload.offered_request_rate(), 1)
                        results[name][contender.name] = summary
                        print(
                            f"  {contender.name:28s} {name:7s} TTFT p90 "
                            f"{summary['ttft_p90_ms']} ms, {summary['output_tok_s']} tok/s, "
                            f"hit {summary['prefix_hit_rate']}, load {summary['load_max_mean']}, "
                            f"errors {summary['errors']} ({summary['wall_s']} s)",
                            flush=True,
                        )
                        if do_sweep and contender.name in SWEEP_CONTENDERS:
                            per = sweep.setdefault(name, {"points": {}, "saturation_tok_s": {}})
                            points = per["points"].setdefault(contender.name, [])
                            points.append(
                                {"offered_req_s": summary["offered_req_s"],
                                 "output_tok_s": summary["output_tok_s"]}
                            )  # fmt: skip
                            for factor in SWEEP_FACTORS:
                                faster = workload.with_rate(workload.arrival_rate * factor)
                                s = asyncio.run(run_one(base, upstreams, faster, args.timeout))
                                points.append(
                                    {"offered_req_s": round(faster.offered_request_rate(), 1),
                                     "output_tok_s": s["output_tok_s"],
                                     "ttft_p90_ms": s["ttft_p90_ms"], "errors": s["errors"]}
                                )  # fmt: skip
                            per["saturation_tok_s"][contender.name] = max(
                                p["output_tok_s"] for p in points
                            )
            except RuntimeError as exc:
                print(f"  {contender.name}: failed: {exc}")
                continue
            print(f"  ({contender.name}: {time.monotonic() - t:.0f} s)", flush=True)

    print()
    for name, rows in results.items():
        w = workloads[name]
        print(f"== {name}: {w.description} ({w.requests} requests) ==")
        print(table(rows))
        print()
    if sweep:
        print("== saturation throughput (max output tok/s over offered rate x1, x3) ==")
        for name, per in sweep.items():
            print(f"  {name}: " + ", ".join(
                f"{k} {v:.0f}" for k, v in per["saturation_tok_s"].items()))  # fmt: skip
        print()
    lines = targets(results, sweep)
    for line in lines:
        print(line)
    elapsed = time.monotonic() - started
    print(f"\ntotal {elapsed:.0f} s")
    data = {
        "benchmark": "routing",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "quick": args.quick,
        "seed": args.seed,
        "scale": scale,
        "sim_args": SIM_ARGS,
        "workloads": {
            n: {
                "description": w.description,
                "requests": w.requests,
                "offered_req_s": round(w.offered_request_rate(), 1),
                "fingerprint": w.fingerprint(),
            }
            for n, w in workloads.items()
        },
        "contenders": [c.name for c in contenders],
        "results": results,
        "sweep": sweep,
        "targets": lines,
        "elapsed_s": round(elapsed, 1),
    }
    path = write_results(args.out, data)
    print(f"wrote {path}")
    for png in plots(data) if args.out == "routing" else []:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
