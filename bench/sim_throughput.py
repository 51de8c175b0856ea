"""How many requests/s one simulator process answers with zero simulated latency.

    .venv/bin/python bench/sim_throughput.py [--requests 20000] [--clients 32,64]

Starts `python -m llmgw.sim --time-scale 0` as a child process (pinned to CPU 0 so it
gets one core), drives it with h2load/wrk/hey on another core,
prints a table and writes bench/results/sim_throughput.json. It never asserts timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._tools import find_load_tool, format_table, run_load, write_results
from llmgw.sim.fleet import spawn

CHAT = {
    "model": "m1",
    "messages": [{"role": "user", "content": "Say hello to the benchmark, briefly."}],
    "max_tokens": 16,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--clients", default="32,64", help="comma-separated concurrency levels")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the sim to CPU 0")
    args = parser.parse_args(argv)

    tool = find_load_tool()
    if tool is None:
        print("no load tool (h2load, wrk, hey) found or installable; nothing measured")
        return 1
    pin = not args.no_pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
    sim_args = ["--port", "0", "--time-scale", "0", "--max-num-seqs", "256", "--max-queue",
                "4096"]  # fmt: skip
    popen: dict[str, Any] = {"stdout": subprocess.DEVNULL}
    if pin:
        # One core for the sim; the load tool (one thread) gets the others.
        popen["preexec_fn"] = lambda: os.sched_setaffinity(0, {0})
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    body = json.dumps(CHAT).encode()
    stream_body = json.dumps({**CHAT, "stream": True}).encode()
    with spawn(sim_args, **popen) as sim:
        url = sim.urls[0]
        scenarios: list[tuple[str, str, bytes | None, int]] = [
            ("warm-up", url + "/v1/chat/completions", body, 16),
        ]
        for clients in (int(c) for c in args.clients.split(",")):
            scenarios.append(("chat, non-streaming", url + "/v1/chat/completions", body, clients))
        scenarios.append(("chat, streaming", url + "/v1/chat/completions", stream_body, 32))
        scenarios.append(("GET /health", url + "/health", None, 32))
        for label, target, payload, clients in scenarios:
            requests = 2_000 if label == "warm-up" else args.requests
            result = run_load(
                tool, target, body=payload, requests=requests, clients=clients, label=label
            )
            if label == "warm-up":
                continue
            rows.append(result.row())
            runs.append(result.to_json())
    print(f"llmgw sim throughput, zero simulated latency ({tool.name}, sim pinned: {pin})")
    print(format_table(rows))
    best = max(r["rps"] for r in runs if r["label"] == "chat, non-streaming")
    print(f"\nnon-streaming chat: {best:,.0f} req/s from one sim process")
    path = write_results(
        "sim_throughput",
        {
            "benchmark": "sim_throughput",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "tool": tool.name,
            "sim_pinned_to_one_cpu": pin,
            "non_streaming_chat_best_rps": best,
            "runs": runs,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
