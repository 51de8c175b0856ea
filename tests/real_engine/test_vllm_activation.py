"""On-demand activation with the local control plane starting a real `vllm serve`."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from llmgw.config import load_dict
from llmgw.errors import ModelLoading
from llmgw.runtime.controlplanes.local import group_members
from llmgw.runtime.router import Router
from llmgw.types import Outcome, RequestInfo
from tests.real_engine.conftest import serve_command

pytestmark = pytest.mark.real_engine


def chat(address: str) -> int:
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    req = urllib.request.Request(
        f"http://{address}/v1/chat/completions",
        data=body.encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return int(r.status)


def make_router(activation_timeout: float, idle_timeout: float = 600) -> Router:
    config = load_dict(
        {
            "activation_timeout": activation_timeout,
            "models": {
                "tiny": {
                    "launch": {"command": serve_command("{port}", 0), "expected_start_seconds": 40},
                    "scaling": {
                        "min": 0,
                        "max": 1,
                        "start_timeout": 300,
                        "idle_timeout": idle_timeout,
                    },
                }
            },
        }
    )
    return Router(config, scrape=False)


async def test_short_timeout_gives_503_then_the_start_completes_and_idle_stop_ends_the_tree(
    vllm_ready: None,
) -> None:
    router = make_router(activation_timeout=1.0, idle_timeout=1.0)
    assert router.activator is not None
    try:
        with pytest.raises(ModelLoading) as info:
            await router.decide(RequestInfo(model="tiny", request_id="r0"))
        assert 1 <= int(info.value.headers["retry-after"]) <= 60
        # The waiter gave up; the start goes on. Retry as a client would, bounded.
        deadline = time.monotonic() + 300
        while True:
            try:
                decision = await router.decide(RequestInfo(model="tiny", request_id="r1"))
                break
            except ModelLoading as exc:
                assert time.monotonic() < deadline, "vLLM never became ready"
                assert exc.retry_after >= 1
        lease = router.acquire(decision)
        assert chat(decision.endpoint.address) == 200
        lease.finish(Outcome.SUCCESS)
        pid = router.activator.control_plane.status("tiny")["pid"]
        assert isinstance(pid, int)
        members = group_members(pid)
        assert len(members) >= 2, f"expected API server + engine core, saw {members}"
        router.activator.clock = lambda: time.monotonic() + 10  # past the idle timeout
        await router.activator.tick()
        # Nothing of the tree is left running (an exited orphan may linger as a zombie
        # until init reaps it: it holds no memory, port or core).
        assert group_members(pid) == []
    finally:
        await router.stop()


async def test_first_request_waits_for_a_cold_start_that_fits_the_timeout(vllm_ready: None) -> None:
    router = make_router(activation_timeout=300)
    assert router.activator is not None
    try:
        started = time.monotonic()
        decision = await router.decide(RequestInfo(model="tiny", request_id="r0"))
        ready = time.monotonic()
        assert chat(decision.endpoint.address) == 200
        served = time.monotonic()
        status = router.models_status()["tiny"]
        print(
            f"\ncold start: {ready - started:.1f}s to ready, first request served "
            f"{(served - ready) * 1000:.0f} ms later; machine says {status['last_start_seconds']}"
        )
        assert status["state"] in ("idle", "ready") and status["starts"] == 1
    finally:
        await router.stop()
