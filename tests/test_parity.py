"""The two edges make the same Decisions: one request sequence, one config, one seed, fed
through the Envoy ext_proc translation (`extproc.translate.Exchange`) and through the ASGI
middleware (`asgi.middleware.SchedulerMiddleware`), with identical outcomes fed back."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from asgi.middleware import DECISION_KEY, SchedulerMiddleware
from asgi.types import Message, Scope
from extproc.testing import parse, request_body, request_headers, response_headers
from extproc.translate import ASK_FOR_BODY, Exchange
from llmgw.config import Config, load_dict
from llmgw.gateway import Gateway
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, EngineMetrics

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 6)]
MODELS = {
    "chat": {"endpoints": ENDPOINTS, "strategy": "chat"},
    "ring": {"endpoints": ENDPOINTS[:3], "strategy": "ring"},
    "batch": {"endpoints": ENDPOINTS[2:], "strategy": "batch"},
    "p2c": {
        "endpoints": ENDPOINTS,
        "strategy": {"scorers": {"queue": 1, "kv": 1}, "picker": "p2c"},
    },
}
PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Call:
    headers: dict[str, str]
    body: bytes
    status: int  # what the "engine" answers, fed back through both edges


def config() -> Config:
    loaded: Config = load_dict({"models": MODELS, "seed": 11})
    return loaded


def scheduler(cfg: Config) -> Scheduler:
    registry = Registry(breaker=cfg.breaker.settings(), staleness=5.0, clock=lambda: 100.0)
    sched = Scheduler(cfg, registry, seed=11)
    rng = random.Random(5)
    for model in cfg.models:
        for state in registry.states(model):
            registry.record_scrape(
                model,
                state.id,
                EngineMetrics(
                    waiting=rng.randint(0, 8), running=rng.randint(0, 16), kv_usage=rng.random()
                ),
            )
    return sched


def calls(n: int = 300) -> list[Call]:
    rng = random.Random(1234)
    out: list[Call] = []
    for i in range(n):
        model = rng.choice([*MODELS, "missing"])
        headers = {"content-type": "application/json", "x-request-id": f"req-{i}"}
        if rng.random() < 0.6:
            headers["x-session-id"] = rng.choice(["alice", "bob", "carol", "dävid", f"s{i % 7}"])
        if rng.random() < 0.2:
            headers["x-llmgw-model"] = model
        prompt = rng.choice(["You are helpful.", "Translate:", "Summarise:"]) + " x" * rng.randint(
            0, 40
        )
        payload: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "q"}],
            "stream": rng.random() < 0.3,
        }
        body = orjson.dumps(payload)
        roll = rng.random()
        if roll < 0.03:
            body = b"{broken"
        elif roll < 0.05:
            body = b'{"messages": []}'
        status = rng.choice([200] * 8 + [429, 500, 503])
        out.append(Call(headers, body, status))
    return out


def through_extproc(sched: Scheduler, call: Call) -> tuple[str, Decision | bytes]:
    exchange = Exchange(Gateway(sched))
    answer = exchange.handle(request_headers({":method": "POST", ":path": PATH, **call.headers}))
    if answer == ASK_FOR_BODY:
        answer = exchange.handle(request_body(call.body))
    if exchange.decision is None:
        immediate = parse(answer).immediate_response
        return "error", f"{immediate.status.code} ".encode() + immediate.body
    decision = exchange.decision
    exchange.handle(response_headers(call.status, end_of_stream=True))
    return "decision", decision


async def through_middleware(app: SchedulerMiddleware, call: Call) -> tuple[str, Decision | bytes]:
    seen: list[Decision] = []
    sent: list[Message] = []

    async def inner(scope: Scope, receive: Any, send: Any) -> None:
        seen.append(scope["state"][DECISION_KEY])
        await send({"type": "http.response.start", "status": call.status, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app.app = inner
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in call.headers.items()],
    }
    await app(scope, receive, send)
    if not seen:
        return "error", f"{sent[0]['status']} ".encode() + sent[1]["body"]
    return "decision", seen[0]


async def _replaced_per_call(scope: Scope, receive: Any, send: Any) -> None:
    raise AssertionError("through_middleware installs the inner app of each call")


@pytest.mark.parametrize("count", [300])
async def test_both_edges_make_identical_decisions(count: int) -> None:
    cfg = config()
    envoy_side, asgi_side = scheduler(cfg), scheduler(cfg)
    middleware = SchedulerMiddleware(_replaced_per_call, cfg, scheduler=asgi_side)
    decisions = errors = 0
    for i, call in enumerate(calls(count)):
        via_envoy = through_extproc(envoy_side, call)
        via_asgi = await through_middleware(middleware, call)
        assert via_envoy == via_asgi, f"call {i} differs: {call}"
        if via_envoy[0] == "decision":
            decisions += 1
        else:
            errors += 1
    assert decisions > count // 2 and errors > 0  # both paths were exercised
    for model in cfg.models:
        a = [(s.id, s.inflight, s.breaker.state) for s in envoy_side.registry.states(model)]
        b = [(s.id, s.inflight, s.breaker.state) for s in asgi_side.registry.states(model)]
        assert a == b
