"""What a worker process of `--workers N` does about its parent and an early SIGHUP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from llmgw.runtime.workers import EarlyHangup, exit_with_parent, hangups_blocked


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


def test_a_sighup_to_a_process_spawned_with_hangups_blocked_waits_for_its_handler() -> None:
    """uvicorn's workers spend hundreds of ms importing before they install the handler; a
    SIGHUP passed on then killed them (the default action). Spawned under
    `hangups_blocked`, the signal waits and is noted at `install`. Found by a review
    helper."""
    child = (
        "import sys\n"
        "from llmgw.runtime.workers import early_hangup\n"
        "sys.stdin.readline()\n"  # the parent sent SIGHUP by now
        "early_hangup.install()\n"
        "print(early_hangup.take())\n"
    )
    with hangups_blocked():
        process = subprocess.Popen(
            [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    try:
        os.kill(process.pid, signal.SIGHUP)
        out, _ = process.communicate("go\n", timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert (process.returncode, out.strip()) == (0, "True")
