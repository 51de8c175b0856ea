"""CPU cost of the decision trace at 100 % sampling, per request.

1. The real server: `llmgw extproc` in a subprocess (8 endpoints, `latency`, no scraping),
   driven over gRPC by this process (16 concurrent streams of the messages Envoy sends);
   the server's own CPU time (/proc/PID/stat) per request, trace off vs on.
2. In process: drives the ext_proc edge (`Exchange`: protocol translation, Lifecycle, pick with
the default `latency` strategy, telemetry) with fake Envoy messages: request headers, a
JSON body, response headers, end of stream. gRPC is left out, so the baseline is the
smallest the router's per-request CPU can be and the ratio is an upper bound (the real
server spends most of its CPU in grpc.aio). Rounds alternate trace off / on.

    python -m bench.trace_cost [--requests 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from llmgw.config import TraceSpec, load_dict
from llmgw.extproc.translate import Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks
from llmgw.registry import Registry
from llmgw.runtime.telemetry import Telemetry
from llmgw.runtime.trace import close_trace, traced
from llmgw.scheduling.scheduler import Scheduler
from llmgw.testing.extproc import (
    chat_headers,
    request_body,
    request_headers,
    response_headers,
    response_trailers,
)
from llmgw.types import EngineMetrics

ROOT = Path(__file__).resolve().parent
PROMPTS = {"2 KB": 2048, "16 KB": 16384}


def setup() -> tuple[Gateway, Hooks]:
    addresses = [f"10.0.0.{i + 1}:8000" for i in range(8)]
    cfg = load_dict({"models": {"m1": {"endpoints": addresses, "strategy": "latency"}}})
    registry = Registry(breaker=cfg.breaker.settings(), staleness=1e9)
    rng = random.Random(1)
    for address in addresses:
        registry.record_scrape(
            "m1", address, EngineMetrics(rng.randint(0, 3), rng.randint(1, 8), rng.random())
        )
    telemetry = Telemetry()
    telemetry.bind(registry)
    return Gateway(Scheduler(cfg, registry, seed=1)), telemetry.hooks("extproc")


def messages(n: int, size: int) -> list[list[bytes]]:
    """Per request: the serialized Envoy messages (sessions with growing shared prefixes)."""
    rng = random.Random(2)
    system = "".join(rng.choice("abcdefghij ") for _ in range(size // 2))
    out = []
    for i in range(n):
        session = f"user-{rng.randrange(200)}"
        tail = "".join(rng.choice("klmnopqrst ") for _ in range(size - len(system)))
        body = orjson.dumps(
            {"model": "m1", "messages": [{"role": "user", "content": system + tail}]}
        )
        headers = chat_headers(
            **{"x-session-id": session, "content-type": "application/json", "x-request-id": str(i)}
        )
        out.append(
            [
                request_headers(headers).SerializeToString(),
                request_body(body).SerializeToString(),
                response_headers(200).SerializeToString(),
                response_trailers().SerializeToString(),
            ]
        )
    return out


def run(gateway: Gateway, hooks: Hooks, requests: list[list[bytes]]) -> float:
    """CPU seconds per request."""
    from envoy.service.ext_proc.v3.external_processor_pb2 import (  # noqa: PLC0415
        ProcessingRequest,
    )

    parsed = [[ProcessingRequest.FromString(m) for m in r] for r in requests]
    gc.collect()
    started = time.process_time()
    for request in parsed:
        exchange = Exchange(gateway, hooks)
        for message in request:
            exchange.handle(message)
        exchange.close()
    return (time.process_time() - started) / len(parsed)


def server_cpu(trace_path: str | None, requests: list[list[bytes]], tmp: Path) -> float:
    """Server CPU seconds per request of a real `llmgw extproc` process."""
    addresses = [f"10.0.0.{i + 1}:8000" for i in range(8)]
    config: dict[str, Any] = {"models": {"m1": {"endpoints": addresses, "strategy": "latency"}}}
    if trace_path is not None:
        config["trace"] = {"path": trace_path}
    cfg, ready = tmp / "llmgw.json", tmp / "ready.json"  # JSON is YAML
    cfg.write_text(json.dumps(config))
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "llmgw.cli", "extproc", "--config", str(cfg)]
    argv += ["--host", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0"]
    argv += ["--plaintext", "--health-port", "0"]  # drive() speaks h2c
    argv += ["--metrics-port", "0", "--no-scrape", "--log-level", "warning"]
    argv += ["--ready-file", str(ready), "--reload-interval", "0"]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():  # the server writes it once serving
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llmgw extproc did not start")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["grpc"]
        asyncio.run(drive(f"127.0.0.1:{port}", requests[: len(requests) // 4]))  # warm-up
        before = cpu_seconds(proc.pid)
        asyncio.run(drive(f"127.0.0.1:{port}", requests))
        return (cpu_seconds(proc.pid) - before) / len(requests)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(target: str, requests: list[list[bytes]], concurrency: int = 16) -> None:
    """Each request on its own stream: every message answered before the next is sent."""
    import grpc  # noqa: PLC0415

    async with grpc.aio.insecure_channel(target) as channel:
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue:
                messages = queue.pop()
                call = process()
                for message in messages:
                    await call.write(message)
                    await call.read()
                await call.done_writing()
                await call.code()

        await asyncio.gather(*[worker() for _ in range(concurrency)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    server: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        requests = messages(args.requests, 2048)
        off_s, on_s = [], []
        for r in range(args.rounds):
            off_s.append(server_cpu(None, requests, Path(tmp)))
            on_s.append(server_cpu(str(Path(tmp) / f"server-{r}.jsonl"), requests, Path(tmp)))
        written = sum(1 for _ in open(Path(tmp) / "server-0.jsonl"))  # noqa: SIM115
        base, traced_cpu = statistics.median(off_s), statistics.median(on_s)
        server = {
            "off_us": base * 1e6,
            "on_us": traced_cpu * 1e6,
            "trace_us": (traced_cpu - base) * 1e6,
            "ratio": traced_cpu / base,
            "lines_written": written,
            "runs_off_us": [x * 1e6 for x in off_s],
            "runs_on_us": [x * 1e6 for x in on_s],
        }
        for label, size in PROMPTS.items():
            requests = messages(args.requests, size)
            off: list[float] = []
            on: list[float] = []
            for r in range(args.rounds):
                gateway, hooks = setup()
                off.append(run(gateway, hooks, requests))
                gateway, hooks = setup()
                spec = TraceSpec(path=str(Path(tmp) / f"trace-{size}-{r}.jsonl"))
                with_trace = traced(hooks, spec)
                on.append(run(gateway, with_trace, requests))
                close_trace(with_trace)
            base, traced_cpu = statistics.median(off), statistics.median(on)
            results[label] = {
                "off_us": base * 1e6,
                "on_us": traced_cpu * 1e6,
                "trace_us": (traced_cpu - base) * 1e6,
                "ratio": traced_cpu / base,
                "line_bytes": Path(tmp, f"trace-{size}-0.jsonl").stat().st_size / args.requests,
            }
    print("\ndecision trace at 100 % sampling, `llmgw extproc` server CPU per request (gRPC)")
    print(f"{'prompt':>8} {'off µs':>8} {'on µs':>8} {'trace µs':>9} {'on/off':>7}")
    print(
        f"{'2 KB':>8} {server['off_us']:8.1f} {server['on_us']:8.1f} "
        f"{server['trace_us']:9.1f} {server['ratio']:7.3f}"
    )
    print("\ndecision trace at 100 % sampling, ext_proc edge in process (no gRPC), CPU/request")
    print(f"{'prompt':>8} {'off µs':>8} {'on µs':>8} {'trace µs':>9} {'on/off':>7} {'B/line':>7}")
    for label, r in results.items():
        print(
            f"{label:>8} {r['off_us']:8.1f} {r['on_us']:8.1f} {r['trace_us']:9.1f} "
            f"{r['ratio']:7.3f} {r['line_bytes']:7.0f}"
        )
    out = ROOT / "results" / "trace_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"requests": args.requests, "server": server, "in_process": results}, indent=2)
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
