"""The embedded proxy (`ProxyApp` under uvicorn) on its own event loop in a daemon thread,
for sync callers (`llmgw demo --edge proxy`, tests)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import Future

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.protocol import guarded
from llmgw.asgi.testing import serve
from llmgw.config import Config


class ProxyThread:
    """Serves `ProxyApp(config)` on 127.0.0.1:<ephemeral>; `url` is its base URL."""

    def __init__(self, config: Config, timeout: float = 10.0) -> None:
        self.app = ProxyApp(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="llmgw-proxy"
        )
        self._thread.start()
        self._stop: asyncio.Event | None = None
        started: Future[str] = Future()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(started), self._loop)
        try:
            self.url = started.result(timeout)
        except BaseException:
            self._halt(timeout)
            raise

    async def _serve(self, started: Future[str]) -> None:
        self._stop = asyncio.Event()
        try:
            async with serve(
                self.app, http=guarded(self.app.config.limits, self.app.telemetry.error)
            ) as base:  # listening before it returns: no polling
                started.set_result(base)
                await self._stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    def stop(self, timeout: float = 15.0) -> None:
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._halt(timeout)

    def _halt(self, timeout: float) -> None:
        with contextlib.suppress(Exception):  # stopping: a failure was reported at start
            self._serving.result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
