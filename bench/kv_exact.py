"""Exact (KV events) vs approximate prefix matching vs sglang-router cache_aware, on a
simulated fleet of 8, under cache pressure and without, over several seeds (issue 16).

    .venv/bin/python bench/kv_exact.py --jobs 2                  # 12 cells x 3 seeds
    .venv/bin/python bench/kv_exact.py --cells chat-long-P-ws4x --seeds 1

Cells are `bench/fleetsim_grid.py` cells (its planning: capacity probe, Little's-law working
set, rate, KV size) with `--replicas` engines; "ws Nx" cells size each engine's KV so the
working set is N times one replica's KV (at N <= 8 the fleet holds it if routing partitions
it; 12x and 20x put the fleet under pressure), "loose" cells give each engine room for all.
Contenders:
- `llmgw:latency`: approximate index, bounded by each engine's KV size (the default);
- `llmgw:latency-nokvsize`: the same index without the KV size (believes what it routed
  is still cached: llm-d's "approximate");
- `llmgw:latency-exact`: exact cached tokens from the engines' KV events;
- `*-2routers`: two router replicas behind a random balancer sharing the fleet (an HA
  endpoint picker);
- `sglang-cache-aware-lib`: sglang-router's cache_aware with its library defaults.
Output: a table per cell (mean over seeds; ratio = TTFT p90 / llmgw:latency's per seed,
min-max), bench/results/kv_exact.json and bench/results/kv_exact.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import make_contender  # noqa: E402
from bench.fleetsim_grid import Cell, run_cell  # noqa: E402

RESULTS = HERE / "results"
REPLICAS = 8
BASELINE = "llmgw:latency"
CONTENDERS = (
    BASELINE,
    "llmgw:latency-nokvsize",
    "llmgw:latency-exact",
    "llmgw:latency-2routers",
    "llmgw:latency-exact-2routers",
    "sglang-cache-aware-lib",
)
# (workload, engine shape, session mix, generator overrides)
WORKLOADS: tuple[tuple[str, str, str, tuple[tuple[str, Any], ...]], ...] = (
    ("chat-long", "P", "many, growing", (("think_s", 2.5),)),
    ("prefix", "P", "none", (("prefixes", 40),)),
    ("hot", "D", "few hot (Zipf)", ()),
)
PRESSURES: tuple[float | None, ...] = (None, 4.0, 12.0, 20.0)  # working set / one replica's KV


def cells() -> dict[str, tuple[Cell, float | None]]:
    out: dict[str, tuple[Cell, float | None]] = {}
    for workload, shape, sessions, overrides in WORKLOADS:
        for ratio in PRESSURES:
            suffix = "loose" if ratio is None else f"ws{ratio:g}x"
            name = f"{workload}-{shape}-{suffix}"
            load = 0.6 if ratio is None else 0.85
            cell = Cell(name, workload, load, shape, ratio is not None, sessions, workload,
                        overrides)  # fmt: skip
            out[name] = (cell, ratio)
    return out


def _run(name: str, ratio: float | None, seed: int, contenders: list[str], replicas: int) -> Any:
    cell, _ = cells()[name]
    fleet_ratio = ratio / replicas if ratio is not None else 1.0  # unused when loose
    return run_cell(cell, contenders, seed, False, 0.05, {}, replicas, fleet_ratio)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise(results: list[dict[str, Any]], contenders: list[str]) -> list[dict[str, Any]]:
    """One row per (cell, contender): means over seeds, ratio to the baseline per seed."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_cell.setdefault(r["cell"], []).append(r)
    rows = []
    for cell, runs in by_cell.items():
        base = {r["seed"]: _p90(r, BASELINE) for r in runs}
        for name in contenders:
            rows_of = [next(x for x in r["runs"] if x["contender"] == name) for r in runs]
            ratios = [
                x["ttft_p90_ms"] / base[r["seed"]]
                for r, x in zip(runs, rows_of, strict=True)
                if x["ttft_p90_ms"] and base[r["seed"]]
            ]
            rows.append(
                {
                    "cell": cell,
                    "ws/replica_kv": round(
                        _mean([r["ws_over_kv"] * r["replicas"] for r in runs]), 1
                    ),
                    "requests": "/".join(str(r["requests"]) for r in runs),
                    "contender": name,
                    "hit_rate": round(_mean([x["hit_rate"] for x in rows_of]), 3),
                    "ttft_p50_ms": round(_mean([x["ttft_p50_ms"] or math.nan for x in rows_of])),
                    "ttft_p90_ms": round(_mean([x["ttft_p90_ms"] or math.nan for x in rows_of])),
                    "p90_vs_latency": f"{_geomean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                    if ratios
                    else "-",
                    "errors": sum(x["errors"] for x in rows_of),
                }
            )
    return rows


def _p90(result: dict[str, Any], name: str) -> float | None:
    for row in result["runs"]:
        if row["contender"] == name:
            value: float | None = row["ttft_p90_ms"]
            return value
    return None


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def plot(rows: list[dict[str, Any]], contenders: list[str], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (only when plotting)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(dict.fromkeys(r["cell"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(contenders)
    for k, contender in enumerate(contenders):
        mine = {r["cell"]: r for r in rows if r["contender"] == contender}
        xs = [i + (k - len(contenders) / 2 + 0.5) * width for i in range(len(names))]
        axes[0].bar(xs, [mine[c]["ttft_p90_ms"] for c in names], width, label=contender)
        axes[1].bar(xs, [mine[c]["hit_rate"] for c in names], width, label=contender)
    for ax, title in zip(axes, ("TTFT p90 (ms, mean of seeds)", "prefix hit rate"), strict=True):
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(contenders), fontsize=8)
    fig.suptitle(f"exact vs approximate prefix matching, {REPLICAS} simulated replicas")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cells", help="comma-separated cell names (default: all)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--name", default="kv_exact", help="results file: bench/results/NAME.json")
    parser.add_argument("--plot", help="the plot's path (default bench/results/NAME.png; '' none)")
    parser.add_argument("--replot", help="redraw the plot from a results JSON, run nothing")
    args = parser.parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        names = list(dict.fromkeys(r["contender"] for r in data["rows"]))
        plot(data["rows"], names, Path(args.plot or RESULTS / f"{args.name}.png"))
        return 0
    table = cells()
    names = args.cells.split(",") if args.cells else list(table)
    for name in names:
        if name not in table:
            raise SystemExit(f"unknown cell {name!r}; known: {', '.join(table)}")
    contenders = args.contenders.split(",")
    if BASELINE not in contenders:
        contenders.insert(0, BASELINE)
    for name in contenders:
        make_contender(name)  # unknown names fail now
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    jobs = [(n, table[n][1], s, contenders, args.replicas) for n in names for s in seeds]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(_run, *zip(*jobs, strict=True)))
    wall = time.perf_counter() - started
    rows = summarise(results, contenders)
    print(f"{args.replicas} replicas, seeds {seeds}; requests per seed listed per cell")
    for name in names:
        print(f"\n## {name}")
        print(format_table([{k: v for k, v in r.items() if k != "cell"} for r in rows
                            if r["cell"] == name]))  # fmt: skip
    print(f"\nwall {wall:.0f} s, cpu in cells {sum(r['cpu_s'] for r in results):.0f} s")
    write_results(args.name, {"seeds": seeds, "replicas": args.replicas, "rows": rows,
                               "cells": results})  # fmt: skip
    path = str(RESULTS / f"{args.name}.png") if args.plot is None else args.plot
    if path:
        plot(rows, contenders, Path(path))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
