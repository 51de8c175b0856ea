"""An agent whose tool list is larger than the kept prompt prefix keeps its conversation in
the prompt text (it kept the tools digest alone: every session was one prefix; found by a
review helper)."""

from __future__ import annotations

import json

from llmgw.registry import Registry
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Outcome, RequestInfo

from .helpers import FakeClock, config

EPS = ["10.0.0.1:8000", "10.0.0.2:8000"]
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


def _request(scheduler: Scheduler, messages: list[dict[str, str]], sid: str) -> RequestInfo:
    body = json.dumps({"model": "m", "messages": messages, "tools": TOOLS, "stream": True})
    return build_request(
        scheduler.config, {"x-session-id": sid}, "/v1/chat/completions", body.encode()
    )


def test_a_tool_list_past_the_kept_prefix_still_leaves_the_conversation_in_the_prompt() -> None:
    """Two sessions of the agent with different conversations must not read as one prefix."""
    scheduler = Scheduler(config({"m": {"endpoints": EPS, "strategy": "latency"}}))
    one = _request(scheduler, [{"role": "user", "content": "fix the bug in foo.py"}], "a")
    two = _request(scheduler, [{"role": "user", "content": "write docs for bar.py"}], "b")
    assert one.prompt != two.prompt, f"both read {one.prompt!r}"


def test_an_agent_with_a_large_tool_list_is_credited_its_history_at_its_home() -> None:
    """As `test_an_agents_tool_list_counts_as_cached_at_its_home` (tests/core/
    test_latency_cache_credit.py), with 37 KB of tools instead of 25 KB: the home, holding
    the tools and the whole conversation, is credited nothing, and the session leaves it
    for a cold replica at a 0.3 s queue."""
    clock = FakeClock(1000.0)
    scheduler = Scheduler(
        config({"m": {"endpoints": EPS, "strategy": "latency"}}), Registry(clock=clock)
    )
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "fix the bug in foo.py " * 20},
    ]
    first = scheduler.pick(_request(scheduler, messages, "agent-1"))
    home = first.endpoint.id
    _serve(scheduler, clock, first)
    clock.advance(1.0)
    messages += [
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "thanks, now run the tests"},
    ]
    scheduler.registry.add_prefill("m", home, 3_000.0)  # 0.3 s queued at the home
    second = _request(scheduler, messages, "agent-1")
    decision = scheduler.pick(second)
    assert second.prompt_tokens > 9_000
    assert _cached(decision, home) >= second.prompt_tokens - 100, (
        f"home credited {_cached(decision, home):.0f} of {second.prompt_tokens}; "
        f"picked {decision.endpoint.id} (home {home})"
    )
