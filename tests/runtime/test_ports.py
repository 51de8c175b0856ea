"""`llmgw.runtime.ports.free_port`: ports a child process can bind after we close the probe."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw.runtime import ports


def test_ports_come_from_below_the_ephemeral_range_and_bind_and_are_not_reused() -> None:
    low, _ = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    for port in got:
        assert ports._LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_taken_port_and_one_handed_out_before_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = ports.free_port()
    low, _ = ports.ephemeral_range()
    candidates = (p for p in range(ports._LOWEST, low) if p != first and p not in ports._given)
    with socket.socket() as holder:
        held = next(candidates)
        holder.bind(("127.0.0.1", held))  # another socket holds this one
        free = next(candidates)
        draws = iter([first, held, free])
        monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(draws))
        assert ports.free_port() == free


def test_without_room_below_the_range_a_bind_zero_port_is_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    assert ports.ephemeral_range() == (1024, 65535)
    port = ports.free_port()
    assert 1024 <= port <= 65535
    range_file.write_text("garbage")
    assert ports.ephemeral_range() == ports._DEFAULT_EPHEMERAL
