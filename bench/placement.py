"""Where each router placed conversations, and what its slowest tenth of requests were.

Reads the per-request records `bench/routing.py --trace DIR` writes (one folder per seed,
`<contender>@<cell>.records.jsonl`) and answers, per contender: were conversations spread
evenly over the replicas (by count, by final history size, by how many were live at once),
how often a turn left its conversation's first replica, and whether the slowest tenth
were first turns, moved turns, or turns that met other prefills on their replica.

    .venv/bin/python bench/routing.py --no-install --seeds 1,2,3 --cells chat-history \
        --only asgi:default,sglang-router:cache_aware,client:ring --trace /tmp/tr
    .venv/bin/python bench/placement.py /tmp/tr --cell chat-history [--out placement.json]

Session 44 read sglang-router's lead on chat-history as better placement of new
conversations (its smallest-tree rule); session 45's records refuted it: llmgw's
placement was as even or more (bench/results/routing_history_s45.txt).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadclient import RequestRecord
from bench.routing import _ttfts
from bench.workloads import percentile

SAMPLE_S = 0.25  # the live-conversation count is sampled this often


@dataclass(frozen=True)
class Record:
    conversation: int
    turn: int
    replica: str
    sent_s: float
    ttft_s: float
    e2e_s: float
    prompt_chars: int


@dataclass(frozen=True)
class Placement:
    """One contender's requests on one cell and seed."""

    seed: str
    conversations: int
    per_replica: list[int]  # conversations by their first turn's replica, ascending
    history_imbalance: float  # max / mean of the final history chars homed per replica
    live_imbalance: float  # time-averaged max / mean of the conversations live per replica
    moved_turns: int  # turns served off their conversation's first replica
    ttft_p90_ms: float  # bench/routing.py's, of all the requests: inf = fell on a failure


@dataclass(frozen=True)
class Tail:
    """The slowest tenth of a contender's requests, pooled over seeds, against all."""

    requests: int
    p90_ms: float  # bench/routing.py's pooled TTFT p90 (inf: it fell on a failed request)
    first_turns: tuple[int, int]  # (in the tail, in all)
    moved: tuple[int, int]
    prefills_ahead: tuple[float, float]  # mean requests still in prefill on the replica
    inflight: tuple[float, float]  # mean requests in flight on the replica at send


def read_records(path: Path) -> list[Record]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("status") != 200 or r.get("ttft_s") is None or r.get("replica") is None:
            continue  # a failed request has no placement to judge
        out.append(
            Record(
                conversation=int(r["conversation"]),
                turn=int(r["turn"]),
                replica=str(r["replica"]),
                sent_s=float(r["sent_s"]),
                ttft_s=float(r["ttft_s"]),
                e2e_s=float(r["e2e_s"]),
                prompt_chars=int(r["prompt_chars"]),
            )
        )
    return out


def ttfts(path: Path) -> list[float]:
    """Every request's TTFT in ms as bench/routing.py counts them: a streamed request
    that got no first token (error, timeout) as inf, slower than any."""
    records = [RequestRecord(**json.loads(line)) for line in path.read_text().splitlines()]
    return [t * 1e3 for t in _ttfts(records)[0]]


def p90(values: list[float]) -> float:
    """bench/routing.py's p90 (nearest rank), in the values' unit, to 0.1."""
    value = percentile(values, 90)
    return value if math.isinf(value) or math.isnan(value) else round(value, 1)


def _homes(records: list[Record]) -> dict[int, str]:
    first: dict[int, Record] = {}
    for r in records:
        if r.conversation not in first or r.turn < first[r.conversation].turn:
            first[r.conversation] = r
    return {c: r.replica for c, r in first.items()}


def _imbalance(counts: list[float]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else math.nan


def placement(
    seed: str, records: list[Record], replicas: list[str], ttfts_ms: list[float]
) -> Placement:
    """`replicas`: every replica of the fleet (one that got nothing counts as 0);
    `ttfts_ms`: every request's, failed ones too (`ttfts`), for the p90."""
    home = _homes(records)
    homed = Counter(home.values())
    history: Counter[str] = Counter()
    spans: dict[int, tuple[float, float]] = {}
    for r in records:
        start, end = spans.get(r.conversation, (math.inf, -math.inf))
        spans[r.conversation] = (min(start, r.sent_s), max(end, r.sent_s + r.e2e_s))
    final: dict[int, int] = {}
    for r in records:
        final[r.conversation] = max(final.get(r.conversation, 0), r.prompt_chars)
    for c, chars in final.items():
        history[home[c]] += chars
    horizon = max((end for _, end in spans.values()), default=0.0)
    live = []
    for k in range(int(horizon / SAMPLE_S)):
        t = k * SAMPLE_S
        now = Counter(home[c] for c, (a, b) in spans.items() if a <= t <= b)
        counts = [float(now.get(x, 0)) for x in replicas]
        if sum(counts) >= len(replicas):  # a near-idle fleet says nothing about balance
            live.append(_imbalance(counts))
    return Placement(
        seed=seed,
        conversations=len(home),
        per_replica=sorted(homed.get(x, 0) for x in replicas),
        history_imbalance=round(_imbalance([float(history[x]) for x in replicas]), 2),
        live_imbalance=round(statistics.fmean(live), 2) if live else math.nan,
        moved_turns=sum(1 for r in records if r.replica != home[r.conversation]),
        ttft_p90_ms=p90(ttfts_ms),
    )


def _context(records: list[Record]) -> list[tuple[float, bool, bool, int, int]]:
    """(ttft ms, first turn, moved, prefills ahead, inflight) per request."""
    home = _homes(records)
    by_replica: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_replica[r.replica].append(r)
    out = []
    for r in records:
        others = [q for q in by_replica[r.replica] if q is not r and q.sent_s <= r.sent_s]
        out.append(
            (
                r.ttft_s * 1e3,
                r.turn == 0,
                r.replica != home[r.conversation],
                sum(1 for q in others if r.sent_s < q.sent_s + q.ttft_s),
                sum(1 for q in others if r.sent_s < q.sent_s + q.e2e_s),
            )
        )
    return out


def tail(per_seed: list[list[Record]], ttfts_ms: list[float]) -> Tail:
    """`ttfts_ms`: every request's of every seed, failed ones too (`ttfts`), for the p90;
    the rest reads the placed requests."""
    rows = sorted((row for records in per_seed for row in _context(records)), reverse=True)
    top = rows[: max(1, len(rows) // 10)]

    def share(index: int) -> tuple[int, int]:
        return sum(1 for r in top if r[index]), sum(1 for r in rows if r[index])

    def mean(index: int) -> tuple[float, float]:
        return (
            round(statistics.fmean(r[index] for r in top), 2),
            round(statistics.fmean(r[index] for r in rows), 2),
        )

    return Tail(
        requests=len(rows),
        p90_ms=p90(ttfts_ms),
        first_turns=share(1),
        moved=share(2),
        prefills_ahead=mean(3),
        inflight=mean(4),
    )


def analyse(folder: Path, cell: str) -> dict[str, dict[str, Any]]:
    """Contender stem -> {"seeds": [Placement...], "tail": Tail}, from `folder`/<seed>/."""
    seeds = sorted(p for p in folder.iterdir() if p.is_dir()) or [folder]
    found: dict[str, list[tuple[str, list[Record], list[float]]]] = defaultdict(list)
    for seed in seeds:
        for path in sorted(seed.glob(f"*@{cell}.records.jsonl")):
            found[path.name.split("@")[0]].append((seed.name, read_records(path), ttfts(path)))
    if not found:
        raise SystemExit(f"no *@{cell}.records.jsonl under {folder} (bench/routing.py --trace)")
    out: dict[str, dict[str, Any]] = {}
    for stem, runs in found.items():
        replicas = sorted({r.replica for _, records, _ in runs for r in records})
        out[stem] = {
            "seeds": [placement(seed, records, replicas, ms) for seed, records, ms in runs],
            "tail": tail([records for _, records, _ in runs], [t for *_, ms in runs for t in ms]),
        }
    return out


def report(result: dict[str, dict[str, Any]]) -> str:
    lines = [
        "contender                  seed  convs  per replica     history max/mean  "
        "live max/mean  moved turns  TTFT p90 ms"
    ]
    for stem, parts in result.items():
        for p in parts["seeds"]:
            lines.append(
                f"{stem:26s} {p.seed:>4s}  {p.conversations:5d}  {p.per_replica!s:14s}  "
                f"{p.history_imbalance:16.2f}  {p.live_imbalance:13.2f}  {p.moved_turns:11d}"
                f"  {_ms(p.ttft_p90_ms):>11s}"
            )
    lines += [
        "",
        "slowest tenth (pooled seeds) vs all requests:",
        "contender                  requests  p90 ms  first turns  moved  "
        "prefills ahead  inflight at send",
    ]
    for stem, parts in result.items():
        t = parts["tail"]
        lines.append(
            f"{stem:26s} {t.requests:8d}  {_ms(t.p90_ms):>6s}  {t.first_turns[0]:4d} / {t.first_turns[1]:<4d}"
            f"  {t.moved[0]:2d} / {t.moved[1]:<2d}  {t.prefills_ahead[0]:5.2f} / {t.prefills_ahead[1]:<5.2f}"
            f"   {t.inflight[0]:5.2f} / {t.inflight[1]:<5.2f}"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    """A p90 as the tables print it: `fail` where it fell on a failed request."""
    return "fail" if math.isinf(value) else f"{value:.1f}"


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf: a p90 that fell on a failed request is written as null."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="bench/routing.py --trace DIR")
    parser.add_argument("--cell", required=True, help="the cell's name, e.g. chat-history")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    result = analyse(args.folder, args.cell)
    print(report(result))
    if args.out is not None:
        payload = {
            stem: {
                "seeds": [_finite(asdict(p)) for p in parts["seeds"]],
                "tail": _finite(asdict(parts["tail"])),
            }
            for stem, parts in result.items()
        }
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
