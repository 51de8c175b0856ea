"""What the proxy reports: the errors it answers itself and the requests in flight on a
draining endpoint (/metrics), its logs' format."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from llmgw.asgi import proxy
from llmgw.asgi.app import ProxyApp
from llmgw.asgi.protocol import guarded
from llmgw.asgi.testing import MODEL, make_config, refused_address, serve
from llmgw.config import load_dict
from llmgw.request import build_request
from llmgw.runtime.telemetry import Telemetry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Endpoint, Outcome

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


def _errors(app: ProxyApp, code: str, status: int) -> float | None:
    return app.telemetry.registry.get_sample_value(
        "llmgw_errors_total", {"code": code, "status": str(status)}
    )


async def test_errors_the_proxy_answers_itself_are_counted() -> None:
    """The 502 when no endpoint answered, the protocol layer's 431 and the 405 of a fixed
    route were answered but not counted in llmgw_errors_total: the dashboard's errors panel
    stayed empty while every replica was unreachable. Found by a review helper."""
    config = make_config([refused_address(), refused_address()])
    app = ProxyApp(config, scrape=False)
    async with (
        serve(app, http=guarded(config.limits, app.telemetry.error)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        reply = await client.post(CHAT, content=BODY)
        assert (reply.status_code, reply.json()["error"]["code"]) == (502, "upstream_unreachable")
        headers = {f"x-h{i}": "v" for i in range(120)}
        assert (await client.post(CHAT, content=BODY, headers=headers)).status_code == 431
        async with httpx.AsyncClient(base_url=base) as fresh:  # the 431 closed that one
            assert (await fresh.post("/readyz")).status_code == 405
    assert _errors(app, "upstream_unreachable", 502) == 1.0
    assert _errors(app, "headers_too_large", 431) == 1.0
    assert _errors(app, "method_not_allowed", 405) == 1.0


def test_a_draining_endpoints_requests_stay_in_the_inflight_gauge() -> None:
    """An endpoint that left the set with a stream running vanished from llmgw_inflight:
    it looked drained while requests still ran there. Found by a review helper."""
    config = load_dict({"models": {"m1": {"endpoints": ["10.0.0.1:8000"], "strategy": "ring"}}})
    scheduler = Scheduler(config, seed=1)
    telemetry = Telemetry()
    telemetry.bind(scheduler.registry)
    body = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    lease = scheduler.acquire(scheduler.pick(build_request(config, {}, CHAT, body)))
    scheduler.registry.set_endpoints("m1", [Endpoint(model="m1", address="10.0.0.2:8000")])
    sample = telemetry.registry.get_sample_value
    assert sample("llmgw_inflight", {"model": "m1", "endpoint": "10.0.0.1:8000"}) == 1.0
    lease.finish(Outcome.SUCCESS)
    assert sample("llmgw_inflight", {"model": "m1", "endpoint": "10.0.0.1:8000"}) is None


def test_the_proxy_gives_uvicorn_no_text_handlers_with_json_logs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "llmgw.yaml"
    path.write_text("models:\n  m1:\n    endpoints: ['127.0.0.1:9']\n")
    seen: list[dict[str, object]] = []

    class _Stop(Exception):
        pass

    def capture(config: object, app: object, delay: float) -> object:
        seen.append(vars(config))
        raise _Stop

    monkeypatch.setattr(proxy, "draining_server", capture)
    monkeypatch.setattr(proxy, "configure", lambda level, fmt: None)
    for fmt, log_config_none in (("json", True), ("text", False)):
        with pytest.raises(_Stop):
            proxy.main(["--config", str(path), "--no-scrape", "--log-format", fmt])
        assert (seen[-1]["log_config"] is None) is log_config_none
