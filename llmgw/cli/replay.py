"""`llmgw replay`: a decision trace against a simulated fleet, one run per strategy.

    llmgw replay trace.jsonl --strategies latency,chat,round-robin \\
        --engine-args replicas=4,max_num_seqs=16,kv_blocks=2048,decode_ms=4

Every strategy sees the same requests at the same arrival times (open loop, virtual
time: a minute of traffic replays in seconds). The router is the real core (`Scheduler`
on a `Registry` fed by the scraper's parse path from each engine's own `/metrics` page);
the engines are `llmgw.sim.model.EngineModel` (continuous batching, prefix cache, LRU
eviction), the model behind `llmgw sim` and `bench/fleetsim.py`.

What a trace line gives a replay: the arrival time, the session (its ring position, so
sessions land where the ring put them), the prompt's length and its 64-token block hashes
(prompts that shared a prefix share it again: each block becomes text derived from its
hash), and the outcome's duration, from which the output length is estimated as
(duration - TTFT) / decode_ms (`--output-tokens` to fix it instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.config import Config, load_dict, load_file
from llmgw.errors import ConfigError, LlmgwError
from llmgw.hashring import HashRing, ring_position
from llmgw.registry import Registry
from llmgw.runtime.scraper import Scraper
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.scheduling.strategies import PRESETS
from llmgw.sim.metrics import ModelObservations, ServedModel, make_registry, render
from llmgw.sim.model import (
    EngineConfig,
    EngineModel,
    QueueFullError,
    RequestTooLargeError,
    SeqRequest,
)
from llmgw.sim.tokens import block_hashes
from llmgw.types import CHARS_PER_TOKEN, Outcome, RequestInfo

BLOCK_CHARS = int(64 * CHARS_PER_TOKEN)  # the trace's block: 64 tokens
_MASK = (1 << 64) - 1
_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"time_scale"}


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to replay."""

    t: float  # seconds after the first arrival
    model: str
    session: str | None  # "@<ring position hex>" from a trace, or a plain session id
    prompt_tokens: int
    blocks: tuple[int, ...]
    output_tokens: int
    endpoint: str | None = None  # where the recorded run sent it
    ttft_ms: float | None = None  # what the recorded run saw, if the edge saw it
    # Did the recording edge see first tokens (the proxy does; Envoy without response body
    # events does not)? The router estimates pending work differently without them.
    first_tokens: bool = True
    request_key: str | None = None  # "@<ring position hex>" of the request id (no session)


def read_trace(paths: Sequence[Path], decode_ms: float, output_tokens: int | None) -> list[Arrival]:
    """Trace lines (in time order across files) as arrivals; raises ValueError naming the
    file and line that is not a trace line."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    float(row["t"]), str(row["model"]), int(row["prompt_tokens"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a trace line ({exc})") from None
                rows.append(row)
    if not rows:
        raise ValueError("the trace has no requests")
    rows.sort(key=lambda r: float(r["t"]))
    t0 = float(rows[0]["t"])
    out = []
    for row in rows:
        outcome = row.get("outcome") or {}
        ttft, duration = outcome.get("ttft_ms"), outcome.get("duration_ms")
        if output_tokens is not None:
            tokens = output_tokens
        elif row.get("output_tokens") is not None:  # a workload exported as a trace
            tokens = int(row["output_tokens"])
        elif duration is not None:  # the time after the first token was decoding
            first = (
                ttft if ttft is not None else (row.get("decision") or {}).get("predicted_ttft_ms")
            )
            tokens = round((float(duration) - float(first or 0.0)) / decode_ms)
        else:
            tokens = 16
        session = row.get("session")
        out.append(
            Arrival(
                t=float(row["t"]) - t0,
                model=str(row["model"]),
                session=f"@{session}" if session else None,
                prompt_tokens=max(1, int(row["prompt_tokens"])),
                blocks=tuple(int(b) for b in row.get("blocks", ())),
                output_tokens=min(max(1, tokens), 4096),
                endpoint=(row.get("decision") or {}).get("endpoint"),
                ttft_ms=ttft,
                first_tokens=ttft is not None,
                request_key=f"@{row['rid']}" if row.get("rid") else None,
            )
        )
    return out


def endpoints_of(arrivals: Iterable[Arrival], replicas: int | None) -> list[str]:
    """The recorded endpoints (so the ring is the recorded ring), else made-up ones."""
    seen = sorted({a.endpoint for a in arrivals if a.endpoint})
    if replicas is None or replicas == len(seen):
        return seen or [f"10.0.0.{i + 1}:8000" for i in range(replicas or 4)]
    return [f"10.0.0.{i + 1}:8000" for i in range(replicas)]


class TraceRing(HashRing):
    """Places a traced session (`@<hex>`) at its recorded ring position."""

    @staticmethod
    def position(key: str) -> int:
        if key.startswith("@"):
            try:
                return int(key[1:], 16) & _MASK
            except ValueError:
                pass
        return ring_position(key)


def prompt_text(arrival: Arrival, index: int) -> str:
    """Text whose 64-token blocks are equal exactly where the traced prompts' were (each
    block is its chained hash written out), then filler of this request's own."""
    parts = [f"{b & _MASK:016x}" * (BLOCK_CHARS // 16) for b in arrival.blocks]
    total = int(arrival.prompt_tokens * CHARS_PER_TOKEN)
    filler = total - len(parts) * BLOCK_CHARS
    if filler > 0:
        tag = f"~{index:x}~"
        parts.append((tag * (filler // len(tag) + 1))[:filler])
    return "".join(parts)


# -- the simulation -----------------------------------------------------------------------

_ARRIVAL, _WAKE, _STEP_END, _SCRAPE = 0, 1, 2, 3


@dataclass
class ReplayResult:
    strategy: str
    requests: int
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    per_replica: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    hit_rate: float = 0.0
    makespan_s: float = 0.0
    same: int = 0  # requests sent where the recorded run sent them
    recorded: int = 0  # requests whose recorded endpoint is known

    def row(self) -> dict[str, Any]:
        span = self.makespan_s or math.nan
        return {
            "same_as_recorded": round(self.same / self.recorded, 3) if self.recorded else None,
            "strategy": self.strategy,
            "requests": self.requests,
            "errors": sum(self.errors.values()),
            "ttft_p50_ms": _ms(_pct(self.ttft_s, 50)),
            "ttft_p90_ms": _ms(_pct(self.ttft_s, 90)),
            "ttft_p99_ms": _ms(_pct(self.ttft_s, 99)),
            "e2e_p90_ms": _ms(_pct(self.e2e_s, 90)),
            "req_per_s": round(len(self.e2e_s) / span, 2),
            "tok_per_s": round(self.output_tokens / span, 1),
            "hit_rate": round(self.hit_rate, 3),
            "per_replica": dict(self.per_replica),
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value * 1e3, 1)


def replay_config(
    endpoints: list[str], models: Iterable[str], strategy: Any, seed: int = 1
) -> Config:
    return load_dict(
        {
            "models": {
                model: {"endpoints": endpoints, "strategy": strategy} for model in sorted(models)
            },
            "scrape": {"interval": 0.05},
            "seed": seed,
        }
    )


@dataclass(slots=True)
class _Flight:
    index: int
    sent: float
    engine: int
    lease: Lease
    first_seen: bool = False


def simulate(
    arrivals: Sequence[Arrival],
    endpoints: list[str],
    strategy: Any,
    engine: EngineConfig,
    *,
    name: str = "",
    seed: int = 1,
    scrape_interval: float = 0.05,
) -> ReplayResult:
    """Every arrival through `Scheduler` with `strategy` onto fresh engines; deterministic."""
    n = len(endpoints)
    models = sorted({a.model for a in arrivals})
    now = 0.0
    registry = Registry(clock=lambda: now)
    config = replay_config(endpoints, models, strategy, seed)
    registry.staleness = config.scrape.staleness
    scheduler = Scheduler(config, registry, seed=seed)
    for model in models:  # traced sessions sit where the recorded ring put them
        router = scheduler.routers[model]
        router.ring_for(registry.states(model))
        router.ring = TraceRing(
            endpoints,
            num_virtual_nodes=router.spec.session.num_virtual_nodes,
            num_fallback_replicas=router.spec.session.num_fallback_replicas,
        )
    scraper = Scraper(config, registry)
    targets = scraper.targets()
    index_of = {e: i for i, e in enumerate(endpoints)}
    engines = [EngineModel(engine) for _ in range(n)]
    observations = [{m: ModelObservations() for m in models} for _ in range(n)]
    pages = [
        make_registry("vllm", [ServedModel(m, engines[i], observations[i][m]) for m in models])
        for i in range(n)
    ]
    stepping = [False] * n
    flights: dict[tuple[int, int], _Flight] = {}
    rng = random.Random(seed * 7919 + 17)
    events: list[tuple[float, int, int, int]] = []
    counter = itertools.count()

    def push(t: float, kind: int, a: int) -> None:
        heapq.heappush(events, (t, next(counter), kind, a))

    for i, arrival in enumerate(arrivals):
        push(arrival.t, _ARRIVAL, i)
    for i in range(n):
        push(rng.uniform(0, scrape_interval), _SCRAPE, i)
    result = ReplayResult(name or str(strategy), len(arrivals))
    result.per_replica = dict.fromkeys(endpoints, 0)
    outstanding = len(arrivals)
    model_of_flight: dict[tuple[int, int], str] = {}

    def error(kind: str) -> None:
        nonlocal outstanding
        result.errors[kind] = result.errors.get(kind, 0) + 1
        outstanding -= 1

    while events and outstanding > 0:
        now, _, kind, a = heapq.heappop(events)
        if kind == _ARRIVAL:
            arrival = arrivals[a]
            text = prompt_text(arrival, a)
            info = RequestInfo(
                model=arrival.model,
                request_id=arrival.request_key or f"r{a}",
                session_key=arrival.session,
                prompt=text,
                prompt_tokens=arrival.prompt_tokens,
            )
            try:
                decision = scheduler.pick(info)
            except LlmgwError as exc:
                error(f"{exc.status} {exc.code}")
                continue
            lease = scheduler.acquire(decision)
            target = index_of[decision.endpoint.id]
            result.per_replica[decision.endpoint.id] += 1
            if arrival.endpoint is not None:
                result.recorded += 1
                result.same += arrival.endpoint == decision.endpoint.id
            hashes = block_hashes(text, engine.block_size) if engine.enable_prefix_caching else ()
            request = SeqRequest(arrival.prompt_tokens, arrival.output_tokens, hashes)
            try:
                seq = engines[target].submit(request, now)
            except (QueueFullError, RequestTooLargeError) as exc:
                too_large = isinstance(exc, RequestTooLargeError)
                lease.finish(Outcome.FAILURE if too_large else Outcome.BACKPRESSURE)
                error("400 too large" if too_large else "429 queue full")
                continue
            flights[(target, seq.seq_id)] = _Flight(a, now, target, lease)
            model_of_flight[(target, seq.seq_id)] = arrival.model
            if not stepping[target]:
                stepping[target] = True
                push(now, _WAKE, target)
        elif kind == _WAKE:
            push(now + engines[a].schedule(now), _STEP_END, a)
        elif kind == _STEP_END:
            step = engines[a].complete(now)
            for seq in step.emitted:
                flight = flights.get((a, seq.seq_id))
                if flight is not None and not flight.first_seen:
                    flight.first_seen = True
                    result.ttft_s.append(now - flight.sent)
                    if arrivals[flight.index].first_tokens:
                        flight.lease.first_token()
            for seq in step.finished:
                flight = flights.pop((a, seq.seq_id))
                observations[a][model_of_flight.pop((a, seq.seq_id))].observe(seq)
                result.e2e_s.append(now - flight.sent)
                result.output_tokens += arrivals[flight.index].output_tokens
                flight.lease.finish(Outcome.SUCCESS)
                outstanding -= 1
            if engines[a].has_work:
                push(now + engines[a].schedule(now), _STEP_END, a)
            else:
                stepping[a] = False
        else:  # _SCRAPE
            address = endpoints[a]
            scraper.ingest(address, targets[address], render(pages[a]).decode())
            spread = scrape_interval * 0.1
            push(now + scrape_interval + rng.uniform(-spread, spread), _SCRAPE, a)
    hits = sum(e.stats.prefix_hits_tokens for e in engines)
    queries = sum(e.stats.prefix_queries_tokens for e in engines)
    result.hit_rate = hits / queries if queries else 0.0
    result.makespan_s = now
    return result


def recorded(arrivals: Sequence[Arrival], endpoints: list[str]) -> dict[str, Any]:
    """The recorded run's own row: where its requests went and the TTFT it saw."""
    per_replica = dict.fromkeys(endpoints, 0)
    for a in arrivals:
        if a.endpoint in per_replica:
            per_replica[a.endpoint] += 1
    ttft = [a.ttft_ms / 1e3 for a in arrivals if a.ttft_ms is not None]
    return {
        "strategy": "recorded",
        "requests": len(arrivals),
        "ttft_p50_ms": _ms(_pct(ttft, 50)),
        "ttft_p90_ms": _ms(_pct(ttft, 90)),
        "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "per_replica": per_replica,
    }


# -- the command --------------------------------------------------------------------------


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
            values[key] = kind(raw)
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
            chosen[f"{args.config.name}:{model}"] = spec.strategy.model_dump()
    if not chosen:
        raise ValueError("give --strategies and/or --config")
    return chosen


def table(rows: list[dict[str, Any]], endpoints: list[str]) -> str:
    head = ["strategy", "requests", "errors", "TTFT p50", "p90", "p99", "e2e p90"]
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
                    for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p90_ms")
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
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv or [])
    try:
        replicas, engine = engine_args(args.engine_args)
        strategies = strategies_of(args)
        arrivals = read_trace(args.trace, engine.decode_ms or 1.0, args.output_tokens)
    except (ValueError, OSError, ConfigError) as exc:
        print(f"llmgw replay: {exc}", file=sys.stderr)
        return 2
    endpoints = endpoints_of(arrivals, replicas)
    began = time.monotonic()
    rows = [recorded(arrivals, endpoints)] if any(a.endpoint for a in arrivals) else []
    for name, strategy in strategies.items():
        result = simulate(arrivals, endpoints, strategy, engine, name=name, seed=args.seed)
        rows.append(result.row())
    if args.json:
        print(json.dumps({"endpoints": endpoints, "rows": rows}, indent=2))
        return 0
    span = arrivals[-1].t
    print(
        f"{len(arrivals)} requests over {span:.1f} s onto {len(endpoints)} simulated replicas "
        f"({', '.join(endpoints)}); replayed in {time.monotonic() - began:.1f} s\n"
    )
    print(table(rows, endpoints))
    return 0
