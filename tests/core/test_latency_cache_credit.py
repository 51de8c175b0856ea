"""The latency scorer credits a home with what it holds of prompts the index hashes only in
part (past the kept prefix, behind a tools digest) and with nothing where caching is off."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from llmgw.promtext import CONTRACTS, extract
from llmgw.registry import Registry
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Engine, Outcome, RequestInfo

from .helpers import FakeClock, config

VLLM = CONTRACTS[Engine.VLLM]
EPS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


def _setup() -> tuple[Scheduler, FakeClock]:
    clock = FakeClock(1000.0)
    cfg = config({"m": {"endpoints": EPS, "strategy": "latency"}})
    return Scheduler(cfg, Registry(clock=clock)), clock


def _request(
    scheduler: Scheduler, messages: list[dict[str, str]], sid: str, tools: list[Any] | None = None
) -> RequestInfo:
    """As an edge builds it (the config's limits: the kept prompt prefix included)."""
    payload: dict[str, Any] = {"model": "m", "messages": messages, "stream": True}
    if tools is not None:
        payload["tools"] = tools
    body = json.dumps(payload).encode()
    return build_request(scheduler.config, {"x-session-id": sid}, "/v1/chat/completions", body)


def _serve(scheduler: Scheduler, clock: FakeClock, decision: Decision) -> None:
    """The request runs there: its first token is seen, then it ends."""
    lease = scheduler.acquire(decision)
    clock.advance(0.2)
    lease.first_token()
    lease.end(Outcome.SUCCESS)


def _cached(decision: Decision, endpoint_id: str) -> float:
    rationale = decision.rationale
    i = rationale.endpoint_ids.index(endpoint_id)
    (column,) = [c for c in rationale.columns if c.name == "latency"]
    return column.terms_at(i)["cached_tokens"]


def _next_turn(
    scheduler: Scheduler,
    clock: FakeClock,
    messages: list[dict[str, str]],
    sid: str,
    queued: float,
    tools: list[Any] | None = None,
) -> tuple[str, RequestInfo, Decision]:
    """A session's turn is served at its home; a second turn comes while `queued` prefill
    tokens wait there: (the home, the second turn, its pick)."""
    first = scheduler.pick(_request(scheduler, messages, sid, tools))
    home = first.endpoint.id
    _serve(scheduler, clock, first)
    clock.advance(1.0)
    messages += [
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "thanks, now the next question"},
    ]
    scheduler.registry.add_prefill("m", home, queued)
    second = _request(scheduler, messages, sid, tools)
    return home, second, scheduler.pick(second)


def _stays_home(home: str, request: RequestInfo, decision: Decision) -> None:
    """The home holds all but the new turn (a few tokens), is credited so, and is picked."""
    assert _cached(decision, home) >= request.prompt_tokens - 100, (
        f"home {home} credited {_cached(decision, home):.0f} of {request.prompt_tokens}; "
        f"picked {decision.endpoint.id}"
    )
    assert decision.endpoint.id == home, [
        decision.rationale.summary(e) for e in decision.rationale.endpoint_ids
    ]


def test_a_long_history_is_credited_as_cached_past_the_kept_prompt_prefix() -> None:
    """A conversation longer than `limits.prompt_prefix_chars` (32 KB, ~8k tokens): its
    home holds the whole history, but the index hashes only the kept prefix, so every
    token past it reads as uncached there. The home is charged a phantom prefill of the
    whole tail (predicted TTFT seconds too long, that work queued at the home for the
    requests behind it), and the session leaves a home holding 59k tokens for a cold
    replica as soon as the home's queue passes ~8k tokens' prefill."""
    scheduler, clock = _setup()
    rng = random.Random(1)
    history = [{"role": "user", "content": _words(rng, 30_000)}]  # ~59k tokens
    # Another request's 25k-token prompt waits at the home (2.5 s at the default price);
    # the other replica is idle but holds nothing of this history (5.9 s of prefill).
    home, request, decision = _next_turn(scheduler, clock, history, "s1", 25_000.0)
    assert request.prompt_tokens > 50_000
    _stays_home(home, request, decision)


def _page(prompt_total: float) -> str:
    """A vLLM started with prefix caching off (`--no-enable-prefix-caching`, or a model
    vLLM cannot cache): it publishes its KV size and counts every prompt token, no hit."""
    return (
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:num_requests_running{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
        f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_total}\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 0\n'
        'vllm:cache_config_info{engine="0",block_size="16",enable_prefix_caching="False",'
        'num_gpu_blocks="20000"} 1.0\n'
    )


def test_an_engine_with_prefix_caching_off_is_not_credited_hits_for_ever() -> None:
    """vLLM with prefix caching off still publishes `cache_config_info` (its KV size, and
    `enable_prefix_caching="False"`) and a hit counter that stays at 0. With the KV size
    known, `_fit_capacity` never runs, so the index keeps crediting a session's home with
    its whole history however many prompts the engine counted without one hit
    (`llmgw_prefix_hits_confirmed` reads 0): sessions stay on a queued home that will
    prefill everything again, and the predicted TTFT there is the queue alone.
    (`test_an_engine_that_caches_nothing_empties_the_index_there` covers only an engine
    that hides its KV size.)"""
    scheduler, clock = _setup()
    registry = scheduler.registry
    totals = dict.fromkeys(EPS, 0.0)

    def scrape_all() -> None:
        for e in EPS:
            registry.record_scrape("m", e, extract(_page(totals[e]), VLLM, model="m"))

    scrape_all()
    rng = random.Random(1)
    messages = [{"role": "user", "content": _words(rng, 2000)}]  # ~4k tokens
    home = None
    for _ in range(12):
        request = _request(scheduler, messages, "s1")
        clock.advance(0.5)
        decision = scheduler.pick(request)
        home = home or decision.endpoint.id
        _serve(scheduler, clock, decision)
        totals[decision.endpoint.id] += request.prompt_tokens  # computed whole: no hit
        scrape_all()
        messages += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": _words(rng, 20)},
        ]
    assert home is not None
    # Another request's 6k-token prompt waits at the home (0.6 s); the other replica is
    # idle, and prefilling the ~4.4k-token history costs the same on both.
    registry.add_prefill("m", home, 6_000.0)
    clock.advance(0.1)
    decision = scheduler.pick(_request(scheduler, messages, "s1"))
    assert decision.endpoint.id != home, [
        decision.rationale.summary(e) for e in decision.rationale.endpoint_ids
    ]
    assert _cached(decision, home) == 0


def test_an_agents_tool_list_counts_as_cached_at_its_home() -> None:
    """The tools' schemas are hashed as a 25-character digest (`request.prompt_parts`) but
    counted whole in `prompt_tokens` (25 KB: ~6k tokens). The index credits a home with
    what its blocks span in characters (depth x 64 tokens), so an agent's home holding its
    tools and whole conversation is credited 64 tokens, and the ~6k tokens of tools read
    as uncached there as everywhere: the session leaves its home for a cold replica at a
    0.3 s queue, to prefill 0.6 s of tokens the home held. (Media parts are padded to
    their token weight for this reason; the tools' digest is not.)"""
    scheduler, clock = _setup()
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Does a thing. " * 30,
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg{j}": {"type": "string", "description": "an argument"}
                        for j in range(5)
                    },
                },
            },
        }
        for i in range(30)
    ]
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "fix the bug in foo.py " * 20},
    ]
    # 0.3 s queued at the home
    home, second, decision = _next_turn(scheduler, clock, messages, "agent-1", 3_000.0, tools)
    assert second.prompt_tokens > 5_000
    _stays_home(home, second, decision)


def test_a_long_history_behind_a_shared_system_prompt_longer_than_the_kept_prefix() -> None:
    """Every session of an agent starts with the same 40 KB system prompt (past the 32 KB
    kept prefix: the index hashes nothing but it), and other sessions have put it on both
    replicas. Session s1's home holds its ~40k-token history; the next turn, with a 2.5 s
    queue at the home, read ~30k tokens uncached there (only the shared 8k credited) and
    left for the replica holding none of its history (found by a review helper)."""
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
    home, request, decision = _next_turn(scheduler, clock, history, "s1", 25_000.0)
    assert request.prompt_tokens > 35_000
    _stays_home(home, request, decision)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "Does a thing. " * 60,
            "parameters": {
                "type": "object",
                "properties": {
                    f"arg{j}": {"type": "string", "description": "an argument"} for j in range(5)
                },
            },
        },
    }
    for i in range(30)
]  # ~37 KB of schemas (~9k tokens): an agent with a few MCP servers


def test_a_tool_list_past_the_kept_prefix_still_leaves_the_conversation_in_the_prompt() -> None:
    """Two sessions of the agent with different conversations must not read as one prefix."""
    scheduler = Scheduler(config({"m": {"endpoints": EPS, "strategy": "latency"}}))
    one = _request(scheduler, [{"role": "user", "content": "fix the bug in foo.py"}], "a", TOOLS)
    two = _request(scheduler, [{"role": "user", "content": "write docs for bar.py"}], "b", TOOLS)
    assert one.prompt != two.prompt, f"both read {one.prompt!r}"


def test_an_agent_with_a_large_tool_list_is_credited_its_history_at_its_home() -> None:
    """As `test_an_agents_tool_list_counts_as_cached_at_its_home`, with 37 KB of tools
    instead of 25 KB: past the kept prefix, the tools digest was all the text kept. The
    home, holding the tools and the whole conversation, was credited nothing, and the
    session left it for a cold replica at a 0.3 s queue (found by a review helper)."""
    clock = FakeClock(1000.0)
    scheduler = Scheduler(
        config({"m": {"endpoints": EPS, "strategy": "latency"}}), Registry(clock=clock)
    )
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "fix the bug in foo.py " * 20},
    ]
    home, second, decision = _next_turn(scheduler, clock, messages, "agent-1", 3_000.0, TOOLS)
    assert second.prompt_tokens > 9_000
    _stays_home(home, second, decision)
