"""Extra seeded workloads for the regime grid (`bench/fleetsim_grid.py`).

Same shapes and conventions as `bench/workloads` (conversations of turns, Poisson
starts, 4 characters a token, one fixed draw order so a seed replays byte-identically):

- `docs`: independent long documents (no session, nothing shared but a short
  instruction): prefill-heavy with no cache to win, the regime where only load matters.
- `decode`: short prompts with long answers and no session: decode-heavy, batch slots
  and decode steps are the bottleneck, prefix caching barely matters.
- `chat-long`: multi-turn chat with long growing histories (4-8 turns, ~1 s think time,
  long replies in the history): the regime where plain consistent hashing is strong.
- `chat-short`: short multi-turn chat (2-5 turns, short messages).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.workloads import (
    Conversation,
    TextSource,
    Turn,
    Workload,
    _n,
    _poisson_starts,
    multi_turn_chat,
)


def _single(index: int, start: float, system: str, user: str, max_tokens: int) -> Conversation:
    turn = Turn(user=user, reply="", max_tokens=max_tokens, think_s=0.0)
    return Conversation(index, None, start, system, (turn,))


def long_documents(
    seed: int = 1,
    *,
    scale: float = 1.0,
    requests: int = 300,
    doc_tokens: tuple[int, int] = (1500, 4000),
    max_tokens: tuple[int, int] = (16, 64),
    arrival_rate: float = 10.0,
) -> Workload:
    """Independent requests, each a unique long document plus a short question."""
    rng = random.Random(f"docs:{seed}")
    text = TextSource(rng)
    count = _n(requests, scale)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = tuple(
        _single(
            i,
            starts[i],
            f"Document {i}. " + text.text(rng.randint(*doc_tokens)),
            "Summarise the document in three points.",
            rng.randint(*max_tokens),
        )
        for i in range(count)
    )
    return Workload(
        name="docs",
        seed=seed,
        description=f"{count} unique {doc_tokens[0]}-{doc_tokens[1]}-token documents, no session",
        conversations=convs,
        arrival_rate=arrival_rate,
        params={"requests": count},
    )


def decode_heavy(
    seed: int = 1,
    *,
    scale: float = 1.0,
    requests: int = 400,
    system_tokens: int = 100,
    user_tokens: tuple[int, int] = (30, 200),
    max_tokens: tuple[int, int] = (150, 400),
    arrival_rate: float = 10.0,
) -> Workload:
    """Short prompts (one short shared system prompt), long answers, no session."""
    rng = random.Random(f"decode:{seed}")
    text = TextSource(rng)
    count = _n(requests, scale)
    system = "You are a storyteller. " + text.text(system_tokens)
    starts = _poisson_starts(rng, count, arrival_rate)
    convs = tuple(
        _single(
            i, starts[i], system, text.text(rng.randint(*user_tokens)), rng.randint(*max_tokens)
        )
        for i in range(count)
    )
    return Workload(
        name="decode",
        seed=seed,
        description=f"{count} short prompts with {max_tokens[0]}-{max_tokens[1]}-token answers",
        conversations=convs,
        arrival_rate=arrival_rate,
        params={"requests": count},
    )


def chat_long(seed: int = 1, *, scale: float = 1.0, **overrides: object) -> Workload:
    """Multi-turn chat, long growing histories, ~1 s think time (consistent hashing's home)."""
    params: dict[str, object] = {
        "conversations": 100,
        "turns": (4, 8),
        "system_tokens": 400,
        "user_tokens": (100, 300),
        "reply_tokens": (150, 350),
        "max_tokens": (16, 48),
        "think_s": 1.0,
        "arrival_rate": 4.0,
    }
    params.update(overrides)
    return multi_turn_chat(seed, scale=scale, **params)  # type: ignore[arg-type]


def chat_short(seed: int = 1, *, scale: float = 1.0, **overrides: object) -> Workload:
    """Short multi-turn chat: small system prompt, short messages, 2-5 turns."""
    params: dict[str, object] = {
        "conversations": 200,
        "turns": (2, 5),
        "system_tokens": 150,
        "user_tokens": (20, 100),
        "reply_tokens": (30, 120),
        "max_tokens": (16, 64),
        "think_s": 1.0,
        "arrival_rate": 10.0,
    }
    params.update(overrides)
    return multi_turn_chat(seed, scale=scale, **params)  # type: ignore[arg-type]


REGIMES: dict[str, Callable[..., Workload]] = {
    "docs": long_documents,
    "decode": decode_heavy,
    "chat-long": chat_long,
    "chat-short": chat_short,
}
