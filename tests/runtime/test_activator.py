from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from llmgw.config import Config, load_dict
from llmgw.errors import ModelDisabled, ModelFailed, ModelLoading, ModelNotFound
from llmgw.runtime.controlplanes.local import LocalProcessControlPlane, group_members
from llmgw.runtime.router import Router
from llmgw.testing.controlplane import FakeControlPlane
from llmgw.testing.wait import eventually
from llmgw.types import Endpoint, Outcome, RequestInfo


def config(timeout: float = 5.0, **scaling: object) -> Config:
    return load_dict(
        {
            "activation_timeout": timeout,
            "activation_poll_interval": 0.01,
            "models": {
                "lazy": {
                    "launch": {"command": "true {port}", "expected_start_seconds": 30},
                    "scaling": {"min": 0, "max": 1, **scaling},
                },
                "off": {"launch": {"command": "true {port}"}, "scaling": {"min": 0, "max": 0}},
                "nostanza": {"launch": {"command": "true {port}"}},
            },
        }
    )


def req(model: str, i: int = 0) -> RequestInfo:
    return RequestInfo(model=model, request_id=f"r{i}")


async def test_twenty_cold_requests_cause_exactly_one_start() -> None:
    cp = FakeControlPlane()
    router = Router(config(), control_plane=cp, scrape=False)
    waiters = [asyncio.create_task(router.decide(req("lazy", i))) for i in range(20)]
    async with asyncio.timeout(5):
        while router.activator is None or router.activator.machines["lazy"].waiters < 20:
            await asyncio.sleep(0)
    cp.release.set()
    decisions = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert cp.wants == 1
    assert {d.endpoint.address for d in decisions} == {"127.0.0.1:9"}


async def test_timeout_gives_503_retry_after_and_the_start_still_completes() -> None:
    cp = FakeControlPlane()
    router = Router(config(timeout=0.05), control_plane=cp, scrape=False)
    with pytest.raises(ModelLoading) as info:
        await router.decide(req("lazy"))
    assert info.value.status == 503 and 1 <= int(info.value.headers["retry-after"]) <= 60
    assert b"loading" in info.value.body()
    cp.release.set()
    decision = await asyncio.wait_for(router.decide(req("lazy", 1)), 5)
    assert decision.endpoint.address == "127.0.0.1:9" and cp.wants == 1


async def test_unknown_model_is_404_not_loading() -> None:
    router = Router(config(), control_plane=FakeControlPlane(), scrape=False)
    with pytest.raises(ModelNotFound) as info:
        await router.decide(req("nope"))
    assert info.value.status == 404 and info.value.code == "model_not_found"


@pytest.mark.parametrize("model", ["off", "nostanza"])
async def test_disabled_model_is_503_without_a_start(model: str) -> None:
    cp = FakeControlPlane()
    router = Router(config(), control_plane=cp, scrape=False)
    with pytest.raises(ModelDisabled) as info:
        await router.decide(req(model))
    assert info.value.headers["x-should-retry"] == "false"
    assert cp.wants == 0


async def test_failed_start_reports_the_reason() -> None:
    cp = FakeControlPlane()
    cp.fail_with = "exit code 3: CUDA not found"
    cp.release.set()
    router = Router(config(), control_plane=cp, scrape=False)
    with pytest.raises(ModelFailed) as info:
        await router.decide(req("lazy"))
    assert "CUDA not found" in info.value.message
    assert router.models_status()["lazy"]["last_error"] == "exit code 3: CUDA not found"


class NoReplicaStart(FakeControlPlane):
    """A control plane whose start returns no replica (the protocol allows it)."""

    async def want(self, model: str) -> list[Endpoint]:
        self.wants += 1
        return []


async def test_a_start_with_no_replica_fails_at_once_and_the_loop_keeps_running() -> None:
    """Running with no replica in the registry, its waiters spun on a set event until the
    activation timeout, holding the event loop: nothing else ran (found by a review
    helper). Now such a start has failed, and says why."""
    router = Router(config(timeout=0.5), control_plane=NoReplicaStart(), scrape=False)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        with pytest.raises(ModelFailed) as info:
            await asyncio.wait_for(router.decide(req("lazy")), 5)
    finally:
        task.cancel()
    assert "no replica" in info.value.message and ticks > 1


async def test_idle_model_is_stopped_and_started_again_later() -> None:
    cp = FakeControlPlane()
    cp.release.set()
    router = Router(config(idle_timeout=0.01), control_plane=cp, scrape=False)
    assert router.activator is not None
    decision = await router.decide(req("lazy"))
    lease = router.acquire(decision)
    clock = router.activator.clock
    router.activator.clock = lambda: clock() + 100  # jump past the idle timeout
    await router.activator.tick()
    assert cp.stops == 0  # a request is in flight
    lease.finish(Outcome.SUCCESS)
    router.activator.clock = lambda: clock() + 200
    await router.activator.tick()
    assert cp.stops == 1 and router.registry.states("lazy") == []
    await router.decide(req("lazy", 2))
    assert cp.wants == 2


async def test_local_control_plane_starts_and_stops_a_real_process() -> None:
    cfg = load_dict(
        {
            "activation_timeout": 30,
            "activation_poll_interval": 0.05,
            "models": {
                "m1": {
                    "launch": {
                        "command": f"{sys.executable} -m llmgw.sim --port {{port}} --model {{model}}"
                    },
                    "scaling": {"min": 0, "max": 1, "start_timeout": 30},
                }
            },
        }
    )
    router = Router(cfg, scrape=False)
    assert router.activator is not None
    try:
        decision = await router.decide(req("m1"))
        status = router.activator.control_plane.status("m1")
        assert status["running"] is True and status["endpoint"] == decision.endpoint.address
        pid = status["pid"]
        assert isinstance(pid, int)
    finally:
        await router.stop()
    assert router.activator.control_plane.status("m1") == {"running": False}
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_local_control_plane_reports_a_process_that_exits_at_start() -> None:
    cfg = load_dict(
        {
            "models": {
                "m1": {
                    "launch": {
                        "command": f"{sys.executable} -c 'import sys; sys.exit(\"no weights\")' {{port}}"
                    },
                    "scaling": {"min": 0, "max": 1, "start_timeout": 10},
                }
            }
        }
    )
    router = Router(cfg, scrape=False)
    try:
        with pytest.raises(ModelFailed) as info:
            await router.decide(req("m1"))
        assert "exited with code 1" in info.value.message and "no weights" in info.value.message
    finally:
        await router.stop()


async def test_a_crash_releases_the_replica_and_the_next_request_restarts_it() -> None:
    cp = FakeControlPlane()
    cp.release.set()
    router = Router(config(), control_plane=cp, scrape=False)
    assert router.activator is not None
    await router.decide(req("lazy"))
    for callback in cp.callbacks:
        callback("lazy", "exit code -9")
    async with asyncio.timeout(5):
        while cp.stops == 0:
            await asyncio.sleep(0)
    status = router.models_status()["lazy"]
    assert status["state"] == "failed" and status["last_error"] == "exit code -9"
    clock = router.activator.clock
    router.activator.clock = lambda: clock() + 60  # past the failure backoff
    await router.decide(req("lazy", 1))
    assert cp.wants == 2
    await router.stop()


async def test_always_on_model_is_never_stopped_for_idleness_and_restarts_after_a_crash() -> None:
    cp = FakeControlPlane()
    cp.release.set()
    cfg = load_dict(
        {
            "models": {
                "warm": {
                    "launch": {"command": "true {port}"},
                    "scaling": {"min": 1, "max": 1, "idle_timeout": 0.01},
                }
            }
        }
    )
    router = Router(cfg, control_plane=cp, scrape=False)
    assert router.activator is not None
    await router.start()
    try:
        await router.decide(req("warm"))
        clock = router.activator.clock
        router.activator.clock = lambda: clock() + 1000
        await router.activator.tick()
        assert cp.stops == 0 and router.models_status()["warm"]["state"] == "idle"
        for callback in cp.callbacks:
            callback("warm", "killed")
        router.activator.clock = lambda: clock() + 2000  # past the failure backoff
        await router.activator.tick()
        async with asyncio.timeout(5):
            while router.models_status()["warm"]["state"] != "idle":
                await asyncio.sleep(0)
        assert cp.wants == 2
    finally:
        await router.stop()


async def test_a_cancelled_start_leaves_no_process_behind() -> None:
    token = f"llmgw-test-{uuid.uuid4().hex}"  # finds this test's process, not anybody else's
    cfg = load_dict(
        {
            "models": {
                "slow": {
                    "launch": {
                        "command": f"{sys.executable} -c 'import time; time.sleep(60)' {{port}} {token}"
                    },
                    "scaling": {"min": 0, "max": 1, "start_timeout": 60},
                }
            }
        }
    )
    cp = LocalProcessControlPlane(cfg, grace=2)
    started = asyncio.create_task(cp.want("slow"))
    pids: list[int] = []
    async with asyncio.timeout(10):
        while not pids:
            await asyncio.sleep(0.02)  # polling the process table under a deadline
            pids = [
                int(p.name)
                for p in Path("/proc").iterdir()
                if p.name.isdigit() and _cmdline(p).endswith(token)
            ]
    started.cancel()
    with pytest.raises(asyncio.CancelledError):
        await started
    assert all(group_members(pid) == [] for pid in pids)


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("in_control_plane", [False, True])
async def test_a_start_cancelled_at_shutdown_fails_its_waiters_at_once(
    in_control_plane: bool,
) -> None:
    """The start is cancelled (the router stops) while requests wait: they get a failed
    start, not a wait that finds the model still starting until their timeout (woken again
    and again once the start had reached the control plane: a busy loop; never woken if
    it had not run yet)."""
    cp = FakeControlPlane()
    router = Router(config(timeout=30), control_plane=cp, scrape=False)
    waiter = asyncio.create_task(router.decide(req("lazy")))
    async with asyncio.timeout(5):
        while router.activator is None or router.activator.machines["lazy"].waiters < 1:
            await asyncio.sleep(0)
        while in_control_plane and cp.wants < 1:
            await asyncio.sleep(0)
    activator = router.activator
    await activator.stop()
    with pytest.raises(ModelFailed, match="stopping"):
        await asyncio.wait_for(waiter, 2)


async def test_router_stopping_during_an_idle_stop_still_ends_the_engines_group() -> None:
    """The stop was cancelled in its SIGTERM grace period, the replica already forgotten:
    an engine that ignores SIGTERM outlived the router."""
    stubborn = Path(__file__).with_name("stubborn_engine.py")
    cfg = load_dict(
        {
            "activation_timeout": 30,
            "models": {
                "m1": {
                    "launch": {"command": f"{sys.executable} {stubborn} {{port}}"},
                    "scaling": {"min": 0, "max": 1, "start_timeout": 30, "idle_timeout": 0.01},
                }
            },
        }
    )
    cp = LocalProcessControlPlane(cfg, grace=2.0)
    router = Router(cfg, control_plane=cp, scrape=False)
    activator = router.activator
    assert activator is not None
    await router.start()
    pid: int | None = None
    try:
        await router.decide(req("m1"))
        started = cp.status("m1")["pid"]
        assert isinstance(started, int)
        pid = started
        clock = activator.clock
        activator.clock = lambda: clock() + 100  # idle past its timeout: the loop stops it
        await eventually(lambda: cp.status("m1") == {"running": False})  # SIGTERM sent
        assert group_members(pid)  # ignoring it, in its grace period
        await router.stop()
        assert group_members(pid) == []
    finally:
        if pid is not None and group_members(pid):
            os.killpg(pid, signal.SIGKILL)


class _SlowStop(FakeControlPlane):
    def __init__(self) -> None:
        super().__init__()
        self.drained = asyncio.Event()  # "lazy"'s pods take long to drain

    async def stop(self, model: str) -> None:
        self.stops += 1
        if model == "lazy":
            await self.drained.wait()


async def test_a_slow_idle_stop_does_not_hold_the_other_models() -> None:
    """It was awaited inside the tick: no other model was idle-stopped, and no crashed
    always-on model restarted, until it ended (a Deployment's: up to stop_timeout)."""
    cfg = load_dict(
        {
            "models": {
                "lazy": {
                    "launch": {"command": "true {port}"},
                    "scaling": {"min": 0, "max": 1, "idle_timeout": 0.01},
                },
                "warm": {"launch": {"command": "true {port}"}, "scaling": {"min": 1, "max": 1}},
            }
        }
    )
    cp = _SlowStop()
    cp.release.set()
    router = Router(cfg, control_plane=cp, scrape=False)
    activator = router.activator
    assert activator is not None
    await router.start()
    try:
        await router.decide(req("lazy"))
        await eventually(lambda: activator.machines["warm"].state.value == "idle")
        clock = activator.clock
        activator.clock = lambda: clock() + 100
        await eventually(lambda: cp.stops == 1)  # lazy's stop began, and drains
        for callback in cp.callbacks:
            callback("warm", "killed")
        activator.clock = lambda: clock() + 1000  # past the failure backoff
        await eventually(lambda: activator.machines["warm"].state.value == "idle", timeout=5)
    finally:
        cp.drained.set()
        await router.stop()


async def test_a_request_right_after_a_failed_start_is_told_start_failed_not_429() -> None:
    """The failed start's woken waiters stay counted until they run again (one loop turn):
    a request in that turn, with the waiter cap full, got 429 "requests already wait for
    model to load" with the failed start's load estimate, not 503 `model_start_failed`
    with the backoff (found by a review helper)."""
    config = load_dict(
        {
            "activation_timeout": 30,
            "models": {
                "lazy": {
                    "launch": {"command": "true {port}", "expected_start_seconds": 30},
                    "scaling": {"min": 0, "max": 1, "max_waiting_requests": 2},
                }
            },
        }
    )
    plane = FakeControlPlane()
    router = Router(config, control_plane=plane, scrape=False)
    activator = router.activator
    assert activator is not None
    waiters = [asyncio.create_task(activator.ensure_ready("lazy")) for _ in range(2)]
    async with asyncio.timeout(5):
        while activator.machines["lazy"].waiters < 2:
            await asyncio.sleep(0)  # a loop turn: the waiters start waiting
    plane.fail_with = "CUDA out of memory"
    plane.release.set()
    await asyncio.sleep(0)  # the start fails and wakes its waiters, which have not run yet
    assert activator.machines["lazy"].failed
    try:
        with pytest.raises(ModelFailed):
            await activator.ensure_ready("lazy")
    finally:
        await asyncio.gather(*waiters, return_exceptions=True)
        await activator.stop()
