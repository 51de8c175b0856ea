"""Seeded, replayable request workloads for the routing benchmark (`bench/routing.py`).

A workload is a list of *conversations*: scripts of dependent turns. Turn k of a
conversation re-sends the whole history (system prompt, every earlier user message and
a scripted assistant reply), so its prompt extends turn k-1's prompt: the shape that
makes prefix caching, and therefore routing, matter. Single requests are one-turn
conversations. The same `(name, seed, scale)` gives byte-identical workloads in every
process, so every contender replays exactly the same traffic.

    from workloads import build
    wl = build("chat", seed=1, scale=1.0)
    wl.requests, wl.conversations[0].turns[0].user

Scripted replies, not the server's: the history carries an assistant reply of realistic
length that the generator wrote, not the text the server streamed back, so the prompts
stay identical whichever replica answered. vLLM does cache the full blocks of what it
generated (`allocate_slots` caches up to `request.num_tokens`, outputs included), but a
scripted reply never matches them, so only the next turn's hits on the *previous prompt*
count here; `llmgw.sim` does not cache output blocks (a known difference: under cache
pressure vLLM's outputs also sit in the LRU list, first in line for eviction). `max_tokens` (what the server decodes) is kept
short so the client's and the simulators' CPU goes to routing-relevant work.

Workloads (`WORKLOADS`):
- `chat`: many concurrent multi-turn conversations (4-10 turns) sharing one system
  prompt, each with its own `x-session-id`, exponential think time between turns.
- `hot`: multi-turn conversations keyed by a *user* id drawn from a Zipf law over few
  users, each user with its own long context: a few session keys carry most traffic.
- `prefix`: independent requests, no session, each starting with one of a few long
  system prompts (RAG / agent style), Poisson arrivals.
- `mixed`: short multi-turn chat plus long-context single requests (unique documents).

Arrivals: every conversation has `start_s`, drawn from a Poisson process at the
workload's rate (open loop); the load client can instead run a closed loop of N
concurrent conversations and ignore `start_s`. `with_rate()` rescales the arrival times
for a rate sweep without changing the requests.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

CHARS_PER_TOKEN = 4  # the simulators' stand-in tokenizer: 4 characters a token


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: the user message, the scripted reply added to the history after it."""

    user: str
    reply: str
    max_tokens: int
    # Pause after this turn's response ends, before the next turn is sent.
    think_s: float
    # False: `"stream": false` (a batch or agent client); the whole answer comes at once,
    # so the request has no time to first token, only its end-to-end time.
    stream: bool = True
    # The client closes the connection after this many content chunks (a user pressing
    # stop); None: it reads the whole answer. Streamed turns only.
    stop_after: int | None = None


@dataclass(frozen=True, slots=True)
class Conversation:
    """Dependent turns; `session_id` goes in the session header (None = no header)."""

    index: int
    session_id: str | None
    start_s: float
    system: str
    turns: tuple[Turn, ...]

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The OpenAI `messages` of turn `turn`: system, history, then the new user message."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for earlier in self.turns[:turn]:
            out.append({"role": "user", "content": earlier.user})
            out.append({"role": "assistant", "content": earlier.reply})
        out.append({"role": "user", "content": self.turns[turn].user})
        return out

    def prompt_chars(self, turn: int) -> int:
        return sum(len(m["content"]) for m in self.messages(turn))


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    description: str
    conversations: tuple[Conversation, ...]
    # Offered conversation arrivals per second in open loop (what `start_s` was drawn at).
    arrival_rate: float
    params: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def sessions(self) -> int:
        return len({c.session_id for c in self.conversations if c.session_id is not None})

    @property
    def duration_s(self) -> float:
        """Open-loop arrival window (last conversation start)."""
        return max((c.start_s for c in self.conversations), default=0.0)

    def offered_request_rate(self) -> float:
        """Requests per second offered in open loop, over the arrival window."""
        window = self.duration_s or 1.0
        return self.requests / window

    def with_rate(self, arrival_rate: float) -> Workload:
        """Same requests, arrival times rescaled to `arrival_rate` conversations/s."""
        factor = self.arrival_rate / arrival_rate
        conversations = tuple(replace(c, start_s=c.start_s * factor) for c in self.conversations)
        return replace(self, conversations=conversations, arrival_rate=arrival_rate)

    def fingerprint(self) -> str:
        """sha256 over every request's content and timing: equal means identical replay."""
        digest = hashlib.sha256()
        for c in self.conversations:
            digest.update(f"{c.index}|{c.session_id}|{c.start_s:.9f}|{c.system}".encode())
            for t in c.turns:
                digest.update(f"|{t.user}|{t.reply}|{t.max_tokens}|{t.think_s:.9f}".encode())
                # How the answer is read; written only when not the default, so a streamed
                # turn read to its end keeps the fingerprint earlier results recorded.
                if not t.stream:
                    digest.update(b"|unstreamed")
                if t.stop_after is not None:
                    digest.update(f"|stop_after={t.stop_after}".encode())
        return digest.hexdigest()


class TextSource:
    """Seeded pseudo-words; texts of a given token length (4 characters a token)."""

    _SYLLABLES = ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "de", "po", "qu", "ze", "an")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        syl = self._SYLLABLES
        self.words = [a + b + c for a in syl for b in syl for c in syl]

    def text(self, tokens: int) -> str:
        chars = max(1, tokens) * CHARS_PER_TOKEN
        # Words average 6.5 chars with the space; draw enough, then cut to length.
        words = self.rng.choices(self.words, k=chars // 6 + 2)
        return " ".join(words)[:chars]


def _poisson_starts(rng: random.Random, count: int, rate: float) -> list[float]:
    t = 0.0
    out: list[float] = []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _think(rng: random.Random, mean_s: float) -> float:
    # Exponential, capped at 4x the mean so one unlucky draw cannot stretch a run.
    return min(rng.expovariate(1.0 / mean_s), 4 * mean_s) if mean_s > 0 else 0.0


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def _n(value: float, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(value * scale))


def _turns(
    rng: random.Random,
    text: TextSource,
    count: int,
    user_tokens: tuple[int, int],
    reply_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    think_s: float,
) -> tuple[Turn, ...]:
    """`count` turns; the draws happen in one fixed order, so a seed replays exactly."""
    return tuple(
        Turn(
            user=text.text(rng.randint(*user_tokens)),
            reply=text.text(rng.randint(*reply_tokens)),
            max_tokens=rng.randint(*max_tokens),
            think_s=_think(rng, think_s),
        )
        for _ in range(count)
    )


def multi_turn_chat(
    seed: int = 1,
    *,
    scale: float = 1.0,
    conversations: int = 200,
    turns: tuple[int, int] = (4, 10),
    system_tokens: int = 500,
    user_tokens: tuple[int, int] = (200, 600),
    reply_tokens: tuple[int, int] = (50, 200),
    max_tokens: tuple[int, int] = (8, 16),
    think_s: float = 0.25,
    arrival_rate: float = 40.0,
) -> Workload:
    """Conversations sharing one system prompt, each its own session, growing history."""
    rng = random.Random(f"chat:{seed}")
    text = TextSource(rng)
    count = _n(conversations, scale)
    system = "You are a helpful assistant. " + text.text(system_tokens)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = []
    for i in range(count):
        n_turns = rng.randint(*turns)
        convs.append(
            Conversation(
                index=i,
                session_id=f"chat-{seed}-{i:04d}",
                start_s=starts[i],
                system=system,
                turns=_turns(rng, text, n_turns, user_tokens, reply_tokens, max_tokens, think_s),
            )
        )
    return Workload(
        name="chat",
        seed=seed,
        description=f"{count} multi-turn conversations ({turns[0]}-{turns[1]} turns), "
        f"shared {system_tokens}-token system prompt, x-session-id per conversation",
        conversations=tuple(convs),
        arrival_rate=arrival_rate,
        params={"conversations": count, "think_s": think_s, "system_tokens": system_tokens},
    )


def hot_sessions(
    seed: int = 1,
    *,
    scale: float = 1.0,
    conversations: int = 200,
    users: int = 40,
    zipf_s: float = 1.3,
    turns: tuple[int, int] = (3, 8),
    context_tokens: tuple[int, int] = (800, 1500),
    user_tokens: tuple[int, int] = (100, 300),
    reply_tokens: tuple[int, int] = (50, 150),
    max_tokens: tuple[int, int] = (8, 16),
    think_s: float = 0.25,
    arrival_rate: float = 40.0,
) -> Workload:
    """Conversations keyed by a user id drawn from Zipf(s) over `users`: hot keys.

    Every user has a long context (its own system prompt) that all of its conversations
    start with, and the session header carries the *user* id, as affinity keyed on an
    account or API key does; the hottest user sends a large share of all requests.
    """
    rng = random.Random(f"hot:{seed}")
    text = TextSource(rng)
    count = _n(conversations, scale)
    contexts = [
        f"You are the assistant of account {u}. " + text.text(rng.randint(*context_tokens))
        for u in range(users)
    ]
    weights = _zipf_weights(users, zipf_s)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = []
    for i in range(count):
        user = rng.choices(range(users), weights=weights)[0]
        n_turns = rng.randint(*turns)
        convs.append(
            Conversation(
                index=i,
                session_id=f"user-{seed}-{user:03d}",
                start_s=starts[i],
                system=contexts[user],
                turns=_turns(rng, text, n_turns, user_tokens, reply_tokens, max_tokens, think_s),
            )
        )
    return Workload(
        name="hot",
        seed=seed,
        description=f"{count} conversations keyed by {users} users drawn Zipf(s={zipf_s}): "
        "a few session keys carry most traffic",
        conversations=tuple(convs),
        arrival_rate=arrival_rate,
        params={"conversations": count, "users": users, "zipf_s": zipf_s},
    )


def shared_prefixes(
    seed: int = 1,
    *,
    scale: float = 1.0,
    requests: int = 600,
    prefixes: int = 12,
    prefix_tokens: tuple[int, int] = (1500, 3000),
    question_tokens: tuple[int, int] = (50, 200),
    max_tokens: tuple[int, int] = (8, 16),
    zipf_s: float = 0.6,
    arrival_rate: float = 100.0,
) -> Workload:
    """Independent requests (no session) that start with one of a few long prompts."""
    rng = random.Random(f"prefix:{seed}")
    text = TextSource(rng)
    count = _n(requests, scale)
    systems = [
        f"Agent {p} instructions and retrieved documents. " + text.text(rng.randint(*prefix_tokens))
        for p in range(prefixes)
    ]
    weights = _zipf_weights(prefixes, zipf_s)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = tuple(
        Conversation(
            index=i,
            session_id=None,
            start_s=starts[i],
            system=systems[rng.choices(range(prefixes), weights=weights)[0]],
            turns=(
                Turn(
                    user=text.text(rng.randint(*question_tokens)),
                    reply="",
                    max_tokens=rng.randint(*max_tokens),
                    think_s=0.0,
                ),
            ),
        )
        for i in range(count)
    )
    return Workload(
        name="prefix",
        seed=seed,
        description=f"{count} independent requests, no session, {prefixes} shared "
        f"{prefix_tokens[0]}-{prefix_tokens[1]}-token system prompts",
        conversations=convs,
        arrival_rate=arrival_rate,
        params={"requests": count, "prefixes": prefixes},
    )


def mixed_lengths(
    seed: int = 1,
    *,
    scale: float = 1.0,
    conversations: int = 300,
    long_share: float = 0.25,
    chat_turns: tuple[int, int] = (2, 5),
    system_tokens: int = 300,
    user_tokens: tuple[int, int] = (30, 150),
    reply_tokens: tuple[int, int] = (30, 100),
    long_tokens: tuple[int, int] = (3000, 6000),
    max_tokens: tuple[int, int] = (8, 16),
    think_s: float = 0.25,
    arrival_rate: float = 40.0,
) -> Workload:
    """Short multi-turn chat (with sessions) mixed with long-context one-shot requests."""
    rng = random.Random(f"mixed:{seed}")
    text = TextSource(rng)
    count = _n(conversations, scale)
    system = "You are a concise assistant. " + text.text(system_tokens)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = []
    for i in range(count):
        if rng.random() < long_share:
            convs.append(
                Conversation(
                    index=i,
                    session_id=None,
                    start_s=starts[i],
                    system="Summarise the document. " + text.text(rng.randint(*long_tokens)),
                    turns=(
                        Turn(
                            user="What are the three main points?",
                            reply="",
                            max_tokens=rng.randint(*max_tokens),
                            think_s=0.0,
                        ),
                    ),
                )
            )
            continue
        convs.append(
            Conversation(
                index=i,
                session_id=f"mixed-{seed}-{i:04d}",
                start_s=starts[i],
                system=system,
                turns=_turns(
                    rng,
                    text,
                    rng.randint(*chat_turns),
                    user_tokens,
                    reply_tokens,
                    max_tokens,
                    think_s,
                ),
            )
        )
    return Workload(
        name="mixed",
        seed=seed,
        description=f"{count} arrivals: short chat ({chat_turns[0]}-{chat_turns[1]} turns) and "
        f"{long_share:.0%} long-context requests ({long_tokens[0]}-{long_tokens[1]} tokens)",
        conversations=tuple(convs),
        arrival_rate=arrival_rate,
        params={"conversations": count, "long_share": long_share},
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": multi_turn_chat,
    "hot": hot_sessions,
    "prefix": shared_prefixes,
    "mixed": mixed_lengths,
}


def build(name: str, seed: int = 1, scale: float = 1.0, **overrides: object) -> Workload:
    """The named workload; `scale` multiplies its size (conversations or requests)."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    return factory(seed, scale=scale, **overrides)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of unsorted values; NaN when empty. The rank
    is computed exactly (q as the decimal it is written as): in floats 0.14 * 50 is
    7.000000000000001, and its ceiling the wrong rank."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(Fraction(str(q)) * len(ordered) / 100))
    return ordered[rank - 1]


def quantile_interval(values: list[float], q: float, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free `level` confidence interval for the q-th percentile (q in
    (0, 100)) of what `values` sample: the order statistics between which a Binomial(n,
    q/100) count of values falls with that probability. NaNs when empty; at small n it
    widens to the sample's extremes and covers less (the p90's: 0.87 at 20 values, 0.64 at
    10; 0.95 from 29 on). It treats requests as independent draws: one run's requests
    share bursts, and runs differ by more than this (see `bench/routing.py --seeds`). On
    `bench/routing.py`'s cells (27-333 requests a seed) it spans -2 % / +5 % of the p90
    (prefill-heavy) to -22 % / +58 % (docs-hot-light); chat-history's ~160 requests: -13 %
    / +17 %. A lead of a few percent is no finding."""
    if not 0 < q < 100:
        raise ValueError(f"percentile {q} is not inside (0, 100)")
    if any(math.isnan(v) for v in values):
        raise ValueError("a NaN among the values: they have no order")
    n = len(values)
    if not n:
        return math.nan, math.nan
    ordered = sorted(values)
    p = q / 100
    tail = (1 - level) / 2
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    cdf, lo, hi = 0.0, -1, n - 1
    for k in range(n + 1):
        cdf += math.exp(
            log_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q
        )
        if lo < 0 and cdf > tail:
            lo = max(0, k - 1)
        if cdf >= 1 - tail:
            hi = min(n - 1, k)
            break
    return ordered[lo], ordered[hi]


__all__ = [
    "WORKLOADS",
    "Conversation",
    "TextSource",
    "Turn",
    "Workload",
    "build",
    "hot_sessions",
    "mixed_lengths",
    "multi_turn_chat",
    "percentile",
    "quantile_interval",
    "shared_prefixes",
]
