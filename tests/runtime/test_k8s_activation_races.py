"""On-demand activation on Kubernetes when the API server or another router gets in the
way: a failed idle stop is tried again, and a start whose Deployment was scaled to 0
meanwhile raises it back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llmgw.config import Config, load_dict
from llmgw.registry import Registry
from llmgw.runtime.activator import Activator
from llmgw.runtime.controlplanes.k8s import KubernetesControlPlane
from llmgw.testing.fake_k8s import FakeKubernetes
from llmgw.testing.wait import eventually


def k8s_config(idle_timeout: float = 60.0, **scaling: Any) -> Config:
    return load_dict(
        {
            "activation_timeout": 5,
            "activation_poll_interval": 0.02,
            "models": {
                "big": {
                    "launch": {"deployment": "vllm-big", "namespace": "models"},
                    "scaling": {
                        "min": 0,
                        "max": 1,
                        "start_timeout": 5,
                        "idle_timeout": idle_timeout,
                        **scaling,
                    },
                }
            },
        }
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def made(api: Any) -> AsyncIterator[list[KubernetesControlPlane]]:
    planes: list[KubernetesControlPlane] = []
    yield planes
    for plane in planes:
        await plane.close()


def plane_on(
    api: Any, config: Config, made: list[KubernetesControlPlane]
) -> KubernetesControlPlane:
    plane = KubernetesControlPlane(config, api_client=api, poll_interval=0.02, blind_after=0.5)
    made.append(plane)
    return plane


async def test_an_idle_stop_that_hit_an_api_error_is_retried(
    kube: FakeKubernetes, api: Any, made: list[KubernetesControlPlane]
) -> None:
    """The idle stop's scale-to-0 meets a moment without the API server (a restart, a
    blip, a 5xx): the stop logs it and the model is `off`, but nothing ever patches the
    Deployment to 0 again: its replicas (GPUs) stay up for good while llmgw reports the
    model off."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18101])
    config = k8s_config(idle_timeout=10)
    clock = Clock()
    plane = plane_on(api, config, made)
    activator = Activator(config, Registry(), plane, clock=clock)
    await activator.ensure_ready("big")
    assert deployment.replicas == 1
    await kube.go_down()  # the API server restarts just as the idle timer runs out
    clock.now += 11
    await activator.tick()
    assert activator.machines["big"].state.value == "off"
    await kube.come_back()
    for _ in range(40):  # 20 idle timeouts' worth of activator passes, API back
        clock.now += 10
        await activator.tick()
        await asyncio.sleep(0.05)
        if deployment.replicas == 0:
            break
    assert deployment.replicas == 0, (
        f"model reported {activator.machines['big'].state.value!r} but its Deployment still "
        f"runs {deployment.replicas} replica(s); plane status: {plane.status('big')}"
    )


async def test_a_start_that_found_the_deployment_up_notices_it_scaled_to_zero_meanwhile(
    kube: FakeKubernetes, api: Any, made: list[KubernetesControlPlane]
) -> None:
    """Two llmgw replicas: B's first request reads the scale (1: A runs the model), and A's
    idle stop patches it to 0 a moment later (A had not heard of B's request yet). B's
    start did not patch, so it waits for a ready pod of a Deployment at 0 replicas: none
    ever comes, and B's clients get 503 model_loading for the whole start_timeout (300 s
    by default), then model_start_failed, while one patch would have brought the model back."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18103])
    config = k8s_config(start_timeout=3)
    a = plane_on(api, config, made)
    b = plane_on(api, config, made)
    await a.want("big")  # replica A started the model and served it
    ensure = b._ensure_replicas
    stopped = False

    async def read_then_a_stops(target: Any, state: Any) -> bool:
        nonlocal stopped
        scaled = await ensure(target, state)  # B reads replicas=1: no patch
        if not stopped:  # ... and A's idle stop lands just after B's first look
            stopped = True
            await a.stop("big")
        return scaled

    b._ensure_replicas = read_then_a_stops  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        endpoints = await b.want("big")
    except Exception as exc:  # StartError after start_timeout
        pytest.fail(
            f"B waited {loop.time() - began:.1f}s (its whole start_timeout) on a Deployment "
            f"at {deployment.replicas} replicas and failed: {exc}"
        )
    assert [e.address for e in endpoints] == ["127.0.0.1:18103"]
    assert deployment.replicas == 1


async def test_a_scale_up_does_not_lower_replicas_set_between_its_read_and_its_patch(
    kube: FakeKubernetes, api: Any, made: list[KubernetesControlPlane]
) -> None:
    """An autoscaler that scales from 0 (KEDA) or `kubectl scale` sets 3 between the
    scale-up's read (0) and its patch: the patch carries the version it read, gets 409,
    and the second read leaves the 3 (it was overwritten with 1)."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18104])
    plane = plane_on(api, k8s_config(), made)
    call = plane._call
    reads = 0

    async def someone_scales_after_the_first_read(fn: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        result = await call(fn, *args, **kwargs)
        if fn.__name__ == "read_namespaced_deployment_scale":
            reads += 1
            if reads == 1:
                kube.scale("vllm-big", 3, namespace="models")
        return result

    plane._call = someone_scales_after_the_first_read  # type: ignore[method-assign]
    await plane.want("big")
    assert deployment.replicas == 3
    assert reads == 2


async def test_a_deployment_left_up_by_a_previous_llmgw_is_adopted_and_stopped_when_idle(
    kube: FakeKubernetes, api: Any, made: list[KubernetesControlPlane]
) -> None:
    """llmgw restarts (its own rollout, an OOM kill) while an on-demand model runs: close()
    leaves the Deployment up (another replica may use it), and the new process started with
    the model off, so nothing ever stopped it: its GPUs stayed taken, idle_timeout or not."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18102])
    config = k8s_config(idle_timeout=10)
    first = Activator(config, Registry(), plane_on(api, config, made))
    await first.ensure_ready("big")
    await first.stop()  # the llmgw process goes away (close(): the Deployment stays up)
    assert deployment.replicas == 1

    clock = Clock()
    second = Activator(config, Registry(), plane_on(api, config, made), clock=clock)
    await second.start(tick=3600)  # the replacement process; no request for "big"
    try:
        # Until the adoption has followed the running replica.
        await eventually(lambda: second.machines["big"].state.value == "idle", timeout=10)
        assert deployment.replicas == 1  # adopted, not restarted: no patch
        clock.now += 11
        await second.tick()
        assert deployment.replicas == 0
    finally:
        await second.stop()
