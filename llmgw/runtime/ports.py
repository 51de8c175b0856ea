"""Free TCP ports for processes that must be told their port before they start.

`bind(port 0)` hands out a port from the kernel's ephemeral range, the same range the kernel
draws from for the local end of every outgoing connection and every other `bind(0)`. Between
closing the probe socket and the child binding the port, any of those can take it: CI failed
once on exactly this (Envoy: "cannot bind '127.0.0.1:56677': Address already in use", while
the test's clients were opening connections). Ports below the ephemeral range are only ever
taken by an explicit bind, so `free_port` draws from there and checks that the port binds.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default; also below macOS's 49152-65535
_LOWEST = 10000  # stay clear of the well-known and registered ports most services use
# Its own generator: a test or a simulation that seeds the global one must not make two
# processes draw the same ports.
_rng = random.Random()
_given: set[int] = set()  # handed out by this process (cleared when it holds 1,000)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _binds(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, attempts: int = 200) -> int:
    """An unused TCP port on `host`, outside the ephemeral range, not handed out before by
    this process. Falls back to a `bind(0)` port if the range below is too small or full."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, _ = ephemeral_range()
    if low - _LOWEST >= 1000:
        for _ in range(attempts):
            port = _rng.randrange(_LOWEST, low)
            if port not in _given and _binds(family, host, port):
                if len(_given) >= 1000:  # a long-lived gateway starting replicas for days
                    _given.clear()
                _given.add(port)
                return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
