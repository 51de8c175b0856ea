"""How far each pick of the latency model is from the best it could have made, in virtual
time: one cell of `bench/fleetsim_robust.py` per engine variant.

    .venv/bin/python bench/oracle_regret.py --cells hot-zipf,docs-shared,decode-heavy
    .venv/bin/python bench/oracle_regret.py --variants mixed-speed --cells decode-heavy --worst 3

At every pick an llmgw contender makes, `GreedyOracle.first_token` runs a copy of each
engine forward to this request's first token (nothing sent after it): the true time to
first token on each replica. Per pick, the regret is the true time where it went less
the least true time, and the prediction error the latency scorer's predicted time less the
true one, on every replica. `--blind`: the truth as the phase-blind oracle sees it (the
step in progress taken as half done), what a router could know at best. Prints a table
(share of picks more than 5 ms from the best, mean and p90 regret, median prediction
error and its mean size) and, with `--worst N`, the N worst picks with each replica's
terms; writes JSON.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import format_table, write_results  # noqa: E402
from bench.fleetsim import (  # noqa: E402
    GreedyOracle,
    LlmgwContender,
    Prepared,
    make_contender,
    simulate,
)
from bench.fleetsim_robust import ALL_REGIMES, VARIANTS, cell_workload  # noqa: E402
from bench.workloads import percentile  # noqa: E402
from llmgw.config import ScrapeSpec  # noqa: E402
from llmgw.scheduling.scheduler import Lease  # noqa: E402

REGRET_MS = 5.0  # a pick this much slower than the best counts as a miss


@dataclass(slots=True)
class Pick:
    """One pick: where it went, the true and predicted TTFT (s) on each replica, and each
    replica's queue and batch then."""

    chosen: int
    prompt_tokens: int
    true: list[float]
    predicted: list[dict[str, float] | None]
    waiting: list[int]
    running: list[int]

    @property
    def regret(self) -> float:
        return self.true[self.chosen] - min(self.true)


class Probe:
    """Wraps an llmgw contender: before each pick, every replica's true time to first
    token; after it, the latency scorer's terms per replica (its Decision's rationale)."""

    def __init__(self, contender: LlmgwContender, blind: bool) -> None:
        self.contender = contender
        self.oracle = GreedyOracle(blind)  # the truth: its forecasts, not its picks
        self.picks: list[Pick] = []
        self._route = contender.route
        contender.route = self.route  # type: ignore[method-assign]
        contender.watch = self.oracle.watch  # type: ignore[attr-defined]

    def route(self, p: Prepared) -> tuple[int, Lease | None]:
        true = self.oracle.forecasts(p.seq)
        index, lease = self._route(p)
        engines = self.oracle.engines
        decision = self.contender.last_decision
        predicted: list[dict[str, float] | None] = [None] * len(engines)
        if decision is not None:
            column = next((c for c in decision.rationale.columns if c.name == "latency"), None)
            if column is not None:
                for i, endpoint_id in enumerate(decision.rationale.endpoint_ids):
                    at = self.contender.index_of(endpoint_id)
                    predicted[at] = column.terms_at(i)
        self.picks.append(
            Pick(
                index,
                p.seq.prompt_tokens,
                true,
                predicted,
                [len(e.waiting) for e in engines],
                [len(e.running) for e in engines],
            )
        )
        return index, lease


def run(
    variant_name: str, cell: str, contender: str, seed: int, blind: bool, window: float = 3.0
) -> tuple[dict[str, Any], list[Pick]]:
    variant = VARIANTS[variant_name]
    _, prepared, _ = cell_workload(variant_name, cell, seed, window)
    scrape = ScrapeSpec().interval
    made = make_contender(contender, scrape)
    if not isinstance(made, LlmgwContender):
        raise SystemExit(f"{contender}: not an llmgw contender (no prediction to compare)")
    probe = Probe(made, blind)
    result = simulate(prepared, made, seed=seed, metrics=variant.metrics, scrape_interval=scrape)
    picks = probe.picks
    regrets = [p.regret * 1e3 for p in picks]
    errors = [
        (pred["ttft_s"] - true) * 1e3
        for p in picks
        for pred, true in zip(p.predicted, p.true, strict=True)
        if pred is not None and math.isfinite(true)
    ]
    row = {
        "variant": variant_name,
        "cell": cell,
        "seed": seed,
        "picks": len(picks),
        "missed": round(sum(1 for r in regrets if r > REGRET_MS) / len(picks), 3)
        if picks
        else None,
        "regret_mean_ms": round(statistics.fmean(regrets), 2) if regrets else None,
        "regret_p90_ms": round(percentile(regrets, 90), 1) if regrets else None,
        "error_median_ms": round(statistics.median(errors), 1) if errors else None,
        "error_abs_mean_ms": round(statistics.fmean(map(abs, errors)), 1) if errors else None,
        "ttft_p90_ms": result.row()["ttft_p90_ms"],
    }
    return row, picks


def describe(pick: Pick) -> list[str]:
    """A pick, a line per replica: true TTFT, queue, batch and the predicted terms (ms)."""
    lines = [
        f"regret {pick.regret * 1e3:.1f} ms, {pick.prompt_tokens} tokens: went to {pick.chosen}, "
        f"best {min(range(len(pick.true)), key=pick.true.__getitem__)}"
    ]
    for i, (true, pred) in enumerate(zip(pick.true, pick.predicted, strict=True)):
        terms = " ".join(
            f"{k[:-2]}={v * 1e3:.1f}" if k.endswith("_s") else f"{k}={v:.0f}"
            for k, v in (pred or {}).items()
        )
        lines.append(
            f"  {i}: true {true * 1e3:7.1f}  waiting {pick.waiting[i]:2d} "
            f"running {pick.running[i]:3d}  predicted {terms}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="base")
    parser.add_argument("--cells", default="hot-zipf,docs-shared,decode-heavy,chat-history")
    parser.add_argument("--contender", default="llmgw:latency")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--blind", action="store_true", help="the phase-blind oracle's truth")
    parser.add_argument("--worst", type=int, default=0, help="print the N worst picks a run")
    parser.add_argument("--out", default="oracle_regret")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    cells = [c for c in args.cells.split(",") if c]
    bad = [v for v in variants if v not in VARIANTS] + [c for c in cells if c not in ALL_REGIMES]
    if bad:
        parser.error(f"unknown variants or cells {bad}; see bench/fleetsim_robust.py --help")
    rows = []
    for variant in variants:
        for cell in cells:
            for seed in args.seeds.split(","):
                row, picks = run(variant, cell, args.contender, int(seed), args.blind)
                rows.append(row)
                for pick in sorted(picks, key=lambda p: -p.regret)[: args.worst]:
                    print("\n".join(describe(pick)))
    truth = "phase-blind oracle" if args.blind else "oracle"
    print(f"## {args.contender}: its picks against the {truth}'s true TTFT per replica")
    print(format_table(rows))
    path = write_results(
        args.out, {"benchmark": "oracle_regret", "blind": args.blind, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
