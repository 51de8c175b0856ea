"""Runs an EngineModel in real time on asyncio: one task steps it while it has work."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from llmgw.sim.model import EngineModel, SeqRequest, Sequence

# Zero-duration steps run back to back; yield to the loop this often to keep I/O going.
_STEPS_PER_YIELD = 256
# A busy engine's steps follow each other on the accelerator whatever its HTTP side does:
# a step that starts late because the event loop was busy (a /metrics render takes ~2 ms,
# and one process serves every replica of a fleet) starts when the last one ended, up to
# this far back. Without it each late wake-up pushed every later step back: scraped at
# 10 Hz, 4 replicas in one process stepped ~9 % slower (25.7 -> 28 ms decode steps, p90
# 26 -> 33 ms), which real engines, whose model runs in its own process, do not.
_MAX_CATCH_UP = 0.1


class ChangeSignal:
    """Wakes waiters whenever engine state changes, so tests wait on state, not on time."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Return once `predicate()` holds; raises TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self._event.wait()


class SeqHandle:
    """A caller's view of one sequence: wait for tokens or for the end."""

    __slots__ = ("_every_token", "_waiter", "seq")

    def __init__(self, seq: Sequence, every_token: bool) -> None:
        self.seq = seq
        self._every_token = every_token
        self._waiter: asyncio.Future[None] | None = None

    async def wait_tokens(self, seen: int) -> int:
        """Wait until more than `seen` tokens exist or the sequence ended; return the count."""
        seq = self.seq
        while seq.output_tokens <= seen and not seq.finished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return seq.output_tokens

    async def wait_finished(self) -> Sequence:
        while not self.seq.finished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.seq

    def _notify(self, finished: bool) -> None:
        waiter = self._waiter
        if waiter is not None and (finished or self._every_token) and not waiter.done():
            waiter.set_result(None)
            self._waiter = None


class EngineDriver:
    """Owns the stepping task of one engine model; `on_finish` sees every ended sequence,
    `on_first_token` every sequence whose first token a step just produced."""

    def __init__(
        self,
        model: EngineModel,
        on_finish: Callable[[Sequence], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        signal: ChangeSignal | None = None,
        on_schedule: Callable[[], None] | None = None,
        on_first_token: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.model = model
        self._on_schedule = on_schedule  # after each step is scheduled (KV events publish)
        self.signal = signal or ChangeSignal()
        self._on_finish = on_finish
        self._on_first_token = on_first_token
        self._clock = clock
        self._handles: dict[int, SeqHandle] = {}
        self._submitted_at = float("-inf")  # the last request's arrival (the clock's time)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in list(self._handles.values()):
            self.abort(handle)

    def submit(self, request: SeqRequest, every_token: bool = False) -> SeqHandle:
        """Queue a request (raises QueueFullError / RequestTooLargeError)."""
        self._submitted_at = now = self._clock()
        seq = self.model.submit(request, now)
        handle = SeqHandle(seq, every_token)
        self._handles[seq.seq_id] = handle
        self._wake.set()
        self.signal.notify()
        return handle

    def abort(self, handle: SeqHandle) -> None:
        if handle.seq.finished:
            return
        self.model.abort(handle.seq, self._clock())
        if self._on_schedule is not None:
            self._on_schedule()
        self._handles.pop(handle.seq.seq_id, None)
        if self._on_finish is not None:
            self._on_finish(handle.seq)
        handle._notify(True)
        self.signal.notify()

    async def _run(self) -> None:
        model = self.model
        clock = self._clock
        steps = 0
        ended: float | None = None  # when the last step ended, while the engine stays busy
        while True:
            if not model.has_work:
                ended = None
                self._wake.clear()
                await self._wake.wait()
            start = clock()
            if ended is not None and start - ended < _MAX_CATCH_UP:
                # Back to back with the last step; not before a request it admits arrived.
                start = ended if ended > self._submitted_at else self._submitted_at
            duration = model.schedule(start)
            if self._on_schedule is not None:
                self._on_schedule()
            if duration > 0:
                end = start + duration
                delay = end - clock()
                # Catching up (delay <= 0) still yields once a step: HTTP handlers and the
                # other replicas run between steps, however short the steps are.
                await asyncio.sleep(delay if delay > 0 else 0)
                ended = end
            else:
                end = start
                ended = None
                steps += 1
                if steps >= _STEPS_PER_YIELD:
                    steps = 0
                    await asyncio.sleep(0)
            result = model.complete(end)
            handles = self._handles
            on_first = self._on_first_token
            for seq in result.emitted:
                if on_first is not None and seq.output_tokens == 1:
                    on_first(seq)
                handle = handles.get(seq.seq_id)
                if handle is not None and not seq.finished:
                    handle._notify(False)
            for seq in result.finished:
                handle = handles.pop(seq.seq_id, None)
                if self._on_finish is not None:
                    self._on_finish(seq)
                if handle is not None:
                    handle._notify(True)
            self.signal.notify()
