"""The two edges make the same Decisions: one request sequence, one config, one seed, fed
through the Envoy ext_proc translation (`llmgw.extproc.translate.Exchange`) and through the ASGI
middleware (`llmgw.asgi.middleware.SchedulerMiddleware`), with identical outcomes fed back."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.middleware import DECISION_KEY, DISPATCH_KEY, SchedulerMiddleware
from llmgw.asgi.types import Message, Scope
from llmgw.config import Config, load_dict
from llmgw.extproc.server import ExtProcServer
from llmgw.extproc.translate import ASK_FOR_BODY, Answer, Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import AwaitActivation
from llmgw.registry import Registry
from llmgw.runtime.driver import activate
from llmgw.runtime.router import Router
from llmgw.runtime.telemetry import Telemetry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.testing.extproc import (
    parse,
    request_body,
    request_headers,
    response_headers,
    set_headers,
)
from llmgw.types import Decision, Endpoint, EngineMetrics, Outcome

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
    return through_extproc_gateway(Gateway(sched), call)


def through_extproc_gateway(gateway: Gateway, call: Call) -> tuple[str, Decision | bytes]:
    exchange = Exchange(gateway)
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


# -- on-demand activation, fallbacks and reload, through both edges -------------------------


class StartingControlPlane:
    """Starts every model at once on one address; counts starts."""

    def __init__(self) -> None:
        self.wants = 0

    async def want(self, model: str) -> list[Endpoint]:
        self.wants += 1
        return [Endpoint(address="127.0.0.1:9", model=model)]

    async def stop(self, model: str) -> None:
        return None

    def status(self, model: str) -> dict[str, object]:
        return {"wants": self.wants}

    def on_crash(self, callback: Any) -> None:
        return None

    async def close(self) -> None:
        return None


Inner = Callable[[Scope, Any, Any], Awaitable[None]]


async def asgi_request(app: SchedulerMiddleware, headers: dict[str, str], inner: Inner) -> int:
    """One request through the middleware with `inner` as the app; the status sent."""
    sent: list[Message] = []
    app.app = inner
    body = orjson.dumps({"model": headers["x-llmgw-model"], "messages": []})

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


def answering(status: int, seen: list[Decision], fall_back: bool = False) -> Inner:
    async def inner(scope: Scope, receive: Any, send: Any) -> None:
        seen.append(scope["state"][DECISION_KEY])
        if fall_back:  # the first endpoint refused: the edge retries on the next one
            assert scope["state"][DISPATCH_KEY].fall_back(Outcome.FAILURE) is not None
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return inner


def envoy_answer(exchange: Exchange, headers: dict[str, str]) -> Answer | AwaitActivation:
    answer = exchange.handle(request_headers({":method": "POST", ":path": PATH, **headers}))
    if answer == ASK_FOR_BODY:
        body = orjson.dumps({"model": headers["x-llmgw-model"], "messages": []})
        answer = exchange.handle(request_body(body))
    return answer


def lazy_config() -> Config:
    loaded: Config = load_dict(
        {
            "seed": 11,
            "activation_poll_interval": 0.01,
            "models": {
                **MODELS,
                "lazy": {"launch": {"command": "true {port}"}, "scaling": {"min": 0, "max": 1}},
            },
        }
    )
    return loaded


async def test_on_demand_model_is_started_once_and_routed_alike_on_both_edges() -> None:
    headers = {"x-llmgw-model": "lazy", "x-request-id": "cold"}
    envoy_plane, asgi_plane = StartingControlPlane(), StartingControlPlane()
    envoy_router = Router(lazy_config(), control_plane=envoy_plane, scrape=False)
    asgi_router = Router(lazy_config(), control_plane=asgi_plane, scrape=False)

    exchange = Exchange(envoy_router.gateway)
    pending = envoy_answer(exchange, headers)
    assert pending == AwaitActivation("lazy")  # a typed event, not an in-band answer
    answer = exchange.answer(await activate(exchange.lifecycle, pending))
    via_envoy = set_headers(parse(answer))["x-gateway-destination-endpoint"].split(",")[0]

    seen: list[Decision] = []
    middleware = SchedulerMiddleware(_replaced_per_call, asgi_router.config, router=asgi_router)
    assert await asgi_request(middleware, headers, answering(200, seen)) == 200
    assert via_envoy == seen[0].endpoint.address == "127.0.0.1:9"
    assert envoy_plane.wants == asgi_plane.wants == 1
    exchange.handle(response_headers(200, end_of_stream=True))
    for router in (envoy_router, asgi_router):
        assert router.activator is not None
        assert router.activator.machines["lazy"].in_use == 0  # the request's use ended
        await router.stop()


def outcomes(telemetry: Telemetry, model: str, endpoint: str) -> dict[str, float]:
    return {
        outcome.value: telemetry.registry.get_sample_value(
            "llmgw_outcomes_total",
            {"model": model, "endpoint": endpoint, "outcome": outcome.value},
        )
        or 0.0
        for outcome in Outcome
    }


async def test_a_fallback_charges_the_same_endpoints_on_both_edges() -> None:
    cfg = config()
    envoy_side, asgi_side = scheduler(cfg), scheduler(cfg)
    envoy_telemetry, asgi_telemetry = Telemetry(), Telemetry()
    headers = {"x-llmgw-model": "chat", "x-session-id": "alice", "x-request-id": "fb"}

    exchange = Exchange(Gateway(envoy_side), envoy_telemetry.hooks("extproc"))
    parse(envoy_answer(exchange, headers))
    decision = exchange.decision
    assert decision is not None and decision.fallbacks
    fallback = decision.fallbacks[0].address  # Envoy retried there (x-llmgw-upstream)
    exchange.handle(response_headers(200, end_of_stream=True, upstream=fallback))

    seen: list[Decision] = []
    middleware = SchedulerMiddleware(
        _replaced_per_call, cfg, scheduler=asgi_side, telemetry=asgi_telemetry
    )
    assert await asgi_request(middleware, headers, answering(200, seen, fall_back=True)) == 200
    assert seen[0] == decision
    for endpoint in (decision.endpoint.address, fallback):
        via_envoy = outcomes(envoy_telemetry, "chat", endpoint)
        assert via_envoy == outcomes(asgi_telemetry, "chat", endpoint)
    assert outcomes(envoy_telemetry, "chat", fallback)["success"] == 1
    assert outcomes(envoy_telemetry, "chat", decision.endpoint.address)["failure"] == 1


async def test_a_reload_applies_alike_on_both_edges() -> None:
    cfg = config()
    envoy_router = Router.bare(scheduler(cfg))
    asgi_router = Router.bare(scheduler(cfg))
    middleware = SchedulerMiddleware(_replaced_per_call, cfg, router=asgi_router)
    smaller = load_dict({"models": {**MODELS, "chat": {"endpoints": ENDPOINTS[:2]}}, "seed": 11})
    envoy_router.reload(smaller)
    asgi_router.reload(smaller)
    routed_chat = 0
    for i, call in enumerate(calls(60)):
        via_envoy = through_extproc_gateway(envoy_router.gateway, call)
        via_asgi = await through_middleware(middleware, call)
        assert via_envoy == via_asgi, f"call {i} differs after the reload: {call}"
        decision = via_envoy[1]
        if isinstance(decision, Decision) and decision.model == "chat":
            assert decision.endpoint.address in ENDPOINTS[:2]
            routed_chat += 1
    assert routed_chat > 0


async def test_both_edges_answer_the_model_catalog_and_health_paths_alike() -> None:
    cfg = lazy_config()
    envoy_side = ExtProcServer(cfg, scrape=False)
    proxy = ProxyApp(cfg, scrape=False)
    transport = httpx.ASGITransport(app=proxy)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        for path in ("/v1/models", "/v1/models/lazy", "/v1/models/gone", "/health", "/healthz"):
            via_envoy = envoy_side.local_answer(path)
            assert via_envoy is not None, path
            reply = await client.get(path)
            assert (reply.status_code, reply.json()) == (via_envoy[0], orjson.loads(via_envoy[1]))
        entry = (await client.get("/v1/models/lazy")).json()
        assert entry["llmgw"] == {"mode": "on_demand", "state": "off"}  # as the list says
        assert (await client.get("/v1/models/gone")).json()["error"]["code"] == "model_not_found"
        status = await client.get("/models/status")  # the ext_proc health port's route
        assert status.json() == envoy_side.router.models_status()
        assert (await client.post("/v1/models/lazy")).status_code == 405
