"""Kubernetes discovery against the fake API server (real paths and JSON, list + watch):
Services, InferencePools and pod selectors feed the registry through one update path."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.config import Config, load_dict
from llmgw.registry import Registry
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.kube.discovery import Discovery
from llmgw.runtime.kube.reflector import Reflector
from llmgw.runtime.router import Router
from llmgw.runtime.telemetry import Telemetry
from llmgw.testing.fake_k8s import FakeKubernetes
from llmgw.testing.wait import eventually
from llmgw.types import Endpoint

NS = "models"


def config_for(**source: Any) -> Config:
    return load_dict({"models": {"chat": {"discovery": source, "strategy": "ring"}}})


class Followed:
    """A Discovery on the fake API feeding a registry; stopped at the end of the test."""

    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client
        self.registry = Registry()
        self.made: list[Discovery] = []
        self.updates: list[tuple[str, list[str]]] = []

    async def __call__(self, config: Config, **options: Any) -> Discovery:
        options.setdefault("backoff", (0.02, 0.1))
        options.setdefault("startup_timeout", 5.0)
        discovery = Discovery(config, api_client=self.api_client, **options)
        self.made.append(discovery)
        await discovery.start(self.update)
        return discovery

    def update(self, model: str, endpoints: list[Endpoint]) -> None:
        self.updates.append((model, [e.address for e in endpoints]))
        self.registry.set_endpoints(model, endpoints)

    def addresses(self, model: str = "chat") -> list[str]:
        return sorted(s.id for s in self.registry.states(model))


@pytest.fixture
async def followed(api: Any) -> AsyncIterator[Followed]:
    made = Followed(api)
    yield made
    for discovery in made.made:
        await discovery.stop()


def ports(*numbers: int) -> list[str]:
    return [f"127.0.0.1:{n}" for n in numbers]


# -- Service (EndpointSlices) ------------------------------------------------------------
async def test_a_service_is_followed_through_its_endpointslices_as_pods_come_and_go(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002, 7003], replicas=2)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 2)
    await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    assert followed.addresses() == ports(7001, 7002)  # listed before start() returned
    kube.scale("vllm", 3, namespace=NS)
    await eventually(lambda: followed.addresses() == ports(7001, 7002, 7003))
    kube.scale("vllm", 1, namespace=NS)
    await eventually(lambda: followed.addresses() == ports(7001))
    # Terminating pods left before they were deleted: never listed as they drained.
    assert all("127.0.0.1:7002" not in a or len(a) == 3 for _, a in followed.updates[2:])


async def test_a_service_port_the_pods_lack_is_reported_not_silently_empty(
    kube: FakeKubernetes, followed: Followed, caplog: pytest.LogCaptureFixture
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001], replicas=1)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 1)
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm", "port": 80}))
    assert followed.addresses() == []
    error = discovery.status("chat")["error"]
    assert isinstance(error, str) and "has port 80" in error and "they have" in error
    assert any("has port 80" in r.getMessage() for r in caplog.records)


async def test_a_rolling_update_that_changes_every_address_ends_on_the_new_pods_only(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002], replicas=2)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 2)
    await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    kube.rollout("vllm", [7101, 7102], namespace=NS)
    await eventually(lambda: followed.addresses() == ports(7101, 7102))
    # Never empty in between: new pods were ready before the old ones left.
    assert all(addresses for _, addresses in followed.updates)


async def test_an_expired_watch_410_lists_again_and_catches_up(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002], replicas=1)
    await eventually(lambda: any(p.ready for p in kube.deployments[(NS, "vllm")].pods))
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    reflector = discovery.followers["chat"].reflectors[0]
    await eventually(lambda: kube.watches_served >= 1)
    kube.expire_watches = 1
    kube.end_watches()
    kube.scale("vllm", 2, namespace=NS)  # happens while the watch is expired
    await eventually(lambda: reflector.expired == 1 and followed.addresses() == ports(7001, 7002))
    assert reflector.lists >= 2


async def test_a_watch_the_server_ends_resumes_from_its_bookmark_without_a_list(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002], replicas=1)
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    reflector = discovery.followers["chat"].reflectors[0]
    await eventually(lambda: kube.watches_served == 1)
    lists = reflector.lists
    kube.end_watches()
    await eventually(lambda: kube.watches_served == 2)
    assert kube.bookmarks_sent >= 1 and reflector.lists == lists
    watches = [r for r in kube.requests if r.query.get("watch") == "true"]
    assert watches[-1].query["allowWatchBookmarks"] == "true"
    assert int(watches[-1].query["resourceVersion"]) >= int(watches[0].query["resourceVersion"])
    kube.scale("vllm", 2, namespace=NS)
    await eventually(lambda: followed.addresses() == ports(7001, 7002))


async def test_losing_the_api_server_keeps_the_last_endpoints_and_reports_since_when(
    kube: FakeKubernetes, followed: Followed, caplog: pytest.LogCaptureFixture
) -> None:
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002], replicas=1)
    await eventually(lambda: any(p.ready for p in kube.deployments[(NS, "vllm")].pods))
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    telemetry = Telemetry()
    telemetry.bind(followed.registry, None, discovery)
    caplog.set_level(logging.WARNING, logger="llmgw.k8s")
    await kube.go_down()
    await eventually(lambda: discovery.staleness()["chat"] > 0)
    assert followed.addresses() == ports(7001)  # still routed on what was last known
    assert any(
        "since" in r.getMessage() and "keeping the last 1" in r.getMessage() for r in caplog.records
    )
    stale = telemetry.registry.get_sample_value("llmgw_discovery_stale_seconds", {"model": "chat"})
    assert stale is not None and stale > 0
    kube.scale("vllm", 2, namespace=NS)  # changed while llmgw could not see it
    await kube.come_back()
    await eventually(lambda: followed.addresses() == ports(7001, 7002))
    assert discovery.staleness()["chat"] == 0.0
    assert discovery.status("chat") == {
        "source": "service models/vllm",
        "endpoints": ports(7001, 7002),
        "stale_seconds": 0.0,
        "error": None,
    }
    assert (
        telemetry.registry.get_sample_value("llmgw_discovery_stale_seconds", {"model": "chat"}) == 0
    )


async def test_a_start_waits_through_a_throttled_or_failed_first_list_until_it_is_answered(
    kube: FakeKubernetes, followed: Followed
) -> None:
    """A first list answered 429 or 500 (or an API not yet reachable) ended the start at
    once: the replica turned ready with no endpoint, well before startup_timeout (found by
    a review helper)."""
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001], replicas=1)
    await eventually(lambda: any(p.ready for p in kube.deployments[(NS, "vllm")].pods))
    kube.list_errors = [429, 500]
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    assert followed.addresses() == ports(7001)  # listed before start() returned
    assert discovery.followers["chat"].reflectors[0].lists == 1 and not kube.list_errors


async def test_a_start_on_an_api_that_keeps_failing_returns_after_startup_timeout(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.list_errors = [500] * 1000
    discovery = await followed(
        config_for(service={"namespace": NS, "name": "vllm"}), startup_timeout=0.3
    )
    reflector = discovery.followers["chat"].reflectors[0]
    assert reflector.lists == 0 and reflector.last_error is not None
    assert "API error 500" in reflector.last_error


async def test_rbac_forbidden_is_a_startup_error_naming_verb_resource_and_role(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.forbidden.add("list-slices")
    with pytest.raises(StartError) as info:
        await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    message = str(info.value)
    assert "may not list endpointslices.discovery.k8s.io in namespace 'models'" in message
    assert "llmgw-discovery" in message and "deploy/k8s/llmgw-rbac.yaml" in message
    assert "cannot list resource" in message  # the API server's own words


async def test_a_role_granting_list_but_not_watch_polls_the_list_quietly(
    kube: FakeKubernetes, followed: Followed, caplog: pytest.LogCaptureFixture
) -> None:
    """A forbidden watch was retried at the back-off, which each good list reset: ten API
    requests and an ERROR line a second, forever. It is a refused watch: the list is polled."""
    kube.add_deployment("vllm", namespace=NS, pod_ports=[8001], replicas=1)
    kube.forbidden.add("watch-slices")
    await followed(config_for(service={"namespace": NS, "name": "vllm"}), poll_interval=0.05)
    await eventually(lambda: followed.addresses() == ports(8001))

    def watches(requests: list[Any]) -> list[Any]:
        return [r for r in requests if r.query.get("watch") in ("true", "1")]

    await eventually(lambda: len(watches(kube.requests)) == 1)  # tried once, refused
    first = len(kube.requests)
    await eventually(lambda: len(kube.requests) >= first + 5)  # a few polls
    assert not watches(kube.requests[first:])  # not retried until watch_retry has passed
    refused = [r for r in caplog.records if "watching" in r.getMessage()]
    assert len(refused) == 1 and "grant `watch`" in refused[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def back_offs(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays the reflectors pause for, recorded instead of waited (never a sleep)."""
    delays: list[float] = []

    async def pause(_reflector: Reflector, seconds: float) -> None:
        delays.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(Reflector, "_pause", pause)
    return delays


async def test_a_watch_failing_on_the_server_backs_off_and_watches_again_not_polls(
    kube: FakeKubernetes, followed: Followed, caplog: pytest.LogCaptureFixture
) -> None:
    """A 500 or 429 ERROR event in a watch was taken for a refused watch: the list was
    polled every second for a minute (an API server throttling us got more requests) and
    logged as refused (found by a review helper)."""
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001, 7002], replicas=1)
    await eventually(lambda: any(p.ready for p in kube.deployments[(NS, "vllm")].pods))
    kube.watch_errors = [500, 429]
    discovery = await followed(config_for(service={"namespace": NS, "name": "vllm"}))
    await eventually(lambda: kube.watches_served == 3)  # two failed, then one that holds
    reflector = discovery.followers["chat"].reflectors[0]
    assert reflector.mode == "watch" and reflector.lists == 3  # listed again after each
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    kube.scale("vllm", 2, namespace=NS)
    await eventually(lambda: followed.addresses() == ports(7001, 7002))


async def test_watches_failing_while_lists_succeed_back_off_doubling(
    kube: FakeKubernetes, followed: Followed, back_offs: list[float]
) -> None:
    """Each good list reset the back-off: a watch failing every time was retried every
    0.2 s, for good, where the README promises 0.2 s doubling to 30 s (found by a review
    helper)."""
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001], replicas=1)
    kube.watch_errors = [500] * 4
    await followed(config_for(service={"namespace": NS, "name": "vllm"}), backoff=(1.0, 100.0))
    await eventually(lambda: kube.watches_served == 5)
    assert len(back_offs) == 4
    # Doubling, each jittered by 0.8-1.2: a step is at least 2 x 0.8 / 1.2 = 1.33x.
    assert all(later > 1.3 * earlier for earlier, later in itertools.pairwise(back_offs))
    # A watch that works (its bookmark here) starts the back-off over.
    kube.watch_errors = [500]
    kube.end_watches()
    await eventually(lambda: kube.watches_served == 7)
    assert len(back_offs) == 5 and back_offs[-1] <= 1.2


async def test_a_watch_ending_at_once_with_no_event_is_not_reopened_in_a_busy_loop(
    kube: FakeKubernetes, followed: Followed, back_offs: list[float]
) -> None:
    """A watch ended at once with nothing in it (a proxy cutting long requests) was opened
    again with no delay: a thread sending watch requests as fast as it could (found by a
    review helper)."""
    kube.add_deployment("vllm", namespace=NS, pod_ports=[7001], replicas=1)
    kube.empty_watches = 4
    await followed(config_for(service={"namespace": NS, "name": "vllm"}), backoff=(1.0, 100.0))
    await eventually(lambda: kube.watches_served == 5)
    assert len(back_offs) == 4
    # Doubling, each jittered by 0.8-1.2: a step is at least 2 x 0.8 / 1.2 = 1.33x.
    assert all(later > 1.3 * earlier for earlier, later in itertools.pairwise(back_offs))


async def test_a_router_whose_discovery_is_refused_stops_the_scraper_it_started(
    kube: FakeKubernetes, api: Any
) -> None:
    """The server exits (code 3) or an embedding app carries on: no scrape loop left behind."""
    kube.forbidden.add("list-slices")
    config = config_for(service={"namespace": NS, "name": "vllm"})
    router = Router(config, discovery=Discovery(config, api_client=api, backoff=(0.02, 0.1)))
    assert router.scraper is not None
    with pytest.raises(StartError):
        await router.start()
    assert router.scraper.running is False


# -- pods and InferencePools ---------------------------------------------------------------
async def test_a_pod_selector_follows_ready_pods_and_drops_not_ready_and_terminating_ones(
    kube: FakeKubernetes, followed: Followed
) -> None:
    labels = {"app": "vllm"}
    kube.put_pod("a", port_ip="10.0.0.1", labels=labels, namespace=NS)
    kube.put_pod("b", port_ip="10.0.0.2", labels=labels, namespace=NS)
    kube.put_pod("other", port_ip="10.0.0.9", labels={"app": "web"}, namespace=NS)
    await followed(config_for(pods={"namespace": NS, "selector": labels, "port": 8000}))
    assert followed.addresses() == ["10.0.0.1:8000", "10.0.0.2:8000"]
    kube.set_pod_ready("a", False, namespace=NS)
    await eventually(lambda: followed.addresses() == ["10.0.0.2:8000"])
    kube.set_pod_ready("a", True, namespace=NS)
    kube.terminate_pod("b", namespace=NS)
    await eventually(lambda: followed.addresses() == ["10.0.0.1:8000"])
    kube.delete_object("pods", "b", namespace=NS)
    kube.put_pod("c", port_ip="10.0.0.3", labels=labels, namespace=NS)
    await eventually(lambda: followed.addresses() == ["10.0.0.1:8000", "10.0.0.3:8000"])


async def test_an_inference_pool_routes_its_selected_pods_at_every_target_port(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.put_pool("chat-pool", selector={"pool": "chat"}, ports=[8000, 8001], namespace=NS)
    kube.put_pod("a", port_ip="10.0.0.1", labels={"pool": "chat"}, namespace=NS)
    kube.put_pod("b", port_ip="10.0.0.2", labels={"pool": "canary"}, namespace=NS)
    discovery = await followed(config_for(inference_pool={"namespace": NS, "name": "chat-pool"}))
    await eventually(lambda: followed.addresses() == ["10.0.0.1:8000", "10.0.0.1:8001"])
    # The pool's selector and ports change: the pods it selects follow.
    kube.put_pool("chat-pool", selector={"pool": "canary"}, ports=[9000], namespace=NS)
    await eventually(lambda: followed.addresses() == ["10.0.0.2:9000"])
    kube.delete_object("inferencepools", "chat-pool", namespace=NS)
    await eventually(lambda: followed.addresses() == [])
    assert discovery.status("chat")["error"] == "inferencepool models/chat-pool not found"
    pool_lists = [r for r in kube.requests if r.path.endswith("/inferencepools")]
    assert pool_lists[0].query["fieldSelector"] == "metadata.name=chat-pool"
    assert (
        pool_lists[0].path == f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
    )


async def test_forbidden_inference_pools_is_a_startup_error_naming_the_resource(
    kube: FakeKubernetes, followed: Followed
) -> None:
    kube.forbidden.add("list-pools")
    with pytest.raises(
        StartError, match=r"may not list inferencepools\.inference\.networking\.k8s\.io"
    ):
        await followed(config_for(inference_pool={"namespace": NS, "name": "chat-pool"}))


async def test_a_pool_whose_pods_are_forbidden_is_a_startup_error(
    kube: FakeKubernetes, followed: Followed
) -> None:
    """The pool listed, its pods refused: the router started with no endpoints and an
    ERROR line, where every other forbidden list stops the start."""
    kube.put_pool("chat-pool", selector={"pool": "chat"}, ports=[8000], namespace=NS)
    kube.forbidden.add("list-pods")
    with pytest.raises(StartError, match="may not list pods"):
        await followed(config_for(inference_pool={"namespace": NS, "name": "chat-pool"}))


async def test_an_inference_pool_crd_not_installed_is_a_startup_error_saying_so(
    kube: FakeKubernetes, followed: Followed
) -> None:
    """A 404 on the collection read as 'Kubernetes API lost ... retrying', forever."""
    kube.unserved.add("inferencepools")
    with pytest.raises(StartError, match="CustomResourceDefinition installed"):
        await followed(config_for(inference_pool={"namespace": NS, "name": "chat-pool"}))


# Every port ephemeral: a fixed default (9003, 8000) may be taken on a shared machine.
SERVER_ARGS = {
    "extproc": [
        "--host=127.0.0.1",
        "--grpc-port=0",
        "--grpc-health-port=0",
        "--health-port=0",
        "--metrics-port=0",
    ],
    "proxy": ["--host=127.0.0.1", "--port=0"],
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("command", sorted(SERVER_ARGS))
async def test_the_servers_refuse_to_start_without_rbac_naming_what_to_apply(
    kube: FakeKubernetes, tmp_path: Path, command: str, workers: int
) -> None:
    """The CLI, as deployed: credentials from KUBECONFIG, exit code 3, the message on stderr.
    `--workers 2` alike: `llmgw proxy` exited 0, its workers' errors in uvicorn's log only
    (found by a review helper)."""
    kube.forbidden.add("list-slices")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube.host}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    config = tmp_path / "llmgw.yaml"
    config.write_text("models: {chat: {discovery: {service: {namespace: models, name: vllm}}}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw.cli",
        command,
        f"--config={config}",
        *SERVER_ARGS[command],
        f"--workers={workers}",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(60):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 3, stderr.decode()[-2000:]
    message = stderr.decode()
    assert f"llmgw {command}: cannot start: RBAC" in message
    assert "may not list endpointslices.discovery.k8s.io in namespace 'models'" in message
    assert "llmgw-discovery" in message


def test_a_malformed_kubeconfig_is_a_start_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut-off YAML file printed a ParserError traceback from `llmgw extproc`."""
    from llmgw.runtime.kube import load_client  # noqa: PLC0415

    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\nclusters:\n- cluster: {server: [\n")
    monkeypatch.setenv("KUBECONFIG", str(broken))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(StartError, match=f"no usable kubeconfig \\({broken}\\)"):
        load_client()


def test_rejected_credentials_are_not_reported_as_missing_rbac() -> None:
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    from llmgw.runtime.kube import forbidden  # noqa: PLC0415

    message = str(forbidden("list", "pods", NS, ApiException(status=401, reason="Unauthorized")))
    assert "rejected llmgw's credentials" in message and "Role" not in message
