"""The real-process grid's regimes (`bench/routing.py`) in virtual time (`bench/fleetsim.py`).

    .venv/bin/python bench/fleetsim_regimes.py                       # 12 regimes
    .venv/bin/python bench/fleetsim_regimes.py --cells hot-zipf,chat-history \\
        --contenders llmgw:latency,llmgw:latency@envoy,consistent-hash

Same workloads (`bench/workloads/grid.py`, sized to capacity from the engine's numbers)
and the same simulated engine as `bench/routing.py` (4 replicas, 60 us a prefill token,
25 ms decode steps, 8 sequences a replica, chunked prefill at 2,048 tokens), but every
replica, the router and the clock run in one process: deterministic, minutes instead of
25, and unaffected by other load on the machine. `llmgw:<preset>@envoy` stands for llmgw
behind Envoy without response body events (no first-token signal). Network, HTTP and
Envoy costs are not in it: the real grid stays the judge; this one is for iterating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import make_contender  # noqa: E402
from bench.fleetsim_grid import heat_map, load_strategy_file  # noqa: E402
from bench.fleetsim_robust import mean_ratios, run_cell  # noqa: E402
from bench.workloads.grid import REGIMES  # noqa: E402

RESULTS = HERE / "results"
CONTENDERS = (
    "llmgw:latency",
    "llmgw:latency@envoy",
    "llmgw:chat",
    "llmgw:chat@envoy",
    "consistent-hash",
    "round-robin",
    "least-requests",
    "sglang-cache-aware-lib",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cells", help="comma-separated regime names (default: all)")
    parser.add_argument("--contenders", help="comma-separated contenders")
    parser.add_argument("--strategy-file", action="append", default=[], help="YAML strategy")
    parser.add_argument("--seeds", default="1", help="comma-separated; ratios are averaged")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default="fleetsim_regimes", help="bench/results/<out>.json")
    parser.add_argument("--plot", default=str(RESULTS / "fleetsim_regimes.png"))
    args = parser.parse_args(argv)
    custom: dict[str, dict[str, Any]] = {}
    for path in args.strategy_file:
        custom.update(load_strategy_file(path))
    names = args.cells.split(",") if args.cells else list(REGIMES)
    unknown = [n for n in names if n not in REGIMES]
    if unknown:
        raise SystemExit(f"unknown regimes {unknown}; known: {', '.join(REGIMES)}")
    contenders = args.contenders.split(",") if args.contenders else [*CONTENDERS, *custom]
    for c in contenders:
        make_contender(c, 0.05, custom)  # unknown names fail now

    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = [(n, seed) for seed in seeds for n in names]
    started = time.perf_counter()
    jobs = max(1, min(args.jobs, len(tasks)))
    # bench/routing.py's engine at its window: fleetsim_robust's base variant, window 1.
    if jobs == 1:
        results = [run_cell("base", n, contenders, seed, 1.0, custom) for n, seed in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [
                pool.submit(run_cell, "base", n, contenders, seed, 1.0, custom) for n, seed in tasks
            ]
            results = [f.result() for f in futures]
    wall = time.perf_counter() - started
    keys = ("contender", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "hit_rate", "max_mean",
            "errors")  # fmt: skip
    for cell in results:
        print(f"\n## {cell['cell']} seed {cell['seed']}: {cell['description']} "
              f"({cell['requests']} requests)")  # fmt: skip
        print(format_table([{k: r[k] for k in keys} for r in cell["runs"]]))
    ratios = mean_ratios(results)
    print(f"\n## TTFT p90 / best in cell (geometric mean over seeds {args.seeds})")
    print(format_table([{"contender": n, **r} for n, r in ratios.items()]))
    worst = {n: max((v for v in r.values() if v is not None), default=None)
             for n, r in ratios.items()}  # fmt: skip
    print("worst ratio per contender:", worst)
    print(f"wall {wall:.1f} s, jobs {jobs}")
    write_results(args.out, {"seeds": seeds, "contenders": contenders, "cells": results})
    if args.plot:
        heat_map([r for r in results if r["seed"] == seeds[0]], Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
