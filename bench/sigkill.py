"""One replica SIGKILLed under session traffic through Envoy + llmgw's ext_proc.

    python bench/sigkill.py [--requests 3000] [--concurrency 32] [--out bench/results/sigkill.json]

Four `llmgw sim` processes (one replica each, so one can really die) serve `m1`; Envoy
(the `override-host` shape, retries walking llmgw's fallbacks) routes sessions through
the ext_proc server. After a third of the requests, replica 1 gets SIGKILL. Each request
ends:

- ok: 200 and a complete answer (JSON choices, or SSE up to `[DONE]`);
- cut: a 200 head, then the stream broke (the replica died mid-answer: nobody can retry it);
- failed: anything else (an error status, or a transport error before any head).

Two rows: the generated config as shipped, and the same with Envoy's default circuit
breakers and no outlier detection (what the generated config had before), where retries
overflow Envoy's default budget of 3 concurrent retries. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's llmgw, whatever is installed

from llmgw.config import load_dict  # noqa: E402
from llmgw.sim.fleet import SimProcess, spawn  # noqa: E402
from llmgw.testing.extproc import (  # noqa: E402
    EnvoyProcess,
    ExtProcThread,
    loopback_bootstrap,
    wait_for,
)

RESULTS = Path(__file__).parent / "results" / "sigkill.json"
VICTIM = 1
SIM_ARGS = ["--model", "m1", "--decode-ms", "4", "--prefill-us-per-token", "5"]


@dataclass
class Row:
    config: str
    sent: int = 0
    ok: int = 0
    cut: int = 0
    failed: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    retry_overflow: int = 0
    retries: int = 0
    ejections: int = 0
    inflight_after: int = -1
    seconds: float = 0.0


def fleet_config(replicas: list[SimProcess]) -> dict[str, Any]:
    return {
        "models": {
            "m1": {
                "endpoints": [f"127.0.0.1:{r.ports[0]}" for r in replicas],
                "strategy": "chat",
                "session": {"num_fallback_replicas": 2},
            }
        },
        "breaker": {"failure_threshold": 2, "base_cooldown": 0.5, "max_cooldown": 2.0},
        "scrape": {"interval": 0.05, "staleness": 1.0},
        "limits": {"upstream_read_timeout": 2.0, "upstream_connect_timeout": 0.5},
        "destination_fallbacks": True,  # override-host: Envoy retries down the list
    }


def envoy_defaults(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap without the fleet-sized breakers and outlier detection."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        cluster.pop("circuit_breakers", None)
        cluster.pop("outlier_detection", None)
    return bootstrap


async def one(client: httpx.AsyncClient, url: str, session: str, stream: bool) -> str:
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": f"{session}: tell me something"}],
        "stream": stream,
        "max_tokens": 16,
    }
    status = 0
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
        ) as r:
            status = r.status_code
            data = await r.aread()
        if status != 200:
            return f"failed {status}"
        complete = (
            data.rstrip().endswith(b"data: [DONE]") if stream else bool(json.loads(data)["choices"])
        )
        return "ok" if complete else "cut"
    except (httpx.TransportError, ValueError) as exc:
        return "cut" if status == 200 else f"failed {type(exc).__name__}"


async def load(
    url: str, requests: int, concurrency: int, kill_at: int, victim: SimProcess
) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    gate = asyncio.Semaphore(concurrency)
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def request(i: int) -> None:
            nonlocal done
            async with gate:
                outcome = await one(client, url, f"s{i % 300}", stream=i % 2 == 0)
            outcomes[outcome] += 1
            done += 1
            if done == kill_at:
                os.kill(victim.process.pid, signal.SIGKILL)

        await asyncio.gather(*(request(i) for i in range(requests)))
    return outcomes


def run(name: str, requests: int, concurrency: int) -> Row:
    replicas = [
        spawn(["--port", "0", "--seed", str(i), *SIM_ARGS], stdout=subprocess.DEVNULL)
        for i in range(4)
    ]
    config = load_dict(fleet_config(replicas))
    extproc = ExtProcThread(config)
    row = Row(config=name, sent=requests)
    try:
        bootstrap = loopback_bootstrap(
            config,
            extproc.address,
            shape="override-host",
            message_timeout=5.0,
            connect_timeout=0.5,
            route_timeout=30.0,
        )
        if name == "Envoy defaults":
            bootstrap = envoy_defaults(bootstrap)
        with EnvoyProcess(bootstrap) as envoy:
            started = time.monotonic()
            outcomes = asyncio.run(
                load(envoy.url, requests, concurrency, requests // 3, replicas[VICTIM])
            )
            row.seconds = round(time.monotonic() - started, 1)
            row.ok, row.cut = outcomes.pop("ok", 0), outcomes.pop("cut", 0)
            row.failed = sum(outcomes.values())
            row.statuses = dict(outcomes)
            stats = envoy.stats("cluster.llm-pool.")
            row.retry_overflow = stats.get("cluster.llm-pool.upstream_rq_retry_overflow", 0)
            row.retries = stats.get("cluster.llm-pool.upstream_rq_retry", 0)
            row.ejections = stats.get(
                "cluster.llm-pool.outlier_detection.ejections_enforced_total", 0
            )
            try:
                wait_for(lambda: sum(extproc.inflight().values()) == 0, 10, "inflight 0")
            finally:
                row.inflight_after = sum(extproc.inflight().values())
    finally:
        extproc.stop()
        for replica in replicas:
            replica.stop()
    return row


def table(rows: list[Row]) -> str:
    lines = [
        "| Envoy config | sent | ok | cut mid-stream | failed | retries | retry overflow | ejections | inflight after | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        failed = f"{r.failed} {r.statuses}" if r.failed else "0"
        lines.append(
            f"| {r.config} | {r.sent} | {r.ok} | {r.cut} | {failed} | {r.retries} | "
            f"{r.retry_overflow} | {r.ejections} | {r.inflight_after} | {r.seconds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--configs", default="generated,Envoy defaults")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [run(name, args.requests, args.concurrency) for name in args.configs.split(",")]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.failed == 0 and r.inflight_after == 0 for r in rows[:1]) else 1


if __name__ == "__main__":
    sys.exit(main())
