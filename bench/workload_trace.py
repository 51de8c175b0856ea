"""A `bench/workloads` workload as a decision-trace file, for `llmgw replay`.

    python -m bench.workload_trace chat out.jsonl [--scale 0.2] [--seed 1] [--service-s 0.5]
    llmgw replay out.jsonl --strategies latency,chat,round-robin

Workloads are closed loops (turn k+1 follows turn k's answer plus a think time); a trace is
open loop, so turn k+1 arrives at start + the think times + `--service-s` per earlier turn
(an assumed answer time). Each line carries `output_tokens` (the turn's max_tokens) and no
outcome; prompts become the same 64-token block hashes a recorded trace holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import orjson

from bench.workloads import WORKLOADS, build
from bench.workloads.regimes import REGIMES
from llmgw.config import load_dict
from llmgw.request import build_request
from llmgw.runtime.trace import _blocks, session_hash


def export(name: str, out: Path, *, seed: int, scale: float, service_s: float) -> int:
    workload = REGIMES[name](seed, scale=scale) if name in REGIMES else build(name, seed, scale)
    config = load_dict({"models": {"m1": {"endpoints": ["10.0.0.1:8000"]}}})
    lines = []
    for conv in workload.conversations:
        t = conv.start_s
        for k, turn in enumerate(conv.turns):
            body = orjson.dumps({"model": "m1", "messages": conv.messages(k)})
            headers = {"x-session-id": conv.session_id} if conv.session_id else {}
            info = build_request(
                config, headers, "/v1/chat/completions", body, request_id=f"c{conv.index}t{k}"
            )
            lines.append(
                {
                    "t": round(t, 6),
                    "model": "m1",
                    "session": session_hash(conv.session_id) if conv.session_id else None,
                    "rid": None if conv.session_id else session_hash(info.request_id),
                    "prompt_tokens": info.prompt_tokens,
                    "blocks": _blocks.hashes(info.prompt),
                    "output_tokens": turn.max_tokens,
                }
            )
            t += service_s + turn.think_s
    lines.sort(key=lambda row: float(row["t"]))  # type: ignore[arg-type]
    out.write_text("".join(json.dumps(row) + "\n" for row in lines))
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload", choices=sorted([*WORKLOADS, *REGIMES]))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--service-s", type=float, default=0.5)
    args = parser.parse_args()
    count = export(
        args.workload, args.out, seed=args.seed, scale=args.scale, service_s=args.service_s
    )
    print(f"wrote {count} requests to {args.out}")


if __name__ == "__main__":
    main()
