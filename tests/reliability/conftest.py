"""Fixtures for the reliability tests: real `llmgw extproc` / `llmgw proxy` processes.

- `sim` (module): 4 simulated vLLM replicas serving `m1` in a background thread.
- `spawn_extproc(config, **options)`: `llmgw extproc` as a child process on loopback
  (gRPC on a given or free port, health and metrics on free ports); waits for its ready
  file. `spawn_proxy(config, **options)`: `llmgw proxy` on a free port; waits for /healthz.
  Both write the config dict to a YAML file (`.config_path`), log to a file (`.log()`), and
  are killed at the end of the test if still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.runtime.ports import free_port
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import quick_fleet, wait_for


@dataclass
class Child:
    process: subprocess.Popen[bytes]
    ports: dict[str, int]
    config_path: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def write_config(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)  # atomic: the watcher never reads half a file

    def kill(self) -> None:
        """SIGKILL its whole process group (`--workers N` spawns processes of its own,
        which a SIGKILL of the parent alone would orphan)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def http_status(url: str, timeout: float = 2.0) -> int:
    """The status of a GET, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


SpawnFn = Callable[..., Child]


def _flags(options: dict[str, Any]) -> list[str]:
    """`drain_delay=0.5` -> `--drain-delay 0.5`; `no_scrape=True` -> `--no-scrape`."""
    out: list[str] = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def sim() -> Iterator[ThreadedFleet]:
    fleet = quick_fleet(seed=5)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def _prepare(tmp_path: Path, name: str, config: dict[str, Any]) -> tuple[Path, Path]:
    config_path = tmp_path / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return config_path, tmp_path / f"{name}.log"


@pytest.fixture
def spawn_extproc(tmp_path: Path, children: list[Child]) -> SpawnFn:
    def spawn(
        config: dict[str, Any], *, grpc_port: int | None = None, name: str = "extproc", **opts: Any
    ) -> Child:
        config_path, log_path = _prepare(tmp_path, name, config)
        ready = tmp_path / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "llmgw.cli",
            "extproc",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port or free_port()),
            "--plaintext",  # the Envoy configs here are built with build(): plaintext
            "--grpc-health-port",
            "0",
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            "--ready-file",
            str(ready),
        ]
        args += _flags(opts)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        child = Child(process, {}, config_path, log_path)
        children.append(child)

        def is_ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"llmgw extproc exited: {child.log()}")
            return ready.exists()

        wait_for(is_ready, 20, "llmgw extproc ready file")
        child.ports = {k: v for k, v in json.loads(ready.read_text()).items() if k != "pid"}
        return child

    return spawn


@pytest.fixture
def spawn_proxy(tmp_path: Path, children: list[Child]) -> SpawnFn:
    def spawn(config: dict[str, Any], *, name: str = "proxy", **opts: Any) -> Child:
        config_path, log_path = _prepare(tmp_path, name, config)
        port = free_port()
        args = [
            sys.executable,
            "-m",
            "llmgw.cli",
            "proxy",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "info",
        ]
        args += _flags(opts)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        child = Child(process, {"http": port}, config_path, log_path)
        children.append(child)

        def is_ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"llmgw proxy exited: {child.log()}")
            return http_status(child.url("http") + "/healthz") == 200

        wait_for(is_ready, 20, "llmgw proxy /healthz")
        return child

    return spawn
