"""SchedulerMiddleware in Starlette and FastAPI apps (TestClient) and as bare ASGI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from llmgw.asgi.middleware import DECISION_KEY, DISPATCH_KEY, SchedulerMiddleware
from llmgw.asgi.testing import MODEL, make_config
from llmgw.asgi.types import Message, Scope
from llmgw.breaker import BreakerState
from llmgw.config import Config, TraceSpec
from llmgw.errors import BadRequest, ModelNotFound
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision

ADDRESSES = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]
CHAT = "/v1/chat/completions"


def body(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})


async def echo(request: Request) -> Response:
    decision: Decision = request.state.llmgw_decision
    return JSONResponse(
        {
            "endpoint": decision.endpoint.address,
            "fallbacks": [e.address for e in decision.fallbacks],
            "destination": request.headers.get("x-gateway-destination-endpoint"),
            "decision": request.headers.get("x-llmgw-decision"),
            "body": (await request.body()).decode(),
        }
    )


async def fail(request: Request) -> Response:
    return Response(b"boom", status_code=int(request.query_params.get("status", "500")))


async def explode(request: Request) -> Response:
    raise RuntimeError("the app broke")


async def plain(request: Request) -> Response:
    return JSONResponse({"routed": DECISION_KEY in request.scope.get("state", {})})


def starlette_app(config: Config, scheduler: Scheduler) -> Starlette:
    app = Starlette(
        routes=[
            Route(CHAT, echo, methods=["POST"]),
            Route("/v1/completions", fail, methods=["POST"]),
            Route("/v1/embeddings", explode, methods=["POST"]),
            Route("/other", plain, methods=["GET", "POST"]),
        ]
    )
    app.add_middleware(SchedulerMiddleware, config=config, scheduler=scheduler)
    return app


@pytest.fixture
def config() -> Config:
    return make_config(ADDRESSES)


@pytest.fixture
def scheduler(config: Config) -> Scheduler:
    return Scheduler(config, seed=7)


@pytest.fixture
def client(config: Config, scheduler: Scheduler) -> TestClient:
    return TestClient(starlette_app(config, scheduler), raise_server_exceptions=False)


def inflight(scheduler: Scheduler) -> int:
    return sum(s.inflight for s in scheduler.registry.states(MODEL))


def test_decision_reaches_the_app_in_state_and_headers(
    client: TestClient, scheduler: Scheduler
) -> None:
    reply = client.post(CHAT, content=body(), headers={"x-session-id": "alice"}).json()
    assert reply["endpoint"] in ADDRESSES
    assert reply["destination"] == reply["endpoint"]
    assert len(reply["fallbacks"]) == 2 and reply["endpoint"] not in reply["fallbacks"]
    assert reply["decision"].startswith("strategy=ring picker=max-score")
    again = client.post(CHAT, content=body(), headers={"x-session-id": "alice"}).json()
    assert again["endpoint"] == reply["endpoint"]  # same session, same replica
    assert inflight(scheduler) == 0


def test_body_is_replayed_to_the_app_unchanged(client: TestClient) -> None:
    raw = b'{"model": "m1",  "messages": [{"role": "user", "content": "h\\u00e9"}]}'
    assert client.post(CHAT, content=raw).json()["body"] == raw.decode()


def test_streamed_request_body_is_replayed_whole(client: TestClient) -> None:
    pieces = [body()[:10], body()[10:]]
    assert client.post(CHAT, content=iter(pieces)).json()["body"] == body().decode()


def test_client_cannot_spoof_the_destination_header(client: TestClient) -> None:
    reply = client.post(
        CHAT, content=body(), headers={"x-gateway-destination-endpoint": "10.9.9.9:1"}
    ).json()
    assert reply["destination"] == reply["endpoint"] != "10.9.9.9:1"


def test_other_paths_pass_through_unrouted(client: TestClient) -> None:
    assert client.get("/other").json() == {"routed": False}


def test_model_header_routes_any_path(client: TestClient) -> None:
    assert client.post("/other", headers={"x-llmgw-model": MODEL}).json() == {"routed": True}


def test_bad_json_is_400_with_the_core_error_body(client: TestClient) -> None:
    reply = client.post(CHAT, content=b"{not json")
    assert reply.status_code == BadRequest.status == 400
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["code"] == BadRequest.code
    assert reply.json()["error"]["type"] == BadRequest.type


def test_unknown_model_is_404_model_not_found(client: TestClient) -> None:
    reply = client.post(CHAT, content=orjson.dumps({"model": "nope", "messages": []}))
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == ModelNotFound.code
    assert "configured models: m1" in error["message"]


def test_error_cors_headers_are_the_apps_choice(config: Config, scheduler: Scheduler) -> None:
    """The proxy (`cors=True`) answers a browser's request's errors with allow-origin *, as
    vLLM does; in an app of its own, its CORS middleware decides: none is added unasked."""
    unknown = orjson.dumps({"model": "nope", "messages": []})
    browser = {"origin": "http://localhost:3000"}
    for cors in (False, True):
        app = SchedulerMiddleware(Starlette(), config=config, scheduler=scheduler, cors=cors)
        reply = TestClient(app).post(CHAT, content=unknown, headers=browser)
        assert reply.status_code == 404
        assert reply.headers.get("access-control-allow-origin") == ("*" if cors else None)


def test_body_over_the_limit_is_413_by_content_length(scheduler: Scheduler) -> None:
    config = make_config(ADDRESSES, limits={"max_body_bytes": 1024})
    client = TestClient(starlette_app(config, Scheduler(config)))
    reply = client.post(CHAT, content=b"x" * 2000)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "body_too_large"


async def test_streamed_body_over_the_limit_is_413_before_it_is_all_read() -> None:
    config = make_config(ADDRESSES, limits={"max_body_bytes": 1024})
    reached_app: list[bool] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        reached_app.append(True)

    harness = Harness(b"x" * 800, more_body=True)
    harness.incoming.put_nowait({"type": "http.request", "body": b"x" * 800, "more_body": True})
    middleware = SchedulerMiddleware(app, config=config, scheduler=Scheduler(config))
    await asyncio.wait_for(middleware(harness.scope(), harness.receive, harness.send), 5)
    assert harness.sent[0]["status"] == 413
    assert b"more than 1024 bytes" in harness.sent[1]["body"]
    assert not reached_app
    assert harness.incoming.empty()


def test_5xx_from_the_app_counts_against_the_endpoint(
    client: TestClient, scheduler: Scheduler
) -> None:
    for _ in range(3):  # failure_threshold defaults to 3; one session: one endpoint
        reply = client.post("/v1/completions", content=body(), headers={"x-session-id": "z"})
        assert reply.status_code == 500
    assert inflight(scheduler) == 0
    opened = [s for s in scheduler.registry.states(MODEL) if s.breaker.state is BreakerState.OPEN]
    assert len(opened) == 1


def test_exception_in_the_app_releases_as_failure(client: TestClient, scheduler: Scheduler) -> None:
    assert client.post("/v1/embeddings", content=body(input="x")).status_code == 500
    assert inflight(scheduler) == 0


def test_fastapi_app_gets_the_decision(config: Config, scheduler: Scheduler) -> None:
    app = FastAPI()
    app.add_middleware(SchedulerMiddleware, config=config, scheduler=scheduler)

    @app.post(CHAT)
    async def chat(request: FastAPIRequest) -> dict[str, Any]:
        decision: Decision = request.state.llmgw_decision
        payload = await request.json()
        return {"endpoint": decision.endpoint.address, "model": payload["model"]}

    with TestClient(app) as client:
        reply = client.post(CHAT, content=body(), headers={"x-session-id": "bob"})
        assert reply.status_code == 200
        assert reply.json()["endpoint"] in ADDRESSES
        assert reply.json()["model"] == MODEL
        assert client.post(CHAT, content=b"[]").status_code == 400
    assert inflight(scheduler) == 0


def test_middleware_without_a_scheduler_builds_and_runs_a_router(config: Config) -> None:
    app = Starlette(routes=[Route(CHAT, echo, methods=["POST"])])
    app.add_middleware(SchedulerMiddleware, config=config)
    with TestClient(app) as client:  # runs the lifespan: the router's scraper starts and stops
        assert client.post(CHAT, content=body()).json()["endpoint"] in ADDRESSES


def test_middleware_closes_its_decision_trace_when_the_app_shuts_down(
    config: Config, tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    traced = config.model_copy(update={"trace": TraceSpec(path=str(path))})
    app = Starlette(routes=[Route(CHAT, echo, methods=["POST"])])
    app.add_middleware(SchedulerMiddleware, config=traced)
    with TestClient(app) as client:
        assert client.post(CHAT, content=body()).status_code == 200
    # Buffered lines (flushed within a second) are written out at shutdown.
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1 and orjson.loads(lines[0])["model"] == MODEL


# -- bare ASGI: lease timing for streams and disconnects -----------------------------------


class Harness:
    """Drive one request through the middleware by hand."""

    def __init__(self, request_body: bytes, *, more_body: bool = False) -> None:
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        self.incoming.put_nowait(
            {"type": "http.request", "body": request_body, "more_body": more_body}
        )
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        return await self.incoming.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @staticmethod
    def scope() -> Scope:
        return {
            "type": "http",
            "method": "POST",
            "path": CHAT,
            "raw_path": CHAT.encode(),
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
        }


async def test_stream_holds_the_lease_until_its_last_chunk(
    config: Config, scheduler: Scheduler
) -> None:
    gate = asyncio.Event()
    mid_stream_inflight: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        mid_stream_inflight.append(inflight(scheduler))
        await gate.wait()
        yield b"data: [DONE]\n\n"

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)

    harness = Harness(body(stream=True))
    middleware = SchedulerMiddleware(app, config=config, scheduler=scheduler)
    task = asyncio.create_task(middleware(harness.scope(), harness.receive, harness.send))
    await asyncio.wait_for(_until(lambda: bool(mid_stream_inflight)), 5)  # first chunk sent
    assert mid_stream_inflight == [1]
    gate.set()
    await asyncio.wait_for(task, 5)
    assert inflight(scheduler) == 0
    assert harness.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_client_disconnect_releases_as_cancelled(
    config: Config, scheduler: Scheduler
) -> None:
    seen: list[Decision] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        seen.append(scope["state"][DECISION_KEY])
        assert scope["state"][DISPATCH_KEY].endpoint == seen[0].endpoint
        await receive()  # the replayed body
        message = await receive()  # waits for the client
        assert message["type"] == "http.disconnect"

    harness = Harness(body())
    middleware = SchedulerMiddleware(app, config=config, scheduler=scheduler)
    task = asyncio.create_task(middleware(harness.scope(), harness.receive, harness.send))
    await asyncio.wait_for(_until(lambda: inflight(scheduler) == 1), 5)
    harness.incoming.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(task, 5)
    assert inflight(scheduler) == 0
    state = scheduler.registry.get(MODEL, seen[0].endpoint.address)
    assert state is not None and state.breaker.state is BreakerState.CLOSED


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0)  # yield to the task under test; bounded by the caller's wait_for
