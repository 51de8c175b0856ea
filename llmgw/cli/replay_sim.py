"""`llmgw replay`, part 2: arrivals through the real `Scheduler` onto simulated engines
(`llmgw.sim.model.EngineModel`), open loop, in virtual time."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.cli.replay_mirror import Correction, Speed, View, apply, correction, view_of
from llmgw.cli.replay_trace import Arrival, TraceRing, prompt_text, recorded_endpoints
from llmgw.config import Config, load_dict
from llmgw.errors import LlmgwError
from llmgw.registry import Registry
from llmgw.runtime.scraper import Scraper
from llmgw.scheduling.interfaces import PickContext, Picker
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.sim.metrics import ModelObservations, ServedModel, make_registry, render
from llmgw.sim.model import (
    EngineConfig,
    EngineModel,
    QueueFullError,
    RequestTooLargeError,
    SeqRequest,
)
from llmgw.sim.tokens import block_hashes
from llmgw.types import Outcome, RequestInfo

# -- the simulation -----------------------------------------------------------------------

_ARRIVAL, _WAKE, _STEP_END, _SCRAPE, _FIRST, _RELEASE = 0, 1, 2, 3, 4, 5
IDLE_SCRAPES = 20  # scrapes kept before an arrival that ends an idle gap (its windows)


@dataclass
class ReplayResult:
    strategy: str
    requests: int
    ttft_s: list[float] = field(default_factory=list)
    predicted_s: list[float] = field(default_factory=list)  # the latency model's, per pick
    e2e_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    per_replica: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    hit_rate: float = 0.0
    makespan_s: float = 0.0
    scrapes: int = 0  # simulated scrapes of all replicas (idle gaps are skipped, not stepped)
    same: int = 0  # requests sent where the recorded run sent them
    recorded: int = 0  # requests whose recorded endpoint is known

    def row(self) -> dict[str, Any]:
        span = self.makespan_s  # 0 when nothing completed: rates None, not NaN (not JSON)
        return {
            "same_as_recorded": round(self.same / self.recorded, 3) if self.recorded else None,
            "strategy": self.strategy,
            "requests": self.requests,
            "errors": sum(self.errors.values()),
            "ttft_p50_ms": _ms(_pct(self.ttft_s, 50)),
            "predicted_ttft_p50_ms": _ms(_pct(self.predicted_s, 50)),
            "ttft_p90_ms": _ms(_pct(self.ttft_s, 90)),
            "ttft_p99_ms": _ms(_pct(self.ttft_s, 99)),
            "e2e_p90_ms": _ms(_pct(self.e2e_s, 90)),
            "req_per_s": round(len(self.e2e_s) / span, 2) if span > 0 else None,
            "tok_per_s": round(self.output_tokens / span, 1) if span > 0 else None,
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


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """A config file's model to replay: its strategy with its ring (`session`) and its
    saturation ceilings (a replay on the default ring matched its own picks 15 % of the
    time with `num_virtual_nodes: 7`)."""

    strategy: Any
    session: Mapping[str, Any] | None = None
    saturation: Mapping[str, Any] | None = None

    def __str__(self) -> str:
        return str(self.strategy)


def replay_config(fleets: Mapping[str, list[str]], strategy: Any, seed: int = 1) -> Config:
    """Each model on its own endpoints (`fleets`), with `strategy`: a preset name, a
    strategy mapping, or a config's `ModelSettings`."""
    spec: dict[str, Any] = {"strategy": strategy}
    if isinstance(strategy, ModelSettings):
        spec = {"strategy": strategy.strategy}
        if strategy.session is not None:
            spec["session"] = dict(strategy.session)
        if strategy.saturation is not None:
            spec["saturation"] = dict(strategy.saturation)
    return load_dict(
        {
            "models": {model: {"endpoints": fleets[model], **spec} for model in sorted(fleets)},
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
    held: bool = False  # the lease follows the recorded timing, not the engine


class RecordedTies:
    """A max-score picker that breaks an exact tie the way the recorded run broke it (its
    endpoint, when among the tied best) instead of by a random draw the trace cannot
    repeat; about a quarter of `latency` picks on the demo are exact ties."""

    def __init__(self, inner: Picker) -> None:
        self.inner = inner
        self.name = inner.name
        self.prefer: str | None = None

    def order(self, ctx: PickContext, totals: list[float], limit: int) -> list[int]:
        order = self.inner.order(ctx, totals, limit)
        states = ctx.all_states
        if self.prefer is None or len(states) != len(totals):  # a filter dropped some
            return order
        for i, s in enumerate(states):
            if s.id == self.prefer and i != order[0] and totals[i] == totals[order[0]]:
                return [i, *[j for j in order if j != i]][:limit]
        return order


def _recorded_times(arrival: Arrival) -> tuple[float | None, float]:
    """(first token, end) seconds after the pick as the recording router clocked them,
    else from the edge's TTFT and duration (their wall-clock anchors jitter by µs-ms)."""
    first: float | None = None
    if arrival.first_tokens:
        first = arrival.first_s if arrival.first_s is not None else (arrival.ttft_ms or 0.0) / 1e3
    if arrival.held_s is not None:
        return first, arrival.held_s
    return first, (arrival.duration_ms or 0.0) / 1e3


def simulate(
    arrivals: Sequence[Arrival],
    endpoints: list[str],
    strategy: Any,
    engine: EngineConfig,
    *,
    name: str = "",
    seed: int = 1,
    scrape_interval: float = 0.05,
    timing: str = "simulated",
    force: bool = False,
    corrections: Sequence[Correction | None] | None = None,
    views: dict[int, tuple[View, Speed]] | None = None,
    fleets: Mapping[str, list[str]] | None = None,
) -> ReplayResult:
    """Every arrival through `Scheduler` with `strategy` onto fresh engines; deterministic.
    `timing="recorded"`: the router holds each request for its recorded duration (first
    token at its recorded TTFT) instead of until its simulated engine ends it. `force`:
    every request goes where the recorded run sent it; `views` collects what each pick saw
    of the engines; `corrections` shift that view per pick (`replay_mirror`); `fleets`:
    each model's own endpoints (None: every model on all of them)."""
    n = len(endpoints)
    models = sorted({a.model for a in arrivals})
    fleet = {m: list((fleets or {}).get(m) or endpoints) for m in models}
    fleet_sets = {m: frozenset(f) for m, f in fleet.items()}
    now = 0.0
    registry = Registry(clock=lambda: now)
    config = replay_config(fleet, strategy, seed)
    registry.staleness = config.scrape.staleness
    scheduler = Scheduler(config, registry, seed=seed)
    ties: list[RecordedTies] = []
    for model in models:  # traced sessions sit where the recorded ring put them
        router = scheduler.routers[model]
        if router.picker.name == "max-score":
            router.picker = tie = RecordedTies(router.picker)
            ties.append(tie)
        router.ring_for(registry.states(model))
        router.ring = TraceRing(
            fleet[model],
            num_virtual_nodes=router.spec.session.num_virtual_nodes,
            num_fallback_replicas=router.spec.session.num_fallback_replicas,
        )
    scraper = Scraper(config, registry)
    targets = scraper.targets()
    index_of = {e: i for i, e in enumerate(endpoints)}
    engines = [EngineModel(engine) for _ in range(n)]
    observations = [
        {m: ModelObservations(max_model_len=engine.max_model_len) for m in models} for _ in range(n)
    ]
    pages = [  # each engine serves the models whose fleet it is in
        make_registry(
            "vllm",
            [
                ServedModel(m, engines[i], observations[i][m])
                for m in models
                if endpoints[i] in fleet[m]
            ],
        )
        for i in range(n)
    ]
    stepping = [False] * n
    flights: dict[tuple[int, int], _Flight] = {}
    rng = random.Random(seed * 7919 + 17)
    events: list[tuple[float, int, int, int]] = []
    counter = itertools.count()

    def push(t: float, kind: int, a: int) -> None:
        heapq.heappush(events, (t, next(counter), kind, a))

    for i in range(n):  # a live router has scraped its engines before traffic comes
        address = endpoints[i]
        if address in targets:  # (every endpoint is some model's)
            scraper.ingest(address, targets[address], render(pages[i]).decode())
        push(rng.uniform(0, scrape_interval), _SCRAPE, i)
    for i, arrival in enumerate(arrivals):
        push(arrival.t, _ARRIVAL, i)
    result = ReplayResult(name or str(strategy), len(arrivals))
    result.per_replica = dict.fromkeys(endpoints, 0)
    outstanding = len(arrivals)
    model_of_flight: dict[tuple[int, int], str] = {}
    leases: dict[int, Lease] = {}

    def error(kind: str) -> None:
        nonlocal outstanding
        result.errors[kind] = result.errors.get(kind, 0) + 1
        outstanding -= 1

    arrived = 0  # arrivals are in time order: arrivals[arrived] comes next

    def next_scrape(now: float) -> float:
        """One scrape interval on; across an idle fleet's long gap (a trace spanning a
        restart or a night), to just before the next arrival: stepping through it ran 20
        scrapes a second of trace per replica (two requests 1,000 s apart took minutes)."""
        spread = scrape_interval * 0.1
        at = now + scrape_interval + rng.uniform(-spread, spread)
        if arrived < len(arrivals) and not leases and not any(stepping):
            ahead = arrivals[arrived].t - IDLE_SCRAPES * scrape_interval
            if ahead > at:
                return ahead + rng.uniform(0, spread)
        return at

    while events and (outstanding > 0 or leases):
        now, _, kind, a = heapq.heappop(events)
        if kind == _ARRIVAL:
            arrived += 1
            arrival = arrivals[a]
            text = prompt_text(arrival, a)
            if force and arrival.endpoint:
                subset: frozenset[str] | None = frozenset({arrival.endpoint})
            elif arrival.engines or arrival.candidates:
                # The fleet of its time: across a rollout (new pod addresses) the pick has
                # only the endpoints its recorded view names, not every one the trace ever
                # does (pooled, post-rollout requests went to pods that were gone).
                subset = fleet_sets[arrival.model].intersection(recorded_endpoints(arrival))
                subset = subset or None
            else:  # no view recorded (its endpoint alone is no fleet)
                subset = None
            info = RequestInfo(
                model=arrival.model,
                request_id=arrival.request_key or f"r{a}",
                session_key=arrival.session,
                prompt=text,
                prompt_tokens=arrival.prompt_tokens,
                subset=subset,
            )
            for tie in ties:
                tie.prefer = arrival.endpoint
            fix = corrections[a] if corrections is not None else None
            undo = None
            if fix is not None:
                scorers = [sc for sc, _ in scheduler.routers[arrival.model].scorers]
                undo = apply(fix, registry.states(arrival.model), scorers, registry.clock())
            try:
                decision = scheduler.pick(info)
            except LlmgwError as exc:
                error(f"{exc.status} {exc.code}")
                continue
            finally:
                if undo is not None:
                    undo()
            lease = scheduler.acquire(decision)
            if views is not None:
                views[a] = view_of(registry, arrival.model)
            if decision.predicted_ttft is not None:
                result.predicted_s.append(decision.predicted_ttft)
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
                lease.end(Outcome.FAILURE if too_large else Outcome.BACKPRESSURE)
                error("400 too large" if too_large else "429 queue full")
                continue
            held = _Flight(a, now, target, lease)
            if timing == "recorded" and arrival.duration_ms is not None:
                held.held = True
                leases[a] = lease
                first, hold = _recorded_times(arrival)
                if first is not None:
                    push(now + first, _FIRST, a)
                push(now + hold, _RELEASE, a)
            flights[(target, seq.seq_id)] = held
            model_of_flight[(target, seq.seq_id)] = arrival.model
            if not stepping[target]:
                stepping[target] = True
                push(now, _WAKE, target)
        elif kind == _WAKE:
            push(now + engines[a].schedule(now), _STEP_END, a)
        elif kind == _STEP_END:
            step = engines[a].complete(now)
            for seq in step.emitted:
                if seq.output_tokens == 1:  # vLLM observes time to first token now
                    observations[a][model_of_flight[(a, seq.seq_id)]].first_token(seq)
                flight = flights.get((a, seq.seq_id))
                if flight is None:
                    continue
                if not flight.first_seen:
                    flight.first_seen = True
                    result.ttft_s.append(now - flight.sent)
                    if arrivals[flight.index].first_tokens and not flight.held:
                        flight.lease.first_token()
                elif flight.lease.streaming and not flight.held:
                    flight.lease.token()  # a later token: the router sees the step end
            for seq in step.finished:
                flight = flights.pop((a, seq.seq_id))
                observations[a][model_of_flight.pop((a, seq.seq_id))].observe(seq)
                result.e2e_s.append(now - flight.sent)
                result.output_tokens += arrivals[flight.index].output_tokens
                if not flight.held:
                    flight.lease.end(Outcome.SUCCESS)
                outstanding -= 1
            if engines[a].has_work:
                push(now + engines[a].schedule(now), _STEP_END, a)
            else:
                stepping[a] = False
        elif kind == _FIRST:
            leases[a].first_token()
        elif kind == _RELEASE:
            leases.pop(a).end(Outcome.SUCCESS)
        else:  # _SCRAPE
            result.scrapes += 1
            address = endpoints[a]
            if address in targets:
                scraper.ingest(address, targets[address], render(pages[a]).decode())
            push(next_scrape(now), _SCRAPE, a)
    hits = sum(e.stats.prefix_hits_tokens for e in engines)
    queries = sum(e.stats.prefix_queries_tokens for e in engines)
    result.hit_rate = hits / queries if queries else 0.0
    result.makespan_s = now
    return result


def mirrorable(arrivals: Sequence[Arrival], endpoints: list[str]) -> bool:
    """The trace says what its picks saw, and the replay uses the recorded endpoints."""
    recorded_endpoints = {a.endpoint for a in arrivals if a.endpoint}
    return any(a.engines for a in arrivals) and recorded_endpoints <= set(endpoints)


def mirror_corrections(
    arrivals: Sequence[Arrival],
    endpoints: list[str],
    engine: EngineConfig,
    seed: int = 1,
    fleets: Mapping[str, list[str]] | None = None,
) -> list[Correction | None]:
    """Per arrival, how the recorded engine view differs from the simulated one when every
    request goes where it went, held as long as it was (`replay_mirror`); ValueError when
    the trace lacks what that needs."""
    if not any(a.engines for a in arrivals):
        raise ValueError("--mirror: the trace has no `engines` views (record it with this llmgw)")
    if not {a.endpoint for a in arrivals if a.endpoint} <= set(endpoints):
        raise ValueError(
            "--mirror: replay the recorded endpoints (drop replicas= from --engine-args)"
        )
    views: dict[int, tuple[View, Speed]] = {}
    simulate(
        arrivals,
        endpoints,
        "ring",
        engine,
        seed=seed,
        timing="recorded",
        force=True,
        views=views,
        fleets=fleets,
    )
    out: list[Correction | None] = []
    for i, a in enumerate(arrivals):
        seen = views.get(i)
        if a.engines is None or seen is None:
            out.append(None)
            continue
        out.append(
            correction(a.engines, a.costs, seen[0], seen[1], a.batches, a.slowdowns, a.tokens)
        )
    return out


def recorded(arrivals: Sequence[Arrival], endpoints: list[str]) -> dict[str, Any]:
    """The recorded run's own row: where its requests went and the TTFT it saw."""
    per_replica = dict.fromkeys(endpoints, 0)
    for a in arrivals:
        if a.endpoint in per_replica:
            per_replica[a.endpoint] += 1
    ttft = [a.ttft_ms / 1e3 for a in arrivals if a.ttft_ms is not None]
    predicted = [a.predicted_ms / 1e3 for a in arrivals if a.predicted_ms is not None]
    return {
        "strategy": "recorded",
        "requests": len(arrivals),
        "ttft_p50_ms": _ms(_pct(ttft, 50)),
        "predicted_ttft_p50_ms": _ms(_pct(predicted, 50)),
        "ttft_p90_ms": _ms(_pct(ttft, 90)),
        "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "per_replica": per_replica,
    }
