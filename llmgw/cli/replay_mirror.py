"""`llmgw replay --mirror`: the recorded run's host noise on top of the simulated engines.

The simulated engines reproduce the load routing causes, not what the host added: the
demo's live engines, starved of CPU, queued and slowed unevenly in ways the engine model
does not. A first pass sends every request where the recorded run sent it (held for its
recorded duration) and notes, at each pick, how the simulated engines' view differs from
the one the trace recorded (`engines`), and the fleet's simulated speed. The replays then
see their own simulated view plus that difference, and the latency costs the recorded
pick used, scaled by how the simulated speed moved since: replaying the recorded strategy
gives its router the recorded inputs again (`replay_sim.RecordedTies` repeats exact-tie
draws), and another strategy's extra load still shows, as the engines simulate it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmgw.calibration import Costs, pooled
from llmgw.registry import EndpointState, Registry, fresh_metrics_of
from llmgw.scheduling.scorers import LatencyScorer

# endpoint -> (waiting, running, kv, released, peak running[, open prefill tokens, seconds
# since the scrape that counted first tokens]); older traces lack the peak and the counts
View = Mapping[str, tuple[float, ...] | None]
Speed = tuple[float | None, ...]  # per_token s, step s, tokens per prefill, service s
# A pick's costs: `Speed`, then engine tokens per router token, observed s/token, marginal
# s/token (older traces: `Speed` alone).
Recorded = tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class Correction:
    """At one pick: (recorded - simulated) engine view per endpoint; the latency costs the
    recorded pick used, and the simulated fleet's speed then (to scale them by)."""

    engines: Mapping[str, tuple[float, float, float, float]]
    costs: Recorded | None
    speed: Speed
    stale: frozenset[str] = frozenset()  # the recorded pick had no fresh metrics there
    fresh: frozenset[str] = frozenset()  # it had; the simulated ones had gone stale
    # The most running the recorded router had scraped there (its own scrapes' history,
    # not the simulated one's): at it, the latency queue waits for a batch slot.
    peaks: Mapping[str, float] = field(default_factory=dict)
    # Where that peak was known to be the batch (None: the trace predates it).
    batches: frozenset[str] | None = None
    # The latency scorer's slowdowns the recorded pick used (None: the trace predates them):
    # the demo's starved engines run unevenly, and a replay that prices them all alike
    # sent a request where the recorded router saw a replica ~1.9x slower.
    slowdowns: Mapping[str, float] | None = None
    # Where the recorded router closed its prefills by the engine's first-token count:
    # (prefill tokens open, seconds since that scrape), as it saw them. Endpoints in `blind`
    # were fresh but not counted there (the time-drained queue; traces before session 27).
    counted: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    blind: frozenset[str] = frozenset()
    # Seconds since the recording edge last saw a token from each endpoint (the latency
    # scorer's step phase; absent: none seen lately). None: the trace predates them.
    tokens: Mapping[str, float] | None = None


def view_of(registry: Registry, model: str) -> tuple[View, Speed]:
    """The engine view a pick sees now (the trace's `engines` and `fleet`, in seconds)."""
    states = registry.states(model)
    fresh = fresh_metrics_of(states, registry.clock(), registry.staleness)
    engines: dict[str, tuple[float, ...] | None] = {}
    for s in states:
        m = fresh[s]
        engines[s.id] = (
            None
            if m is None
            else (m.waiting, m.running, m.kv_usage, s.released_since_scrape, s.peak_running)
        )
    return engines, _speed(states)


def _speed(states: Sequence[EndpointState]) -> Speed:
    c = pooled(s.calibration for s in states)
    return (c.per_token, c.step, c.tokens_per_prefill, c.service)


def correction(
    recorded: View,
    costs: Recorded | None,
    simulated: View,
    speed: Speed,
    batches: frozenset[str] | None = None,
    slowdowns: Mapping[str, float] | None = None,
    tokens: Mapping[str, float] | None = None,
) -> Correction:
    engines: dict[str, tuple[float, float, float, float]] = {}
    stale, fresh, blind = set(), set(), set()
    peaks: dict[str, float] = {}
    counted: dict[str, tuple[float, float]] = {}
    for endpoint, seen in recorded.items():
        mine = simulated.get(endpoint)
        if seen is not None and len(seen) > 4:
            peaks[endpoint] = seen[4]
        if seen is not None:
            if len(seen) > 6:
                counted[endpoint] = (seen[5], seen[6])
            else:
                blind.add(endpoint)
        if seen is not None and mine is not None:
            w, r, k, x = (a - b for a, b in zip(seen[:4], mine[:4], strict=True))
            engines[endpoint] = (w, r, k, x)
        elif seen is None and mine is not None:
            stale.add(endpoint)
        elif seen is not None and endpoint in simulated:
            fresh.add(endpoint)
    return Correction(
        engines,
        costs,
        speed,
        frozenset(stale),
        frozenset(fresh),
        peaks,
        batches,
        slowdowns,
        counted,
        frozenset(blind),
        tokens,
    )


def apply(
    fix: Correction, states: Sequence[EndpointState], scorers: Sequence[object], now: float
) -> Callable[[], None]:
    """Shift the states' engine view by `fix`, and give latency scorers the recorded costs
    scaled by how the simulated fleet's speed moved since the first pass, for one pick
    (`now`: the registry clock); returns the undo."""
    undo: list[Callable[[], None]] = []
    for s in states:
        if fix.tokens is not None:  # the step phase the recorded pick read
            undo.append(_restore_token(s))
            age = fix.tokens.get(s.id)
            s.token_at = float("-inf") if age is None else now - age
        peak = fix.peaks.get(s.id)
        if peak is not None:
            undo.append(_restore_peak(s))
            s.peak_running = peak
            if fix.batches is not None:
                s.peak_is_batch = s.id in fix.batches
        counted = fix.counted.get(s.id)
        if (counted is not None or s.id in fix.blind) and not s.reports_first_token:
            # The queue the recorded router saw: what stayed open by its engine's count, as
            # old as its scrape was (the simulated engines count their own first tokens).
            undo.append(_restore_counted(s))
            s.counts_first_tokens = counted is not None
            if counted is not None:
                s.counted_prefill, s.scraped_at = counted[0], now - counted[1]
        if s.id in fix.stale or (s.id in fix.fresh and s.metrics is not None):
            undo.append(_restore_metrics(s))  # as stale or as fresh as the recorded pick saw
            if s.id in fix.stale:
                s.scraped_at = float("-inf")
            elif counted is None:
                s.scraped_at = float("inf")
            continue
        d = fix.engines.get(s.id)
        m = s.metrics
        if d is not None and m is not None:
            undo.append(_restore_metrics(s))
            s.metrics = replace(
                m,
                waiting=max(0.0, m.waiting + d[0]),
                running=max(0.0, m.running + d[1]),
                kv_usage=min(1.0, max(0.0, m.kv_usage + d[2])),
            )
            s.released_since_scrape = max(0, s.released_since_scrape + round(d[3]))
    latency = [scorer for scorer in scorers if isinstance(scorer, LatencyScorer)]
    for scorer in latency:
        # The recorded pick read the step's phase iff the trace has it (null, or a trace from
        # before it: the router did not); the replay's own calibration may start it sooner.
        undo.append(_override(scorer, "phase_override", fix.tokens is not None))
        if fix.slowdowns is not None:
            undo.append(_override(scorer, "speeds_override", dict(fix.slowdowns)))
    if fix.costs is not None:
        speed_now = _speed(states)
        scales = [a / b if a and b else 1.0 for a, b in zip(speed_now, fix.speed, strict=True)]
        per_token, step, tokens, service = [
            None if rec is None else rec * scale
            for rec, scale in zip(fix.costs[:4], scales, strict=True)
        ]
        # Traces since session 17 add the engine tokens per router token and the two
        # sessionless prices (the first tokens' slope, the net cost), per token like the first.
        engine_tokens, observed, marginal = (*fix.costs[4:7], None, None, None)[:3]
        wanted = Costs(
            per_token,
            step,
            tokens,
            service,
            engine_tokens or 1.0,
            None if observed is None else observed * scales[0],
            None if marginal is None else marginal * scales[0],
        )
        for scorer in latency:
            undo.append(_override(scorer, "costs_override", wanted))

    def undo_all() -> None:
        for step_back in reversed(undo):
            step_back()

    return undo_all


def _override(scorer: LatencyScorer, name: str, value: object) -> Callable[[], None]:
    """Set one of the scorer's `*_override` fields for a pick; returns the undo."""
    before = getattr(scorer, name)
    setattr(scorer, name, value)

    def restore() -> None:
        setattr(scorer, name, before)

    return restore


def _restore_metrics(s: EndpointState) -> Callable[[], None]:
    metrics, released, scraped_at = s.metrics, s.released_since_scrape, s.scraped_at

    def restore() -> None:
        s.metrics, s.released_since_scrape, s.scraped_at = metrics, released, scraped_at

    return restore


def _restore_token(s: EndpointState) -> Callable[[], None]:
    token_at = s.token_at

    def restore() -> None:
        s.token_at = token_at

    return restore


def _restore_counted(s: EndpointState) -> Callable[[], None]:
    counts, pending, scraped_at = s.counts_first_tokens, s.counted_prefill, s.scraped_at

    def restore() -> None:
        s.counts_first_tokens, s.counted_prefill, s.scraped_at = counts, pending, scraped_at

    return restore


def _restore_peak(s: EndpointState) -> Callable[[], None]:
    peak, batch = s.peak_running, s.peak_is_batch

    def restore() -> None:
        s.peak_running, s.peak_is_batch = peak, batch

    return restore
