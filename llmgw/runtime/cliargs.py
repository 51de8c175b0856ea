"""Argument types the servers' command lines share: a bad value is named at parse time
(exit 2), not found later as a socket error or a silent wrap-around."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (0: one the kernel picks)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 0-65535")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value
