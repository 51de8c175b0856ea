"""SchedulerMiddleware while an on-demand model starts: a request that stops waiting (its
client gone, or its task cancelled) leaves nothing behind when the model comes up."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest

from llmgw.asgi.middleware import SchedulerMiddleware
from llmgw.asgi.testing import MODEL
from llmgw.config import load_dict
from llmgw.runtime.router import Router
from llmgw.testing.controlplane import FakeControlPlane
from llmgw.testing.wait import eventually

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
SCOPE = {
    "type": "http",
    "method": "POST",
    "path": CHAT,
    "raw_path": CHAT.encode(),
    "query_string": b"",
    "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
}


@pytest.mark.parametrize("how", ["cancelled", "disconnected"])
async def test_a_request_that_stops_waiting_for_a_start_takes_no_lease(how: str) -> None:
    config = load_dict(
        {
            "activation_timeout": 30,
            "models": {
                MODEL: {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}}
            },
        }
    )
    plane = FakeControlPlane()
    router = Router(config, control_plane=plane, scrape=False)
    await router.start()
    reached: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope)

    middleware = SchedulerMiddleware(app, config=config, router=router, buffer_body=True)
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    incoming.put_nowait({"type": "http.request", "body": BODY, "more_body": False})

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    activator = router.activator
    assert activator is not None
    machine = activator.machines[MODEL]
    task = asyncio.create_task(middleware(dict(SCOPE), incoming.get, send))
    try:
        await eventually(lambda: machine.waiters == 1)
        if how == "cancelled":  # an outer timeout, or a server cancelling on shutdown
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            incoming.put_nowait({"type": "http.disconnect"})
            await task
        # The waiter went with the request (cancelled, it stayed and picked once the model
        # came up: a lease and an in-use count nobody would end).
        await eventually(lambda: machine.waiters == 0, timeout=2)
        plane.release.set()
        await eventually(lambda: bool(router.registry.states(MODEL)), timeout=5)
        inflight = sum(s.inflight for s in router.registry.states(MODEL))
        assert (inflight, machine.in_use, reached) == (0, 0, [])
    finally:
        await router.stop()
