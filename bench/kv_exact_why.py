"""Why exact matching barely beats the approximate index with one router: on every pick of
`llmgw:latency-exact`, score the candidates twice, with the engines' KV events and with the
approximate index alone, and count where their cached tokens and their choices differ.

    .venv/bin/python bench/kv_exact_why.py --cells chat-long-P-ws20x,prefix-P-ws20x

Per cell: picks; share of (pick, endpoint) pairs where the index believes >= 64 tokens more
than the engine holds ("stale": evicted, or never stored) or >= 64 fewer ("unseen": the
replies' tokens, the last partial block, others' traffic); share of picks whose choice
differs; the mean predicted TTFT the approximate choice loses, priced by the exact terms
(over all picks, and over the differing ones); of the differing picks, how many the
approximate choice made on a stale belief about its own choice.

`--realised`: run `llmgw:latency` and `llmgw:latency-exact` on the cells and compare, per
request, the cached tokens predicted on the chosen endpoint with what the engine found at
admission (`Sequence.cached_tokens`): the share predicted >= 64 tokens too high (lost to an
eviction while the request waited, or never there), too low, and the mean wait for admission.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import format_table  # noqa: E402
from bench.fleetsim_grid import run_cell  # noqa: E402
from bench.kv_exact import REPLICAS, cells  # noqa: E402
from llmgw.registry import EndpointState  # noqa: E402
from llmgw.scheduling.interfaces import PickContext  # noqa: E402
from llmgw.scheduling.scorers import LatencyScorer  # noqa: E402
from llmgw.sim.model import EngineModel, SeqRequest, Sequence  # noqa: E402

BLOCK = 64  # tokens: the approximate index's block, the smallest difference it can see


@dataclass
class Tally:
    picks: int = 0
    pairs: int = 0
    stale: int = 0
    unseen: int = 0
    differ: int = 0
    differ_stale_choice: int = 0
    regret_s: float = 0.0


TALLY = [Tally()]  # the current cell's
_score = LatencyScorer.score


def _probed(self: LatencyScorer, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
    tokenizer = self.tokenizer
    if tokenizer is None or ctx.kv is None or not ctx.kv.any_live() or len(candidates) < 2:
        return _score(self, ctx, candidates)
    mean_queue = self._mean_queue
    self.tokenizer = None  # the approximate index alone (the same pick, the same state)
    approx = _score(self, ctx, candidates)
    approx_uncached = list(self._uncached)
    self.tokenizer, self._mean_queue = tokenizer, mean_queue
    exact = _score(self, ctx, candidates)
    rows = self.term_rows()
    t = TALLY[0]
    t.picks += 1
    for a, e in zip(approx_uncached, self._uncached, strict=True):
        t.pairs += 1
        t.stale += e - a >= BLOCK  # fewer uncached by the index: it believes more cached
        t.unseen += a - e >= BLOCK
    pick_a = max(range(len(approx)), key=approx.__getitem__)
    pick_e = max(range(len(exact)), key=exact.__getitem__)
    if pick_a != pick_e:
        t.differ += 1
        t.regret_s += rows[pick_a][0] - rows[pick_e][0]
        t.differ_stale_choice += self._uncached[pick_a] - approx_uncached[pick_a] >= BLOCK
    return exact


PREDICTED: list[float] = []  # cached tokens predicted on the chosen endpoint, per pick
ADMITTED: list[Sequence] = []  # the engine's sequences, in the same order
_observe = LatencyScorer.observe
_submit = EngineModel.submit


def _observed(self: LatencyScorer, ctx: PickContext, chosen: EndpointState) -> None:
    i = next(k for k, s in enumerate(self._candidates) if s is chosen)
    PREDICTED.append(self.term_rows()[i][4])
    _observe(self, ctx, chosen)


def _submitted(self: EngineModel, request: SeqRequest, now: float) -> Sequence:
    seq = _submit(self, request, now)
    ADMITTED.append(seq)
    return seq


def realised(names: list[str], seed: int, replicas: int) -> None:
    setattr(LatencyScorer, "observe", _observed)  # noqa: B010
    setattr(EngineModel, "submit", _submitted)  # noqa: B010
    table = cells()
    rows: list[dict[str, Any]] = []
    for name in names:
        cell, ratio = table[name]
        fleet_ratio = ratio / replicas if ratio is not None else 1.0
        for contender in ("llmgw:latency", "llmgw:latency-exact"):
            PREDICTED.clear()
            ADMITTED.clear()
            # The plan's capacity probes submit too (least-requests, no observe): skip them.
            out = run_cell(cell, [contender], seed, False, 0.05, {}, replicas, fleet_ratio)
            seqs = ADMITTED[-len(PREDICTED) :]
            pairs = list(zip(PREDICTED, seqs, strict=True))
            n = max(1, len(pairs))
            waits = [q.scheduled_time - q.arrival_time for _, q in pairs if q.scheduled_time]
            rows.append(
                {
                    "cell": name,
                    "contender": contender,
                    "requests": len(pairs),
                    "predicted cached": round(sum(p for p, _ in pairs) / n),
                    "found cached": round(sum(q.cached_tokens for _, q in pairs) / n),
                    "too high": f"{sum(p - q.cached_tokens >= BLOCK for p, q in pairs) / n:.1%}",
                    "too low": f"{sum(q.cached_tokens - p >= BLOCK for p, q in pairs) / n:.1%}",
                    "wait ms": round(sum(waits) / max(1, len(waits)) * 1e3, 1),
                    "ttft p90": out["runs"][0]["ttft_p90_ms"],
                }
            )
    print(f"{replicas} replicas, seed {seed}: predicted vs found cached tokens per request")
    print(format_table(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cells", default="chat-long-P-ws20x,prefix-P-ws20x,hot-D-ws20x")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--realised", action="store_true", help="predicted vs found cached")
    args = parser.parse_args(argv)
    if args.realised:
        realised(args.cells.split(","), args.seed, args.replicas)
        return 0
    setattr(LatencyScorer, "score", _probed)  # noqa: B010
    table = cells()
    rows: list[dict[str, Any]] = []
    for name in args.cells.split(","):
        cell, ratio = table[name]
        TALLY[0] = Tally()
        fleet_ratio = ratio / args.replicas if ratio is not None else 1.0
        run_cell(cell, ["llmgw:latency-exact"], args.seed, False, 0.05, {}, args.replicas,
                 fleet_ratio)  # fmt: skip
        t = TALLY[0]
        rows.append(
            {
                "cell": name,
                "picks": t.picks,
                "stale pairs": f"{t.stale / max(1, t.pairs):.1%}",
                "unseen pairs": f"{t.unseen / max(1, t.pairs):.1%}",
                "choice differs": f"{t.differ / max(1, t.picks):.1%}",
                "regret ms/pick": round(t.regret_s / max(1, t.picks) * 1e3, 2),
                "regret ms/differing": round(t.regret_s / max(1, t.differ) * 1e3, 1),
                "differing on stale": f"{t.differ_stale_choice / max(1, t.differ):.0%}",
            }
        )
    print(f"{args.replicas} replicas, seed {args.seed}, llmgw:latency-exact")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
