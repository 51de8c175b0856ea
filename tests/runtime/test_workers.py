"""What a worker process of `--workers N` does about its parent and an early SIGHUP."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from llmgw.runtime.workers import EarlyHangup, exit_with_parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_worker_whose_parent_is_already_gone_gets_its_signal_at_once() -> None:
    """The race prctl alone misses: the parent died before the worker asked (the worker
    served on as an orphan; found by a review helper)."""
    pid = os.fork()
    if pid == 0:  # a "worker" told a parent it does not have: as if reparented already
        try:
            exit_with_parent(os.getppid() + 1_000_000)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM


def test_a_worker_whose_parent_lives_goes_on() -> None:
    pid = os.fork()
    if pid == 0:
        try:
            exit_with_parent(os.getppid())
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_sighup_before_the_reload_handler_is_noted_not_fatal() -> None:
    """A SIGHUP passed on to a worker still starting ended it (the signal's default)."""
    before = signal.getsignal(signal.SIGHUP)
    hangup = EarlyHangup()
    try:
        hangup.install()
        assert hangup.take() is False
        os.kill(os.getpid(), signal.SIGHUP)
        assert hangup.take() is True
        assert hangup.take() is False
    finally:
        signal.signal(signal.SIGHUP, before)
