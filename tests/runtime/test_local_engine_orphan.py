"""A local on-demand engine does not outlive a SIGKILLed router."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from llmgw.config import load_dict
    from llmgw.runtime.router import Router
    from llmgw.types import RequestInfo

    async def main():
        cfg = load_dict({
            "activation_timeout": 30,
            "activation_poll_interval": 0.05,
            "models": {"m1": {
                "launch": {"command": sys.executable + " -m llmgw.sim --port {port} --model {model}"},
                "scaling": {"min": 0, "max": 1, "start_timeout": 30},
            }},
        })
        router = Router(cfg, scrape=False)
        await router.start()
        await router.decide(RequestInfo(model="m1", request_id="r"))
        print(router.activator.control_plane.status("m1")["pid"], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_local_engine_does_not_outlive_a_sigkilled_router() -> None:
    """The router process is SIGKILLed (the OOM killer, systemd's final kill, `kill -9`):
    the engine it launched (own session, so no terminal or group signal reaches it) keeps
    running with its GPU and port; the next llmgw launches a second engine beside it."""
    router = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    engine = None
    try:
        assert router.stdout is not None
        line = router.stdout.readline()  # the engine is up and healthy
        engine = int(line)
        assert _alive(engine)
        router.kill()
        router.wait(5)
        deadline = time.monotonic() + 5
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine), "the engine outlived the router that launched it"
    finally:
        if router.poll() is None:
            router.kill()
            router.wait(5)
        if router.stdout is not None:
            router.stdout.close()
        if engine is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine, signal.SIGKILL)
