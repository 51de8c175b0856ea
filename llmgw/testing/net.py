"""What the host's network stack offers tests (loopback only)."""

from __future__ import annotations

import socket


def ipv6_loopback() -> bool:
    """Whether this host can bind `::1` (tests over IPv6 skip without it)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True
