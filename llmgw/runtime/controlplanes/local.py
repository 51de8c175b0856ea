"""Local processes: each model's `launch.command` runs in its own process group.

`{port}`, `{host}` and `{model}` in the command are filled in; the control plane waits for
`launch.health_path` to answer 200, stops with SIGTERM then SIGKILL after a grace period
(the whole group, so an engine's worker processes go too), and reaps crashed processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from llmgw.config import Config, LaunchSpec, launch_argv
from llmgw.discovery import join
from llmgw.runtime.controlplanes import CrashCallback, StartError
from llmgw.runtime.httpget import HttpGetError, KeepAliveGetter
from llmgw.runtime.ports import free_port
from llmgw.runtime.workers import dies_with_parent
from llmgw.types import Endpoint


class _Replica:
    def __init__(self, process: asyncio.subprocess.Process, endpoint: Endpoint, log: Path) -> None:
        self.process = process
        self.endpoint = endpoint
        self.log = log
        self.stopping = False
        self.watcher: asyncio.Task[None] | None = None


class LocalProcessControlPlane:
    def __init__(
        self, config: Config, *, grace: float = 10.0, health_interval: float = 0.25
    ) -> None:
        self.config = config
        self.grace = grace
        self.health_interval = health_interval
        self._replicas: dict[str, _Replica] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._callbacks: list[CrashCallback] = []
        # Terminations under way: one whose caller is cancelled (the router stopping during
        # an idle stop) still ends the group, and close() waits for it.
        self._terminations: set[asyncio.Task[None]] = set()

    def on_crash(self, callback: CrashCallback) -> None:
        self._callbacks.append(callback)

    def _launch(self, model: str) -> LaunchSpec:
        spec = self.config.models[model]
        if spec.launch is None or spec.launch.command is None:
            raise StartError(f"model {model!r} has no launch.command")
        return spec.launch

    async def want(self, model: str) -> list[Endpoint]:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            running = self._replicas.get(model)
            if running is not None and running.process.returncode is None:
                return [running.endpoint]
            return [await self._start(model)]

    async def _start(self, model: str) -> Endpoint:
        launch = self._launch(model)
        spec = self.config.models[model]
        port = launch.base_port or free_port(launch.host)
        assert launch.command is not None
        try:  # checked at config load: this only fails for a config built another way
            argv = launch_argv(launch.command, port=port, host=launch.host, model=model)
        except ValueError as exc:
            raise StartError(f"launch.{exc}") from None
        # Output goes to a file, not a pipe: a chatty engine would block on a full pipe.
        fd, log_name = tempfile.mkstemp(prefix=f"llmgw-{model}-{port}-", suffix=".log")
        try:
            if shutil.which(argv[0]) is None:  # (the wrapper below would only log it)
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv[0])
            process = await asyncio.create_subprocess_exec(
                # SIGTERM when this process dies, however (the engine takes its workers down).
                *dies_with_parent(argv),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=fd,
                stderr=fd,
                start_new_session=True,  # own process group: stop() signals the whole tree
            )
        except OSError as exc:
            raise StartError(f"cannot run {argv[0]!r}: {exc}") from None
        finally:
            os.close(fd)
        endpoint = Endpoint(
            address=join(launch.host, port), model=model, pool=model, engine=spec.engine
        )
        replica = _Replica(process, endpoint, Path(log_name))
        timeout = spec.scaling.start_timeout if spec.scaling else 300.0
        try:
            await self._wait_healthy(replica, launch, timeout)
        except BaseException:  # a failed or cancelled start must not leave an engine running
            await asyncio.shield(self._terminate(replica))
            raise
        self._replicas[model] = replica
        replica.watcher = asyncio.create_task(self._watch(model, replica))
        return endpoint

    async def _wait_healthy(self, replica: _Replica, launch: LaunchSpec, timeout: float) -> None:
        host, _, port = replica.endpoint.address.rpartition(":")
        getter = KeepAliveGetter(host.strip("[]"), int(port))
        deadline = time.monotonic() + timeout
        try:
            while True:
                if replica.process.returncode is not None:
                    tail = _log_tail(replica.log)
                    raise StartError(
                        f"process exited with code {replica.process.returncode} before becoming "
                        f"healthy{': ' + tail if tail else ''}"
                    )
                try:
                    async with asyncio.timeout(max(0.05, min(2.0, deadline - time.monotonic()))):
                        status, _ = await getter.get(launch.health_path)
                    if status == 200:
                        return
                except (HttpGetError, TimeoutError):
                    pass
                if time.monotonic() >= deadline:
                    raise StartError(
                        f"health check {launch.health_path} did not pass within {timeout:g}s"
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.health_interval):
                        await replica.process.wait()
        finally:
            await getter.close()

    async def _watch(self, model: str, replica: _Replica) -> None:
        code = await replica.process.wait()
        if replica.stopping:
            return
        if self._replicas.get(model) is replica:
            del self._replicas[model]
        tail = _log_tail(replica.log)
        reason = f"process exited with code {code}{': ' + tail if tail else ''}"
        # The parent is gone; workers it forked into its group may still hold the GPU.
        _signal_group(replica.process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            replica.log.unlink()
        for callback in self._callbacks:
            callback(model, reason)

    async def _terminate(self, replica: _Replica) -> None:
        """SIGTERM the whole group, SIGKILL what is left after the grace period, and return
        only when no process of the group is alive (engines fork workers that outlive
        their parent for a moment)."""
        replica.stopping = True
        pgid = replica.process.pid
        _signal_group(pgid, signal.SIGTERM)
        if not await _group_gone(pgid, self.grace):
            _signal_group(pgid, signal.SIGKILL)
            await _group_gone(pgid, 10.0)
        if replica.process.returncode is None:
            await replica.process.wait()
        if replica.watcher is not None:
            replica.watcher.cancel()
        with contextlib.suppress(OSError):
            replica.log.unlink()

    async def stop(self, model: str) -> None:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            replica = self._replicas.pop(model, None)
            if replica is not None:
                task = asyncio.ensure_future(self._terminate(replica))
                self._terminations.add(task)
                task.add_done_callback(self._terminations.discard)
                await asyncio.shield(task)

    def status(self, model: str) -> dict[str, object]:
        replica = self._replicas.get(model)
        if replica is None:
            return {"running": False}
        return {
            "running": replica.process.returncode is None,
            "pid": replica.process.pid,
            "endpoint": replica.endpoint.address,
        }

    async def close(self) -> None:
        for model in list(self._replicas):
            await self.stop(model)
        if self._terminations:
            await asyncio.gather(*self._terminations, return_exceptions=True)


def _log_tail(path: Path, limit: int = 400) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc where there is one."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


async def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)  # polling the kernel's process table under a deadline
    return True
