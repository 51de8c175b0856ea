"""A seeded run of the `latency` preset whose every decision is frozen in a fixture.

Sessions with growing histories, shared system prompts, session-less requests, scrapes
(with the calibration counters), first tokens, finishes (some failing, so breakers open
and filters drop), subset hints, a warm-up cap and an endpoint set change. The `exact`
fleet adds the exact path: the latency scorer with the `sim` tokenizer, chat messages, and
engines publishing KV-cache events for most endpoints (stores after each pick routed there,
evictions, a lost stream and its restart, a cleared cache; the rest stay approximate). Each
pick is
recorded exactly (floats round-trip through JSON), so a speed-up that alters any decision,
prediction or Rationale value fails `test_pick_reference.py` at the first pick it changes.

Regenerate only when a decision change is intended (and say why in the commit):

    .venv/bin/python -m tests.core.pick_scenario
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from llmgw.errors import LlmgwError
from llmgw.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent
from llmgw.kvindex import block_keys
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.scheduling.strategies import PRESETS
from llmgw.tokenize import sim_chat_prompt, sim_token_ids
from llmgw.types import Decision, Endpoint, EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock, config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pick_reference.json"
# (endpoints, picks, seed, exact): a small fleet with much churn per endpoint, a wider one,
# and one matching exactly on KV events where engines publish them.
FLEETS = ((6, 2500, 11, False), (40, 1200, 12, False), (12, 1500, 13, True))
KV_BLOCK = 16  # engine block size (tokens) in the exact fleet


def fleet_key(endpoints: int, picks: int, seed: int, exact: bool) -> str:
    return f"{endpoints}x{picks}@{seed}" + ("-exact" if exact else "")


def _digest(decision: Decision) -> str:
    """Every value the Rationale carries, hashed: ids, totals, raw scores, term rows, drops."""
    r = decision.rationale
    body = repr(
        (
            r.strategy,
            r.picker,
            r.endpoint_ids,
            r.totals,
            r.filter_drops,
            r.considered,
            [
                (c.name, c.weight, tuple(c.raw), c.term_names, [tuple(t) for t in c.term_rows])
                for c in r.columns
            ],
        )
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _text(rng: random.Random, alphabet: str, chars: int) -> str:
    return "".join(rng.choices(alphabet, k=chars))


class _Engine:
    """Cumulative counters one simulated engine publishes (they only grow)."""

    def __init__(self) -> None:
        self.counters = [0.0] * 8

    def scrape(self, rng: random.Random, calibrated: bool) -> EngineMetrics:
        c = self.counters
        prefills = rng.randint(0, 6)
        tokens = prefills * rng.uniform(200, 1200)
        c[0] += tokens * rng.uniform(5e-5, 2e-4)  # prefill seconds
        c[1] += prefills
        c[2] += tokens
        c[3] += rng.uniform(0.05, 0.4)  # step seconds
        c[4] += rng.randint(5, 40)  # steps
        c[5] += prefills * rng.uniform(0.5, 4.0)  # service seconds
        c[6] += prefills
        c[7] += prefills
        running = float(rng.randint(0, 24))
        kv = rng.choice((rng.uniform(0.05, 0.85), rng.uniform(0.88, 0.99)))
        base = EngineMetrics(waiting=float(rng.randint(0, 6)), running=running, kv_usage=kv)
        if not calibrated:
            return base
        return EngineMetrics(
            waiting=base.waiting,
            running=running,
            kv_usage=kv,
            finished_total=c[7],
            prefill_seconds_sum=c[0],
            prefill_count=c[1],
            computed_tokens_sum=c[2],
            step_seconds_sum=c[3],
            step_count=c[4],
            service_seconds_sum=c[5],
            service_count=c[6],
            kv_tokens=float(rng.choice((4096, 16384, 65536))),
        )


def _record(decision: Decision) -> list[Any]:
    return [
        decision.endpoint.id,
        [e.id for e in decision.fallbacks],
        decision.predicted_ttft,
        decision.ready_at,
        decision.prefill_tokens,
        _digest(decision),
    ]


class _Publishers:
    """The KV-event streams of the engines that publish (every endpoint not a multiple of 3)."""

    def __init__(self, registry: Registry, clock: FakeClock) -> None:
        self.registry, self.clock = registry, clock
        self.seq: dict[str, int] = {}
        self.stored: dict[str, list[tuple[int, ...]]] = {}
        self.held: dict[str, set[int]] = {}  # per engine: the blocks it caches

    def publishes(self, address: str) -> bool:
        return int(address.rsplit(".", 1)[1].split(":", maxsplit=1)[0]) % 3 != 0

    def send(self, address: str, events: tuple[KvEvent, ...]) -> None:
        seq = self.seq.get(address, -1) + 1
        self.seq[address] = seq
        batch = EventBatch(seq, self.clock(), events)
        self.registry.kv_index.apply_batch(address, batch, self.clock())

    def store(self, address: str, tokens: tuple[int, ...]) -> None:
        """As vLLM does: the leading blocks the engine holds are hits, not stored again (a
        block stored twice is a second copy there); the rest are computed and stored."""
        blocks = len(tokens) // KV_BLOCK
        hashes = tuple(block_keys(tokens, KV_BLOCK))  # unique per chained content
        held = self.held.setdefault(address, set())
        hit = 0
        while hit < blocks and hashes[hit] in held:
            hit += 1
        if hit == blocks:
            return
        new = hashes[hit:]
        held.update(new)
        self.stored.setdefault(address, []).append(new)
        parent = hashes[hit - 1] if hit else None
        tail = tokens[hit * KV_BLOCK : blocks * KV_BLOCK]
        self.send(address, (BlockStored(new, parent, tail, KV_BLOCK),))

    def evict(self, rng: random.Random, address: str) -> None:
        held = self.stored.get(address)
        if held:
            hashes = held.pop(rng.randrange(len(held)))
            gone = hashes[rng.randrange(len(hashes) + 1) :]
            self.held.get(address, set()).difference_update(gone)
            self.send(address, (BlockRemoved(gone),))

    def restart(self, address: str) -> None:  # the engine restarts: sequence 0, empty cache
        self.seq[address] = -1
        self.stored.pop(address, None)
        self.held.pop(address, None)
        self.send(address, ())

    def clear(self, address: str) -> None:
        self.stored.pop(address, None)
        self.held.pop(address, None)
        self.send(address, (AllBlocksCleared(),))


def _strategy(exact: bool) -> Any:
    if not exact:
        return "latency"
    spec = PRESETS["latency"].model_dump()
    spec["scorers"]["latency"]["params"]["tokenizer"] = "sim"
    return spec


def run_fleet(endpoints: int, picks: int, seed: int, exact: bool = False) -> list[list[Any]]:
    """The scenario on one fleet: one record per pick, in order."""
    rng = random.Random(seed)
    clock = FakeClock(5000.0)
    addresses = [f"10.1.{i // 200}.{i % 200 + 1}:8000" for i in range(endpoints)]
    cfg = config({"chat": {"endpoints": addresses, "strategy": _strategy(exact)}})
    registry = Registry(breaker=cfg.breaker.settings(), staleness=cfg.scrape.staleness, clock=clock)
    registry.warmup_inflight = 2
    scheduler = Scheduler(cfg, registry, seed=seed)
    engines = {a: _Engine() for a in addresses}
    systems = [_text(rng, "abcdefghij ", rng.choice((300, 1100, 1600))) for _ in range(5)]
    histories = {
        f"s-{i}": rng.choice(systems) + _text(rng, "klmnop ", 200) for i in range(3 * endpoints)
    }
    leases: list[Lease] = []
    out: list[list[Any]] = []
    kv = _Publishers(registry, clock) if exact else None
    if kv is not None:  # publishers follow their engine from sequence 0: live at once
        for a in addresses:
            if kv.publishes(a):
                kv.send(a, ())
    turns: dict[str, list[dict[str, str]]] = {}
    for i in range(picks):
        clock.advance(rng.expovariate(1 / 0.004))
        if kv is not None:
            _kv_churn(rng, kv, registry, i, picks)
        if i % 37 == 0:  # a scrape round: most endpoints answer, a few fail
            for a in [s.id for s in registry.states("chat")]:
                roll = rng.random()
                if roll < 0.04:
                    registry.record_scrape_error("chat", a, "timeout")
                elif roll < 0.05:
                    registry.record_scrape_error("chat", a, "no series", model_absent=True)
                else:
                    engine = engines.setdefault(a, _Engine())
                    registry.record_scrape("chat", a, engine.scrape(rng, calibrated=roll < 0.8))
        if i == picks // 2:  # one endpoint leaves, a new one joins (warming until scraped)
            current = [e.endpoint for e in registry.states("chat")]
            joined = Endpoint(f"10.9.0.{seed}:8000", "chat")
            registry.set_endpoints("chat", [*current[1:], joined])
        session = None if rng.random() < 0.2 else rng.choice(list(histories))
        system = ""
        if session is None:
            system = rng.choice(systems)
            prompt = system + _text(rng, "qrstuv ", rng.randint(0, 900))
        else:
            histories[session] += _text(rng, "wxyz ", rng.randint(20, 400))
            prompt = histories[session]
        subset = None
        if rng.random() < 0.03:
            states = registry.states("chat")
            subset = frozenset(s.id for s in rng.sample(states, min(3, len(states))))
        raw: list[dict[str, str]] | None = None
        if exact:  # chat messages: one system prompt, then the session's turns
            raw = _messages(turns, session, system, prompt)
            prompt = sim_chat_prompt(raw)
        request = RequestInfo(
            model="chat",
            request_id=f"r-{i}",
            session_key=session,
            prompt=prompt,
            prompt_tokens=len(prompt) // 4,
            subset=subset,
            raw_prompt=raw,
        )
        try:
            decision = scheduler.pick(request)
        except LlmgwError as exc:
            out.append(["error", type(exc).__name__])
            continue
        out.append(_record(decision))
        if kv is not None:
            out[-1].extend(_chosen_cache_terms(decision))
            if kv.publishes(decision.endpoint.id):  # the engine caches what it served
                kv.store(decision.endpoint.id, sim_token_ids(prompt))
        leases.append(scheduler.acquire(decision))
        # Progress on what is in flight: first tokens on some endpoints (the edge reports
        # them), finishes everywhere, a few failures (breakers open, the filter drops).
        for lease in list(leases):
            roll = rng.random()
            if roll < 0.25 and int(lease.endpoint_id.rsplit(".", 1)[1].split(":")[0]) % 2:
                lease.first_token()
            elif roll > 0.8:
                failed = rng.random() < 0.04
                lease.finish(Outcome.FAILURE if failed else Outcome.SUCCESS)
                leases.remove(lease)
    return out


def _messages(
    turns: dict[str, list[dict[str, str]]], session: str | None, system: str, prompt: str
) -> list[dict[str, str]]:
    """The request's messages: a session's history grows by one user turn per request."""
    if session is None:
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": prompt[len(system) :]},
        ]
    history = turns.setdefault(session, [{"role": "system", "content": prompt}])
    seen = sum(len(m["content"]) for m in history)
    history.append({"role": "user", "content": prompt[seen:] if seen < len(prompt) else "."})
    return list(history)  # a copy: the tokenizer may keep the list it was given


def _chosen_cache_terms(decision: Decision) -> list[float]:
    """The chosen endpoint's cached_tokens and exact (1 = from events) terms."""
    r = decision.rationale
    column = next(c for c in r.columns if c.name == "latency")
    terms = column.terms_at(r.endpoint_ids.index(decision.endpoint.id))
    return [terms["cached_tokens"], terms["exact"]]


def _kv_churn(rng: random.Random, kv: _Publishers, registry: Registry, i: int, picks: int) -> None:
    """Evictions now and then; one stream lost (unknown) then its engine restarted (live,
    empty); one engine's cache cleared."""
    live = [s.id for s in registry.states("chat") if kv.publishes(s.id)]
    if not live:
        return
    if rng.random() < 0.05:
        kv.evict(rng, rng.choice(live))
    if i == picks // 3:
        registry.kv_index.mark_unknown(live[0], "disconnected", kv.clock())
    elif i == 2 * picks // 3:
        kv.restart(live[0])
    elif i == picks // 4:
        kv.clear(live[-1])


def run_all() -> dict[str, list[list[Any]]]:
    return {fleet_key(*f): run_fleet(*f) for f in FLEETS}


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(run_all(), separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}")
