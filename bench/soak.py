"""Soak: a steady rate through Envoy + the ext_proc server, a new session id per request
out of 1,000,000 (generated lazily), long prompts; the ext_proc process's RSS over time.

    python bench/soak.py [--minutes 5] [--rate 60] [--prompt-chars 6000] [--strategy latency]

Children: a simulated fleet (`llmgw sim`, no latency), `llmgw extproc` (`--strategy`, the
default `latency`: its prefix index and session caches fill up) and Envoy (override-host).
Every `--sample` seconds the ext_proc RSS (VmRSS from /proc) and the counts are printed;
at the end the table, the verdict (RSS flat over the last third of the run) and
`bench/results/soak.json`. Requests: 1 in 4 streamed; prompts share a system preamble
and carry a unique session part, so each request adds new blocks to the prefix index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._tools import format_table, write_results  # noqa: E402
from llmgw.config import load_dict  # noqa: E402
from llmgw.runtime.ports import free_port  # noqa: E402
from llmgw.sim.fleet import spawn  # noqa: E402
from llmgw.testing.extproc import EnvoyProcess, loopback_bootstrap, wait_for  # noqa: E402

SESSION_SPACE = 1_000_000
PREAMBLE = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 24


def session_ids(space: int = SESSION_SPACE) -> Iterator[str]:
    """`space` distinct ids in a scattered order, one at a time (never a list of them)."""
    step = 7_919  # prime, coprime with 10**6: i -> i*step mod space is a permutation
    for i in range(space):
        yield f"sess-{(i * step + 17) % space:06d}"


def prompt(session: str, chars: int) -> str:
    unique = (f"{session} asks about item {session[::-1]}; " * (chars // 40 + 1))[
        : max(0, chars - len(PREAMBLE))
    ]
    return PREAMBLE[:chars] + unique


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return round(int(match.group(1)) / 1024, 1) if match else 0.0


def inflight_from_metrics(url: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(
        float(m.group(1)) for m in re.finditer(r"^llmgw_inflight\{[^}]*\} (\S+)$", text, re.M)
    )


class Stats:
    def __init__(self) -> None:
        self.sent = 0
        self.ok = 0
        self.errors = 0
        self.statuses: Counter[str] = Counter()
        self.open = 0


async def one(client: httpx.AsyncClient, url: str, session: str, args: argparse.Namespace,
              stats: Stats, stream: bool) -> None:  # fmt: skip
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": prompt(session, args.prompt_chars)}],
        "max_tokens": 4,
        "stream": stream,
    }
    stats.open += 1
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
        ) as r:
            data = await r.aread()
            good = r.status_code == 200 and (
                data.rstrip().endswith(b"[DONE]") if stream else b'"choices"' in data
            )
            stats.statuses[str(r.status_code)] += 1
    except httpx.HTTPError as exc:
        good = False
        stats.statuses[type(exc).__name__] += 1
    finally:
        stats.open -= 1
    stats.ok += good
    stats.errors += not good


async def drive(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    stats = Stats()
    samples: list[dict[str, Any]] = []
    ids = session_ids()
    duration = args.minutes * 60
    interval = 1.0 / args.rate
    tasks: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        start = time.monotonic()
        next_sample = start
        n = 0
        while True:
            now = time.monotonic()
            if now >= next_sample:
                sample = {
                    "t_s": round(now - start),
                    "rss_mb": rss_mb(pid),
                    "sent": stats.sent,
                    "ok": stats.ok,
                    "errors": stats.errors,
                    "open": stats.open,
                }
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                next_sample += args.sample
            if now - start >= duration:
                break
            due = start + n * interval
            if due > now:
                await asyncio.sleep(min(due - now, next_sample - now))
                continue
            if stats.open >= args.concurrency:  # open loop, but bounded: count as shed
                stats.sent += 1
                stats.errors += 1
                stats.statuses["client-shed"] += 1
            else:
                session = next(ids)
                stats.sent += 1
                task = asyncio.create_task(one(client, url, session, args, stats, n % 4 == 0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.wait(tasks, timeout=30)
    samples.append(
        {
            "t_s": round(time.monotonic() - start),
            "rss_mb": rss_mb(pid),
            "sent": stats.sent,
            "ok": stats.ok,
            "errors": stats.errors,
            "open": stats.open,
        }
    )
    return {
        "samples": samples,
        "sent": stats.sent,
        "ok": stats.ok,
        "errors": stats.errors,
        "statuses": dict(stats.statuses),
        "distinct_sessions": n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=60.0, help="requests per second")
    parser.add_argument("--prompt-chars", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=512, help="open requests at most")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--strategy", default="latency", help="the model's strategy preset")
    args = parser.parse_args(argv)

    sim_args = ["--replicas", str(args.replicas), "--base-port", "0", "--time-scale", "0"]
    sim_args += ["--max-model-len", "65536", "--kv-blocks", "200000", "--seed", "3"]
    with tempfile.TemporaryDirectory(prefix="llmgw-soak-") as tmp, spawn(sim_args) as sim:
        config = {
            "destination_fallbacks": True,  # override-host: Envoy retries down the list
            "models": {
                "m1": {
                    "endpoints": [u.removeprefix("http://") for u in sim.urls],
                    "strategy": args.strategy,
                }
            },
            "scrape": {"interval": 0.1},
        }
        config_path = Path(tmp) / "llmgw.yaml"
        config_path.write_text(yaml.safe_dump(config))
        ready = Path(tmp) / "ready.json"
        grpc_port = free_port()
        extproc = subprocess.Popen(
            [sys.executable, "-m", "llmgw.cli", "extproc", "--config", str(config_path),
             "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--plaintext",
             "--grpc-health-port", "0", "--health-port", "0",
             "--metrics-port", "0", "--ready-file", str(ready), "--log-level", "warning"],
            stderr=(Path(tmp) / "extproc.log").open("wb"),
        )  # fmt: skip
        try:
            wait_for(ready.exists, 30, "ext_proc ready")
            ports = json.loads(ready.read_text())
            envoy = EnvoyProcess(
                loopback_bootstrap(
                    load_dict(config),
                    f"127.0.0.1:{grpc_port}",
                    shape="override-host",
                )
            )
            try:
                print(f"soak: {args.minutes} min at {args.rate}/s, ext_proc pid {extproc.pid}")
                result = asyncio.run(drive(envoy.url, extproc.pid, args))
                metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
                wait_for(lambda: inflight_from_metrics(metrics_url) == 0, 10, "inflight 0")
                result["inflight_at_end"] = inflight_from_metrics(metrics_url)
            finally:
                envoy.stop()
        finally:
            extproc.terminate()
            extproc.wait(15)

    samples = result["samples"]
    # The prefix index fills first (per-endpoint caps), then RSS must stay flat: compare the
    # last third of the run with its start (allocator noise allowed, not a per-session slope).
    total = samples[-1]["t_s"]
    warm = next(s for s in samples if s["t_s"] >= total * 2 / 3)
    growth = round(max(s["rss_mb"] for s in samples if s["t_s"] >= warm["t_s"]) - warm["rss_mb"], 1)
    result.update(
        {
            "settings": vars(args),
            "rss_start_mb": samples[0]["rss_mb"],
            "rss_at_two_thirds_mb": warm["rss_mb"],
            "rss_end_mb": samples[-1]["rss_mb"],
            "rss_peak_mb": max(s["rss_mb"] for s in samples),
            "growth_last_third_mb": growth,
            "bounded": growth <= max(5.0, 0.05 * warm["rss_mb"]),
        }
    )
    print()
    print(format_table(samples))
    print()
    keys = ("sent", "ok", "errors", "inflight_at_end", "distinct_sessions", "rss_start_mb",
            "rss_at_two_thirds_mb", "rss_end_mb", "rss_peak_mb", "growth_last_third_mb",
            "bounded")  # fmt: skip
    print(format_table([{k: result[k] for k in keys}]))
    print(f"statuses: {result['statuses']}")
    path = write_results("soak", result)
    print(f"wrote {path}")
    return 0 if result["bounded"] and result["inflight_at_end"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
