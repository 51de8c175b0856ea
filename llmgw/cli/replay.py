"""`llmgw replay`: a decision trace against a simulated fleet, one run per strategy.

    llmgw replay trace.jsonl --strategies latency,chat,round-robin \\
        --engine-args replicas=4,max_num_seqs=16,kv_blocks=2048,decode_ms=4

Every strategy sees the same requests at the same arrival times (open loop, virtual
time: a minute of traffic replays in seconds). The router is the real core (`Scheduler`
on a `Registry` fed by the scraper's parse path from each engine's own `/metrics` page);
the engines are `llmgw.sim.model.EngineModel` (continuous batching, prefix cache, LRU
eviction), the model behind `llmgw sim` and `bench/fleetsim.py`.

What a trace line gives a replay: the pick time, the session (its ring position, so
sessions land where the ring put them), the prompt's length and its 64-token block hashes
(prompts that shared a prefix share it again: each block becomes text derived from its
hash), the recorded endpoint, TTFT and duration, the fleet's calibrated speed (the
engines' default prefill/decode costs) and what the pick saw of the engines (`--mirror`:
`replay_mirror` adds the recorded host noise to the simulated engines). Output lengths
are estimated as (duration - TTFT) / decode step (`--output-tokens` to fix them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from llmgw.cli.replay_sim import (
    ModelSettings,
    mirror_corrections,
    mirrorable,
    recorded,
    simulate,
)
from llmgw.cli.replay_trace import endpoints_of, fit_engine, fleets_of, read_trace
from llmgw.config import load_file
from llmgw.errors import ConfigError
from llmgw.scheduling.strategies import PRESETS
from llmgw.sim.model import (
    EngineConfig,
)

_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"time_scale"}

# -- the command --------------------------------------------------------------------------


def set_keys(text: str) -> set[str]:
    """The EngineConfig fields `--engine-args` sets (a replay keeps them as given)."""
    return {p.partition("=")[0].strip().replace("-", "_") for p in text.split(",") if p.strip()}


def engine_args(text: str) -> tuple[int | None, EngineConfig]:
    """`replicas=4,max_num_seqs=16,...` -> (replicas, EngineConfig); ValueError says what."""
    replicas: int | None = None
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"--engine-args {item!r}: write key=value")
        if key == "replicas":
            replicas = int(raw)
            if replicas < 1:
                raise ValueError("--engine-args replicas: must be >= 1")
            continue
        if key not in _FIELDS:
            known = ", ".join(["replicas", *sorted(_FIELDS)])
            raise ValueError(f"--engine-args {key!r}: unknown (known: {known})")
        kind = type(getattr(EngineConfig(), key))
        if kind is bool:
            values[key] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif key == "max_num_batched_tokens":
            values[key] = None if raw.strip().lower() in ("", "none") else int(raw)
        else:
            try:
                values[key] = kind(raw)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise ValueError(f"--engine-args {key}: {raw.strip()!r} is not {what}") from None
            if kind is float and not math.isfinite(values[key]):  # inf replayed for ever
                raise ValueError(f"--engine-args {key}: must be a finite number")
    return replicas, EngineConfig(**values)


def strategies_of(args: argparse.Namespace) -> dict[str, Any]:
    """Name -> strategy (a preset name or a strategy mapping); ValueError says what."""
    chosen: dict[str, Any] = {}
    for name in filter(None, (s.strip() for s in args.strategies.split(","))):
        if name not in PRESETS:
            raise ValueError(f"--strategies {name!r}: unknown preset (known: {', '.join(PRESETS)})")
        chosen[name] = name
    if args.config is not None:  # each model's strategy of a config file, by model name
        config = load_file(args.config)
        for model, spec in config.models.items():
            chosen[f"{args.config.name}:{model}"] = ModelSettings(
                spec.strategy.model_dump(),
                spec.session.model_dump(),
                spec.saturation.model_dump(),
            )
    if not chosen:
        raise ValueError("give --strategies and/or --config")
    return chosen


def table(rows: list[dict[str, Any]], endpoints: list[str]) -> str:
    head = ["strategy", "requests", "errors", "TTFT p50", "p90", "p99", "e2e p90", "pred p50"]
    head += ["req/s", "tok/s", "hit rate", "same", "per replica"]
    lines = [head]
    for r in rows:
        counts = " ".join(str(r["per_replica"].get(e, 0)) for e in endpoints)
        lines.append(
            [
                r["strategy"],
                str(r["requests"]),
                str(r.get("errors", "-")),
                *[
                    "-" if r.get(k) is None else f"{r[k]:.1f}"
                    for k in (
                        "ttft_p50_ms",
                        "ttft_p90_ms",
                        "ttft_p99_ms",
                        "e2e_p90_ms",
                        "predicted_ttft_p50_ms",
                    )
                ],
                *["-" if r.get(k) is None else f"{r[k]:g}" for k in ("req_per_s", "tok_per_s")],
                "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.3f}",
                "-" if r.get("same_as_recorded") is None else f"{r['same_as_recorded']:.0%}",
                counts,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw replay", description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="+", type=Path, help="trace JSONL file(s)")
    parser.add_argument(
        "--strategies", default="latency", help="comma-separated presets (default latency)"
    )
    parser.add_argument("--config", type=Path, help="also replay each model's strategy of a config")
    parser.add_argument(
        "--engine-args",
        default="",
        help="replicas=N and EngineConfig fields: max_num_seqs, kv_blocks, block_size, "
        "prefill_us_per_token, decode_ms, decode_batch_factor, max_num_batched_tokens, ...",
    )
    parser.add_argument(
        "--output-tokens", type=int, help="output length of every request (default: estimated)"
    )
    parser.add_argument(
        "--nominal",
        action="store_true",
        help="keep EngineConfig's defaults for prefill/decode costs instead of the speed the "
        "trace's router measured",
    )
    parser.add_argument(
        "--timing",
        choices=("simulated", "recorded"),
        default="simulated",
        help="how long the router holds each request: until the simulated engine ends it "
        "(default), or the recorded TTFT and duration (the recorded run's edge overheads)",
    )
    parser.add_argument(
        "--mirror",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the recorded run's host noise (engine queues, speed, timings) that the "
        "simulation does not reproduce (default: when the trace records what its picks saw "
        "and the replay uses the recorded endpoints); implies --timing recorded",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv or [])
    try:
        replicas, engine = engine_args(args.engine_args)
        strategies = strategies_of(args)
        arrivals = read_trace(args.trace, engine.decode_ms or 1.0, args.output_tokens)
        given = engine
        if not args.nominal:
            fitted = fit_engine(arrivals, engine, set_keys(args.engine_args))
            if fitted.decode_ms != engine.decode_ms:  # output lengths from the fitted step
                arrivals = read_trace(args.trace, fitted.decode_ms or 1.0, args.output_tokens)
            engine = fitted
    except (ValueError, OSError, ConfigError) as exc:
        print(f"llmgw replay: {exc}", file=sys.stderr)
        return 2
    endpoints = endpoints_of(arrivals, replicas)
    fleets = fleets_of(arrivals, endpoints)
    began = time.monotonic()
    try:
        mirror = args.mirror
        if mirror is None:
            mirror = mirrorable(arrivals, endpoints)
        fixes = (
            mirror_corrections(arrivals, endpoints, engine, args.seed, fleets) if mirror else None
        )
    except ValueError as exc:
        print(f"llmgw replay: {exc}", file=sys.stderr)
        return 2
    rows = [recorded(arrivals, endpoints)] if any(a.endpoint for a in arrivals) else []
    for name, strategy in strategies.items():
        result = simulate(
            arrivals,
            endpoints,
            strategy,
            engine,
            name=name,
            seed=args.seed,
            timing="recorded" if mirror else args.timing,
            corrections=fixes,
            fleets=fleets,
        )
        rows.append(result.row())
    if args.json:
        shape = dataclasses.asdict(engine)
        print(json.dumps({"endpoints": endpoints, "engine": shape, "rows": rows}, indent=2))
        return 0
    span = arrivals[-1].t
    print(
        f"{len(arrivals)} requests over {span:.1f} s onto {len(endpoints)} simulated replicas "
        f"({', '.join(endpoints)}); replayed in {time.monotonic() - began:.1f} s"
        + (", mirroring the recorded host noise\n" if mirror else "\n")
    )
    print(
        f"engines: prefill {engine.prefill_us_per_token:.0f} us/token, decode step "
        f"{engine.decode_ms:.1f} ms ({'as given' if engine == given else 'as the trace measured'})\n"
    )
    print(table(rows, endpoints))
    return 0
