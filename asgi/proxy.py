"""The embedded proxy: an OpenAI-compatible reverse proxy on `SchedulerMiddleware`.

    llmgw proxy --config llmgw.yaml --host 0.0.0.0 --port 8000

Routes: `POST /v1/...` inference paths (and any request with the model header) go through
the middleware and are forwarded to the chosen endpoint; `GET /v1/models` lists the
configured models; `/healthz` (alive), `/readyz` (started, some endpoint routable),
`/metrics` (the shared `Telemetry` series, the same names as the ext_proc server).

Forwarding (`Forwarder`): the request body is held (it is bounded by
`limits.max_body_bytes` and needed to replay on a fallback) and sent with the client's
headers minus hop-by-hop ones over pooled HTTP/1.1 keep-alive connections
(`asgi.upstream`, limits from `limits.upstream_*`). If the endpoint refuses before any
response byte reached the client (connect error, reset, 429, 503), the request goes to
the Decision's next fallback, at most `num_fallback_replicas` times; once the response
head has been sent nothing is retried. Status, headers (minus hop-by-hop) and the body
pass through chunk by chunk (SSE is never buffered). A client that goes away cancels the
upstream exchange (its connection is dropped) and the lease ends CANCELLED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import orjson

from asgi.middleware import (
    DISPATCH_KEY,
    Dispatch,
    SchedulerMiddleware,
    _Disconnected,
    read_body,
    send_error,
)
from asgi.types import Message, Receive, Scope, Send
from asgi.upstream import (
    ConnectFailed,
    PoolLimits,
    ResetBeforeResponse,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.config import Config, ModelMode, load_file, model_mode
from llmgw.errors import ConfigError, LlmgwError
from llmgw.logs import configure
from llmgw.types import Outcome

if TYPE_CHECKING:
    from llmgw.runtime.router import ConfigWatcher, Router
    from llmgw.runtime.telemetry import Telemetry

log = logging.getLogger("llmgw.proxy")

# Headers that describe one hop, not the message: never forwarded either way.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the upstream client sets itself.
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_REFUSING = (429, 503)  # an engine saying "not now": another replica may take it
_WATCH_AFTER = 0.02  # seconds before a slow exchange starts watching for a disconnect


class UpstreamUnreachable(LlmgwError):
    """No endpoint of the Decision could be reached (connect error, reset, timeout)."""

    status = 502
    code = "upstream_unreachable"
    type = "server_error"


class RouteNotFound(LlmgwError):
    status = 404
    code = "route_not_found"
    type = "invalid_request_error"


class MethodNotAllowed(LlmgwError):
    status = 405
    code = "method_not_allowed"
    type = "invalid_request_error"


def pool_limits(config: Config) -> PoolLimits:
    limits = config.limits
    return PoolLimits(
        max_connections=limits.upstream_max_connections,
        connect_timeout=limits.upstream_connect_timeout,
        read_timeout=limits.upstream_read_timeout,
        idle_timeout=limits.upstream_idle_timeout,
    )


class Forwarder:
    """The inner ASGI app: forwards a routed request to `scope["state"]["llmgw_dispatch"]`."""

    def __init__(self, pool: UpstreamPool, config: Config) -> None:
        self.pool = pool
        self.max_body = config.limits.max_body_bytes
        self.debug_headers = config.debug_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state") or {}
        dispatch: Dispatch | None = state.get(DISPATCH_KEY)
        if dispatch is None:
            error = RouteNotFound(f"no route for {scope['method']} {scope['path']}")
            await send_error(send, error)
            return
        try:
            body = await read_body(receive, self.max_body)
        except _Disconnected:
            return
        except LlmgwError as error:
            await send_error(send, error)
            return
        query: bytes = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        if query:
            target = target + b"?" + query
        headers = [(n, v) for n, v in scope["headers"] if n not in _REQUEST_DROP]

        task = asyncio.current_task()
        assert task is not None
        watch = _DisconnectWatch(receive, task)
        response: UpstreamResponse | None = None
        try:
            response = await self._exchange(
                dispatch, scope["method"], target.decode("latin-1"), headers, body
            )
            await self._relay(dispatch, response, send)
        except UpstreamUnreachable as error:
            await send_error(send, error)
        except UpstreamError as error:
            # Cut after the head went out (engine died mid-stream): nothing can be retried.
            # A failure for the breaker; uvicorn closes the client connection unfinished.
            log.warning("upstream broke mid-response: %s", error)
            dispatch.finish(Outcome.FAILURE)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            task.uncancel()  # the client went away: the middleware records CANCELLED
        finally:
            watch.stop()
            if response is not None:
                response.close()

    async def _exchange(
        self,
        dispatch: Dispatch,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """The first acceptable response head, trying fallbacks while nothing was sent."""
        while True:
            address = dispatch.endpoint.address
            try:
                response = await self.pool.request(address, method, target, headers, body)
            except (ConnectFailed, ResetBeforeResponse, UpstreamTimeout) as exc:
                log.debug("upstream %s refused before answering: %s", address, exc)
                if dispatch.fall_back(Outcome.FAILURE) is None:
                    raise UpstreamUnreachable(
                        f"no endpoint of model {dispatch.decision.model!r} could be reached "
                        f"(tried {dispatch.attempts}; last: {exc})"
                    ) from None
                continue
            if response.status in _REFUSING and dispatch.fall_back(Outcome.BACKPRESSURE):
                log.debug("upstream %s answered %d; falling back", address, response.status)
                response.close()
                continue
            return response

    async def _relay(self, dispatch: Dispatch, response: UpstreamResponse, send: Send) -> None:
        headers = [(n, v) for n, v in response.headers if n not in _HOP_BY_HOP]
        if self.debug_headers:
            headers.append((b"x-llmgw-endpoint", dispatch.endpoint.address.encode("latin-1")))
        start: Message = {
            "type": "http.response.start",
            "status": response.status,
            "headers": headers,
        }
        if response.complete:  # the whole body came with the head: one send each
            body = response.take_buffered()
            response.release()
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(start)
        while True:
            data = await response.next_chunk()
            done = response.complete and not response.has_buffered
            if not data or done:
                response.release()
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})


class _DisconnectWatch:
    """Cancels the forwarding task when the client disconnects.

    Waiting on `receive()` takes a task of its own; most exchanges are over before
    `_WATCH_AFTER`, so the watcher is only started when one takes longer (a timer handle
    costs far less than a task). Uvicorn remembers a disconnect, so none is missed.
    """

    __slots__ = ("_receive", "_task", "_timer", "_watcher", "gone")

    def __init__(self, receive: Receive, task: asyncio.Task[None]) -> None:
        self._receive = receive
        self._task = task
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            _WATCH_AFTER, self._start
        )

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._task.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class ProxyApp:
    """The proxy's ASGI app: a handful of fixed routes, everything else through the middleware."""

    def __init__(
        self,
        config: Config,
        *,
        router: Router | None = None,
        telemetry: Telemetry | None = None,
        scrape: bool = True,
        config_path: str | None = None,
        reload_interval: float = 1.0,
    ) -> None:
        from llmgw.runtime.router import ConfigWatcher, Router  # noqa: PLC0415
        from llmgw.runtime.telemetry import Telemetry  # noqa: PLC0415

        self.config = config
        self.router = router or Router(config, scrape=scrape)
        self.telemetry = telemetry or Telemetry()
        self.telemetry.bind(self.router.registry, self.router.scraper)
        self.pool = UpstreamPool(pool_limits(config))
        self.forwarder = Forwarder(self.pool, config)
        self.routed = SchedulerMiddleware(
            self.forwarder, config, router=self.router, telemetry=self.telemetry
        )
        self.started = False
        self.draining = False  # SIGTERM: /readyz answers 503 before the listener closes
        self._models = _model_list(config)
        # With a config file: SIGHUP or a change of the file reloads it (see ConfigWatcher).
        self.watcher: ConfigWatcher | None = (
            ConfigWatcher(config_path, self.reload, interval=reload_interval)
            if config_path is not None
            else None
        )
        self._watching: asyncio.Task[None] | None = None

    def reload(self, config: Config) -> None:
        """Route requests that arrive from now on with `config`; raises ConfigError.
        (Upstream pool limits stay as they were at start.)"""
        self.router.reload(config)
        self.config = config
        self.routed.reconfigure(config)
        self.forwarder.max_body = config.limits.max_body_bytes
        self.forwarder.debug_headers = config.debug_headers
        self._models = _model_list(config)

    async def startup(self) -> None:
        await self.router.start()
        if self.watcher is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, self.watcher.reload)
            if self.watcher.interval > 0:
                self._watching = loop.create_task(self.watcher.run(), name="config watch")
        self.started = True

    async def shutdown(self) -> None:
        self.started = False
        if self.watcher is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
            self._watching = None
        await self.router.stop()
        await self.pool.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            if path.startswith("/v1/") and path != "/v1/models":
                await self.routed(scope, receive, send)
                return
            await self._fixed(path, scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _fixed(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        handler = {
            "/v1/models": self._list_models,
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/metrics": self._metrics,
        }.get(path)
        if handler is None:
            await self.routed(scope, receive, send)  # routed if it names a model, else 404
            return
        if scope["method"] not in ("GET", "HEAD"):
            await send_error(send, MethodNotAllowed(f"{path} answers GET only"))
            return
        status, content_type, body = handler()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _list_models(self) -> tuple[int, str, bytes]:
        return 200, "application/json", self._models

    def _healthz(self) -> tuple[int, str, bytes]:
        return 200, "application/json", b'{"status":"ok"}'

    def _readyz(self) -> tuple[int, str, bytes]:
        registry = self.router.registry
        now = registry.clock()
        models: dict[str, dict[str, object]] = {}
        ready = self.started
        routable = False
        for name, spec in self.config.models.items():
            mode = model_mode(spec)
            states = registry.states(name)
            available = sum(1 for s in states if s.breaker.available(now))
            models[name] = {"mode": mode.value, "endpoints": len(states), "available": available}
            routable |= available > 0 or mode is ModelMode.ON_DEMAND
        ready = ready and routable and not self.draining
        body = orjson.dumps({"ready": ready, "models": models})
        return (200 if ready else 503), "application/json", body

    def _metrics(self) -> tuple[int, str, bytes]:
        body, content_type = self.telemetry.render()
        return 200, content_type, body

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _model_list(config: Config) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
                for name in config.models
            ],
        }
    )


def build_app(
    config: Config,
    *,
    scrape: bool = True,
    config_path: str | None = None,
    reload_interval: float = 1.0,
) -> ProxyApp:
    return ProxyApp(config, scrape=scrape, config_path=config_path, reload_interval=reload_interval)


def _draining_server(config: Any, app: ProxyApp, drain_delay: float) -> Any:
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


def _event_loop_and_parser() -> tuple[str, str]:
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


_WORKER_ARGS = "_LLMGW_PROXY_WORKER_ARGS"  # parent -> worker processes, set by main()


def _worker_app() -> ProxyApp:
    """The app of one worker process of `--workers N` (uvicorn imports it by name)."""
    args = orjson.loads(os.environ[_WORKER_ARGS])
    return build_app(
        load_file(args["config"]),
        scrape=args["scrape"],
        config_path=args["config"],
        reload_interval=args["reload_interval"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw proxy", description="OpenAI-compatible routing proxy (no Envoy needed)."
    )
    parser.add_argument("--config", required=True, help="llmgw config file (YAML)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes sharing the port; each routes on its own (same ring, own inflight)",
    )
    parser.add_argument("--no-scrape", action="store_true", help="do not poll /metrics")
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds between SIGTERM (readiness false) and closing the listener",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=10.0, help="seconds open requests get to finish"
    )
    parser.add_argument(
        "--reload-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the config file for changes (0: only on SIGHUP)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    args = parser.parse_args(argv)
    configure(args.log_level)
    try:
        config = load_file(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    import uvicorn  # noqa: PLC0415

    loop, http = _event_loop_and_parser()
    options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "loop": loop,
        "http": http,
        "lifespan": "on",
        "access_log": False,
        "log_level": args.log_level,
        "server_header": False,
        "date_header": False,
        "proxy_headers": False,  # a routing proxy forwards X-Forwarded-* untouched
        "timeout_graceful_shutdown": args.drain_timeout,
    }
    if args.workers > 1:
        os.environ[_WORKER_ARGS] = orjson.dumps(
            {
                "config": os.path.abspath(args.config),
                "scrape": not args.no_scrape,
                "reload_interval": args.reload_interval,
            }
        ).decode()
        uvicorn.run("asgi.proxy:_worker_app", factory=True, workers=args.workers, **options)
        return 0
    app = build_app(
        config,
        scrape=not args.no_scrape,
        config_path=args.config,
        reload_interval=args.reload_interval,
    )
    server = _draining_server(uvicorn.Config(app, **options), app, args.drain_delay)
    server.run()
    return 0 if server.started else 1
