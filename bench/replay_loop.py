"""Replay flakiness: the e2e test's case (a 96-request `llmgw demo` recorded with a trace,
replayed with its own strategy, per-replica counts within 5 %) run N times per edge, and
how many runs replayed every pick where the recorded run made it.

    python bench/replay_loop.py --runs 30 [--edges proxy,envoy] [--strategies latency]
        [--keep DIR]     # keep the traces of runs whose replay diverged anywhere

Prints a table and writes bench/results/replay_loop.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.cli import demo, replay

RESULTS = Path(__file__).parent / "results"
# As the e2e test (short histories: the demo without its opening notes, as first measured).
DEMO = ["--sessions", "16", "--turns", "4", "--anonymous", "32", "--context-tokens", "0"]


def one(edge: str, strategy: str, trace: Path) -> tuple[bool, float]:
    """(within 5 % per replica, share of picks made where the recorded run made them)."""
    with contextlib.redirect_stdout(io.StringIO()):
        if demo.main([*DEMO, "--strategy", strategy, "--edge", edge, "--trace", str(trace)]):
            raise RuntimeError(f"llmgw demo --edge {edge} failed")
    out = io.StringIO()
    argv = [str(trace), "--strategies", strategy, "--engine-args", "replicas=4", "--json"]
    with contextlib.redirect_stdout(out):
        if replay.main(argv):
            raise RuntimeError(f"llmgw replay {trace} failed")
    rows = {r["strategy"]: r for r in json.loads(out.getvalue())["rows"]}
    recorded, got = rows["recorded"]["per_replica"], rows[strategy]["per_replica"]
    within = rows[strategy]["errors"] == 0 and all(
        abs(got[e] - n) <= 0.05 * n for e, n in recorded.items()
    )
    return within, float(rows[strategy]["same_as_recorded"] or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--edges", default="proxy,envoy")
    parser.add_argument("--strategies", default="latency")
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        keep = args.keep or Path(scratch)
        keep.mkdir(parents=True, exist_ok=True)
        for strategy in args.strategies.split(","):
            for edge in args.edges.split(","):
                passed = exact = 0
                for i in range(args.runs):
                    trace = keep / f"{edge}-{strategy}-{i}.jsonl"
                    within, same = one(edge, strategy, trace)
                    passed += within
                    exact += same == 1.0
                    if within and same == 1.0:
                        trace.unlink()
                rows.append(
                    {"edge": edge, "strategy": strategy, "runs": args.runs}
                    | {"within_5pct": passed, "every_pick_as_recorded": exact}
                )
    print("| edge | strategy | runs | within 5 % | every pick as recorded |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['edge']} | {r['strategy']} | {r['runs']} | {r['within_5pct']} "
            f"| {r['every_pick_as_recorded']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay_loop.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
