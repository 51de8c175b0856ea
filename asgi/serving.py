"""How `llmgw proxy` runs under uvicorn: draining on SIGTERM, event loop and parser
choice, and the hand-off of the command line to worker processes (`--workers N`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.protocol import WorkerProtocol
from llmgw.config import load_file
from llmgw.logs import configure
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.router import WORKER_GROUP
from llmgw.runtime.workers import early_hangup, exit_with_parent, hangups_blocked

log = logging.getLogger("llmgw.proxy")


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
    reaches uvicorn's handler `drain_delay` s later (at once for 0, and for a second
    SIGTERM). The app knows it drains whatever the delay: a request the drain timeout
    cuts gets 503 `router_draining`. Called in the worker's running loop, after uvicorn
    installed its handler."""
    uvicorn_exit = signal.getsignal(signal.SIGTERM)
    if not callable(uvicorn_exit):
        return
    loop = asyncio.get_running_loop()
    pending: asyncio.TimerHandle | None = None

    def on_term() -> None:
        nonlocal pending
        app.draining = True
        if pending is None and drain_delay > 0:
            pending = loop.call_later(drain_delay, uvicorn_exit, signal.SIGTERM, None)
            return
        if pending is not None:
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
START_ERROR = "start-error"  # in the worker group's directory: why a worker could not start


class WorkerApp(ProxyApp):
    """The app of one worker process of `--workers N`: a start error is left for the
    parent to print (`START_ERROR` in `report_to`), and a SIGHUP that came while it started
    (noted by `early_hangup`) reloads once its handler is in place."""

    report_to: Path | None = None

    async def startup(self) -> None:
        try:
            await super().startup()
        except StartError as exc:
            if self.report_to is not None:
                tmp = self.report_to / f"{START_ERROR}.{os.getpid()}"
                tmp.write_text(str(exc))
                tmp.replace(self.report_to / START_ERROR)
            raise
        if early_hangup.take() and self.watcher is not None:
            self.watcher.reload()


def worker_app() -> ProxyApp:
    """The app of one worker process of `--workers N` (uvicorn imports it by name, and calls
    it in the worker's running loop)."""
    args = orjson.loads(os.environ[WORKER_ARGS])
    exit_with_parent(args["parent"])  # no orphan serving on if the parent is SIGKILLed
    early_hangup.install()  # the parent passes SIGHUP on, maybe before startup is done
    configure(args["log_level"], args["log_format"])
    group = os.environ.get(WORKER_GROUP)  # taken out of the environment by the start
    config = load_file(args["config"])
    app = WorkerApp(
        config,
        scrape=args["scrape"],
        config_path=args["config"],
        reload_interval=args["reload_interval"],
    )
    app.report_to = Path(group) if group else None
    WorkerProtocol.use(config.limits, app.telemetry.error)
    drain_worker_on_sigterm(app, args["drain_delay"])
    return app


def supervise(config: Any) -> int:
    """Serve `config` (a uvicorn Config with `workers` > 1 and the app `worker_app`) with
    uvicorn's supervisor, which restarts a worker that dies, and stops all on SIGTERM or
    SIGINT. Unlike `uvicorn.run`: a worker that cannot start is exit code 3 with its reason
    on stderr, as with one process (`uvicorn.run` returned, exit 0), and SIGHUP is passed
    on to every worker, which reloads its config in place (uvicorn replaced each worker,
    cutting streams longer than the drain timeout, and starting its state over)."""
    from uvicorn.config import STARTUP_FAILURE  # noqa: PLC0415
    from uvicorn.supervisors import Multiprocess  # noqa: PLC0415

    class Supervisor(Multiprocess):
        start_failed = False

        def init_processes(self) -> None:
            with hangups_blocked():
                super().init_processes()

        def restart_all(self) -> None:
            with hangups_blocked():
                super().restart_all()

        def handle_ttin(self) -> None:
            with hangups_blocked():
                super().handle_ttin()

        def keep_subprocess_alive(self) -> None:
            with hangups_blocked():  # it spawns a worker in place of a dead one
                super().keep_subprocess_alive()
            if any(p.exitcode == STARTUP_FAILURE for p in self.processes):
                self.start_failed = True  # uvicorn stops then: the next would fail as well
                self.should_exit.set()

        def handle_hup(self) -> None:
            log.info("SIGHUP: each worker reloads its config")
            for process in self.processes:
                if process.pid is not None and process.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGHUP)

    group = os.environ.get(WORKER_GROUP)
    sock = config.bind_socket()  # in use: uvicorn logs it and exits 3
    supervisor = Supervisor(config, sockets=[sock])
    try:
        supervisor.run()
    except KeyboardInterrupt:  # Ctrl+C: the workers have been stopped
        pass
    finally:
        sock.close()
    if not supervisor.start_failed:
        return 0
    report = Path(group) / START_ERROR if group else None
    reason = report.read_text() if report is not None and report.exists() else None
    print(
        f"llmgw proxy: cannot start: {reason or 'a worker failed to start (its log is above)'}",
        file=sys.stderr,
    )
    return STARTUP_FAILURE
