"""SchedulerMiddleware inside a user's app: a prefix mount, the app's own CORS middleware,
state shared with outer middleware, an inner app that does not speak lifespan."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from llmgw.asgi.middleware import SchedulerMiddleware
from llmgw.asgi.testing import (
    DEADLINE,
    MODEL,
    ScriptedUpstream,
    answer_ok,
    make_config,
    serve,
)
from llmgw.asgi.types import Receive, Scope, Send
from llmgw.scheduling.scheduler import Scheduler

ADDRESSES = ["127.0.0.1:9101", "127.0.0.1:9102"]
CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


async def routed_echo(request: Request) -> Response:
    """An app's handler that forwards by itself: it needs the middleware's Decision."""
    decision = request.state.llmgw_decision
    return JSONResponse({"endpoint": decision.endpoint.address})


# -- 1. a prefix mount / --root-path: the middleware never routes --------------------------


def test_a_mounted_app_is_routed_below_its_root_path() -> None:
    """ASGI `path` includes `root_path` (uvicorn `--root-path`, Starlette `Mount`): the
    middleware matches the full path against the inference paths, so an app mounted at
    `/llm` is never routed, and its handler finds no Decision (500)."""
    config = make_config(ADDRESSES)
    inner = Starlette(routes=[Route(CHAT, routed_echo, methods=["POST"])])
    app = Starlette(
        routes=[Mount("/llm", app=SchedulerMiddleware(inner, config, scheduler=Scheduler(config)))]
    )
    client = TestClient(app, raise_server_exceptions=False)
    reply = client.post("/llm" + CHAT, content=BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["endpoint"] in ADDRESSES


async def test_uvicorn_root_path_requests_are_routed() -> None:
    """The same with `uvicorn --root-path /llm` (an ingress that strips the prefix): scope
    path `/llm/v1/chat/completions`, root_path `/llm`."""
    config = make_config(ADDRESSES)
    inner = Starlette(routes=[Route(CHAT, routed_echo, methods=["POST"])])
    middleware = SchedulerMiddleware(inner, config, scheduler=Scheduler(config))

    async def with_root_path(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":  # what uvicorn --root-path /llm hands the app
            scope = dict(scope, root_path="/llm", path="/llm" + scope["path"])
        await middleware(scope, receive, send)

    async with (
        serve(with_root_path, lifespan="off") as base,
        httpx.AsyncClient(base_url=base, timeout=DEADLINE) as client,
    ):
        reply = await client.post(CHAT, content=BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["endpoint"] in ADDRESSES


# -- 2. a browser's CORS preflight is refused 405 before the app's CORS middleware --------


def test_a_cors_preflight_reaches_the_apps_cors_middleware() -> None:
    """`cors=False` says "an app's own CORS middleware decides", but the middleware answers
    a preflight (OPTIONS) on an inference path 405 itself: a browser page can never POST
    to the app when its CORSMiddleware sits inside SchedulerMiddleware."""
    config = make_config(ADDRESSES)
    app = Starlette(routes=[Route(CHAT, routed_echo, methods=["POST"])])
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]
    )
    app.add_middleware(SchedulerMiddleware, config=config, scheduler=Scheduler(config))
    client = TestClient(app)
    reply = client.options(
        CHAT,
        headers={
            "origin": "http://localhost:3000",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers.get("access-control-allow-origin") == "*"


def test_with_cors_on_the_middleware_answers_a_preflight_as_vllm_does() -> None:
    config = make_config(ADDRESSES)
    inner = Starlette(routes=[Route(CHAT, routed_echo, methods=["POST"])])
    app = SchedulerMiddleware(inner, config, scheduler=Scheduler(config), cors=True)
    asked = {"origin": "http://localhost:3000", "access-control-request-method": "POST"}
    reply = TestClient(app).options(CHAT, headers=asked)
    assert reply.status_code == 200
    assert "POST" in reply.headers["access-control-allow-methods"]
    # Not a preflight (no Origin): still llmgw's 405, saying what to send.
    reply = TestClient(app).options(CHAT, headers={"access-control-request-method": "POST"})
    assert reply.status_code == 405


# -- 3. scope["state"] replaced by a copy: the app's state is lost to outer middleware ---


def test_state_set_by_the_handler_is_seen_by_an_outer_middleware() -> None:
    """Starlette shares `scope["state"]` (request.state) across middleware by reference; the
    middleware hands the inner app a copy, so what a handler sets (and the Decision
    itself) is invisible to an outer logging/auth middleware."""
    config = make_config(ADDRESSES)
    seen: dict[str, Any] = {}

    async def chat(request: Request) -> Response:
        request.state.user = "alice"
        return JSONResponse({})

    class Log(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            response = await call_next(request)
            seen["user"] = getattr(request.state, "user", None)
            seen["decision"] = getattr(request.state, "llmgw_decision", None)
            return response

    app = Starlette(routes=[Route(CHAT, chat, methods=["POST"])])
    app.add_middleware(SchedulerMiddleware, config=config, scheduler=Scheduler(config))
    app.add_middleware(Log)  # outermost
    assert TestClient(app).post(CHAT, content=BODY).status_code == 200
    assert seen["user"] == "alice"
    assert seen["decision"] is not None


# -- 4. an inner app without lifespan support: the router never starts --------------------


async def test_the_router_starts_even_if_the_inner_app_has_no_lifespan() -> None:
    """`SchedulerMiddleware(any_asgi_app, config=config)` starts its router only from inside
    the inner app's `receive()` for `lifespan.startup`. An app that does not speak lifespan
    (Django's ASGIHandler raises for it; many bare apps return) never calls it: no scraper,
    no discovery, no activator ever runs, silently (the endpoint is never scraped)."""

    upstream = await ScriptedUpstream(answer_ok).start()

    async def django_like(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = SchedulerMiddleware(django_like, config=make_config([upstream.address]))
    try:
        async with serve(app, lifespan="auto") as base, httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/")).status_code == 200  # the server is up: started
            assert app.router._started, "the middleware's own router was never started"
            # Started, it scrapes the engine (scrape.interval 0.1 s): a timeout fails here.
            await asyncio.wait_for(upstream.received.wait(), DEADLINE)
    finally:
        await upstream.stop()
    assert [r.target for r in upstream.requests][:1] == ["/metrics"]
