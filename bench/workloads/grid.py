"""Regime workloads for the routing grid (`bench/routing.py`): one generator, four axes.

A regime is a point on four axes (issue 13, item 4):
- load: offered requests as a fraction of the fleet's capacity, computed from the
  simulator's parameters (`EngineSpeed.capacity_req_s`), so 0.85 means the same thing
  for a cheap chat turn and a 4,000-token document;
- prompt mix (`MIXES`): short chat, long multi-turn histories, long documents,
  prefill-heavy (long prompts, tiny answers), decode-heavy (short prompts, long answers);
- sessions: `none` (no session header; requests share a few contexts, RAG style),
  `cold` (many conversations, each its own context and `x-session-id`), `hot` (few
  users drawn Zipf; the session header carries the user, every conversation of a user
  starts with that user's context);
- cache pressure: the working set of reusable context tokens over the fleet's total KV
  cache, e.g. 0.4 (fits) or 2.5 (evictions).

Deterministic: `(regime, engine, seed)` gives a byte-identical workload in every
process. Capacity assumes ideal affinity (each context prefilled once, then only new
tokens; above the cache, context tokens miss with probability 1 - 1/pressure), so at
load 0.85 a router that loses the cache saturates and one that keeps it does not. The
working set is every distinct prompt token the run touches (contexts once, plus each
conversation's own turns).

    speed = EngineSpeed(replicas=4, prefill_s_per_token=60e-6, decode_step_s=0.025, ...)
    wl = regime_workload(REGIMES["chat-history"], speed, seed=1)
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from bench.workloads import Conversation, TextSource, Turn, Workload, _poisson_starts, _think

SESSION_KINDS = ("none", "cold", "hot")


@dataclass(frozen=True)
class PromptMix:
    """Token ranges of one prompt mix; `context` is the reusable head of every prompt."""

    name: str
    description: str
    context_tokens: tuple[int, int]
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    turns: tuple[int, int]
    think_s: float


MIXES: dict[str, PromptMix] = {
    m.name: m
    for m in (
        PromptMix("short", "short chat", (300, 600), (30, 120), (30, 100), (8, 16), (2, 4), 0.5),
        PromptMix(
            "history",
            "long growing chat histories, 4-8 turns, ~1 s think time",
            (600, 1200),
            (150, 400),
            (200, 500),
            (8, 16),
            (4, 8),
            1.0,
        ),
        PromptMix(
            "long-doc", "long documents", (2500, 4500), (40, 120), (30, 80), (16, 32), (1, 2), 0.5
        ),
        PromptMix(
            "prefill-heavy",
            "long prompts, tiny answers",
            (1500, 3000),
            (300, 800),
            (20, 60),
            (2, 4),
            (1, 3),
            0.5,
        ),
        PromptMix(
            "decode-heavy",
            "short prompts, long answers",
            (150, 300),
            (30, 80),
            (100, 200),
            (48, 80),
            (1, 3),
            0.5,
        ),
    )
}


@dataclass(frozen=True)
class EngineSpeed:
    """What capacity depends on, in wall seconds (the simulator's values x time_scale)."""

    replicas: int
    prefill_s_per_token: float
    decode_step_s: float
    decode_batch_factor: float
    max_num_seqs: int
    kv_tokens_per_replica: int

    @property
    def kv_tokens_total(self) -> int:
        return self.replicas * self.kv_tokens_per_replica

    def request_cost_s(self, new_tokens: float, output_tokens: float, seq_tokens: float) -> float:
        """Engine seconds one request takes at saturation (a full batch shares decode steps;
        KV room can cap the batch below max_num_seqs for long sequences)."""
        batch = max(1.0, min(self.max_num_seqs, self.kv_tokens_per_replica / max(seq_tokens, 1)))
        step = self.decode_step_s * (1 + self.decode_batch_factor * (batch - 1))
        return new_tokens * self.prefill_s_per_token + output_tokens * step / batch


@dataclass(frozen=True)
class Regime:
    """One grid cell's traffic."""

    name: str
    load: float
    mix: str
    sessions: str
    pressure: float
    window_s: float = 6.0
    zipf_s: float = 1.1
    note: str = ""

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"unknown mix {self.mix!r}; known: {', '.join(MIXES)}")
        if self.sessions not in SESSION_KINDS:
            raise ValueError(f"sessions must be one of {', '.join(SESSION_KINDS)}")
        if not 0 < self.load <= 2 or self.pressure <= 0 or self.window_s <= 0:
            raise ValueError("load in (0, 2], pressure > 0, window_s > 0")


@dataclass
class _Plan:
    """Numbers of one conversation, drawn before any text (capacity needs only sizes)."""

    context: int
    user: list[int]
    reply: list[int]
    max_tokens: list[int]
    think: list[float]
    new_tokens: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


def _plans(
    rng: random.Random, regime: Regime, mix: PromptMix, contexts: int, count: int
) -> list[_Plan]:
    cumulative = list(
        itertools.accumulate(1.0 / (k**regime.zipf_s) for k in range(1, contexts + 1))
    )
    indices = range(contexts)
    plans = []
    for i in range(count):
        cold = regime.sessions == "cold"
        context = i if cold else rng.choices(indices, cum_weights=cumulative)[0]
        turns = 1 if regime.sessions == "none" else rng.randint(*mix.turns)
        plans.append(
            _Plan(
                context=context,
                user=[rng.randint(*mix.user_tokens) for _ in range(turns)],
                reply=[rng.randint(*mix.reply_tokens) for _ in range(turns)],
                max_tokens=[rng.randint(*mix.max_tokens) for _ in range(turns)],
                think=[_think(rng, mix.think_s) for _ in range(turns)],
            )
        )
    return plans


def _account(plans: list[_Plan], context_tokens: list[int], pressure: float) -> None:
    """New (uncached) tokens per request under ideal affinity; see the module docstring."""
    seen: set[int] = set()
    miss = max(0.0, 1.0 - 1.0 / pressure)
    for plan in plans:
        head = context_tokens[plan.context]
        first = plan.context not in seen
        seen.add(plan.context)
        history = head
        for k, user in enumerate(plan.user):
            prompt = history + user
            if k == 0:
                new = head + user if first else head * miss + user
            else:
                new = plan.reply[k - 1] + user
            plan.new_tokens.append(new)
            plan.prompt_tokens.append(prompt)
            history = prompt + plan.reply[k]


def _mean_cost(plans: list[_Plan], speed: EngineSpeed) -> tuple[float, float]:
    """(mean engine seconds per request, mean turns per conversation)."""
    costs = [
        speed.request_cost_s(new, out, prompt + out)
        for p in plans
        for new, out, prompt in zip(p.new_tokens, p.max_tokens, p.prompt_tokens, strict=True)
    ]
    return sum(costs) / len(costs), len(costs) / len(plans)


def _sized(
    rng: random.Random,
    regime: Regime,
    mix: PromptMix,
    speed: EngineSpeed,
    contexts: int,
    context_tokens: list[int],
) -> tuple[list[_Plan], int, float, float]:
    """(plans of the window, how many, mean engine s a request, mean turns)."""
    pool = _plans(rng, regime, mix, contexts, 4000)
    # The rate depends on the mean cost, the cost on how many requests share a context,
    # which depends on how many conversations the window holds: iterate a few times.
    count = 200
    for _ in range(4):
        plans = [_Plan(p.context, p.user, p.reply, p.max_tokens, p.think) for p in pool[:count]]
        _account(plans, context_tokens, regime.pressure)
        cost_s, turns = _mean_cost(plans, speed)
        conv_rate = regime.load * speed.replicas / cost_s / turns
        count = max(8, min(len(pool), round(conv_rate * regime.window_s)))
    plans = pool[:count]
    _account(plans, context_tokens, regime.pressure)
    cost_s, turns = _mean_cost(plans, speed)
    return plans, count, cost_s, turns


def _working_set(plans: list[_Plan], context_tokens: list[int]) -> int:
    """Reusable prompt tokens the run touches: contexts once, plus every conversation's
    turns that a later turn re-sends (what a cache must hold for no reuse to miss)."""
    contexts = sum(context_tokens[c] for c in {p.context for p in plans})
    return contexts + sum(sum(p.user[:-1]) + sum(p.reply[:-1]) for p in plans)


def regime_workload(regime: Regime, speed: EngineSpeed, seed: int = 1) -> Workload:
    """The conversations of one cell, arriving at `regime.load` x capacity for
    `regime.window_s` seconds (Poisson, open loop)."""
    mix = MIXES[regime.mix]
    rng = random.Random(f"regime:{regime.name}:{seed}")
    mean_context = sum(mix.context_tokens) / 2
    pool_size = 4000
    target = regime.pressure * speed.kv_tokens_total
    sizes = random.Random(f"regime-sizes:{regime.name}:{seed}")
    context_tokens = [sizes.randint(*mix.context_tokens) for _ in range(pool_size * 4)]
    # none/hot: grow the number of contexts until what the run touches reaches the target
    # working set (Zipf leaves the tail untouched); cold: every conversation has its own.
    contexts = pool_size if regime.sessions == "cold" else max(2, round(target / mean_context))
    for _ in range(16):
        rng = random.Random(f"regime:{regime.name}:{seed}")
        plans, count, cost_s, turns = _sized(rng, regime, mix, speed, contexts, context_tokens)
        working_set = _working_set(plans, context_tokens)
        # Below the cache needs no search: fewer contexts touched is still below.
        if regime.sessions == "cold" or regime.pressure <= 1 or working_set >= 0.9 * target:
            break
        if contexts >= len(context_tokens):
            break
        contexts = min(len(context_tokens), round(contexts * 1.4))
    capacity = speed.replicas / cost_s
    conv_rate = regime.load * capacity / turns

    text = TextSource(rng)
    heads: dict[int, str] = {}
    starts = _poisson_starts(random.Random(f"regime-starts:{regime.name}:{seed}"), count, conv_rate)
    conversations = []
    for i, plan in enumerate(plans):
        if plan.context not in heads:
            heads[plan.context] = f"Context {plan.context} of {regime.name}. " + text.text(
                context_tokens[plan.context]
            )
        session = {
            "none": None,
            "cold": f"{regime.name}-{seed}-c{i:04d}",
            "hot": f"{regime.name}-{seed}-u{plan.context:03d}",
        }[regime.sessions]
        turns_ = tuple(
            Turn(
                user=text.text(plan.user[k]),
                reply=text.text(plan.reply[k]) if k + 1 < len(plan.user) else "",
                max_tokens=plan.max_tokens[k],
                think_s=plan.think[k],
            )
            for k in range(len(plan.user))
        )
        conversations.append(Conversation(i, session, starts[i], heads[plan.context], turns_))
    used = {p.context for p in plans}
    return Workload(
        name=regime.name,
        seed=seed,
        description=(
            f"{mix.description}; sessions {regime.sessions}; load {regime.load:g} of "
            f"{capacity:.1f} req/s; working set {working_set / speed.kv_tokens_total:.2f}x KV"
        ),
        conversations=tuple(conversations),
        arrival_rate=conv_rate,
        params={
            "load": regime.load,
            "mix": regime.mix,
            "sessions": regime.sessions,
            "pressure_target": regime.pressure,
            "working_set_tokens": round(working_set),
            "working_set_over_kv": round(working_set / speed.kv_tokens_total, 2),
            "capacity_req_s": round(capacity, 2),
            "offered_req_s": round(conv_rate * turns, 2),
            "contexts_used": len(used),
            "mean_engine_ms_per_request": round(cost_s * 1e3, 1),
        },
    )


# The grid: every level of every axis at least once, plus the combinations that decide
# rankings (multi-turn chat at moderate load is where plain consistent hashing is strong).
REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("chat-history", 0.6, "history", "cold", 0.4, note="consistent hashing's home"),
        Regime("chat-history-heavy", 0.85, "history", "cold", 0.4),
        Regime("chat-light", 0.3, "short", "cold", 0.4),
        Regime("chat-heavy", 0.85, "short", "cold", 0.4),
        Regime("hot-zipf", 0.6, "short", "hot", 0.4, zipf_s=1.2),
        Regime("hot-zipf-pressure", 0.85, "short", "hot", 2.5, zipf_s=0.9),
        Regime("docs-shared", 0.6, "long-doc", "none", 0.4, zipf_s=0.8),
        Regime("docs-pressure", 0.6, "long-doc", "none", 2.5, zipf_s=0.8),
        Regime("docs-hot-light", 0.3, "long-doc", "hot", 2.5, zipf_s=0.8, window_s=8.0),
        Regime("prefill-heavy", 0.85, "prefill-heavy", "none", 0.4, zipf_s=0.8),
        Regime("decode-heavy", 0.6, "decode-heavy", "cold", 0.4, window_s=8.0),
        Regime("decode-hot-light", 0.3, "decode-heavy", "hot", 0.4, zipf_s=1.2, window_s=8.0),
    )
}
QUICK_REGIMES = ("chat-history", "hot-zipf", "docs-shared")
# Not in the real grid (its 12 cells take half an hour): short chat whose requests share a
# few system prompts and carry no session header, the third workload of issue 13's report.
# The virtual-time benches run them (`bench/fleetsim_robust.py --cells system-shared,...`).
EXTRA_REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("system-shared", 0.6, "short", "none", 0.4, zipf_s=0.8),
        Regime("system-shared-heavy", 0.85, "short", "none", 0.4, zipf_s=0.8),
        Regime("system-shared-pressure", 0.85, "short", "none", 2.5, zipf_s=0.8),
    )
}
# Sustained overload, also outside the real grid: more than the fleet can serve, so every
# queue grows for the whole window and a pick decides how long a request waits in it.
# Run them 4x longer than the grid's window (`bench/fleetsim_robust.py --variants base
# --cells chat-history-over,... --window 4`): a queue that grows needs time to tell routers apart.
OVER_REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("chat-history-over", 1.15, "history", "cold", 0.4),
        Regime("chat-over", 1.2, "short", "cold", 0.4),
        Regime("hot-over", 1.2, "short", "hot", 0.4, zipf_s=1.2),
        Regime("docs-over", 1.1, "long-doc", "none", 0.4, zipf_s=0.8),
        Regime("decode-over", 1.15, "decode-heavy", "cold", 0.4, window_s=8.0),
    )
}


__all__ = [
    "EXTRA_REGIMES",
    "MIXES",
    "OVER_REGIMES",
    "QUICK_REGIMES",
    "REGIMES",
    "SESSION_KINDS",
    "EngineSpeed",
    "PromptMix",
    "Regime",
    "regime_workload",
]
