"""Several simulated replicas: in this event loop, in a background thread, or in a
child process. See the package docstring for examples.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from llmgw.sim.faults import Faults
from llmgw.sim.model import EngineConfig
from llmgw.sim.replica import Replica, ReplicaOptions

T = TypeVar("T")


def build_options(
    model: str | None = None,
    models: list[str] | tuple[str, ...] | None = None,
    engine: str = "vllm",
    seed: int = 0,
    faults: Faults | dict[str, Any] | None = None,
    crash_exits_process: bool = False,
    default_output_tokens: tuple[int, int] = (16, 64),
    kv_events_port: int | None = None,
    **engine_options: Any,
) -> ReplicaOptions:
    """ReplicaOptions from keyword arguments; `engine_options` are EngineConfig fields."""
    names = tuple(models) if models else (model or "m1",)
    if isinstance(faults, dict):
        faults = Faults().updated(faults)
    return ReplicaOptions(
        models=names,
        engine=engine,
        engine_config=EngineConfig(**engine_options),
        seed=seed,
        faults=faults or Faults(),
        default_output_tokens=default_output_tokens,
        crash_exits_process=crash_exits_process,
        kv_events_port=kv_events_port,
    )


class SimFleet:
    """N replicas on host, ports base_port+i (base_port 0: ephemeral ports)."""

    def __init__(
        self,
        replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        options: ReplicaOptions | None = None,
        **option_kwargs: Any,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if options is not None and option_kwargs:
            raise ValueError("pass either options or keyword options, not both")
        self.options = options or build_options(**option_kwargs)
        self.host = host
        self.replicas = [
            Replica(self.options, index=i, host=host, port=base_port + i if base_port else 0)
            for i in range(replicas)
        ]

    @property
    def ports(self) -> list[int]:
        return [replica.port for replica in self.replicas]

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    async def start(self) -> None:
        try:
            for replica in self.replicas:
                await replica.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for replica in self.replicas:
            await replica.stop()

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @classmethod
    def start_in_thread(cls, replicas: int = 1, **kwargs: Any) -> ThreadedFleet:
        """Run a fleet on its own event loop in a daemon thread (for sync tests)."""
        threaded = ThreadedFleet(cls(replicas, **kwargs))
        threaded.start()
        return threaded


class ThreadedFleet:
    """A SimFleet on a background loop; use as a context manager or call stop()."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="llmgw-sim"
        )

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    @property
    def ports(self) -> list[int]:
        return self.fleet.ports

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        self.run(self.fleet.start(), timeout)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run a coroutine on the fleet's loop and wait for its result."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Call a plain function on the fleet's loop (replicas are not thread-safe)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper(), timeout)

    def set_faults(self, index: int, **changes: Any) -> Faults:
        return self.call(lambda: self.fleet.replicas[index].set_faults(**changes))

    def reset(self, index: int) -> None:
        self.call(self.fleet.replicas[index].reset)

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        self.run(self.fleet.stop(), timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()

    def __enter__(self) -> ThreadedFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@dataclass
class SimProcess:
    """A `python -m llmgw.sim` child process that is listening."""

    process: subprocess.Popen[bytes]
    host: str
    ports: list[int]

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        return self.process.returncode

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def spawn(args: list[str], timeout: float = 15.0, **popen: Any) -> SimProcess:
    """Start `python -m llmgw.sim *args --ready-file F` and wait until it listens.

    Pass `--port 0` or `--base-port 0` style args for ephemeral ports; the bound ports
    come back in `SimProcess.ports`. Raises RuntimeError if the child dies first.
    """
    with tempfile.TemporaryDirectory(prefix="llmgw-sim-") as directory:
        ready = Path(directory) / "ready.json"
        command = [sys.executable, "-m", "llmgw.sim", *args, "--ready-file", str(ready)]
        process = subprocess.Popen(command, **popen)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"sim exited with {process.returncode} before listening")
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"sim did not listen within {timeout} s")
            # Polling a file the child writes atomically; 20 ms keeps start-up snappy.
            time.sleep(0.02)
        info = json.loads(ready.read_text())
    return SimProcess(process=process, host=info["host"], ports=list(info["ports"]))


def write_ready_file(path: str, host: str, ports: list[int]) -> None:
    """Write the bound ports as JSON atomically (readers never see half a file)."""
    target = Path(path)
    temporary = target.with_name(target.name + f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"host": host, "ports": ports, "pid": os.getpid()}))
    temporary.replace(target)


__all__ = [
    "SimFleet",
    "SimProcess",
    "ThreadedFleet",
    "build_options",
    "spawn",
    "write_ready_file",
]
