"""A session's home is credited its history past the kept prefix also when that prefix is
all a system prompt many sessions share (found by a review helper)."""

from __future__ import annotations

import dataclasses
import json
import random

from llmgw.registry import Registry
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Outcome, RequestInfo

from .helpers import FakeClock, config

EPS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


def _request(scheduler: Scheduler, messages: list[dict[str, str]], sid: str) -> RequestInfo:
    body = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
    return build_request(scheduler.config, {"x-session-id": sid}, "/v1/chat/completions", body)


def _serve(scheduler: Scheduler, clock: FakeClock, decision: Decision) -> None:
    lease = scheduler.acquire(decision)
    clock.advance(0.2)
    lease.first_token()
    lease.end(Outcome.SUCCESS)


def _cached(decision: Decision, endpoint_id: str) -> float:
    rationale = decision.rationale
    i = rationale.endpoint_ids.index(endpoint_id)
    (column,) = [c for c in rationale.columns if c.name == "latency"]
    return column.terms_at(i)["cached_tokens"]


def test_a_long_history_behind_a_shared_system_prompt_longer_than_the_kept_prefix() -> None:
    """Every session of an agent starts with the same 40 KB system prompt (past the 32 KB
    kept prefix: the index hashes nothing but it), and other sessions have put it on both
    replicas. Session s1's home holds its ~40k-token history; the next turn, with a 2.5 s
    queue at the home, reads ~30k tokens uncached there (only the shared 8k credited) and
    leaves for the replica holding none of its history."""
    clock = FakeClock(1000.0)
    scheduler = Scheduler(
        config({"m": {"endpoints": EPS, "strategy": "latency"}}), Registry(clock=clock)
    )
    rng = random.Random(1)
    system = {"role": "system", "content": _words(rng, 5_000)}  # ~40 KB of characters
    for i in range(6):  # other sessions of the agent, on both replicas
        request = _request(scheduler, [system, {"role": "user", "content": f"task {i}"}], f"o{i}")
        request = dataclasses.replace(request, subset=frozenset({EPS[i % 2]}))
        _serve(scheduler, clock, scheduler.pick(request))
        clock.advance(0.5)
    history = [system, {"role": "user", "content": _words(rng, 15_000)}]  # ~40k tokens in all
    first = scheduler.pick(_request(scheduler, history, "s1"))
    home = first.endpoint.id
    _serve(scheduler, clock, first)
    clock.advance(1.0)
    history += [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "next question please"},
    ]
    scheduler.registry.add_prefill("m", home, 25_000.0)
    request = _request(scheduler, history, "s1")
    decision = scheduler.pick(request)
    assert request.prompt_tokens > 35_000
    assert _cached(decision, home) >= request.prompt_tokens - 100, (
        f"home {home} credited {_cached(decision, home):.0f} of {request.prompt_tokens}; "
        f"picked {decision.endpoint.id}"
    )
    assert decision.endpoint.id == home, [
        decision.rationale.summary(e) for e in decision.rationale.endpoint_ids
    ]
