"""What the latency model prices a prefill token at, against what the engine charges, over
a run: one cell of `bench/fleetsim_robust.py` per engine variant, in virtual time.

    .venv/bin/python bench/fleetsim_calibration.py --variants base,vllm-batch,fast-prefill
    .venv/bin/python bench/fleetsim_calibration.py --cell chat-history --contender llmgw:latency@envoy

For every pick the `latency` scorer makes, the seconds per prefill token it used (its
calibration, pooled over the model's endpoints, in this router's tokens); printed as the
median over windows of virtual time, over the engine's own cost per token (its
`prefill_us_per_token`, in the same tokens). A miss also pays for the steps it shares with
the batch, so its true cost is at or above that floor: a ratio well below 1 prices moves as
cheap, one far above prices them dear. The first seconds matter most: that is when a cell's
documents and sessions find their replicas. Writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import MODEL, LlmgwContender, Prepared, make_contender, simulate  # noqa: E402
from bench.fleetsim_robust import ALL_REGIMES, VARIANTS, cell_workload  # noqa: E402
from llmgw.config import ScrapeSpec  # noqa: E402
from llmgw.scheduling.scorers import LatencyScorer  # noqa: E402

# Window edges in virtual seconds: the run's start, while batches fill, and after.
EDGES = (0.0, 1.0, 2.0, 4.0, 8.0, float("inf"))


def _windows() -> list[str]:
    return [
        f"{a:g}-{b:g}s" if b != float("inf") else f"{a:g}s+" for a, b in itertools.pairwise(EDGES)
    ]


class _Recording:
    """Wraps a contender's `route`: after each pick, (virtual now, seconds per token used)."""

    def __init__(self, contender: LlmgwContender) -> None:
        self.contender = contender
        self.samples: list[tuple[float, float]] = []
        self._route = contender.route
        contender.route = self.route  # type: ignore[method-assign]

    def route(self, p: Prepared) -> Any:
        out = self._route(p)
        scheduler = self.contender.scheduler
        assert scheduler is not None
        for scorer, _ in scheduler.router(MODEL).scorers:
            if isinstance(scorer, LatencyScorer):
                per_token = scorer.costs_in_use.per_token
                if per_token is not None:
                    self.samples.append((scheduler.registry.clock(), per_token))
        return out


def trace(
    variant_name: str, cell: str, contender: str, seed: int, window: float = 3.0
) -> dict[str, Any]:
    """One run: the engine's cost per token and the model's, by window of virtual time."""
    variant = VARIANTS[variant_name]
    _, prepared, speed = cell_workload(variant_name, cell, seed, window)
    scrape = ScrapeSpec().interval
    made = make_contender(contender, scrape)
    if not isinstance(made, LlmgwContender):
        raise SystemExit(f"{contender}: not an llmgw contender (no latency model to read)")
    recording = _Recording(made)
    result = simulate(prepared, made, seed=seed, metrics=variant.metrics, scrape_interval=scrape)
    if not recording.samples:
        raise SystemExit(f"{contender}: its strategy has no latency scorer (no price to read)")
    engine_s = speed.prefill_s_per_token  # in the workload's tokens, as the router counts
    start = recording.samples[0][0]
    ratios: dict[str, float | None] = {}
    for name, (low, high) in zip(_windows(), itertools.pairwise(EDGES), strict=True):
        inside = [v for t, v in recording.samples if low <= t - start < high]
        ratios[name] = round(statistics.median(inside) / engine_s, 2) if inside else None
    below = sum(1 for _, v in recording.samples if v < engine_s / 2)
    return {
        "variant": variant_name,
        "cell": cell,
        "seed": seed,
        "contender": contender,
        "engine_us_per_token": round(engine_s * 1e6, 1),
        "model_over_engine": ratios,
        "picks": len(recording.samples),
        "picks_below_half": below,
        "ttft_p90_ms": result.row()["ttft_p90_ms"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        [
            {
                "variant": r["variant"],
                "seed": r["seed"],
                "engine us/token": r["engine_us_per_token"],
                **{w: r["model_over_engine"][w] for w in _windows()},
                "< half": f"{r['picks_below_half']}/{r['picks']}",
                "TTFT p90 ms": r["ttft_p90_ms"],
            }
            for r in rows
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="base,vllm-batch,big-batch,fast-prefill,slow-prefill")
    parser.add_argument("--cell", default="docs-shared", choices=sorted(ALL_REGIMES))
    parser.add_argument("--contender", default="llmgw:latency")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--out", default="fleetsim_calibration")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = [
        trace(v, args.cell, args.contender, int(seed))
        for v in names
        for seed in args.seeds.split(",")
    ]
    print(f"## {args.cell}, {args.contender}: the model's cost per prefill token / the engine's")
    print(table(rows))
    path = write_results(
        args.out, {"benchmark": "fleetsim_calibration", "cell": args.cell, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
