"""Replay fidelity: record `llmgw demo` runs (Envoy and the proxy, three strategies), replay
each with its own strategy, with and without mirroring the recorded host noise, and compare
per-replica request counts.

    python bench/replay_fidelity.py [--sessions 32 --turns 4 --anonymous 128]

Prints a table and writes bench/results/replay_fidelity.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.cli import demo, replay

RESULTS = Path(__file__).parent / "results"


def replayed(trace: Path, strategy: str, *flags: str) -> tuple[dict[str, Any], float]:
    out = io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stdout(out):
        code = replay.main([str(trace), "--strategies", strategy, "--json", *flags])
    if code != 0:
        raise RuntimeError(f"llmgw replay {trace} exited {code}")
    rows = {r["strategy"]: r for r in json.loads(out.getvalue())["rows"]}
    return rows, time.monotonic() - began


def worst(recorded: dict[str, int], got: dict[str, int]) -> float:
    """The largest per-replica difference, relative to the recorded count."""
    return max(abs(got[e] - n) / n for e, n in recorded.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--anonymous", type=int, default=128)
    args = parser.parse_args()
    load = ["--sessions", str(args.sessions), "--turns", str(args.turns)]
    load += ["--anonymous", str(args.anonymous), "--context-tokens", "0"]  # as first measured
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for edge in ("envoy", "proxy"):
            for strategy in ("latency", "chat", "ring"):
                trace = Path(tmp) / f"{edge}-{strategy}.jsonl"
                with contextlib.redirect_stdout(io.StringIO()):
                    code = demo.main(
                        [*load, "--strategy", strategy, "--edge", edge, "--trace", str(trace)]
                    )
                if code != 0:
                    raise RuntimeError(f"llmgw demo --edge {edge} --strategy {strategy} failed")
                row: dict[str, Any] = {"edge": edge, "strategy": strategy}
                for mode, flags in (("mirror", ()), ("no_mirror", ("--no-mirror",))):
                    got, seconds = replayed(trace, strategy, *flags)
                    recorded, mine = got["recorded"]["per_replica"], got[strategy]["per_replica"]
                    row["recorded"] = list(recorded.values())
                    row[mode] = {
                        "per_replica": [mine[e] for e in recorded],
                        "worst_diff": round(worst(recorded, mine), 3),
                        "same": got[strategy]["same_as_recorded"],
                        "replay_s": round(seconds, 2),
                    }
                rows.append(row)
    head = f"{'edge':6} {'strategy':8} {'recorded':>16} | {'mirrored':>16} {'worst':>6} {'same':>5}"
    head += f" | {'no mirror':>16} {'worst':>6} {'same':>5}"
    print(head)
    for r in rows:
        m, n = r["mirror"], r["no_mirror"]
        print(
            f"{r['edge']:6} {r['strategy']:8} {' '.join(map(str, r['recorded'])):>16} | "
            f"{' '.join(map(str, m['per_replica'])):>16} {m['worst_diff']:6.1%} {m['same']:5.0%} | "
            f"{' '.join(map(str, n['per_replica'])):>16} {n['worst_diff']:6.1%} {n['same']:5.0%}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay_fidelity.json").write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {RESULTS / 'replay_fidelity.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
