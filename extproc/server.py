"""`llmgw extproc`: the Envoy external-processing server (grpc.aio), health and metrics.

Thin on purpose: each gRPC stream gets an `Exchange` (extproc/translate.py) that turns
messages into answers; this module only reads, writes, and releases on stream end.

Ports (defaults): gRPC 9002 (ext_proc + grpc.health.v1), HTTP 9003 (`/healthz`,
`/readyz`, `/models/status`, `POST /admin/explain` if enabled), HTTP 9090 (`/metrics`). SIGTERM: readiness goes false, new streams are
refused after `--drain-delay`, open ones get `--drain-timeout` seconds to finish.
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

from llmgw.config import Config, load_file
from llmgw.errors import ConfigError
from llmgw.extproc.translate import Exchange
from llmgw.lifecycle import AwaitActivation
from llmgw.logs import configure
from llmgw.runtime.admin import EXPLAIN_PATH, MAX_QUERY_BYTES, explain
from llmgw.runtime.driver import activate
from llmgw.runtime.health import readiness
from llmgw.runtime.router import ConfigWatcher, router_for
from llmgw.runtime.telemetry import Telemetry
from llmgw.runtime.trace import close_trace, shared_trace_problem, traced
from llmgw.scheduling.scheduler import Scheduler

log = logging.getLogger("llmgw.extproc")

PROCESS_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICE = "grpc.health.v1.Health"
# grpc.health.v1.HealthCheckResponse{status}: field 1, varint. Two bytes, no codegen needed.
_SERVING = b"\x08\x01"
_NOT_SERVING = b"\x08\x02"


def _identity(data: bytes) -> bytes:
    return data


def _health_service(request: bytes) -> str:
    """grpc.health.v1.HealthCheckRequest{service = 1 (string)}; empty = the whole server."""
    if len(request) >= 2 and request[0] == 0x0A and request[1] < 0x80:
        return request[2 : 2 + request[1]].decode("utf-8", "replace")
    return ""


class ExtProcServer:
    """One ext_proc server: gRPC + health + metrics listeners around one Scheduler."""

    def __init__(
        self,
        config: Config,
        *,
        host: str = "0.0.0.0",
        grpc_port: int = 9002,
        health_port: int | None = 9003,
        metrics_port: int | None = 9090,
        scrape: bool = True,
        scheduler: Scheduler | None = None,
        telemetry: Telemetry | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.host = host
        self.router = router_for(config, scheduler=scheduler, scrape=scrape)
        self.gateway = self.router.gateway
        self.telemetry = telemetry or Telemetry()
        self.scraper = self.router.scraper
        self.telemetry.bind(self.router.registry, self.scraper, self.router.models_status)
        self.hooks = traced(self.telemetry.hooks("extproc"), config.trace)
        self.draining = False
        self.open_streams = 0
        self._ports = {"grpc": grpc_port, "health": health_port, "metrics": metrics_port}
        self._reuse_port = reuse_port
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._health_changed = asyncio.Event()

    @property
    def config(self) -> Config:
        return self.gateway.config

    @property
    def scheduler(self) -> Scheduler:
        return self.gateway.scheduler

    # -- ext_proc ------------------------------------------------------------------------
    async def process(self, _requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        """One Envoy stream = one HTTP request. Reader/writer API: no generator overhead."""
        exchange = Exchange(self.gateway, self.hooks)
        self.open_streams += 1
        try:
            read, write, eof = context.read, context.write, grpc.aio.EOF
            while True:
                message = await read()
                if message is eof:
                    break
                answer = exchange.handle(message)
                if isinstance(answer, AwaitActivation):
                    answer = exchange.answer(await activate(exchange.lifecycle, answer))
                await write(answer)
        finally:
            # Response end, client abort or stream cancel: release exactly once.
            exchange.close()
            self.open_streams -= 1

    # -- grpc.health.v1 ------------------------------------------------------------------
    def _health_bytes(self, service: str) -> bytes:
        known = service in ("", PROCESS_SERVICE)
        return _SERVING if known and not self.draining else _NOT_SERVING

    async def _health_check(self, request: bytes, context: Any) -> bytes:
        service = _health_service(request)
        if service not in ("", PROCESS_SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return self._health_bytes(service)

    async def _health_watch(self, request: bytes, context: Any) -> None:
        service = _health_service(request)
        last = b""
        while True:
            current = self._health_bytes(service)
            if current != last:
                await context.write(current)
                last = current
            self._health_changed.clear()
            await self._health_changed.wait()

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

    async def _serve_http(self, routes: list[web.RouteDef], port: int) -> int:
        app = web.Application(client_max_size=MAX_QUERY_BYTES)
        app.add_routes(routes)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port, reuse_port=self._reuse_port or None)
        await site.start()
        self._runners.append(runner)
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def ports(self) -> dict[str, int | None]:
        return dict(self._ports)

    async def start(self) -> None:
        max_message = self.config.limits.max_body_bytes + (1 << 20)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
                ("grpc.so_reuseport", 1 if self._reuse_port else 0),
            ]
        )
        handlers: dict[str, Callable[..., Any]] = {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.process,
                request_deserializer=ProcessingRequest.FromString,
                response_serializer=_identity,
            )
        }
        health = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self._health_check, request_deserializer=_identity, response_serializer=_identity
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self._health_watch, request_deserializer=_identity, response_serializer=_identity
            ),
        }
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(PROCESS_SERVICE, handlers),
                grpc.method_handlers_generic_handler(HEALTH_SERVICE, health),
            )
        )
        bound = server.add_insecure_port(f"{self.host}:{self._ports['grpc']}")
        if not bound:
            raise OSError(f"cannot bind gRPC port {self.host}:{self._ports['grpc']}")
        self._ports["grpc"] = bound
        await self.router.start()
        await server.start()
        self._grpc = server
        if self._ports["health"] is not None:
            self._ports["health"] = await self._serve_http(
                [
                    web.get("/healthz", self._healthz),
                    web.get("/readyz", self._readyz),
                    web.get("/models/status", self._models_status),
                    web.post(EXPLAIN_PATH, self._explain),
                ],
                self._ports["health"],
            )
        if self._ports["metrics"] is not None:
            self._ports["metrics"] = await self._serve_http(
                [web.get("/metrics", self._metrics)], self._ports["metrics"]
            )
        log.info("ext_proc listening", extra={"ports": self.ports})

    def reload(self, config: Config) -> None:
        """Route new streams with `config` (see `Router.reload`); raises ConfigError."""
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
        await self.router.stop()
        close_trace(self.hooks)
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw extproc", description="Envoy ext_proc endpoint picker for LLM servers."
    )
    parser.add_argument("--config", required=True, help="llmgw config file (YAML)")
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--grpc-port", type=int, default=9002)
    parser.add_argument("--health-port", type=int, default=9003)
    parser.add_argument("--metrics-port", type=int, default=9090)
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
        type=int,
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
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    return parser


async def serve(args: argparse.Namespace, config: Config, worker: int = 0) -> None:
    # Workers > 0 share the gRPC port only; health and metrics stay with worker 0.
    server = ExtProcServer(
        config,
        host=args.host,
        grpc_port=args.grpc_port,
        health_port=args.health_port if worker == 0 else None,
        metrics_port=args.metrics_port if worker == 0 else None,
        scrape=not args.no_scrape,
        reuse_port=args.workers > 1,
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
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP or a changed file: reload; an invalid file is logged and the old config kept.
    watcher = ConfigWatcher(
        args.config, lambda c: server.reload(_with_flags(c, args)), interval=args.reload_interval
    )
    loop.add_signal_handler(signal.SIGHUP, watcher.reload)
    polling = asyncio.create_task(watcher.run()) if args.reload_interval > 0 else None
    await stop.wait()
    if polling is not None:
        polling.cancel()
    log.info("draining", extra={"open_streams": server.open_streams})
    server.begin_drain()
    if args.drain_delay > 0:
        await asyncio.sleep(args.drain_delay)  # let load balancers see readiness go false
    await server.stop(args.drain_timeout)


def _with_flags(config: Config, args: argparse.Namespace) -> Config:
    """The config as the command line amends it."""
    if args.debug_headers:
        return config.model_copy(update={"debug_headers": True})
    return config


def _run_worker(args: argparse.Namespace, config: Config, worker: int) -> None:
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if args.loop == "uvloop":
        import uvloop  # noqa: PLC0415 (optional dependency)

        loop_factory = uvloop.new_event_loop
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=loop_factory) as runner,
    ):
        runner.run(serve(args, config, worker))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        config = load_file(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    config = _with_flags(config, args)
    if args.workers < 1:
        print("llmgw extproc: --workers must be >= 1", file=sys.stderr)
        return 2
    problem = shared_trace_problem(config.trace, args.workers)
    if problem is not None:
        print(f"llmgw extproc: {problem}", file=sys.stderr)
        return 2
    children: list[int] = []
    for worker in range(1, args.workers):
        pid = os.fork()
        if pid == 0:  # child: serve, then exit without running the parent's cleanup
            code = 0
            try:
                _run_worker(args, config, worker)
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    try:
        _run_worker(args, config, 0)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    return 0
