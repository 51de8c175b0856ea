"""How `llmgw proxy` runs under uvicorn: draining on SIGTERM, event loop and parser
choice, and the hand-off of the command line to worker processes (`--workers N`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from types import FrameType
from typing import Any

import orjson

from llmgw.asgi.app import ProxyApp, build_app
from llmgw.asgi.protocol import WorkerProtocol
from llmgw.config import load_file
from llmgw.logs import configure


def draining_server(config: Any, app: ProxyApp, drain_delay: float) -> Any:
    """A uvicorn Server whose SIGTERM first turns /readyz to 503, then, `drain_delay` s
    later, closes the listener; open requests then get `timeout_graceful_shutdown` s."""
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        exit_at: float | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.draining = True
            if drain_delay > 0 and self.exit_at is None and sig == signal.SIGTERM:
                self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
                self.exit_at = time.monotonic() + drain_delay
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.exit_at is not None and time.monotonic() >= self.exit_at:
                self.should_exit = True
            return await super().on_tick(counter)

    return Server(config)


def drain_worker_on_sigterm(app: ProxyApp, drain_delay: float) -> None:
    """`draining_server` for a worker of `--workers N`, which runs uvicorn's own Server
    (its SIGTERM handler closes the listener at once): SIGTERM turns /readyz to 503 and
    reaches uvicorn's handler `drain_delay` s later (a second SIGTERM at once). Called in
    the worker's running loop, after uvicorn installed its handler."""
    uvicorn_exit = signal.getsignal(signal.SIGTERM)
    if drain_delay <= 0 or not callable(uvicorn_exit):
        return
    loop = asyncio.get_running_loop()
    pending: asyncio.TimerHandle | None = None

    def on_term() -> None:
        nonlocal pending
        app.draining = True
        if pending is None:
            pending = loop.call_later(drain_delay, uvicorn_exit, signal.SIGTERM, None)
            return
        pending.cancel()
        uvicorn_exit(signal.SIGTERM, None)

    with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
        loop.add_signal_handler(signal.SIGTERM, on_term)


def event_loop_and_parser() -> tuple[str, str]:
    try:
        import uvloop  # noqa: F401, PLC0415
    except ImportError:
        loop = "asyncio"
    else:
        loop = "uvloop"
    try:
        import httptools  # noqa: F401, PLC0415
    except ImportError:
        http = "h11"
    else:
        http = "httptools"
    return loop, http


WORKER_ARGS = "_LLMGW_PROXY_WORKER_ARGS"  # parent -> worker processes, set by `llmgw proxy`


def worker_app() -> ProxyApp:
    """The app of one worker process of `--workers N` (uvicorn imports it by name, and calls
    it in the worker's running loop)."""
    args = orjson.loads(os.environ[WORKER_ARGS])
    configure(args["log_level"], args["log_format"])
    config = load_file(args["config"])
    app = build_app(
        config,
        scrape=args["scrape"],
        config_path=args["config"],
        reload_interval=args["reload_interval"],
    )
    WorkerProtocol.use(config.limits, app.telemetry.error)
    drain_worker_on_sigterm(app, args["drain_delay"])
    return app
