"""`ProxyApp`: the embedded proxy's ASGI app, an OpenAI-compatible reverse proxy.

Routes: `POST /v1/...` inference paths (and any request with the model header) go through
`SchedulerMiddleware` and are forwarded by `llmgw.asgi.forwarder.Forwarder` to the chosen
endpoint; `GET /v1/models` (and `/v1/models/{id}`) lists the configured models;
`/healthz` (also `/health`), `/readyz` and `/models/status` mean what they mean on the Envoy
edge (`llmgw.runtime.health`); `/metrics` (the shared `Telemetry` series, the same names as
the ext_proc server). A browser's CORS preflight on an inference path or the model list is
answered here, as vLLM answers it (`llmgw.request.cors_preflight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import orjson

from llmgw.asgi.forwarder import Forwarder, pool_limits
from llmgw.asgi.middleware import (
    Disconnected,
    SchedulerMiddleware,
    from_browser,
    read_body,
    send_error,
)
from llmgw.asgi.types import Message, Receive, Scope, Send
from llmgw.asgi.upstream import UpstreamPool
from llmgw.catalog import catalog_answer, is_catalog_path
from llmgw.config import Config
from llmgw.errors import BodyTooLarge, LlmgwError, MethodNotAllowed, RouterDraining
from llmgw.request import CORS_ANSWER_HEADERS, cors_preflight
from llmgw.runtime.admin import EXPLAIN_PATH, MAX_QUERY_BYTES, explain
from llmgw.runtime.health import HEALTHZ_BODY, readiness
from llmgw.runtime.router import ConfigWatcher, Router
from llmgw.runtime.telemetry import Telemetry
from llmgw.runtime.trace import close_trace

_log = logging.getLogger("llmgw.proxy")


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
        self.router = router or Router(config, scrape=scrape)
        self.telemetry = telemetry or Telemetry()
        self.telemetry.bind(
            self.router.registry,
            self.router.scraper,
            discovery=self.router.discovery,
            models=self.router.models_status,
            peers=self.router.peer_stats,
        )
        self.pool = UpstreamPool(pool_limits(config))
        self.forwarder = Forwarder(self.pool, self.router.gateway, on_error=self.telemetry.error)
        self.routed = SchedulerMiddleware(
            self.forwarder,
            config,
            router=self.router,
            telemetry=self.telemetry,
            buffer_body=True,
            cors=True,
        )
        self.started = False
        self.start_error: Exception | None = None  # why the lifespan startup failed
        self.draining = False  # SIGTERM: /readyz answers 503 before the listener closes
        self.cut_by_drain = 0  # requests the drain timeout cancelled
        # With a config file: SIGHUP or a change of the file reloads it (see ConfigWatcher).
        self.watcher: ConfigWatcher | None = (
            ConfigWatcher(config_path, self.reload, interval=reload_interval)
            if config_path is not None
            else None
        )
        self._watching: asyncio.Task[None] | None = None

    @property
    def config(self) -> Config:
        return self.router.config

    def reload(self, config: Config) -> None:
        """Route requests that arrive from now on with `config` (one snapshot swap every
        part reads); raises ConfigError. The upstream pool's limits apply to its next
        connections and reads (they were accepted and ignored)."""
        self.router.reload(config)
        self.pool.limits = pool_limits(config)

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
        close_trace(self.routed.hooks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            if scope["method"] == "OPTIONS" and await self._preflight(scope, send):
                return
            if path.startswith("/v1/") and not is_catalog_path(path):
                await self._route(scope, receive, send)
                return
            if path == EXPLAIN_PATH:
                await self._explain(scope, receive, send)
                return
            await self._fixed(path, scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Through the middleware. A request still open when the SIGTERM drain's timeout
        ends is cancelled by uvicorn: that is the drain, not an error, so it gets 503
        `router_draining` if its answer has not begun (a begun one is cut: uvicorn closes
        the connection) rather than uvicorn's plain-text 500 and a logged traceback."""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.routed(scope, receive, tracked)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.draining or task is None:
                raise
            task.uncancel()
            self.cut_by_drain += 1
            if self.cut_by_drain == 1:
                _log.info("drain timeout: cutting the requests still open")
            if not started:
                await self._error(scope, send, RouterDraining("the router is shutting down; retry"))

    async def _fixed(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._catalog if is_catalog_path(path) else self._routes.get(path)
        if handler is None:
            await self._route(scope, receive, send)  # routed if it names a model, else 404
            return
        if scope["method"] not in ("GET", "HEAD"):
            refused = MethodNotAllowed(f"{path} answers GET only", headers={"allow": "GET, HEAD"})
            await self._error(scope, send, refused)
            return
        status, content_type, body = handler(path)
        cors = CORS_ANSWER_HEADERS if from_browser(scope) else None
        await self._send(send, status, content_type, body, cors)

    async def _preflight(self, scope: Scope, send: Send) -> bool:
        """Answer a browser's CORS preflight as vLLM does (`cors_preflight`); False: it is
        none (answered as any other request: an OPTIONS on an inference path is a 405)."""
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in scope["headers"]}
        answer = cors_preflight("OPTIONS", scope["path"], headers)
        if answer is None:
            return False
        await self._send(send, 200, "text/plain; charset=utf-8", b"OK", answer)
        return True

    async def _explain(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            refused = MethodNotAllowed(
                f"{EXPLAIN_PATH} answers POST only", headers={"allow": "POST"}
            )
            await self._error(scope, send, refused)
            return
        config = self.router.gateway.config
        cors = CORS_ANSWER_HEADERS if from_browser(scope) else None
        if not config.admin.explain:  # answered before the body is read
            status, body = explain(self.router.gateway, b"")
            await self._send(send, status, "application/json", body, cors)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        try:  # like a request's body: 413 early (its length said so), 408 on a stall
            if length.isdigit() and int(length) > MAX_QUERY_BYTES:
                raise BodyTooLarge("")
            query = await read_body(receive, MAX_QUERY_BYTES, config.limits.client_body_timeout)
        except Disconnected:
            return
        except BodyTooLarge:
            await self._error(
                scope, send, BodyTooLarge(f"explain query is over {MAX_QUERY_BYTES} bytes")
            )
            return
        except LlmgwError as error:
            await self._error(scope, send, error)
            return
        status, body = explain(self.router.gateway, query)
        await self._send(send, status, "application/json", body, cors)

    async def _error(self, scope: Scope, send: Send, error: LlmgwError) -> None:
        """Answer `error`, counted in `llmgw_errors_total` as every error answered (with
        CORS headers to a browser's request)."""
        self.telemetry.error(error)
        await send_error(send, error, cors=from_browser(scope))

    async def _send(
        self,
        send: Send,
        status: int,
        content_type: str,
        body: bytes,
        extra: dict[str, str] | None = None,
    ) -> None:
        headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        if extra:
            headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    @property
    def _routes(self) -> dict[str, Callable[[str], tuple[int, str, bytes]]]:
        return {
            "/health": self._healthz,  # vLLM's probe path, as the ext_proc edge answers it
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/models/status": self._models_status,
            "/metrics": self._metrics,
        }

    def _catalog(self, path: str) -> tuple[int, str, bytes]:
        answer = catalog_answer(self.router.config, path, self.router.models_status())
        assert answer is not None  # only called for catalog paths
        return answer[0], "application/json", answer[1]

    def _healthz(self, _path: str) -> tuple[int, str, bytes]:
        return 200, "application/json", HEALTHZ_BODY

    def _readyz(self, _path: str) -> tuple[int, str, bytes]:
        ready, body = readiness(self.router, started=self.started, draining=self.draining)
        return (200 if ready else 503), "application/json", body

    def _models_status(self, _path: str) -> tuple[int, str, bytes]:
        return 200, "application/json", orjson.dumps(self.router.models_status())

    def _metrics(self, _path: str) -> tuple[int, str, bytes]:
        body, content_type = self.telemetry.render()
        return 200, content_type, body

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to the server, which exits
                    self.start_error = exc
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_app(
    config: Config,
    *,
    scrape: bool = True,
    config_path: str | None = None,
    reload_interval: float = 1.0,
) -> ProxyApp:
    return ProxyApp(config, scrape=scrape, config_path=config_path, reload_interval=reload_interval)
