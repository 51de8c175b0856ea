"""Named strategies: a strategy is a set of scorer weights plus a picker."""

from __future__ import annotations

from llmgw.scheduling.specs import PickerSpec, ScorerSpec, StrategySpec


def _s(weight: float, **params: float | int | str | bool) -> ScorerSpec:
    return ScorerSpec(weight=weight, params=params)


PRESETS: dict[str, StrategySpec] = {
    # Conversations: stay where the history is cached unless that replica is clearly busier.
    # `load` (waiting + running, or local inflight) rather than `queue` (waiting only): a
    # replica filling its batch is busier before anything waits. Without a session the ring
    # abstains, so prefix and load decide instead of a per-request random preference.
    # Measured with bench/routing.py (4 workloads, 8 simulated replicas, through Envoy):
    # TTFT p90 equal or lower than {session 1, prefix 2, queue 2, kv 1} on every workload,
    # and a higher prefix-cache hit rate on session-less traffic (0.92 vs 0.86).
    "chat": StrategySpec(
        name="chat",
        scorers={
            "session": _s(2.0, abstain_without_session=True),
            "prefix": _s(2.0),
            "load": _s(3.0, smoothing=4.0),
            "kv": _s(1.0),
        },
    ),
    # Predicted time to first token, in seconds: queueing vs the prefill of uncached tokens,
    # calibrated online from each engine's histograms. A session stays where its history is
    # cached because leaving costs the prefill of every uncached token; a new session goes
    # where it starts soonest (equal predictions: at random). No session ring: at weight
    # 0.05 (until session 21) it placed new sessions by hash whenever the predictions were
    # within ~5 %, nearly always, since a first turn's prefill is most of its cost; sessions
    # then landed as consistent hashing lands them (served max/mean 1.26 vs 1.17 without it)
    # and cold-session chat ran up to 1.20x the best TTFT p90. Without it, through Envoy on
    # the real grid's 9 session cells x 2 seeds: 0.935x (14 of 18 better); in virtual time
    # (8 engines x 8 cells x 4 seeds) within 1.05x of the best in 50 of 64 cells, not 35.
    # What the ring alone gave: two routers without KV events agree on a new session's
    # replica (1.34x the best with it, 1.38x without, geo); with KV events 1.03x.
    # No `not-saturated` filter: the model prices a full engine's queue in seconds, and
    # engines queue rather than fail (add the filter to shed with 429 instead). Measured
    # with bench/fleetsim_grid.py (12 regimes x 2 engine shapes) and bench/routing.py.
    # `blind-imbalance` acts only where the router sees no load at all (no metrics, no
    # first tokens): through Envoy on engines that publish nothing, hot sessions piled on
    # their homes (with it, hot-zipf TTFT p90 is 0.33x the preset's without it, the other
    # cells 0.78-1.05x, on engines of 8, 48 and 256 sequences; bench/fleetsim_robust.py).
    "latency": StrategySpec(
        name="latency",
        scorers={"latency": _s(1.0)},
        filters=("healthy", "model-serves", "blind-imbalance"),
    ),
    # Throughput jobs: no affinity, spread by queue, local inflight and KV room.
    "batch": StrategySpec(
        name="batch",
        scorers={"queue": _s(1.0), "inflight": _s(1.0), "kv": _s(1.0)},
    ),
    # Long prompts: KV room matters most.
    "long-context": StrategySpec(
        name="long-context",
        scorers={"kv": _s(3.0), "queue": _s(1.0), "prefix": _s(1.0)},
    ),
    # Baselines, kept to compare against in benchmarks.
    "ring": StrategySpec(name="ring", scorers={"session": _s(1.0)}, filters=("healthy",)),
    # c = 1.1, not the textbook 1.25: capacity is ceil(c * (total + 1) / n), and with a few
    # requests in flight per replica the ceiling alone adds slack (hot sessions through
    # Envoy, 8 replicas: max/mean load 1.32 at c = 1.25, 1.12 at c = 1.1, same TTFT).
    "bounded-ring": StrategySpec(
        name="bounded-ring", scorers={"session": _s(1.0, bounded_load=1.1)}, filters=("healthy",)
    ),
    "least-load": StrategySpec(name="least-load", scorers={"load": _s(1.0)}),
    "round-robin": StrategySpec(name="round-robin", picker=PickerSpec(type="round-robin")),
    "random": StrategySpec(name="random", picker=PickerSpec(type="random")),
}


def tuned(spec: StrategySpec) -> StrategySpec:
    """An explicit strategy whose scorers are those of exactly one preset is that preset
    tuned (`{scorers: {latency: {params: {step_ms: 30}}}}`): what it leaves out (filters,
    picker) is the preset's, and it reports the preset's name (metrics, x-llmgw-decision)
    while only scorer params differ: another weight, filter or picker, or a `name`, makes it
    another strategy. It got the generic defaults before: tuning a latency param added
    `not-saturated` (429s the preset never gives), dropped `blind-imbalance`, and reported
    the strategy as `custom`. Scorer sets two presets share (ring and bounded-ring;
    round-robin and random, none) match neither."""
    names = set(spec.scorers)
    matches = [p for p in PRESETS.values() if set(p.scorers) == names]
    if len(matches) != 1 or spec is matches[0]:
        return spec
    preset = matches[0]
    given = spec.model_fields_set
    filters = spec.filters if "filters" in given else preset.filters
    picker = spec.picker if "picker" in given else preset.picker
    same = (
        filters == preset.filters
        and picker == preset.picker
        and all(s.weight == preset.scorers[n].weight for n, s in spec.scorers.items())
    )
    name = preset.name if "name" not in given and same else spec.name
    return spec.model_copy(update={"filters": filters, "picker": picker, "name": name})


def resolve(strategy: StrategySpec | str) -> StrategySpec:
    return PRESETS[strategy] if isinstance(strategy, str) else strategy
