"""`llmgw replay`, part 1: trace lines -> arrivals, and what a replay needs of them (the
ring position of a session, text whose blocks are shared exactly where the traced
prompts' were)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.hashring import HashRing, ring_position
from llmgw.sim.model import EngineConfig
from llmgw.types import CHARS_PER_TOKEN

log = logging.getLogger("llmgw.replay")

BLOCK_CHARS = int(64 * CHARS_PER_TOKEN)  # the trace's block: 64 tokens
_MASK = (1 << 64) - 1


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
    duration_ms: float | None = None  # how long the recorded run held it, dispatch to end
    # The fleet's speed as the recording router calibrated it (the trace's `fleet`).
    prefill_us_per_token: float | None = None
    step_ms: float | None = None
    predicted_ms: float | None = None  # the recording router's predicted TTFT
    # What its pick saw (`--mirror`): per endpoint (waiting, running, KV usage, released
    # since scrape[, peak running]) or None if stale; the model's speed (s/token, s/step,
    # tokens, s).
    engines: Mapping[str, tuple[float, ...] | None] | None = None
    batches: frozenset[str] | None = None  # where that peak was the batch (None: not traced)
    # The latency scorer's slowdowns at the pick, slower endpoints only (None: not traced).
    slowdowns: Mapping[str, float] | None = None
    # Seconds since the recording edge last saw a token from each endpoint, at the pick
    # (the step's phase; endpoints without one in the last few seconds are left out; None:
    # not traced).
    tokens: Mapping[str, float] | None = None
    speed: tuple[float | None, ...] | None = None
    # What its latency scorer used, if any: the speed's four, then the engines' tokens per
    # one of the router's, its first tokens' slope and the net cost (s/token), None where a
    # trace predates them.
    costs: tuple[float | None, ...] | None = None
    # On the recording router's own clock, seconds after the pick: its first token (if the
    # edge saw it) and its end; None for traces without `clock` (then ttft/duration).
    first_s: float | None = None
    held_s: float | None = None
    # The endpoints its pick scored (the trace's `decision.totals`): the model's fleet.
    candidates: frozenset[str] = frozenset()


def read_trace(paths: Sequence[Path], decode_ms: float, output_tokens: int | None) -> list[Arrival]:
    """Trace lines (in time order across files) as arrivals; raises ValueError naming the
    file and line that is not a trace line."""
    rows: list[dict[str, Any]] = []
    where: dict[int, str] = {}  # id(row) -> "path:line", for errors found later
    cut: list[str] = []  # lines a full disk cut short (the writer ends them on reopening)
    for path in paths:
        # Decoded line by line: a line cut inside a character (model names are raw UTF-8)
        # is one cut line, not a file that is not text.
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if raw.startswith(b'{"'):  # cut short (a full disk): that one lost
                        cut.append(f"{path}:{number}")
                        continue
                    raise ValueError(
                        f"{path}: not a trace (not UTF-8 text: {exc.reason})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    if line.startswith('{"'):  # cut short (a full disk): that one lost
                        cut.append(f"{path}:{number}")
                        continue
                    raise ValueError(f"{path}:{number}: not a trace line ({exc})") from None
                try:
                    _check_row(row)
                except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
                    raise ValueError(f"{path}:{number}: not a trace line ({exc})") from None
                rows.append(row)
                where[id(row)] = f"{path}:{number}"
    if cut:
        log.warning(
            "%d trace line(s) cut short, left out (a full disk?): %s", len(cut), ", ".join(cut[:5])
        )
    if not rows:
        raise ValueError("the trace has no requests")
    # One router's clock: one file, every line clocked, and that clock never jumping
    # against the wall (a router restarted after a reboot, or on another node, appends to
    # the same file with a monotonic clock started again: ordered by it, the later run's
    # requests were replayed first).
    clocked = len(paths) == 1 and all(_clocked(row) for row in rows) and _one_clock(rows)
    for row in rows:  # the pick's time where the trace has it: replays space picks by it
        if clocked:  # and hold requests as that router's clock saw it (wall anchors jitter)
            row["t"] = row["clock"]["pick"]
            continue
        picked = row.get("t_pick")
        if isinstance(picked, int | float):
            outcome = row.get("outcome") or {}
            if isinstance(outcome.get("duration_ms"), int | float):  # held from the pick on
                waited = (float(picked) - float(row["t"])) * 1e3
                row["outcome"] = {**outcome, "duration_ms": outcome["duration_ms"] - waited}
            row["t"] = picked
    rows.sort(key=lambda r: float(r["t"]))
    t0 = float(rows[0]["t"])
    out = []
    for row in rows:
        try:
            out.append(_arrival(row, t0, clocked, decode_ms, output_tokens))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise ValueError(f"{where[id(row)]}: not a trace line ({exc!r})") from None
    return out


MAX_PROMPT_TOKENS = 10_000_000  # past any model's context: a corrupt line, not a prompt


def _check_row(row: Any) -> None:
    """The fields every use reads, typed; raises on a line that is not a trace line."""
    if not isinstance(row, dict):
        raise TypeError(f"a JSON object per line, got {type(row).__name__}")
    t, tokens = float(row["t"]), int(row["prompt_tokens"])
    if not math.isfinite(t):
        raise ValueError(f"t is {row['t']!r}")
    if not 0 <= tokens <= MAX_PROMPT_TOKENS:
        raise ValueError(f"prompt_tokens {tokens} is not a prompt's length")
    if not isinstance(row["model"], str):
        raise TypeError("model is not a string")
    for name in ("outcome", "decision", "fleet", "clock", "engines", "costs"):
        if row.get(name) is not None and not isinstance(row[name], dict):
            raise TypeError(f"{name} is not an object")
    # The times a replay spaces and holds requests by, and the engine view `--mirror`
    # replays: a string, a short row or JSON's Infinity broke the replay far from the
    # line, or replayed for ever.
    _check_number(row.get("t_pick"), "t_pick")
    for part, keys in (
        ("outcome", ("ttft_ms", "duration_ms")),
        ("clock", ("pick", "first", "end")),
    ):
        fields = row.get(part) or {}
        for key in keys:
            _check_number(fields.get(key), f"{part}.{key}")
    for endpoint, seen in (row.get("engines") or {}).items():
        if seen is None:  # its metrics were stale at the pick
            continue
        if not isinstance(seen, list) or len(seen) < 4:
            raise ValueError(f"engines[{endpoint!r}] is {seen!r}, not a list of 4 or more numbers")
        for value in seen:
            _check_number(value, f"engines[{endpoint!r}]")


def _check_number(value: Any, name: str) -> None:
    """`value` is absent (None) or a finite number; raises naming the field otherwise."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} is {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}, not a finite number")


def _arrival(
    row: dict[str, Any],
    t0: float,
    clocked: bool,
    decode_ms: float,
    output_tokens: int | None,
) -> Arrival:
    outcome = row.get("outcome") or {}
    ttft, duration = outcome.get("ttft_ms"), outcome.get("duration_ms")
    if output_tokens is not None:
        tokens = output_tokens
    elif row.get("output_tokens") is not None:  # a workload exported as a trace
        tokens = int(row["output_tokens"])
    elif duration is not None and outcome.get("outcome") != "unknown":
        # The time after the first token was decoding (an `unknown` end came at the pick:
        # a gateway that reports no response, its duration the pick's)
        first = ttft if ttft is not None else (row.get("decision") or {}).get("predicted_ttft_ms")
        tokens = round((float(duration) - float(first or 0.0)) / decode_ms)
    else:
        tokens = 16
    session = row.get("session")
    fleet = row.get("fleet") or {}
    clock = row["clock"] if clocked else {}
    first_at = clock.get("first")
    endpoint = (row.get("decision") or {}).get("endpoint")
    if endpoint is not None and not isinstance(endpoint, str):
        raise TypeError("decision.endpoint is not a string")
    return Arrival(
        t=float(row["t"]) - t0,
        model=str(row["model"]),
        session=f"@{session}" if session else None,
        prompt_tokens=max(1, int(row["prompt_tokens"])),
        blocks=tuple(int(b) for b in row.get("blocks", ())),
        output_tokens=min(max(1, tokens), 4096),
        endpoint=endpoint,
        ttft_ms=ttft,
        first_tokens=ttft is not None,
        request_key=f"@{row['rid']}" if row.get("rid") else None,
        duration_ms=None if duration is None else float(duration),
        prefill_us_per_token=_number(fleet.get("prefill_us_per_token")),
        step_ms=_number(fleet.get("step_ms")),
        predicted_ms=_number((row.get("decision") or {}).get("predicted_ttft_ms")),
        engines=_engines(row.get("engines")),
        batches=(
            frozenset(str(e) for e in row["batches"])
            if isinstance(row.get("batches"), list)
            else None
        ),
        slowdowns=(
            {str(e): float(x) for e, x in row["slowdowns"].items()}
            if isinstance(row.get("slowdowns"), dict)
            else None
        ),
        tokens=(
            {str(e): float(x) for e, x in row["tokens"].items()}
            if isinstance(row.get("tokens"), dict)
            else None
        ),
        speed=_speed(fleet) if fleet else None,
        costs=_costs(row["costs"]) if isinstance(row.get("costs"), dict) else None,
        first_s=float(first_at) - row["t"] if isinstance(first_at, int | float) else None,
        held_s=float(clock["end"]) - row["t"] if clocked else None,
        candidates=(
            frozenset(str(e) for e in totals)
            if isinstance(totals := (row.get("decision") or {}).get("totals"), dict)
            else frozenset()
        ),
    )


_CLOCK_DRIFT_S = 1.0  # the wall clock's steps (NTP) against a monotonic one, at most


def _one_clock(rows: Sequence[dict[str, Any]]) -> bool:
    """Every row's monotonic pick time is its wall pick time less one offset (within
    `_CLOCK_DRIFT_S`): one process's clock throughout."""
    offsets = [
        float(row["clock"]["pick"]) - float(row["t_pick"])
        for row in rows
        if isinstance(row.get("t_pick"), int | float)
    ]
    return not offsets or max(offsets) - min(offsets) <= _CLOCK_DRIFT_S


def _clocked(row: dict[str, Any]) -> bool:
    clock = row.get("clock")
    return isinstance(clock, dict) and all(
        isinstance(clock.get(k), int | float) for k in ("pick", "end")
    )


def _engines(raw: Any) -> dict[str, tuple[float, ...] | None] | None:
    if not isinstance(raw, dict):
        return None
    return {str(e): None if v is None else tuple(float(x) for x in v) for e, v in raw.items()}


def _speed(fleet: dict[str, Any]) -> tuple[float | None, ...]:
    """The trace's `fleet` in the router's units (seconds, tokens)."""
    per_token, step = _number(fleet.get("prefill_us_per_token")), _number(fleet.get("step_ms"))
    tokens, service = _number(fleet.get("tokens_per_prefill")), _number(fleet.get("service_ms"))
    return (
        None if per_token is None else per_token / 1e6,
        None if step is None else step / 1e3,
        tokens,
        None if service is None else service / 1e3,
    )


def _costs(costs: dict[str, Any]) -> tuple[float | None, ...]:
    """The trace's `costs` in the router's units: `_speed`'s four, then engine tokens per
    router token, the first tokens' slope and the net cost per token (seconds)."""
    observed, marginal = (_number(costs.get(f"{k}_us_per_token")) for k in ("observed", "marginal"))
    return (
        *_speed(costs),
        _number(costs.get("engine_tokens")),
        None if observed is None else observed / 1e6,
        None if marginal is None else marginal / 1e6,
    )


def _number(value: Any) -> float | None:
    """A positive, finite number, else None (an infinite speed would replay for ever)."""
    if isinstance(value, int | float) and 0 < value < math.inf:
        return float(value)
    return None


def fit_engine(
    arrivals: Sequence[Arrival], engine: EngineConfig, keep: Collection[str] = ()
) -> EngineConfig:
    """`engine` with the prefill and decode costs the recording router measured (medians
    over the trace), except the fields in `keep` (set by the user). A fleet's nominal
    settings say little about its speed: the demo's engines, configured for 50 us/token and
    4 ms steps, ran at 200-560 us and 9-19 ms on a busy 2-core host."""
    prefill = [a.prefill_us_per_token for a in arrivals if a.prefill_us_per_token is not None]
    step = [a.step_ms for a in arrivals if a.step_ms is not None]
    if prefill and "prefill_us_per_token" not in keep:
        engine = dataclasses.replace(engine, prefill_us_per_token=statistics.median(prefill))
    if step and "decode_ms" not in keep:
        engine = dataclasses.replace(engine, decode_ms=statistics.median(step))
    return engine


def recorded_endpoints(arrival: Arrival) -> set[str]:
    """The endpoints its pick had: the one chosen, and every one its view of the engines
    names (a replica never chosen is still on the ring and in the what-ifs)."""
    out = set(arrival.engines or ()) | arrival.candidates
    if arrival.endpoint:
        out.add(arrival.endpoint)
    return out


def endpoints_of(arrivals: Iterable[Arrival], replicas: int | None) -> list[str]:
    """The recorded endpoints (so the ring is the recorded ring), else made-up ones."""
    seen = sorted(set().union(*(recorded_endpoints(a) for a in arrivals)))
    if replicas is None or replicas == len(seen):
        return seen or [f"10.0.0.{i + 1}:8000" for i in range(replicas or 4)]
    return [f"10.0.0.{i + 1}:8000" for i in range(replicas)]


def fleets_of(arrivals: Iterable[Arrival], endpoints: list[str]) -> dict[str, list[str]]:
    """Each model's own endpoints among `endpoints` (the recorded ones: what its own lines
    name; made-up ones: all of them). Pooled, one model's sessions were replayed on a ring
    of every model's replicas and landed on another model's."""
    known = set(endpoints)
    fleets: dict[str, set[str]] = {}
    for a in arrivals:
        fleets.setdefault(a.model, set()).update(recorded_endpoints(a) & known)
    return {m: sorted(f) if f else list(endpoints) for m, f in sorted(fleets.items())}


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
