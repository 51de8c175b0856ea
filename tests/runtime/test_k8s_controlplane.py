"""The Kubernetes control plane against a fake API server that speaks the real HTTP + JSON.

No cluster here: `fake_k8s.FakeKubernetes` serves the Deployment scale subresource and
EndpointSlice list/watch on loopback; the official client talks to it unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes import client

from llmgw.config import Config, ModelMode, load_dict, load_text, model_mode
from llmgw.registry import Registry
from llmgw.runtime.activator import Activator
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.controlplanes.composite import CompositeControlPlane, control_plane_for
from llmgw.runtime.controlplanes.k8s import KubernetesControlPlane, ready_addresses
from llmgw.runtime.controlplanes.local import LocalProcessControlPlane
from llmgw.runtime.router import Router
from llmgw.sim import SimFleet
from llmgw.testing.fake_k8s import FakeKubernetes
from llmgw.testing.wait import eventually
from llmgw.types import RequestInfo

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def k8s_config(
    *,
    namespace: str = "models",
    min_: int = 0,
    max_: int = 1,
    start_timeout: float = 5.0,
    **launch: Any,
) -> Config:
    return load_dict(
        {
            "activation_timeout": 10,
            "activation_poll_interval": 0.02,
            "models": {
                "big": {
                    "launch": {"deployment": "vllm-big", "namespace": namespace, **launch},
                    "scaling": {"min": min_, "max": max_, "start_timeout": start_timeout},
                }
            },
        }
    )


class Planes:
    """Builds control planes on the fake API and closes them at the end of the test."""

    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client
        self.made: list[KubernetesControlPlane] = []
        self.crashes: list[tuple[str, str]] = []

    def __call__(self, config: Config, **options: Any) -> KubernetesControlPlane:
        options.setdefault("poll_interval", 0.02)
        plane = KubernetesControlPlane(config, api_client=self.api_client, **options)
        plane.on_crash(lambda model, reason: self.crashes.append((model, reason)))
        self.made.append(plane)
        return plane


@pytest.fixture
async def planes(api: Any) -> AsyncIterator[Planes]:
    made = Planes(api)
    yield made
    for plane in made.made:
        await plane.close()


# -- scale up --------------------------------------------------------------------------
async def test_first_want_scales_zero_to_one_through_the_scale_subresource(
    kube: FakeKubernetes, planes: Planes
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18001])
    plane = planes(k8s_config())
    endpoints = await plane.want("big")
    assert [e.address for e in endpoints] == ["127.0.0.1:18001"]
    assert deployment.replicas == 1
    [patch] = kube.patches()
    assert patch.path == SCALE_PATH.format(ns="models", name="vllm-big")
    assert patch.body["spec"] == {"replicas": 1}
    # On the version it read: a count set since is a 409, not overwritten.
    assert patch.body["metadata"]["resourceVersion"]
    assert patch.content_type in (
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    )
    lists = [r for r in kube.requests if r.path == SLICES_PATH.format(ns="models")]
    assert lists and all(
        r.query["labelSelector"] == "kubernetes.io/service-name=vllm-big" for r in lists
    )
    status = plane.status("big")
    assert status["replicas_wanted"] == 1 and status["ready_endpoints"] == ["127.0.0.1:18001"]


async def test_a_second_want_of_a_running_model_does_not_patch_again(
    kube: FakeKubernetes, planes: Planes
) -> None:
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18001])
    plane = planes(k8s_config())
    await plane.want("big")
    await plane.want("big")
    assert len(kube.patches()) == 1


@pytest.mark.parametrize(
    ("min_", "max_", "current", "patched"),
    [
        (0, 1, 0, 1),  # on demand: one replica
        (2, 3, 0, 2),  # always on: min replicas
        (0, 4, 3, None),  # someone (an HPA) already runs more: never lowered
    ],
)
async def test_replicas_asked_for_are_min_at_least_one_never_lowering(
    kube: FakeKubernetes, planes: Planes, min_: int, max_: int, current: int, patched: int | None
) -> None:
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18001, 18002, 18003])
    if current:
        kube.scale("vllm-big", current, namespace="models")
    plane = planes(k8s_config(min_=min_, max_=max_))
    await plane.want("big")
    specs = [p.body["spec"] for p in kube.patches()]
    assert specs == ([] if patched is None else [{"replicas": patched}])


async def test_service_defaults_to_the_deployment_and_can_be_named(
    kube: FakeKubernetes, planes: Planes
) -> None:
    kube.add_deployment("vllm-big", namespace="models", service="big-svc", pod_ports=[18004])
    plane = planes(k8s_config(service="big-svc"))
    assert [e.address for e in await plane.want("big")] == ["127.0.0.1:18004"]
    assert kube.requests[-1].query["labelSelector"] == "kubernetes.io/service-name=big-svc"


# -- readiness -------------------------------------------------------------------------
@pytest.mark.parametrize("watch", [True, False], ids=["watch", "list"])
async def test_endpoints_are_returned_only_once_ready(
    kube: FakeKubernetes, planes: Planes, watch: bool
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18005])
    deployment.never_ready = True
    plane = planes(k8s_config(), watch=watch)
    start = asyncio.create_task(plane.want("big"))
    # The pod is listed, not ready: the control plane has seen it and still waits.
    await eventually(lambda: bool(plane._models.get("big") and plane._models["big"].slices))
    assert not start.done() and plane.status("big")["ready_endpoints"] == []
    kube.set_ready("vllm-big", True, namespace="models")
    endpoints = await asyncio.wait_for(start, 5)
    assert [e.address for e in endpoints] == ["127.0.0.1:18005"]
    assert plane.status("big")["discovery"] == ("watch" if watch else "list")


async def test_a_start_after_a_stop_blind_to_its_pods_does_not_return_the_old_ones(
    kube: FakeKubernetes, planes: Planes
) -> None:
    """A stop during an API blip scaled to 0 without seeing the pods go; their addresses
    stayed `ready`, and the next start returned them at once, before any new pod was."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18031])
    plane = planes(k8s_config(start_timeout=1.0), poll_interval=3.0, blind_after=0.0)
    assert [e.address for e in await plane.want("big")] == ["127.0.0.1:18031"]
    state = plane._models["big"]
    await kube.go_down()
    await eventually(
        lambda: state.reflector is not None and state.reflector.stale_since is not None
    )
    await kube.come_back()
    await plane.stop("big")  # accepted, its pods unseen going (backs off >= 2.4 s)
    assert deployment.replicas == 0
    await eventually(lambda: not deployment.pods)
    deployment.never_ready = True  # the next pod never turns ready
    with pytest.raises(StartError, match="no ready endpoint"):
        await asyncio.wait_for(plane.want("big"), 10)


async def test_a_refused_watch_falls_back_to_listing(kube: FakeKubernetes, planes: Planes) -> None:
    kube.watch_supported = False
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18006], ready_after=0.1)
    plane = planes(k8s_config(), watch=True)
    assert [e.address for e in await plane.want("big")] == ["127.0.0.1:18006"]
    assert plane.status("big")["discovery"] == "list"


@pytest.mark.parametrize(
    ("slices", "ready"),
    [
        # ready true / nil count (the API: nil means ready); false does not
        (
            [
                {
                    "ports": [{"name": "http", "port": 8000}],
                    "endpoints": [
                        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                        {"addresses": ["10.0.0.2"], "conditions": {}},
                        {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
                    ],
                }
            ],
            ["10.0.0.1:8000", "10.0.0.2:8000"],
        ),
        # the port named http wins over others; several slices merge
        (
            [
                {
                    "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8001}],
                    "endpoints": [{"addresses": ["10.0.0.4"], "conditions": {"ready": True}}],
                },
                {
                    "ports": [{"name": "web", "port": 8002}],
                    "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}}],
                },
            ],
            ["10.0.0.4:8001", "10.0.0.5:8002"],
        ),
        # no ports: launch.port; IPv6 in brackets; no endpoints at all
        (
            [
                {"endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": True}}]},
                {"ports": [], "endpoints": None},
            ],
            ["[fd00::7]:7777"],
        ),
    ],
)
def test_ready_addresses_from_endpoint_slices(
    slices: list[dict[str, Any]], ready: list[str]
) -> None:
    assert ready_addresses(slices, 7777) == ready


# -- failures --------------------------------------------------------------------------
async def test_start_timeout_is_a_start_error_and_scales_back_to_zero(
    kube: FakeKubernetes, planes: Planes
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18007])
    deployment.never_ready = True
    plane = planes(k8s_config(start_timeout=0.3))
    with pytest.raises(StartError, match=r"no ready endpoint .* models/vllm-big within 0.3s"):
        await asyncio.wait_for(plane.want("big"), 30)  # bounded; how long it took is not asserted
    assert deployment.replicas == 0
    assert [p.body["spec"] for p in kube.patches()] == [{"replicas": 1}, {"replicas": 0}]


async def test_a_start_timeout_leaves_replicas_it_did_not_set(
    kube: FakeKubernetes, planes: Planes
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18011])
    deployment.never_ready = True
    kube.scale("vllm-big", 2, namespace="models")  # an HPA or a person did
    plane = planes(k8s_config(start_timeout=0.2))
    with pytest.raises(StartError):
        await plane.want("big")
    assert deployment.replicas == 2 and kube.patches() == []


@pytest.mark.parametrize(
    ("forbidden", "message"),
    [
        (
            "get-scale",
            "RBAC: the service account cannot get deployments/scale in namespace 'models'",
        ),
        (
            "patch-scale",
            "RBAC: the service account cannot patch deployments/scale in namespace 'models'",
        ),
        (
            "list-slices",
            "RBAC: the service account cannot list/watch discovery.k8s.io endpointslices in namespace 'models'",
        ),
    ],
)
async def test_rbac_403_is_a_start_error_that_says_what_to_fix(
    kube: FakeKubernetes, planes: Planes, forbidden: str, message: str
) -> None:
    kube.forbidden.add(forbidden)
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18008])
    plane = planes(k8s_config(start_timeout=3600))
    with pytest.raises(StartError) as info:  # at once, not at start_timeout (an hour)
        await asyncio.wait_for(plane.want("big"), 30)
    assert message in str(info.value)
    assert "deploy/k8s/activation-rbac.yaml" in str(info.value)
    assert "is forbidden" in str(info.value)  # the API server's own words are kept
    assert plane.status("big")["last_error"] == str(info.value)


async def test_missing_deployment_404_is_a_start_error_naming_it(
    kube: FakeKubernetes, planes: Planes
) -> None:
    plane = planes(k8s_config())
    with pytest.raises(StartError) as info:
        await plane.want("big")
    assert "deployment models/vllm-big not found" in str(info.value)
    assert "launch.deployment and launch.namespace" in str(info.value)


async def test_unreachable_api_is_a_start_error(planes: Planes) -> None:
    api_client: Any = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
    try:
        plane = KubernetesControlPlane(k8s_config(), api_client=api_client)
        with pytest.raises(
            StartError, match=r"cannot reach the Kubernetes API at http://127.0.0.1:9"
        ):
            await plane.want("big")
        await plane.close()
    finally:
        api_client.close()


# -- stop and crashes ------------------------------------------------------------------
async def test_stop_scales_to_zero_without_reporting_a_crash(
    kube: FakeKubernetes, planes: Planes
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18009])
    plane = planes(k8s_config())
    await plane.want("big")
    await plane.stop("big")
    assert kube.patches()[-1].body == {"spec": {"replicas": 0}}
    assert deployment.replicas == 0
    await eventually(lambda: not deployment.pods)
    status = plane.status("big")
    assert status["replicas_wanted"] == 0 and status["running"] is False
    assert planes.crashes == []


async def test_stop_returns_once_the_pods_are_gone_not_when_the_api_accepted_it(
    kube: FakeKubernetes, planes: Planes
) -> None:
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18013])
    deployment.grace = 0.3  # the pods drain for a while after scale-to-0
    plane = planes(k8s_config())
    await plane.want("big")
    await plane.stop("big")
    assert deployment.pods == []
    assert plane.status("big")["discovery"] == "idle"  # the follower ended with the stop


async def test_replicas_an_autoscaler_changes_after_the_start_reach_the_registry(
    kube: FakeKubernetes, planes: Planes
) -> None:
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18014, 18015, 18016])
    config = k8s_config(max_=3)
    plane = planes(config)
    registry = Registry()
    activator = Activator(config, registry, plane)
    await activator.ensure_ready("big")
    assert [s.id for s in registry.states("big")] == ["127.0.0.1:18014"]
    first = registry.get("big", "127.0.0.1:18014")
    kube.scale("vllm-big", 3, namespace="models")  # an HPA scales out
    await eventually(lambda: len(registry.states("big")) == 3)
    assert registry.get("big", "127.0.0.1:18014") is first  # the staying one keeps its state
    kube.scale("vllm-big", 2, namespace="models")  # ... and in again
    await eventually(lambda: len(registry.states("big")) == 2)
    assert planes.crashes == []


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "list"])
async def test_a_ready_model_losing_every_ready_endpoint_is_reported_as_crashed(
    kube: FakeKubernetes, planes: Planes, watch: bool
) -> None:
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18010])
    plane = planes(k8s_config(), watch=watch)
    await plane.want("big")
    kube.set_ready("vllm-big", False, namespace="models")
    await eventually(lambda: bool(planes.crashes))
    [(model, reason)] = planes.crashes
    assert model == "big" and "no ready endpoint left" in reason and "models/vllm-big" in reason
    # The pod comes back: the next want() finds it without scaling again.
    kube.set_ready("vllm-big", True, namespace="models")
    assert [e.address for e in await plane.want("big")] == ["127.0.0.1:18010"]
    assert len(kube.patches()) == 1


# -- wiring and end to end -------------------------------------------------------------
def test_each_model_gets_the_control_plane_of_its_launch_kind() -> None:
    mixed = load_dict(
        {
            "models": {
                "local": {"launch": {"command": "true {port}"}, "scaling": {"min": 0, "max": 1}},
                "kube": {"launch": {"deployment": "d"}, "scaling": {"min": 0, "max": 1}},
            }
        }
    )
    plane = control_plane_for(mixed)
    assert isinstance(plane, CompositeControlPlane)
    assert isinstance(plane.planes["local"], LocalProcessControlPlane)
    assert isinstance(plane.planes["kube"], KubernetesControlPlane)
    assert isinstance(control_plane_for(k8s_config()), KubernetesControlPlane)
    static = load_dict({"models": {"s": {"endpoints": ["127.0.0.1:1"]}}})
    assert control_plane_for(static) is None


def write_kubeconfig(path: Path, host: str) -> None:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{host}"}}}}]
users: [{{name: fake, user: {{token: test-token}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: models}}}}]
current-context: fake
"""
    )


async def test_twenty_cold_requests_through_the_router_scale_up_once(
    kube: FakeKubernetes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SimFleet(replicas=1, model="big", time_scale=0) as fleet:
        deployment = kube.add_deployment(
            "vllm-big", namespace="models", pod_ports=fleet.ports, ready_after=0.2
        )
        # The router builds the control plane itself and finds the fake through a kubeconfig.
        write_kubeconfig(tmp_path / "kubeconfig", kube.host)
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        default = client.Configuration.get_default_copy()
        router = Router(k8s_config(), scrape=False)
        try:
            assert router.activator is not None
            waiters = [
                asyncio.create_task(router.decide(RequestInfo(model="big", request_id=f"r{i}")))
                for i in range(20)
            ]
            decisions = await asyncio.wait_for(asyncio.gather(*waiters), 10)
            assert {d.endpoint.address for d in decisions} == {f"127.0.0.1:{fleet.ports[0]}"}
            assert [p.body["spec"] for p in kube.patches()] == [{"replicas": 1}]
            assert deployment.replicas == 1
            # The endpoint found in the slices is a live engine.
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://{decisions[0].endpoint.address}/health") as response,
            ):
                assert response.status == 200
            plane_status = router.models_status()["big"]["control_plane"]
            assert isinstance(plane_status, dict) and plane_status["running"] is True
        finally:
            await router.stop()
            client.Configuration.set_default(default)


# -- the shipped manifests -------------------------------------------------------------
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def manifests(name: str) -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / name).read_text())
    return {doc["kind"]: doc for doc in docs}


def test_the_on_demand_sample_config_names_the_sample_deployment_and_service() -> None:
    sample = manifests("on-demand-sample.yaml")
    config = load_text(sample["ConfigMap"]["data"]["llmgw.yaml"], "on-demand-sample.yaml")
    [(name, spec)] = config.models.items()
    assert model_mode(spec) is ModelMode.ON_DEMAND
    assert spec.launch is not None
    assert spec.launch.deployment == sample["Deployment"]["metadata"]["name"]
    assert spec.launch.service == sample["Service"]["metadata"]["name"]
    assert spec.launch.namespace == sample["Deployment"]["metadata"]["namespace"]
    assert sample["Deployment"]["spec"]["replicas"] == 0
    assert (
        f"--served-model-name={name}"
        in sample["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert [p["name"] for p in sample["Service"]["spec"]["ports"]] == ["http"]


def test_the_rbac_role_grants_what_the_control_plane_calls_and_no_more() -> None:
    rbac = manifests("activation-rbac.yaml")
    grants = {
        (group, resource, verb)
        for rule in rbac["Role"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert grants == {
        ("apps", "deployments/scale", "get"),
        ("apps", "deployments/scale", "patch"),
        ("apps", "deployments", "get"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
    }
    [subject] = rbac["RoleBinding"]["subjects"]
    assert subject["name"] == rbac["ServiceAccount"]["metadata"]["name"]
    assert rbac["RoleBinding"]["roleRef"]["name"] == rbac["Role"]["metadata"]["name"]


async def test_an_expired_or_ended_watch_lists_and_watches_again(
    kube: FakeKubernetes, planes: Planes
) -> None:
    kube.expire_watches = 1  # the first watch answers 410 Expired
    kube.add_deployment("vllm-big", namespace="models", pod_ports=[18012])
    plane = planes(k8s_config())
    await plane.want("big")
    await eventually(lambda: kube.watches_served >= 2)
    assert plane.status("big")["discovery"] == "watch"  # a 410 is no reason to stop watching
    served = kube.watches_served
    kube.end_watches()  # the server ends the stream (timeoutSeconds, restart)
    await eventually(lambda: kube.watches_served > served)
    kube.set_ready("vllm-big", False, namespace="models")
    await eventually(lambda: bool(planes.crashes))  # seen through the new watch
    assert plane.status("big")["discovery"] == "watch"


async def test_a_transient_watch_failure_during_a_stop_does_not_end_the_wait_for_the_pods(
    kube: FakeKubernetes, planes: Planes
) -> None:
    """One watch answered 500 marked the API lost and the stop returned at once, its pods
    still draining (a failed watch is followed by a list a moment later). Found by a
    review helper."""
    deployment = kube.add_deployment("vllm-big", namespace="models", pod_ports=[18032])
    deployment.grace = 0.5  # the pods drain for a while after scale-to-0
    plane = planes(k8s_config(), poll_interval=0.02)
    await plane.want("big")
    kube.watch_errors = [500]  # the API server hiccups once, on the next watch
    kube.end_watches()
    await plane.stop("big")
    assert deployment.pods == [], "stop returned with the pods still draining"
