"""Does a strategy's ranking survive a different engine? The grid's regimes on engines unlike
the one `bench/routing.py` simulates, in virtual time (`bench/fleetsim.py`).

    .venv/bin/python bench/fleetsim_robust.py --seeds 1,2 --jobs 2
    .venv/bin/python bench/fleetsim_robust.py --variants base,gauges-only --cells chat-history
    # after a change to llmgw:latency, rerun it alone, the other contenders from the last run:
    .venv/bin/python bench/fleetsim_robust.py --contenders llmgw:latency,llmgw:latency@envoy \
        --reuse bench/results/fleetsim_robust.json

A router tuned to one simulator can lose on another (issue 13: the old default was 2-2.5x
worse than consistent hashing on a simulator that was not ours). Each variant changes one
thing of the base engine (4 replicas, 60 us a prefill token, 25 ms decode steps, 8
sequences, chunked prefill at 2,048 tokens, every vLLM metric): prefill 4x faster or
slower, big batches (48 sequences, or vLLM's default 256), small prefill chunks, 8
replicas, an engine that publishes only the load gauges (no histograms, counters or cache
config: llmgw's calibration falls back to the first tokens and picks it sees itself, else
its params), or one that adds only the token and request counters (no histograms, like
SGLang). A few change two things, because a router's params are right for nobody's engine:
a prefill speed 4x off the params on an engine that publishes only the gauges
(`gauges-fast`, `gauges-slow`) or counters plus time to first token, time between tokens
and end to end, no prefill or queue histogram (`ttft-*`, what most vLLM look-alikes
publish); and an engine that publishes no metrics at all (`no-metrics`, also with 48 or
256 sequences a replica), and one that publishes everything but its KV size (`no-kv-size`,
no `cache_config_info`: the prefix index fits itself to the engine's hit counter).
`bench/fleetsim_regimes.py` runs the base engine's cells.
`--cells` also takes the regimes outside the real grid (`system-shared`, `-heavy`,
`-pressure`: short chat sharing system prompts, no session header). Workloads are sized to
each variant's capacity, so load 0.6 means 0.6 of that engine's capacity. Windows are
`--window` x the real grid's (more requests: p90 of a few hundred moves 20-40 % between
seeds), and longer where a cell would still hold fewer than `--min-requests` (500). The
router scrapes each replica every `--scrape` seconds, llmgw's own default (0.1) unless
told. Prints per variant the TTFT p90 over the best contender of each cell (geometric mean
over seeds) and writes JSON + a heat map.
"""

from __future__ import annotations

import argparse
import json
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

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import (  # noqa: E402
    ALL_BUT_KV_SIZE,
    COUNTERS_ONLY,
    GAUGES_ONLY,
    TTFT_ONLY,
    PreparedWorkload,
    make_contender,
    prepare,
    simulate,
)
from bench.fleetsim_grid import _ratios, load_strategy_file  # noqa: E402
from bench.routing import (  # noqa: E402
    BATCH_FACTOR,
    BLOCK,
    DECODE_MS,
    KV_BLOCKS,
    MAX_SEQS,
    PREFILL_US,
    REPLICAS,
    engine_speed,
    pressure_level,
)
from bench.workloads import Workload  # noqa: E402
from bench.workloads.grid import (  # noqa: E402
    EXTRA_REGIMES,
    OVER_REGIMES,
    REGIMES,
    EngineSpeed,
    regime_workload,
)
from llmgw.config import ScrapeSpec  # noqa: E402
from llmgw.sim.model import EngineConfig  # noqa: E402

RESULTS = HERE / "results"
CELLS = ("chat-history", "chat-history-heavy", "hot-zipf", "hot-zipf-pressure", "docs-shared",
         "prefill-heavy", "decode-heavy")  # fmt: skip
# The grid's, then short chat without sessions, then sustained overload.
ALL_REGIMES = {**REGIMES, **EXTRA_REGIMES, **OVER_REGIMES}
CONTENDERS = (
    "llmgw:latency",
    "llmgw:latency@envoy",
    "consistent-hash",
    "sglang-cache-aware-lib",
    "least-requests",
    "round-robin",
)


@dataclass(frozen=True)
class Variant:
    """One change to the base engine (`engine` / `engine_speed` of the real grid)."""

    note: str
    engine: dict[str, Any]
    replicas: int = REPLICAS
    metrics: frozenset[str] | None = None
    # The engine's tokenizer: characters per token where the router estimates 4. Its
    # per-token costs and sizes scale with it, so a character costs the same time and
    # cache as on the base engine: only the unit the engine counts in differs.
    chars_per_token: float = 4.0
    # Replicas (the last ones) that run this many times slower, prefill and decode alike:
    # a fleet of two hardware generations, or a noisy neighbour.
    slow_replicas: int = 0
    slow_factor: float = 2.0

    def engines(self, cfg: EngineConfig) -> list[EngineConfig]:
        slow = replace(
            cfg,
            prefill_us_per_token=cfg.prefill_us_per_token * self.slow_factor,
            decode_ms=cfg.decode_ms * self.slow_factor,
        )
        fast = self.replicas - self.slow_replicas
        return [cfg] * fast + [slow] * self.slow_replicas


# bench/routing.py's engine (its sim_args), from the constants it imports, so the two
# stay in step.
def engine(level: str) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=MAX_SEQS,
        max_queue=4096,
        kv_blocks=KV_BLOCKS[level],
        block_size=BLOCK,
        prefill_us_per_token=PREFILL_US,
        decode_ms=DECODE_MS,
        decode_batch_factor=BATCH_FACTOR,
        max_model_len=16384,
        max_num_batched_tokens=2048,
    )


def mean_ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """TTFT p90 / best in cell per seed, then the geometric mean over seeds per cell (p90
    of a few hundred requests moves by 20-40 % between seeds in the hot cells)."""
    per_seed: dict[str, dict[str, list[float]]] = {}
    for cell in results:
        for name, cells in _ratios([cell]).items():
            value = cells[cell["cell"]]
            if value is not None:
                per_seed.setdefault(name, {}).setdefault(cell["cell"], []).append(value)
    return {
        name: {c: round(math.prod(v) ** (1 / len(v)), 2) for c, v in cells.items()}
        for name, cells in per_seed.items()
    }


# Engine changes several variants share (EngineConfig fields).
FAST = {"prefill_us_per_token": 15.0}  # 4x faster prefill than the base engine
SLOW = {"prefill_us_per_token": 240.0}  # 4x slower
BATCH_48 = {"max_num_seqs": 48, "decode_batch_factor": 0.01}
BATCH_256 = {"max_num_seqs": 256, "decode_batch_factor": 0.005}  # vLLM's default batch
VARIANTS: dict[str, Variant] = {
    "base": Variant("the real grid's engine", {}),
    "gauges-only": Variant("publishes running/waiting/KV use only", {}, metrics=GAUGES_ONLY),
    "counters-only": Variant(
        "gauges + token and request counters, no histograms (like SGLang)",
        {},
        metrics=COUNTERS_ONLY,
    ),
    "fast-prefill": Variant("prefill 15 us a token (4x faster)", FAST),
    "slow-prefill": Variant("prefill 240 us a token (4x slower)", SLOW),
    "big-batch": Variant("48 sequences a replica, +1 % step per sequence", BATCH_48),
    # vLLM's default batch (max_num_seqs 256): slots never bind, so requests queue only for
    # the prefill budget and KV memory, and every prefill chunk stalls a large decode batch.
    "vllm-batch": Variant("256 sequences a replica, +0.5 % step per sequence", BATCH_256),
    "small-chunk": Variant("chunked prefill at 512 tokens", {"max_num_batched_tokens": 512}),
    # vLLM v1's KV: a request admitted with its prompt's blocks, one more as its output
    # fills one, the newest preempted (computed again) when none is free; the others
    # reserve prompt + max_tokens at admission and never preempt.
    "kv-on-demand": Variant(
        "KV taken as tokens are computed, the newest preempted when out (vLLM v1)",
        {"kv_on_demand": True},
    ),
    "8-replicas": Variant("8 replicas", {}, replicas=8),
    "gauges-fast": Variant("gauges only, prefill 15 us a token", FAST, metrics=GAUGES_ONLY),
    "gauges-slow": Variant("gauges only, prefill 240 us a token", SLOW, metrics=GAUGES_ONLY),
    "no-metrics": Variant("publishes no metrics", {}, metrics=frozenset()),
    # Blind big batches: in-flight counts are all a router sees, and an imbalance that
    # fills an 8-sequence batch leaves a 48- or 256-sequence one with room (the
    # `blind-imbalance` guard's gap scales with the load for these).
    "no-metrics-48": Variant("no metrics, 48 sequences a replica", BATCH_48, metrics=frozenset()),
    "no-metrics-256": Variant(
        "no metrics, 256 sequences a replica", BATCH_256, metrics=frozenset()
    ),
    "ttft-fast": Variant(
        "counters + TTFT/ITL/e2e histograms, prefill 15 us a token", FAST, metrics=TTFT_ONLY
    ),
    "ttft-slow": Variant(
        "counters + TTFT/ITL/e2e histograms, prefill 240 us a token", SLOW, metrics=TTFT_ONLY
    ),
    "ttft-base": Variant("counters + TTFT/ITL/e2e histograms", {}, metrics=TTFT_ONLY),
    # A real tokenizer on a benchmark's random text counts 2-3 characters a token; a
    # simulator counting words, ~6.
    "dense-tokens": Variant("its tokenizer counts 2 characters a token", {}, chars_per_token=2.0),
    "sparse-tokens": Variant("its tokenizer counts 6 characters a token", {}, chars_per_token=6.0),
    "mixed-speed": Variant("2 of the 4 replicas 2x slower", {}, slow_replicas=2),
    "mixed-1.5x": Variant("2 of the 4 replicas 1.5x slower", {}, slow_replicas=2, slow_factor=1.5),
    "one-slow-3x": Variant("1 of the 4 replicas 3x slower", {}, slow_replicas=1, slow_factor=3.0),
    # Session 32: only an engine's own numbers say it is slow; with none published a router
    # has its own observations or nothing (bench/results/crosscheck_none.txt, chat-mixed-gpu).
    "no-metrics-mixed": Variant(
        "no metrics, 2 of the 4 replicas 2x slower", {}, metrics=frozenset(), slow_replicas=2
    ),
    "no-kv-size": Variant(
        "every metric but the KV size (cache_config_info)", {}, metrics=ALL_BUT_KV_SIZE
    ),
}


def variant_engine(variant: Variant, level: str) -> tuple[EngineConfig, EngineSpeed]:
    """The variant's engine, in its own tokens, and its speed in the workload's (chars / 4)."""
    cfg = replace(engine(level), **variant.engine)
    scale = variant.chars_per_token / 4.0  # engine tokens per workload token: 1 / scale
    if scale != 1.0:
        chunk = cfg.max_num_batched_tokens
        cfg = replace(
            cfg,
            prefill_us_per_token=cfg.prefill_us_per_token * scale,
            kv_blocks=round(cfg.kv_blocks / scale),
            max_num_batched_tokens=None if chunk is None else round(chunk / scale),
            max_model_len=round(cfg.max_model_len / scale),
        )
    base = engine_speed(level)
    # Capacity adds up over replicas (1 / cost each): the fleet's as if every replica ran
    # at n / sum(1 / cost).
    slow = variant.slow_replicas
    slower = variant.replicas / (variant.replicas - slow + slow / variant.slow_factor)
    speed = replace(
        base,
        replicas=variant.replicas,
        prefill_s_per_token=cfg.prefill_us_per_token / scale / 1e6 * slower,
        decode_step_s=cfg.decode_ms / 1e3 * slower,
        decode_batch_factor=cfg.decode_batch_factor,
        max_num_seqs=cfg.max_num_seqs,
    )
    return cfg, speed


def cell_workload(
    variant_name: str, cell: str, seed: int, window: float, min_requests: int = 0
) -> tuple[Workload, PreparedWorkload, EngineSpeed]:
    """One cell's workload on one engine variant, prepared for `simulate`, and the engine's
    speed in the workload's tokens. `window` scales the real grid's window. A cell that
    would still hold fewer than `min_requests` requests gets a longer window, rescaled until
    it holds at least 90 % of them: a p90 over ~180 requests is the 18th-slowest one."""
    variant = VARIANTS[variant_name]
    regime = ALL_REGIMES[cell]
    regime = replace(regime, window_s=regime.window_s * window)
    cfg, speed = variant_engine(variant, pressure_level(regime))
    wl = regime_workload(regime, speed, seed=seed)
    below: float = min_requests
    for _ in range(4):
        if not 0 < wl.requests < below:
            break
        regime = replace(regime, window_s=regime.window_s * min_requests / wl.requests)
        wl = regime_workload(regime, speed, seed=seed)
        below = 0.9 * min_requests  # requests are not proportional to the window: near is enough
    return wl, prepare(wl, variant.engines(cfg), variant.chars_per_token), speed


def run_cell(
    variant_name: str,
    cell: str,
    contenders: list[str],
    seed: int,
    window: float,
    custom: dict[str, dict[str, Any]],
    min_requests: int = 0,
    scrape_interval: float = ScrapeSpec().interval,
) -> dict[str, Any]:
    """One cell on one engine variant for every contender (`cell_workload`)."""
    variant = VARIANTS[variant_name]
    wl, prepared, _ = cell_workload(variant_name, cell, seed, window, min_requests)
    runs = []
    for name in contenders:
        result = simulate(
            prepared,
            make_contender(name, scrape_interval, custom),
            seed=seed,
            metrics=variant.metrics,
            scrape_interval=scrape_interval,
        )
        row = result.row()
        row["per_replica"] = result.per_replica
        runs.append(row)
    return {
        "variant": variant_name,
        "cell": cell,
        "seed": seed,
        "description": wl.description,
        "requests": wl.requests,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated regimes")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--strategy-file", action="append", default=[], help="YAML strategy")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--window", type=float, default=3.0, help="x the real grid's window")
    parser.add_argument(
        "--min-requests", type=int, default=500, help="longer windows for smaller cells"
    )
    parser.add_argument(
        "--scrape",
        type=float,
        default=ScrapeSpec().interval,
        help="seconds between two scrapes of a replica (default: llmgw's own default)",
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--reuse",
        help="a results JSON: take the other contenders' runs from it (runs are deterministic;"
        " rerun only what changed)",
    )
    parser.add_argument("--out", default="fleetsim_robust")
    parser.add_argument("--plot", default=str(RESULTS / "fleetsim_robust.png"))
    args = parser.parse_args(argv)
    variants, cells = args.variants.split(","), args.cells.split(",")
    custom: dict[str, dict[str, Any]] = {}
    for path in args.strategy_file:
        custom.update(load_strategy_file(path))
    contenders = [*args.contenders.split(","), *(c for c in custom if c not in args.contenders)]
    for name, known in ((variants, VARIANTS), (cells, ALL_REGIMES)):
        unknown = [n for n in name if n not in known]
        if unknown:
            raise SystemExit(f"unknown {unknown}; known: {', '.join(known)}")
    for c in contenders:
        make_contender(c, 0.05, custom)  # unknown names fail now
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = [(v, c, s) for v in variants for s in seeds for c in cells]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [
            pool.submit(
                run_cell, v, c, contenders, s, args.window, custom, args.min_requests, args.scrape
            )
            for v, c, s in tasks
        ]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - started
    if args.reuse:
        contenders = reuse_runs(results, contenders, Path(args.reuse))

    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    worst_rows = []
    for v in variants:
        ratios = mean_ratios([r for r in results if r["variant"] == v])
        summary[v] = ratios
        print(f"\n## {v}: {VARIANTS[v].note} — TTFT p90 / best in cell (geo-mean over seeds)")
        print(format_table([{"contender": n, **r} for n, r in ratios.items()]))
        worst = {n: max(x for x in r.values() if x is not None) for n, r in ratios.items()}
        worst_rows.append({"variant": v, **worst})
    print("\n## worst ratio per contender and variant")
    print(format_table(worst_rows))
    print(errors_report(results))
    requests = sorted({r["requests"] for r in results})
    print(f"requests per cell: {requests[0]}-{requests[-1]}; wall {wall:.0f} s")
    write_results(args.out, {"seeds": seeds, "variants": variants, "cells": results,
                             "summary": summary})  # fmt: skip
    if args.plot:
        plot(summary, contenders, cells, Path(args.plot))
    return 0


def errors_report(results: list[dict[str, Any]]) -> str:
    """The runs that refused or failed requests (429 queue full, 400 too large, a router's
    503): the ratios above time only the answered ones, so a contender that sheds load
    must not read as fast without saying so."""
    lines = [
        f"  {cell['variant']} / {cell['cell']} / seed {cell['seed']}: {run['contender']} "
        f"{run['errors']} of {cell['requests']}"
        for cell in results
        for run in cell["runs"]
        if run.get("errors")
    ]
    if not lines:
        return "errors: none in any run"
    return "\n".join(["## runs with errors (left out of the TTFT percentiles)", *lines])


def reuse_runs(results: list[dict[str, Any]], contenders: list[str], path: Path) -> list[str]:
    """Add to each cell the runs of the contenders `path` holds and this run did not (same
    variant, cell and seed; the same requests, as runs are deterministic); all contenders."""
    old = json.loads(path.read_text())
    by_key = {(c["variant"], c["cell"], c["seed"]): c for c in old["cells"]}
    names = list(contenders)
    for cell in results:
        kept = by_key.get((cell["variant"], cell["cell"], cell["seed"]))
        if kept is None:
            raise SystemExit(f"{path} has no {cell['variant']}/{cell['cell']}/{cell['seed']}")
        if kept["requests"] != cell["requests"]:
            raise SystemExit(f"{path}: {cell['cell']} ran other requests; rerun every contender")
        for run in kept["runs"]:
            if run["contender"] not in contenders:
                cell["runs"].append(run)
                if run["contender"] not in names:
                    names.append(run["contender"])
    order = [run["contender"] for run in old["cells"][0]["runs"]] if old["cells"] else []
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def plot(
    summary: dict[str, dict[str, dict[str, float | None]]],
    contenders: list[str],
    cells: list[str],
    path: Path,
) -> None:
    """One heat map per variant: contender x cell, TTFT p90 / best (log colour)."""
    import matplotlib  # noqa: PLC0415 (only when plotting)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    variants = list(summary)
    fig, axes = plt.subplots(len(variants), 1, figsize=(1.3 * len(cells) + 3, 2.2 * len(variants)))
    axes_list = [axes] if len(variants) == 1 else list(axes)
    for ax, v in zip(axes_list, variants, strict=True):
        grid = [[summary[v].get(c, {}).get(cell) or math.nan for cell in cells]
                for c in contenders]  # fmt: skip
        ax.imshow([[math.nan if math.isnan(x) else math.log(x) for x in row] for row in grid],
                  cmap="RdYlGn_r", vmin=0, vmax=math.log(3), aspect="auto")  # fmt: skip
        for i, row in enumerate(grid):
            for j, x in enumerate(row):
                if not math.isnan(x):
                    ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(contenders)), contenders, fontsize=7)
        ax.set_xticks(range(len(cells)), cells if ax is axes_list[-1] else [""] * len(cells),
                      fontsize=7, rotation=20)  # fmt: skip
        ax.set_title(f"{v}: {VARIANTS[v].note}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
