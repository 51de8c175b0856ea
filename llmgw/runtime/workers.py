"""What a worker process of `--workers N` (either edge) does about its parent and SIGHUP.

- `exit_with_parent(pid)`: the worker gets SIGTERM (and drains) when its parent dies, even
  by SIGKILL (the OOM killer, `kill -9`), instead of serving on as an orphan that nobody
  stops and a restarted instance shares its port with (SO_REUSEPORT).
- `early_hangup`: a SIGHUP that reaches a process before its reload handler is installed
  (still starting) is noted and applied once it is, instead of ending the process (the
  signal's default action).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger("llmgw.workers")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for `sig` when this process's parent ends (Linux: prctl
    PR_SET_PDEATHSIG); `sig` at once if `parent` has already ended (this process was
    reparented before the call). Elsewhere a no-op. Call it in the worker, from its parent
    `parent`, which must have started it from the thread that lives as long as it does."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0
    except (OSError, AttributeError):  # no libc symbol to call: leave the worker as it is
        return
    if failed:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != parent:  # the parent died before the request reached the kernel
        os.kill(os.getpid(), sig)


# Run as `python -I -S -c _DIES_WITH_PARENT <parent pid> <command...>`: asks the kernel for
# SIGTERM when the parent ends (the thread that started it), then execs the command. A
# `preexec_fn` would do it in fewer processes, but it makes Python fork() rather than
# vfork(), and gRPC's fork handlers crashed the child (a segfault in CI).
_DIES_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    f"    ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, int(signal.SIGTERM), 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM when this process ends, even by SIGKILL (a launched
    engine: orphaned, it kept its GPU and port, and the next llmgw started a second engine
    beside it). As it is off Linux."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _DIES_WITH_PARENT, str(os.getpid()), *argv]


class EarlyHangup:
    """A SIGHUP before the reload handler: noted (`install`), applied later (`take`)."""

    def __init__(self) -> None:
        self.seen = False

    def install(self) -> None:
        """Note SIGHUP from now on (main thread only), until a loop handler replaces this;
        one held back since the spawn (`hangups_blocked`) arrives now, noted."""
        signal.signal(signal.SIGHUP, self._note)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})

    def _note(self, _sig: int, _frame: FrameType | None) -> None:
        self.seen = True

    def take(self) -> bool:
        """Whether a SIGHUP came since `install` (or the last `take`)."""
        seen, self.seen = self.seen, False
        return seen


early_hangup = EarlyHangup()


@contextlib.contextmanager
def hangups_blocked() -> Iterator[None]:
    """SIGHUP held back while processes are spawned: they inherit the blocked signal (across
    exec too) until `early_hangup.install` takes it; spawned by uvicorn, a worker spends
    hundreds of ms importing before it can, and a SIGHUP passed on then killed it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
