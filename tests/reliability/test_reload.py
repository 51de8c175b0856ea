"""`Router.reload` and `ConfigWatcher`: a new config without dropping live state."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.breaker import BreakerState
from llmgw.config import Config, load_dict
from llmgw.errors import ConfigError
from llmgw.runtime.router import ConfigWatcher, Router
from llmgw.sim import SimFleet
from llmgw.types import Outcome, RequestInfo

A, B, C, D = (f"127.0.0.1:{9200 + i}" for i in range(4))


def config_dict(endpoints: list[str], **top: Any) -> dict[str, Any]:
    return {
        "models": {"m1": {"endpoints": endpoints, "strategy": "ring"}},
        "breaker": {"failure_threshold": 1, "base_cooldown": 30, "max_cooldown": 60},
        **top,
    }


def make(endpoints: list[str], **top: Any) -> Config:
    return load_dict(config_dict(endpoints, **top))


def request(session: str) -> RequestInfo:
    return RequestInfo(model="m1", request_id=session, session_key=session)


def test_reload_keeps_inflight_and_breakers_of_endpoints_that_stay() -> None:
    router = Router(make([A, B, C]), scrape=False)
    registry = router.registry
    first = registry.states("m1")[0].endpoint
    lease_a = router.scheduler.acquire(router.scheduler.pick(request("s")), first)
    assert lease_a.endpoint_id == A
    registry.acquire("m1", B)
    registry.release("m1", B, Outcome.FAILURE)  # threshold 1: B is open
    assert registry.breaker_states()[("m1", B)] is BreakerState.OPEN

    router.reload(make([A, B, D]))

    state_a = registry.get("m1", A)
    assert state_a is not None and state_a.inflight == 1
    assert registry.breaker_states()[("m1", B)] is BreakerState.OPEN
    assert registry.get("m1", C) is None
    assert registry.get("m1", D) is not None
    picked = {router.scheduler.pick(request(f"s{i}")).endpoint.address for i in range(200)}
    assert picked == {A, D}  # C left, B is still open
    lease_a.finish(Outcome.SUCCESS)
    assert state_a.inflight == 0


def test_unchanged_model_keeps_its_router_a_changed_one_is_rebuilt() -> None:
    base = config_dict([A, B])
    base["models"]["m2"] = {"endpoints": [C], "strategy": "chat"}
    router = Router(load_dict(base), scrape=False)
    m1, m2 = router.scheduler.routers["m1"], router.scheduler.routers["m2"]
    base["models"]["m2"]["strategy"] = "least-load"
    router.reload(load_dict(base))
    assert router.scheduler.routers["m1"] is m1  # ring and prefix index kept
    assert router.scheduler.routers["m2"] is not m2
    assert router.scheduler.routers["m2"].strategy_name == "least-load"


def test_removed_model_is_404_added_model_routes() -> None:
    router = Router(make([A]), scrape=False)
    new = config_dict([A])
    new["models"] = {"m3": {"endpoints": [B]}}
    router.reload(load_dict(new))
    assert router.registry.states("m1") == []
    with pytest.raises(Exception, match="does not exist"):
        router.scheduler.pick(request("x"))
    decision = router.scheduler.pick(RequestInfo(model="m3", request_id="r"))
    assert decision.endpoint.address == B


def test_new_breaker_settings_apply_to_endpoints_that_stay() -> None:
    router = Router(make([A, B]), scrape=False)
    new = config_dict([A, B])
    new["breaker"] = {"failure_threshold": 5, "base_cooldown": 0.1, "max_cooldown": 1}
    router.reload(load_dict(new))
    state = router.registry.get("m1", A)
    assert state is not None and state.breaker.settings.failure_threshold == 5
    assert router.registry.staleness == router.config.scrape.staleness


def test_changing_an_on_demand_model_is_rejected_and_nothing_changes() -> None:
    lazy = {"launch": {"command": "sim --port {port}"}, "scaling": {"min": 0, "max": 1}}
    first = config_dict([A])
    first["models"]["lazy"] = lazy
    router = Router(load_dict(first), scrape=False, control_plane=None)
    second = config_dict([A, B])
    second["models"]["lazy"] = {**lazy, "scaling": {"min": 0, "max": 2}}
    with pytest.raises(ConfigError) as info:
        router.reload(load_dict(second))
    assert info.value.problems == [
        "models.lazy: launch and scaling of an on-demand model change only on restart"
    ]
    assert [s.id for s in router.registry.states("m1")] == [A]
    assert router.config.models["lazy"].scaling.max == 1  # type: ignore[union-attr]


def _write(path: Path, data: Any, *, bump: int) -> None:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    # The poll compares mtime and size: make the change visible however coarse the clock.
    stamp = 1_700_000_000_000_000_000 + bump * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def test_watcher_reloads_on_change_and_rejects_an_invalid_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "llmgw.yaml"
    _write(path, config_dict([A]), bump=0)
    router = Router(make([A]), scrape=False)
    watcher = ConfigWatcher(path, router.reload)
    assert watcher.check() is None  # unchanged: not even parsed

    _write(path, config_dict([A, B]), bump=1)
    assert watcher.check() is True
    assert [s.id for s in router.registry.states("m1")] == [A, B]

    bad = config_dict([A, "not-an-address"])
    _write(path, bad, bump=2)
    with caplog.at_level(logging.ERROR, logger="llmgw.reload"):
        assert watcher.check() is False
    assert watcher.rejected == 1
    assert "models.m1.endpoints.1.address: must be host:port" in caplog.text
    assert [s.id for s in router.registry.states("m1")] == [A, B]  # old config kept

    _write(path, "models: [unclosed", bump=3)
    assert watcher.reload() is False
    assert watcher.check() is None  # a rejected file is not retried until it changes again
    assert watcher.reloads == 1


async def test_scraper_follows_the_reloaded_endpoints() -> None:
    async with SimFleet(replicas=2, model="m1", time_scale=0) as fleet:
        first, second = (u.removeprefix("http://") for u in fleet.urls)
        config = make([first], scrape={"interval": 0.02})
        router = Router(config, control_plane=None)
        await router.start()
        try:
            router.reload(make([second], scrape={"interval": 0.02}))
            state = router.registry.get("m1", second)
            assert state is not None

            async def scraped() -> None:
                while state.metrics is None:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(scraped(), 5.0)
            assert router.scraper is not None
            assert set(router.scraper._loops) == {second}
        finally:
            await router.stop()
