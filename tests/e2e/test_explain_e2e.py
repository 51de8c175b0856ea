"""`llmgw explain` against the demo fleet: the explained pick is the pick the router makes
for the same request right after, through Envoy + ext_proc and through the proxy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import serve
from llmgw.cli.demo import demo_fleet
from llmgw.cli.explain import ask, build_parser, main, query_of
from llmgw.config import Config
from llmgw.runtime.ports import free_port
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import (
    EnvoyProcess,
    ExtProcThread,
    fleet_config,
    loopback_bootstrap,
    wait_for,
)

pytestmark = pytest.mark.e2e

SESSIONS = ("alice", "bob", "carol")
SYSTEM = "You are a concise travel assistant who knows Lisbon well. " * 20


@pytest.fixture(scope="module")
def fleet() -> Iterator[ThreadedFleet]:
    threaded = demo_fleet()
    try:
        yield threaded
    finally:
        threaded.stop()


def config_for(fleet: ThreadedFleet, *, explain: bool = True) -> Config:
    return fleet_config(
        fleet, strategy="latency", admin={"explain": explain}, destination_fallbacks=True
    )


def conversation() -> Iterator[tuple[str | None, dict[str, Any]]]:
    """Growing chat histories (prefix hits) interleaved with one-off requests. The sessions
    share a system prompt, so on an idle fleet they all stay where the first one went; the
    one-offs, equal everywhere, are the real choices (3 a turn: all 9 on one of the demo's
    replicas by chance is about 1 in 260,000)."""
    histories = {s: [{"role": "system", "content": SYSTEM}] for s in SESSIONS}
    for turn in range(3):
        for session in SESSIONS:
            history = histories[session]
            history.append({"role": "user", "content": f"{session} question {turn} " * 30})
            yield session, {"model": "m1", "messages": list(history), "max_tokens": 8}
            history.append({"role": "assistant", "content": f"answer {turn} " * 20})
        for k in range(3):
            content = f"one-off {turn}.{k}"
            yield None, {"model": "m1", "messages": [{"role": "user", "content": content}]}


def explained(url: str, session: str | None, body: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """What `llmgw explain --url URL [--session S] --body FILE` asks and gets."""
    tmp.write_text(json.dumps(body))
    argv = ["--url", url, "--body", str(tmp)] + (["--session", session] if session else [])
    status, answer = ask(url, query_of(build_parser().parse_args(argv)), 5.0)
    assert status == 200, answer
    assert answer["error"] is None
    return answer


def decided(response: httpx.Response) -> str:
    return response.headers["x-llmgw-decision"].split()[0].removeprefix("endpoint=")


def test_explained_pick_is_the_next_pick_through_envoy(
    fleet: ThreadedFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config_for(fleet)
    extproc = ExtProcThread(cfg)
    envoy: EnvoyProcess | None = None
    try:
        envoy = EnvoyProcess(
            loopback_bootstrap(
                cfg,
                extproc.address,
                shape="override-host",
            )
        )
        admin = f"http://127.0.0.1:{extproc.ports['health']}"
        picks = []
        with httpx.Client(timeout=10) as client:
            for session, body in conversation():
                answer = explained(admin, session, body, tmp_path / "body.json")
                headers = {"x-session-id": session} if session else {}
                reply = client.post(envoy.url + "/v1/chat/completions", json=body, headers=headers)
                assert reply.status_code == 200, reply.text
                assert decided(reply) == answer["pick"], answer
                picks.append(answer["pick"])
                wait_for(lambda: sum(extproc.inflight().values()) == 0, what="requests ended")
        assert len(set(picks)) >= 2  # the test saw real choices, not one replica
        # The printed table, as an operator sees it.
        assert main(["--url", admin, "--model", "m1", "--session", "alice", "--prompt", "hi"]) == 0
        table = capsys.readouterr().out
        assert "latency x1" in table and "pick 127.0.0.1:" in table and "ttft ms" in table
    finally:
        if envoy is not None:
            envoy.stop()
        extproc.stop()


async def test_explained_pick_is_the_next_pick_through_the_proxy(
    fleet: ThreadedFleet, tmp_path: Path
) -> None:
    app = ProxyApp(config_for(fleet))
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        for session, body in conversation():
            # The CLI blocks: it runs in a thread while this loop serves it.
            answer = await asyncio.to_thread(explained, base, session, body, tmp_path / "b.json")
            headers = {"x-session-id": session} if session else {}
            reply = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            assert decided(reply) == answer["pick"], answer


async def test_explain_is_off_unless_the_config_enables_it(fleet: ThreadedFleet) -> None:
    app = ProxyApp(config_for(fleet, explain=False), scrape=False)
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        reply = await client.post("/admin/explain", json={"model": "m1", "prompt": "hi"})
        assert reply.status_code == 404
        assert "admin: {explain: true}" in reply.json()["error"]["message"]
        reply = await client.get("/admin/explain")
        assert reply.status_code == 405


def test_explain_cli_reports_an_unreachable_router(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--url", url, "--model", "m1", "--prompt", "hi", "--timeout", "1"]) == 1
    assert "no answer from" in capsys.readouterr().err
