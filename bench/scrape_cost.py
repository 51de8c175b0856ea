"""What a /metrics scrape costs the engine: one streamed answer at a time while a scraper
polls `/metrics` at 0 / 4 / 10 / 20 Hz (llmgw's default is 10 Hz per router replica, GIE's
reference EPP scrapes at 20 Hz). Prints the render time of one `/metrics` GET and, per
rate, TTFT, the end of the answer and the inter-token gaps (p50s over the answers).

    python bench/scrape_cost.py --engine vllm    # real vLLM (scripts/vllm-cpu.sh setup first)
    python bench/scrape_cost.py --engine sim     # the simulator, one replica

Writes bench/results/scrape_cost.json. One machine, one run: compare the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._tools import format_table, write_results  # noqa: E402
from bench.peers import Service  # noqa: E402
from llmgw.runtime.ports import free_port  # noqa: E402

RATES_HZ = (0, 4, 10, 20, 0)  # the idle rate twice: first and last, to see drift


@contextlib.contextmanager
def engine(kind: str) -> Iterator[tuple[str, str]]:
    """Start the engine; yield (base URL, served model name)."""
    port = free_port()
    if kind == "vllm":
        script = ROOT / "scripts" / "vllm-cpu.sh"
        line = subprocess.run(
            ["bash", str(script), "cmd", str(port), "0", "--max-num-seqs", "8"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        cmd, model = shlex.split(line), "tiny"
    else:
        cmd = [sys.executable, "-m", "llmgw.sim", "--replicas", "1", "--base-port", str(port)]
        cmd += ["--model", "m1", "--time-scale", "1", "--decode-ms", "10"]
        model = "m1"
    # vLLM loads and compiles its model first: minutes on a cold cache.
    with Service(cmd, f"http://127.0.0.1:{port}/health", name=kind, timeout=300):
        yield f"http://127.0.0.1:{port}", model


def get_ms(url: str) -> float:
    t = time.perf_counter()
    urllib.request.urlopen(url, timeout=10).read()
    return (time.perf_counter() - t) * 1e3


def answer(url: str, model: str, tokens: int) -> tuple[float, float, list[float]]:
    """(TTFT ms, end ms, inter-token gaps ms) of one streamed answer of `tokens` tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": "tell " * 50}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t0 = time.perf_counter()
    seen: list[float] = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.strip():
                seen.append(time.perf_counter())
    # seen[0] is the role chunk (with the first token on vLLM), the last two [DONE] etc.
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(seen[2:-1])]
    return (seen[1] - t0) * 1e3, (seen[-1] - t0) * 1e3, gaps


def at_rate(url: str, model: str, hz: float, answers: int, tokens: int) -> dict[str, Any]:
    stop = threading.Event()
    renders: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            renders.append(get_ms(url + "/metrics"))
            stop.wait(1 / hz)

    scraper = threading.Thread(target=scrape, daemon=True) if hz else None
    if scraper is not None:
        scraper.start()
    try:
        runs = [answer(url, model, tokens) for _ in range(answers)]
    finally:
        stop.set()
        if scraper is not None:
            scraper.join()
    gaps = sorted(g for _, _, run_gaps in runs for g in run_gaps)
    return {
        "scrapes_per_s": hz,
        "ttft_p50_ms": round(statistics.median(r[0] for r in runs), 2),
        "end_p50_ms": round(statistics.median(r[1] for r in runs), 1),
        "gap_p50_ms": round(statistics.median(gaps), 2) if gaps else None,
        "gap_p90_ms": round(gaps[int(len(gaps) * 0.9)], 2) if gaps else None,
        "scrapes": len(renders),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "sim"), default="sim")
    parser.add_argument("--answers", type=int, default=8, help="answers per rate")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    args = parser.parse_args(argv)
    with engine(args.engine) as (url, model):
        for _ in range(3):  # warm up: compile, fill histograms
            answer(url, model, 8)
        size = len(urllib.request.urlopen(url + "/metrics", timeout=10).read())
        render = statistics.median(get_ms(url + "/metrics") for _ in range(50))
        health = statistics.median(get_ms(url + "/health") for _ in range(50))
        rows = [at_rate(url, model, hz, args.answers, args.tokens) for hz in RATES_HZ]
    print(
        f"{args.engine}: GET /metrics {render:.2f} ms ({size} bytes), GET /health {health:.2f} ms"
    )
    print(format_table(rows))
    path = write_results(
        "scrape_cost",
        {"engine": args.engine, "metrics_get_ms": round(render, 2), "metrics_bytes": size,
         "health_get_ms": round(health, 2), "answers": args.answers, "tokens": args.tokens,
         "rows": rows},
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
