"""`llmgw extproc`: the Envoy external-processing server (grpc.aio), health and metrics.

Thin on purpose: each gRPC stream gets an `Exchange` (extproc/translate.py) that turns
messages into answers; this module only reads, writes, and releases on stream end.

Ports (defaults, as GIE's endpoint picker): gRPC 9002 (ext_proc + grpc.health.v1, TLS with
a self-signed certificate unless `--tls-cert/--tls-key` or `--plaintext`), gRPC 9003
(grpc.health.v1 with GIE's service names, see extproc/grpchealth.py), HTTP 9004
(`/healthz`, `/readyz`, `/models/status`, `POST /admin/explain` if enabled), HTTP 9090 (`/metrics`). SIGTERM: readiness goes
false, new streams are refused after `--drain-delay`, open ones get `--drain-timeout`
seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from llmgw import native
from llmgw.catalog import catalog_answer
from llmgw.config import Config, load_file
from llmgw.discovery import bracketed
from llmgw.errors import ConfigError
from llmgw.extproc.envoyconfig import host_name_problem
from llmgw.extproc.grpchealth import (
    PROCESS_SERVICE,
    LiveHealth,
    add_to_server,
    extproc_port_health,
    probe_port_health,
)
from llmgw.extproc.tls import ServerTls
from llmgw.extproc.translate import Exchange
from llmgw.lifecycle import AwaitActivation
from llmgw.logs import configure
from llmgw.runtime.admin import EXPLAIN_PATH, MAX_QUERY_BYTES, explain
from llmgw.runtime.cliargs import port_number, positive_int
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.driver import activate
from llmgw.runtime.health import HEALTHZ_BODY, is_ready, readiness
from llmgw.runtime.router import ConfigWatcher, router_for, worker_group, workers_problem
from llmgw.runtime.telemetry import Telemetry
from llmgw.runtime.trace import close_trace, traced
from llmgw.runtime.workers import early_hangup, exit_with_parent
from llmgw.scheduling.scheduler import Scheduler

log = logging.getLogger("llmgw.extproc")

# Seconds between pushes of the health status to grpc.health.v1 Watch streams.
HEALTH_REFRESH_INTERVAL = 1.0


# The flag that sets each port, named when it cannot be bound.
_PORT_FLAGS = {
    "grpc": "--grpc-port",
    "grpc_health": "--grpc-health-port",
    "health": "--health-port",
    "metrics": "--metrics-port",
}


def _identity(data: bytes) -> bytes:
    return data


class ExtProcServer:
    """One ext_proc server: gRPC + health + metrics listeners around one Scheduler."""

    def __init__(
        self,
        config: Config,
        *,
        host: str = "0.0.0.0",
        grpc_port: int = 9002,
        health_port: int | None = 9004,
        metrics_port: int | None = 9090,
        grpc_health_port: int | None = None,
        tls: ServerTls | None = None,
        scrape: bool = True,
        scheduler: Scheduler | None = None,
        telemetry: Telemetry | None = None,
        reuse_port: bool = False,
    ) -> None:
        refuse_host_names(config, "config")
        # Bare (`::1` or `[::1]` alike): aiohttp binds it so, gRPC in brackets (`_bind`).
        self.host = host.removeprefix("[").removesuffix("]")
        self.router = router_for(config, scheduler=scheduler, scrape=scrape)
        self.gateway = self.router.gateway
        self.telemetry = telemetry or Telemetry()
        self.scraper = self.router.scraper
        self.telemetry.bind(
            self.router.registry,
            self.scraper,
            discovery=self.router.discovery,
            models=self.router.models_status,
            peers=self.router.peer_stats,
        )
        self.hooks = traced(self.telemetry.hooks("extproc"), config.trace)
        self.draining = False
        self.open_streams = 0
        self._ports = {
            "grpc": grpc_port,
            "grpc_health": grpc_health_port,
            "health": health_port,
            "metrics": metrics_port,
        }
        self.tls = tls
        self._reuse_port = reuse_port
        self._grpc: grpc.aio.Server | None = None
        self._grpc_bound: grpc.aio.Server | None = None  # bound, maybe not started yet
        self._router_started = False
        self._grpc_health: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._health_changed = asyncio.Event()
        self._health_refresh: asyncio.Task[None] | None = None
        self.extproc_health = extproc_port_health(draining=lambda: self.draining)
        self.probe_health = probe_port_health(alive=lambda: True, ready=self._ready)

    @property
    def config(self) -> Config:
        return self.gateway.config

    @property
    def scheduler(self) -> Scheduler:
        return self.gateway.scheduler

    # -- ext_proc ------------------------------------------------------------------------
    async def process(self, _requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        """One Envoy stream = one HTTP request. Reader/writer API: no generator overhead."""
        exchange = Exchange(self.gateway, self.hooks, self.local_answer)
        self.open_streams += 1
        # Envoy ends a stream by closing its side, then resetting it (its ext_proc client's
        # close): `read` gives EOF, or grpc cancels the task waiting in it; either way every
        # answer had been written (counted as a reset, 53 of 60 whole 200s through a real
        # Envoy 1.40 read `cancelled`). The loop ending otherwise (a reset seen while
        # answering: grpc cancels the task at that write) means Envoy may have given up
        # before the answer arrived, as when this process stalled past its message_timeout
        # and the client got Envoy's 504.
        ended = False
        try:
            read, write, eof = context.read, context.write, grpc.aio.EOF
            while True:
                try:
                    message = await read()
                except asyncio.CancelledError:
                    ended = True
                    raise
                if message is eof:
                    ended = True
                    break
                answer = exchange.handle(message)
                if isinstance(answer, AwaitActivation):
                    answer = exchange.answer(await activate(exchange.lifecycle, answer))
                if type(answer) is bytes:
                    await write(answer)
                else:  # FULL_DUPLEX_STREAMED: several answers in order, or none yet
                    for part in answer:
                        await write(part)
        finally:
            # Response end, client abort or stream cancel: release exactly once.
            try:
                exchange.close(aborted=not ended)
            finally:
                self.open_streams -= 1

    def local_answer(self, path: str) -> tuple[int, bytes] | None:
        """GET paths answered through the gateway without an upstream: the model list (the
        OpenAI client's `models.list()`) and health probes aimed at the gateway."""
        catalog = catalog_answer(self.config, path, self.router.models_status())
        if catalog is not None:
            return catalog
        if path in ("/health", "/healthz"):
            return 200, HEALTHZ_BODY
        if path == "/readyz":
            ready, body = readiness(self.router, started=True, draining=self.draining)
            return (200 if ready else 503), body
        return None

    # -- grpc.health.v1 ------------------------------------------------------------------
    def _ready(self) -> bool:
        return is_ready(started=self._grpc is not None, draining=self.draining)

    async def _refresh_health(self) -> None:
        """Keep Watch streams current: on drain at once, else once a second."""
        servicers: tuple[LiveHealth, ...] = (self.extproc_health, self.probe_health)
        while True:
            for servicer in servicers:
                await servicer.refresh()
            self._health_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._health_changed.wait(), HEALTH_REFRESH_INTERVAL)

    async def _stop_health_refresh(self) -> None:
        task, self._health_refresh = self._health_refresh, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- HTTP ----------------------------------------------------------------------------
    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready, body = readiness(self.router, started=self._grpc is not None, draining=self.draining)
        return web.Response(
            body=body, status=200 if ready else 503, content_type="application/json"
        )

    async def _models_status(self, _request: web.Request) -> web.Response:
        return web.json_response(self.router.models_status())

    async def _explain(self, request: web.Request) -> web.Response:
        status, body = explain(self.gateway, await request.read())
        return web.Response(body=body, status=status, content_type="application/json")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = self.telemetry.render()
        return web.Response(body=body, headers={"content-type": content_type})

    async def _serve_http(self, routes: list[web.RouteDef], port: str) -> int:
        app = web.Application(client_max_size=MAX_QUERY_BYTES)
        app.add_routes(routes)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        number = self._ports[port]
        site = web.TCPSite(runner, self.host, number, reuse_port=self._reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            raise StartError(
                f"cannot listen on {bracketed(self.host)}:{number} ({_PORT_FLAGS[port]}): "
                f"{exc.strerror or exc}"
            ) from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(number or 0)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def ports(self) -> dict[str, int | None]:
        return dict(self._ports)

    async def start(self) -> None:
        """Listen on every port and start the router. StartError, with nothing left
        running, when a port cannot be bound or the router cannot start (Kubernetes
        discovery refused, the peers' port)."""
        try:
            await self._start()
        except BaseException:
            await self._abort_start()
            raise

    async def _start(self) -> None:
        # No gRPC bound on messages: the gateway's buffer bounds a body, and one past
        # limits.max_body_bytes gets its 413 from `Exchange`. With max_body_bytes + a margin
        # here (Envoy's own bound in llmgw's config), a gateway buffering more (a GIE
        # gateway in BUFFERED mode) had its stream killed: a 500, or fail-open unrouted.
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 1 if self._reuse_port else 0),
            ]
        )
        self._grpc_bound = server
        handlers: dict[str, Callable[..., Any]] = {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.process,
                request_deserializer=ProcessingRequest.FromString,
                response_serializer=_identity,
            )
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PROCESS_SERVICE, handlers),)
        )
        add_to_server(self.extproc_health, server)
        self._ports["grpc"] = self._bind(server, "grpc", tls=self.tls)
        if self._ports["grpc_health"] is not None:
            # A separate server like GIE's: probes keep answering while ext_proc is busy.
            probes = grpc.aio.server()
            self._grpc_health = probes
            add_to_server(self.probe_health, probes)
            self._ports["grpc_health"] = self._bind(probes, "grpc_health", tls=None)
            await self.probe_health.refresh()  # Watch agrees with Check from the first stream
            await probes.start()
        # Watch streams follow the start (it may wait for discovery's first lists).
        self._health_refresh = asyncio.create_task(self._refresh_health())
        await self.router.start()  # on failure (RBAC) the router leaves nothing running
        self._router_started = True
        await server.start()
        self._grpc = server
        self._health_changed.set()  # readiness is SERVING now: tell Watch streams at once
        if self._ports["health"] is not None:
            self._ports["health"] = await self._serve_http(
                [
                    web.get("/healthz", self._healthz),
                    web.get("/readyz", self._readyz),
                    web.get("/models/status", self._models_status),
                    web.post(EXPLAIN_PATH, self._explain),
                ],
                "health",
            )
        if self._ports["metrics"] is not None:
            self._ports["metrics"] = await self._serve_http(
                [web.get("/metrics", self._metrics)], "metrics"
            )
        # Which scheduler code runs: the compiled modules or the Python sources (and why).
        log.info(
            "ext_proc listening", extra={"ports": self.ports, "scheduler": native.STATUS.reason}
        )

    async def _abort_start(self) -> None:
        """Close what a failed start had opened (a port already in use past the first)."""
        server, self._grpc_bound = self._grpc_bound, None
        if server is not None:
            if self._grpc is None:  # grpc frees a bound port only once started, then stopped
                await server.start()
            self._grpc = None
            await server.stop(0)
        await self._stop_health_refresh()
        if self._grpc_health is not None:
            await self._grpc_health.stop(0)
            self._grpc_health = None
        if self._router_started:
            self._router_started = False
            await self.router.stop()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    def _bind(self, server: grpc.aio.Server, port: str, *, tls: ServerTls | None) -> int:
        address = f"{bracketed(self.host)}:{self._ports[port]}"
        try:
            if tls is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, tls.credentials())
        except RuntimeError:  # grpc's "Failed to bind to address"
            bound = 0
        if not bound:
            raise StartError(f"cannot listen on {address} ({_PORT_FLAGS[port]}): in use?")
        return int(bound)

    def reload(self, config: Config) -> None:
        """Route new streams with `config` (see `Router.reload`); raises ConfigError."""
        refuse_host_names(config, "reloaded config")
        self.router.reload(config)

    def begin_drain(self) -> None:
        """Readiness and gRPC health go false; streams keep being served."""
        self.draining = True
        self._health_changed.set()

    async def stop(self, grace: float = 10.0) -> None:
        """Refuse new streams, give open ones `grace` seconds, then close everything."""
        self.begin_drain()
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        self._grpc_bound = None
        await self._stop_health_refresh()
        if self._grpc_health is not None:
            await self._grpc_health.stop(0)
            self._grpc_health = None
        self._router_started = False
        await self.router.stop()
        close_trace(self.hooks)
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


def refuse_host_names(config: Config, source: str) -> None:
    """ConfigError if an endpoint is named by host: Envoy would answer every request for it
    with 503 (envoyconfig.host_name_problem). original-dst's envoy.yaml lists no endpoints,
    so `envoy-config` never saw them: the server took them at start and on reload."""
    problem = host_name_problem(config)
    if problem is not None:
        raise ConfigError([problem], source)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw extproc", description="Envoy ext_proc endpoint picker for LLM servers."
    )
    parser.add_argument("--config", required=True, help="llmgw config file (YAML)")
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--grpc-port", type=port_number, default=9002, help="ext_proc gRPC port")
    parser.add_argument(
        "--grpc-health-port",
        type=port_number,
        default=9003,
        help="grpc.health.v1 port with GIE's service names (liveness, readiness, "
        "inference-extension); default 9003 as GIE",
    )
    parser.add_argument(
        "--health-port", type=port_number, default=9004, help="HTTP /healthz /readyz /models/status"
    )
    parser.add_argument("--metrics-port", type=port_number, default=9090)
    tls = parser.add_argument_group("TLS on the ext_proc port (default: self-signed, like GIE)")
    tls.add_argument("--tls-cert", help="PEM certificate (chain) file; needs --tls-key")
    tls.add_argument("--tls-key", help="PEM private key file; needs --tls-cert")
    tls.add_argument("--plaintext", action="store_true", help="serve ext_proc without TLS (h2c)")
    parser.add_argument("--no-scrape", action="store_true", help="do not poll /metrics")
    parser.add_argument(
        "--debug-headers", action="store_true", help="add x-llmgw-decision (overrides config)"
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds between SIGTERM (readiness false) and refusing new streams",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=10.0, help="seconds open streams get to finish"
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes sharing the gRPC port (SO_REUSEPORT); each has its own registry",
    )
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop"
    )
    parser.add_argument(
        "--reload-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the config file for changes (0: only on SIGHUP)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    return parser


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    """The TLS pair the flags ask for (None: plaintext); ConfigError on a bad file or flag mix."""
    if args.plaintext:
        if args.tls_cert or args.tls_key:
            raise ConfigError(["--plaintext cannot be combined with --tls-cert/--tls-key"], "flags")
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError(["--tls-cert and --tls-key go together"], "flags")
    if args.tls_cert:
        return ServerTls.from_files(args.tls_cert, args.tls_key)
    return ServerTls.self_signed_pair()


async def serve(
    args: argparse.Namespace,
    config: Config,
    worker: int = 0,
    tls: ServerTls | None = None,
    children: Children | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain. Worker 0 of `--workers N` (the parent) gets
    `children`, the workers it forked: it passes SIGTERM and SIGHUP on to them, and stops
    them all when one of them dies."""
    # Workers > 0 share the gRPC port only; health and metrics stay with worker 0.
    server = ExtProcServer(
        config,
        host=args.host,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port if worker == 0 else None,
        health_port=args.health_port if worker == 0 else None,
        metrics_port=args.metrics_port if worker == 0 else None,
        tls=tls,
        scrape=not args.no_scrape,
        reuse_port=args.workers > 1,
    )
    # The file as loaded (main read it just before): an edit that lands while the server
    # starts (discovery's first lists, peers) is a change to apply, not the state seen.
    watcher = ConfigWatcher(
        args.config, lambda c: server.reload(_with_flags(c, args)), interval=args.reload_interval
    )
    await server.start()
    # Startup objects (config, modules, protobuf pools) never die: keep them out of every
    # GC pass, so the per-request garbage is all the collector walks.
    gc.collect()
    gc.freeze()
    if args.ready_file and worker == 0:
        target = Path(args.ready_file)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({**server.ports, "pid": os.getpid()}))
        tmp.replace(target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:  # every worker drains at once: all NOT_SERVING together
        stop.set()
        if children is not None:
            children.signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    # SIGHUP or a changed file (`watcher`): reload; an invalid file is logged and the old
    # config kept.

    def on_hangup() -> None:
        watcher.reload()
        if children is not None:
            children.signal(signal.SIGHUP)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    if early_hangup.take():  # a SIGHUP while this process was starting
        on_hangup()
    polling = asyncio.create_task(watcher.run()) if args.reload_interval > 0 else None
    watching = asyncio.create_task(children.watch(on_stop)) if children is not None else None
    await stop.wait()
    for task in (polling, watching):
        if task is not None:
            task.cancel()
    log.info("draining", extra={"open_streams": server.open_streams})
    server.begin_drain()
    if args.drain_delay > 0:
        await asyncio.sleep(args.drain_delay)  # let load balancers see readiness go false
    await server.stop(args.drain_timeout)


class Children:
    """The workers 1..N-1 that worker 0 (the parent) forked, by pid. One that dies while
    they serve is logged and stops them all: the parent exits non-zero (`exit_code`) for
    its supervisor (Kubernetes, systemd) to restart the whole server. A new fork from a
    parent whose gRPC server runs is not safe, so there is no restart in place."""

    POLL_INTERVAL = 0.5  # seconds between looks (uvloop takes no SIGCHLD handler)

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = pids  # pid -> worker number
        self.exit_code = 0
        self.terminated = False  # sent SIGTERM: they drain (a second one could cut a cleanup)

    def signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            if self.terminated:
                return
            self.terminated = True
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def reap(self) -> list[tuple[int, int, int]]:
        """The workers that have ended since the last look: (worker, pid, exit code)."""
        ended: list[tuple[int, int, int]] = []
        for pid in list(self.pids):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                done, status = pid, 0
            if done:
                ended.append((self.pids.pop(pid), pid, os.waitstatus_to_exitcode(status)))
        return ended

    async def watch(self, stop: Callable[[], None]) -> None:
        """Until cancelled (the drain): a worker that ended is logged, and `stop` called."""
        while True:
            for worker, pid, code in self.reap():
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                log.error(
                    "worker %d (pid %d) ended (%s): stopping every worker, exiting non-zero",
                    worker,
                    pid,
                    how,
                    extra={"worker": worker, "pid": pid, "code": code},
                )
                self.exit_code = START_FAILED if code == START_FAILED else 1
                stop()
            await asyncio.sleep(self.POLL_INTERVAL)

    def stop(self) -> None:
        """SIGTERM the workers left (they drain), and wait for them."""
        self.signal(signal.SIGTERM)
        for pid in list(self.pids):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids.clear()


def _with_flags(config: Config, args: argparse.Namespace) -> Config:
    """The config as the command line amends it."""
    if args.debug_headers:
        return config.model_copy(update={"debug_headers": True})
    return config


def _run_worker(
    args: argparse.Namespace,
    config: Config,
    worker: int,
    tls: ServerTls | None,
    children: Children | None = None,
) -> None:
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if args.loop == "uvloop":
        import uvloop  # noqa: PLC0415 (optional dependency)

        loop_factory = uvloop.new_event_loop
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=loop_factory) as runner,
    ):
        runner.run(serve(args, config, worker, tls, children))


START_FAILED = 3  # exit code: the server (or a worker) could not start, as `llmgw proxy`


def _child(
    args: argparse.Namespace, config: Config, worker: int, tls: ServerTls | None, parent: int
) -> int:
    """A forked worker's life: its exit code (its start error logged)."""
    exit_with_parent(parent)
    try:
        _run_worker(args, config, worker, tls)
    except StartError as exc:
        log.error("worker %d cannot start: %s", worker, exc, extra={"worker": worker})
        return START_FAILED
    except BaseException:
        log.exception("worker %d failed", worker, extra={"worker": worker})
        return 1
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        config = load_file(args.config)
        refuse_host_names(config, args.config)
        tls = server_tls(args)  # one pair for every worker (they share the port)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    config = _with_flags(config, args)
    problem = workers_problem(config, args.workers)
    if problem is not None:
        print(f"llmgw extproc: {problem}", file=sys.stderr)
        return 2
    early_hangup.install()  # until each process's loop takes SIGHUP (forks inherit it)
    with worker_group(args.workers):  # the workers peer (share what they route)
        parent = os.getpid()
        pids: dict[int, int] = {}
        for worker in range(1, args.workers):
            pid = os.fork()
            if pid == 0:  # child: serve, then exit without running the parent's cleanup
                code = 1
                try:
                    code = _child(args, config, worker, tls, parent)
                finally:
                    os._exit(code)
            pids[pid] = worker
        children = Children(pids) if pids else None
        try:
            _run_worker(args, config, 0, tls, children)
        except StartError as exc:  # Kubernetes discovery refused (RBAC), a port in use
            print(f"llmgw extproc: cannot start: {exc}", file=sys.stderr)
            return START_FAILED
        finally:
            if children is not None:
                children.stop()
    return children.exit_code if children is not None else 0
