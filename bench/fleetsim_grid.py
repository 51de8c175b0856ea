"""Routing strategies across a grid of regimes, in virtual time (`bench/fleetsim.py`).

    .venv/bin/python bench/fleetsim_grid.py                    # 12 cells, every contender
    .venv/bin/python bench/fleetsim_grid.py --quick --jobs 2   # smaller workloads
    .venv/bin/python bench/fleetsim_grid.py --cells chat-long-mid-P --contenders \\
        llmgw:chat,consistent-hash --strategy-file my_weights.yaml

Each cell: 4 replicas (`--replicas`) of one engine shape, one workload, an offered load as a
fraction of capacity, and a KV size below or 2-3x under the working set. Capacity comes from a
saturation probe in the simulation itself: the workload with every conversation started
at t=0 and no think time, routed by least-requests, onto engines with an unbounded
queue; capacity = completions per second between the 20th and 70th percentile of
completion times (requests/s), divided by the mean turns per conversation for the
conversation arrival rate. Sticky contenders may sustain more than least-requests on
conversational workloads (their cache hits save prefill), so "0.85" is 0.85 of
least-requests' capacity. The working set (KV blocks) is estimated by Little's law:
shared prompts once + live conversations x their final history, live = arrival rate x
(think time + per-turn service estimate); tight cells size the KV so the working set
is 2.5x the fleet's blocks (re-probing capacity with that KV, a few rounds; never below
1.5x the largest request per engine), loose cells give every engine room for the whole
working set. Both numbers are reported per cell.

Every contender replays the same prepared requests on fresh engines and a fresh router.
Output: a table per cell, a summary of TTFT p90 / best-in-cell, bench/results/fleetsim.json
and bench/results/fleetsim_grid.png (heat map of those ratios).

`--strategy-file` takes YAML: either one strategy (`name: mine`, `scorers: {...}`, ...)
or a mapping of names to strategies; each becomes a contender `custom:<name>`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import yaml  # noqa: E402

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import (  # noqa: E402
    LeastRequests,
    contender_names,
    make_contender,
    prepare,
    simulate,
)
from bench.workloads import WORKLOADS, Workload, build, percentile  # noqa: E402
from bench.workloads.regimes import REGIMES  # noqa: E402
from llmgw.scheduling.specs import StrategySpec  # noqa: E402
from llmgw.sim.model import EngineConfig  # noqa: E402

RESULTS = HERE / "results"
REPLICAS = 4

# Prefill-dominated: a 2,000-token uncached prompt costs 400 ms; 16 sequences a batch.
# Decode-dominated: prefill 10x cheaper, decode steps 3x longer, 48 sequences a batch.
SHAPES: dict[str, EngineConfig] = {
    "P": EngineConfig(
        max_num_seqs=16,
        max_queue=256,
        block_size=16,
        prefill_us_per_token=200.0,
        decode_ms=10.0,
        decode_batch_factor=0.02,
        max_model_len=16384,
    ),
    "D": EngineConfig(
        max_num_seqs=48,
        max_queue=256,
        block_size=16,
        prefill_us_per_token=20.0,
        decode_ms=30.0,
        decode_batch_factor=0.01,
        max_model_len=16384,
    ),
}
TIGHT_RATIO = 2.5  # working set / fleet KV blocks in tight cells


@dataclass(frozen=True)
class Cell:
    name: str
    workload: str
    load: float
    shape: str
    tight: bool
    sessions: str
    mix: str
    overrides: tuple[tuple[str, Any], ...] = ()  # workload generator arguments


CELLS: tuple[Cell, ...] = (
    Cell("chat-long-mid-P", "chat-long", 0.6, "P", False, "many, growing", "long chat"),
    Cell("chat-long-mid-D", "chat-long", 0.6, "D", False, "many, growing", "long chat"),
    Cell("chat-long-low-P", "chat-long", 0.3, "P", False, "many, growing", "long chat"),
    Cell(
        "chat-long-high-P-tight",
        "chat-long",
        0.85,
        "P",
        True,
        "many, growing",
        "long chat",
        overrides=(("think_s", 2.5),),  # more live histories: a working set 2-3x the KV
    ),
    Cell("hot-mid-P", "hot", 0.6, "P", False, "few hot (Zipf)", "long context"),
    Cell("hot-high-D-tight", "hot", 0.85, "D", True, "few hot (Zipf)", "long context"),
    Cell("prefix-mid-P", "prefix", 0.6, "P", False, "none", "shared prefixes"),
    Cell(
        "prefix-high-P-tight",
        "prefix",
        0.85,
        "P",
        True,
        "none",
        "shared prefixes",
        overrides=(("prefixes", 40),),  # 12 prefixes fit in the minimum KV of 4 engines
    ),
    Cell("docs-mid-P", "docs", 0.6, "P", False, "none", "long documents"),
    Cell("decode-high-D", "decode", 0.85, "D", False, "none", "decode-heavy"),
    Cell("chat-short-low-D", "chat-short", 0.3, "D", False, "many cold", "short chat"),
    Cell("mixed-high-P-tight", "mixed", 0.85, "P", True, "many + none", "chat + documents"),
)
CELL_BY_NAME = {c.name: c for c in CELLS}


def make_workload(
    name: str, seed: int, count: int | None = None, overrides: tuple[tuple[str, Any], ...] = ()
) -> Workload:
    """The named workload (bench/workloads or regimes), with about `count` conversations."""

    def at(scale: float) -> Workload:
        if name in WORKLOADS:
            return build(name, seed, scale, **dict(overrides))
        return REGIMES[name](seed, scale=scale, **dict(overrides))

    base = at(1.0)
    if count is None:
        return base
    return at(count / len(base.conversations))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def capacity(
    wl: Workload, engine: EngineConfig, conversations: int, replicas: int = REPLICAS
) -> float:
    """Requests/s the fleet sustains under least-requests (see the module docstring)."""
    convs = tuple(
        replace(c, start_s=0.0, turns=tuple(replace(t, think_s=0.0) for t in c.turns))
        for c in wl.conversations[:conversations]
    )
    probe_engine = replace(engine, max_queue=1_000_000)
    prepared = prepare(replace(wl, conversations=convs), [probe_engine] * replicas)
    result = simulate(prepared, LeastRequests(), seed=wl.seed)
    done = sorted(result.done_at)
    lo, hi = done[len(done) // 5], done[int(len(done) * 0.7)]
    count = int(len(done) * 0.7) - len(done) // 5
    return count / (hi - lo) if hi > lo else float(len(done)) / max(done[-1], 1e-9)


def working_set_blocks(wl: Workload, conv_rate: float, engine: EngineConfig) -> float:
    """Little's-law estimate of the KV blocks worth keeping (see the module docstring)."""
    block_tokens = engine.block_size * 4  # characters per block
    systems = {c.system for c in wl.conversations}
    shared = len(systems) < len(wl.conversations) / 2
    shared_blocks = sum(len(s) for s in systems) / block_tokens if shared else 0.0
    lives, uniques = [], []
    for c in wl.conversations:
        last = len(c.turns) - 1
        chars = c.prompt_chars(last) - (len(c.system) if shared else 0)
        uniques.append(chars / block_tokens)
        service = sum(t.max_tokens * engine.decode_ms / 1e3 * 1.5 + 0.05 for t in c.turns) + sum(
            t.think_s for t in c.turns[:-1]
        )
        lives.append(service)
    live = min(len(wl.conversations), conv_rate * _mean(lives))
    return shared_blocks + live * _mean(uniques)


def _max_request_blocks(wl: Workload, engine: EngineConfig) -> int:
    worst = max(
        c.prompt_chars(len(c.turns) - 1) // 4 + 16 + max(t.max_tokens for t in c.turns)
        for c in wl.conversations
    )
    return -(-worst // engine.block_size) + 2


@dataclass(frozen=True)
class CellPlan:
    conv_rate: float
    capacity_rps: float
    kv_blocks: int
    ws_ratio: float
    conversations: int
    mean_turns: float


def plan_cell(
    cell: Cell, seed: int, quick: bool, replicas: int = REPLICAS, tight_ratio: float = TIGHT_RATIO
) -> CellPlan:
    """Rate, KV size and size of a cell; tight cells: working set / fleet KV = tight_ratio."""
    shape = SHAPES[cell.shape]
    slots = replicas * shape.max_num_seqs
    base = make_workload(cell.workload, seed, overrides=cell.overrides)
    mean_turns = _mean([len(c.turns) for c in base.conversations])
    chains = math.ceil((1.5 if mean_turns > 1.5 else 3.0) * slots)
    probe_wl = make_workload(cell.workload, seed, chains, cell.overrides)
    worst = _max_request_blocks(probe_wl, shape)
    # Probe KV: every batch slot can hold a worst-case request, so memory never caps the batch.
    kv = max(8 * worst, shape.max_num_seqs * worst)
    cap = capacity(probe_wl, replace(shape, kv_blocks=kv), chains, replicas)
    conv_rate = cell.load * cap / mean_turns
    ws = working_set_blocks(base, conv_rate, shape)
    if cell.tight:
        # Less KV, less capacity, a lower rate, a smaller working set: iterate a few times.
        for _ in range(4):
            kv = max(3 * worst // 2, math.ceil(ws / tight_ratio / replicas))
            cap = capacity(probe_wl, replace(shape, kv_blocks=kv), chains, replicas)
            conv_rate = cell.load * cap / mean_turns
            ws = working_set_blocks(base, conv_rate, shape)
            if kv == 3 * worst // 2 or abs(ws / (kv * replicas) / tight_ratio - 1) < 0.16:
                break
    else:
        kv = max(kv, math.ceil(ws * 1.2))  # each engine could hold the whole working set
    window, min_requests = (10.0, 150) if quick else (30.0, 500)
    window = max(window, min_requests / (conv_rate * mean_turns))
    conversations = max(8, math.ceil(conv_rate * window))
    return CellPlan(
        conv_rate=conv_rate,
        capacity_rps=cap,
        kv_blocks=kv,
        ws_ratio=ws / (kv * replicas),
        conversations=conversations,
        mean_turns=mean_turns,
    )


def run_cell(
    cell: Cell,
    contenders: list[str],
    seed: int,
    quick: bool,
    scrape_interval: float,
    custom: dict[str, dict[str, Any]],
    replicas: int = REPLICAS,
    tight_ratio: float = TIGHT_RATIO,
) -> dict[str, Any]:
    started = time.process_time()
    plan = plan_cell(cell, seed, quick, replicas, tight_ratio)
    wl = make_workload(cell.workload, seed, plan.conversations, cell.overrides)
    wl = wl.with_rate(plan.conv_rate)
    engine = replace(SHAPES[cell.shape], kv_blocks=plan.kv_blocks)
    prepared = prepare(wl, [engine] * replicas)
    runs = []
    for name in contenders:
        contender = make_contender(name, scrape_interval, custom)
        t0 = time.process_time()
        result = simulate(prepared, contender, seed=seed, scrape_interval=scrape_interval)
        row = result.row()
        row["cpu_s"] = round(time.process_time() - t0, 2)
        row["error_kinds"] = result.error_kinds
        row["per_replica"] = result.per_replica
        row["virtual_s"] = round(result.virtual_s, 1)
        runs.append(row)
    return {
        "cell": cell.name,
        "seed": seed,
        "replicas": replicas,
        "workload": cell.workload,
        "description": wl.description,
        "load": cell.load,
        "shape": cell.shape,
        "engine": {
            "max_num_seqs": engine.max_num_seqs,
            "prefill_us_per_token": engine.prefill_us_per_token,
            "decode_ms": engine.decode_ms,
            "kv_blocks": engine.kv_blocks,
        },
        "tight": cell.tight,
        "sessions": cell.sessions,
        "mix": cell.mix,
        "capacity_rps": round(plan.capacity_rps, 2),
        "offered_rps": round(plan.conv_rate * plan.mean_turns, 2),
        "conversations": len(wl.conversations),
        "requests": wl.requests,
        "ws_over_kv": round(plan.ws_ratio, 2),
        "cpu_s": round(time.process_time() - started, 1),
        "runs": runs,
    }


def _ratios(cells: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for cell in cells:
        p90s = {r["contender"]: r["ttft_p90_ms"] for r in cell["runs"]}
        valid = [v for v in p90s.values() if v is not None]
        best = min(valid) if valid else None
        for name, v in p90s.items():
            out.setdefault(name, {})[cell["cell"]] = (
                round(v / best, 2) if v is not None and best else None
            )
    return out


def heat_map(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (only when plotting)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.colors import LogNorm  # noqa: PLC0415

    ratios = _ratios(cells)
    names = list(ratios)
    columns = [c["cell"] for c in cells]
    grid = [[ratios[n].get(c) or math.nan for c in columns] for n in names]
    fig, ax = plt.subplots(figsize=(1.0 * len(columns) + 3, 0.42 * len(names) + 2))
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=LogNorm(vmin=1.0, vmax=4.0), aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=40, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title("TTFT p90 / best contender in the cell (fleetsim, virtual time)")
    bar = fig.colorbar(image, ax=ax, shrink=0.8)
    bar.set_ticks([1.0, 1.5, 2.0, 3.0, 4.0], labels=["1", "1.5", "2", "3", ">=4"])
    bar.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_strategy_file(path: str) -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping")
    single = "scorers" in data or "picker" in data or "filters" in data
    entries = {str(data.get("name", Path(path).stem)): data} if single else data
    out: dict[str, dict[str, Any]] = {}
    for name, raw in entries.items():
        spec = {**raw, "name": str(name)}
        StrategySpec.model_validate(spec)  # fail here with pydantic's message, not mid-run
        out[f"custom:{name}"] = spec
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cells", help="comma-separated cell names (default: all)")
    parser.add_argument("--contenders", help="comma-separated contenders (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--strategy-file", action="append", default=[], help="YAML strategy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=REPLICAS, help="engines per cell")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--scrape-interval", type=float, default=0.05)
    parser.add_argument("--out", default=str(RESULTS / "fleetsim.json"))
    parser.add_argument("--plot", default=str(RESULTS / "fleetsim_grid.png"))
    parser.add_argument("--list", action="store_true", help="list cells and contenders")
    args = parser.parse_args(argv)

    custom: dict[str, dict[str, Any]] = {}
    for path in args.strategy_file:
        custom.update(load_strategy_file(path))
    all_contenders = contender_names() + list(custom)
    if args.list:
        for c in CELLS:
            print(f"{c.name:24} {c.workload:10} load {c.load:<4} shape {c.shape} "
                  f"tight={c.tight} sessions={c.sessions} mix={c.mix}")  # fmt: skip
        print("contenders:", ", ".join(all_contenders))
        return 0
    cells = [CELL_BY_NAME[n] for n in args.cells.split(",")] if args.cells else list(CELLS)
    contenders = args.contenders.split(",") if args.contenders else all_contenders
    for name in contenders:
        make_contender(name, args.scrape_interval, custom)  # unknown names fail now

    started = time.perf_counter()
    jobs = max(1, min(args.jobs, len(cells)))
    call = (contenders, args.seed, args.quick, args.scrape_interval, custom, args.replicas)
    if jobs == 1:
        results = [run_cell(c, *call) for c in cells]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_cell, c, *call) for c in cells]
            results = [f.result() for f in futures]
    wall = time.perf_counter() - started

    for cell in results:
        print(
            f"\n## {cell['cell']}: {cell['description']}; load {cell['load']} of "
            f"{cell['capacity_rps']} req/s ({cell['offered_rps']} offered), shape "
            f"{cell['shape']}, kv {cell['engine']['kv_blocks']} blocks/engine, working set / "
            f"KV {cell['ws_over_kv']}, {cell['requests']} requests, cpu {cell['cpu_s']} s"
        )
        keys = ("contender", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p90_ms",
                "hit_rate", "max_mean", "errors")  # fmt: skip
        print(format_table([{k: r[k] for k in keys} for r in cell["runs"]]))
    ratios = _ratios(results)
    summary = [
        {"contender": name, **{c["cell"]: ratios[name].get(c["cell"]) for c in results}}
        for name in ratios
    ]
    print("\n## TTFT p90 / best in cell")
    print(format_table(summary))
    worst = {name: max((v for v in r.values() if v is not None), default=None)
             for name, r in ratios.items()}  # fmt: skip
    print("worst ratio per contender:", worst)
    print(f"wall {wall:.1f} s, jobs {jobs}, cpu in cells "
          f"{sum(c['cpu_s'] for c in results):.1f} s")  # fmt: skip
    payload = {
        "seed": args.seed,
        "quick": args.quick,
        "replicas": args.replicas,
        "scrape_interval": args.scrape_interval,
        "wall_s": round(wall, 1),
        "contenders": contenders,
        "custom": custom,
        "cells": results,
        "ratio_to_best": ratios,
        "p90_median": {
            n: percentile([v for v in r.values() if v is not None], 50) for n, r in ratios.items()
        },
    }
    out = Path(args.out)
    if out.parent == RESULTS and out.name == "fleetsim.json":
        write_results("fleetsim", payload)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        import json  # noqa: PLC0415

        out.write_text(json.dumps(payload, indent=2))
    if args.plot:
        heat_map(results, Path(args.plot))
        print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
