"""The Rust peer routers (`vllm-router`, `sglang-router`) for benchmarks, and process helpers.

The peers live in their own venv, `.venv-peers/` at the repository root (never in the
project's `.venv`): `make bench` creates it at set-up (`python -m bench.peers`, the pinned
`PEER_PACKAGES`); a benchmark installs them only when asked (`--install-peers`).

    peers = ensure_peers()                          # {"vllm-router": "/.../bin/vllm-router"}
    cmd = peer_command("vllm-router", peers, port, upstreams, policy="cache_aware")
    with Service(cmd, "http://127.0.0.1:PORT/health") as svc: ...

`Service` starts any command with its output in a log file, waits until a health URL
answers 200, and stops it (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from llmgw.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".venv-peers"
# Pinned to a range like pyproject's dependencies (what the README's tables were run with).
PEER_PACKAGES = {
    "vllm-router": "vllm-router>=0.1.17,<0.2",
    "sglang-router": "sglang-router>=0.3.2,<0.4",
}

# Which policies each peer offers for the routing benchmark (checked against --help).
PEER_POLICIES: dict[str, tuple[str, ...]] = {
    "vllm-router": (
        "consistent_hash",
        "cache_aware",
        "sticky_least_loaded",
        "round_robin",
        "power_of_two",
        "cache_aware-docs",
    ),
    "sglang-router": ("cache_aware", "round_robin", "power_of_two", "cache_aware-docs"),
}

# A policy name with a `-docs` suffix runs the policy with the cache_aware values the
# peer's own documentation recommends, instead of its CLI's defaults (cache-threshold 0.3,
# balance-abs 64, balance-rel 1.5, eviction 60-120 s: sized for batches of hundreds of
# sequences; with 8 a replica the balance rule rarely fires). vllm-router:
# docs/load_balancing/README.md (0.5 / 32 / 1.1, eviction 30 s); sglang-router: the
# `Router` docstring in sglang_router/router.py (0.5 / 32 / 1.0001, eviction 60 s).
DOCS_ARGS: dict[str, list[str]] = {
    "vllm-router": ["--cache-threshold", "0.5", "--balance-abs-threshold", "32",
                    "--balance-rel-threshold", "1.1", "--eviction-interval-secs", "30"],
    "sglang-router": ["--cache-threshold", "0.5", "--balance-abs-threshold", "32",
                      "--balance-rel-threshold", "1.0001", "--eviction-interval-secs", "60"],
}  # fmt: skip


def install_peers(check: bool = True) -> None:
    """pip-install the pinned peers into .venv-peers (created if missing)."""
    if not (PEERS_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    subprocess.run(
        [str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PEER_PACKAGES.values()], check=check
    )


def add_install_option(parser: argparse.ArgumentParser) -> None:
    """`--install-peers` (a benchmark installs nothing unless asked); `--no-install`, the
    default now, is still accepted."""
    parser.add_argument(
        "--install-peers", action="store_true", help="pip-install missing peers (.venv-peers)"
    )
    parser.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)


def ensure_peers(install: bool = False) -> dict[str, str]:
    """{name: executable} of the Rust routers, installing them into .venv-peers if asked."""
    binaries = {name: str(PEERS_VENV / "bin" / name) for name in PEER_PACKAGES}
    missing = [n for n, path in binaries.items() if not Path(path).exists()]
    if missing and install:
        install_peers(check=False)
    return {n: p for n, p in binaries.items() if Path(p).exists()}


def peer_command(
    name: str, peers: dict[str, str], port: int, upstreams: list[str], *, policy: str
) -> list[str]:
    """The command line that runs peer `name` with `policy` in front of `upstreams`."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    metrics = ["--prometheus-port", str(free_port())]
    extra: list[str] = []
    if policy.endswith("-docs"):
        policy, extra = policy.removesuffix("-docs"), DOCS_ARGS[name]
    if name == "vllm-router":
        return [
            peers[name],
            "--worker-urls",
            *upstreams,
            "--policy",
            policy,
            "--log-level",
            "warning",
            *extra,
            *metrics,
            *host,
        ]
    if name == "sglang-router":
        return [
            peers[name],
            "launch",
            "--worker-urls",
            *upstreams,
            "--policy",
            policy,
            "--log-level",
            "warn",
            *extra,
            *metrics,
            *host,
        ]
    raise ValueError(f"unknown peer {name!r}")


def http_status(url: str, timeout: float = 1.0) -> int:
    """Status of GET `url`; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


class Service:
    """A child process with its output in a log file; ready once `ready_url` answers 200."""

    def __init__(
        self,
        command: list[str],
        ready_url: str | None,
        *,
        name: str = "",
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.name = name or Path(command[0]).name
        self.ready_url = ready_url
        self.timeout = timeout
        self.env = env
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the service)
            prefix=f"bench-{self.name}-", suffix=".log", delete=False
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(self.env or {})},
        )
        if self.ready_url is not None:
            deadline = time.monotonic() + self.timeout
            while http_status(self.ready_url) != 200:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                    )
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.name} not ready within {self.timeout} s")
                time.sleep(0.1)  # polling a starting process, bounded by the deadline
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self, tail: int = 3000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-tail:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":  # `make bench`'s set-up
    argparse.ArgumentParser(
        description="Install the pinned peer routers (vllm-router, sglang-router) into "
        ".venv-peers, from the configured package index."
    ).parse_args()  # --help answers without installing
    install_peers()
