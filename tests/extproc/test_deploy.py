"""deploy/: every Kubernetes manifest validates against the API models (InferencePools
against GIE's CRD schema, vendored in tests/fixtures); embedded and compose configs are in
sync with their generators and pass `envoy --mode validate`; no pod address anywhere."""

from __future__ import annotations

import ipaddress
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.config import load_file, load_text
from llmgw.extproc.envoyconfig import build, render
from llmgw.testing.extproc import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
POOL_CRD = ROOT / "tests" / "fixtures" / "inference.networking.k8s.io_inferencepools.yaml"
client = pytest.importorskip("kubernetes.client")
# Custom resources: checked against their CRD's openAPIV3Schema instead of a client model.
CRD_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"): POOL_CRD}

_PRIMITIVES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "bool": bool,
    "float": (int, float),
    "object": object,
    "datetime": str,
    "date": str,
}


def check(data: Any, type_name: str, path: str) -> list[str]:
    """Unknown fields and wrong shapes, recursively, from the client's openapi_types."""
    if data is None:
        return []
    if type_name.lower().startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        item_type = type_name[5:-1]
        return [p for i, item in enumerate(data) for p in check(item, item_type, f"{path}[{i}]")]
    if type_name.lower().startswith("dict"):  # "dict(str, str)" or "Dict[str, str]"
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        parts = re.match(r"[dD]ict[\[(]([^,]*), (.*)[\])]$", type_name)
        assert parts is not None
        return [p for k, v in data.items() for p in check(v, parts.group(2), f"{path}.{k}")]
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and not (
            type_name == "int" and isinstance(data, bool)
        )
        return [] if ok else [f"{path}: expected {type_name}, got {type(data).__name__}"]
    model = getattr(client, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name})"]
    by_json = {json: attr for attr, json in model.attribute_map.items()}
    problems = []
    for key, value in data.items():
        attr = by_json.get(key)
        if attr is None:
            problems.append(f"{path}.{key}: unknown field for {type_name}")
        else:
            problems.extend(check(value, model.openapi_types[attr], f"{path}.{key}"))
    return problems


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(doc, dict) and "kind" in doc:
                out.append((f"{path.name}#{i}:{doc['kind']}", doc))
    return out


def crd_schema(path: Path, api_version: str) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    version = api_version.rsplit("/", 1)[-1]
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
    return schema


def crd_problems(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Where `doc` breaks the CRD schema; unknown fields are errors, as the API server
    prunes them (the schema has no `additionalProperties` where it does not allow any)."""
    jsonschema = pytest.importorskip("jsonschema")

    def closed(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: closed(v) for k, v in node.items()}
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
        elif isinstance(node, list):
            node = [closed(v) for v in node]
        return node

    strict = closed(schema)
    strict["properties"]["metadata"] = {"type": "object"}
    validator = jsonschema.Draft7Validator(strict)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


@pytest.mark.parametrize(("name", "doc"), manifests(), ids=[n for n, _ in manifests()])
def test_manifest_matches_the_kubernetes_api_schema(name: str, doc: dict[str, Any]) -> None:
    crd = CRD_KINDS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        problems = crd_problems(doc, crd_schema(crd, doc["apiVersion"]))
        assert not problems, "\n".join(problems)
        return
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    type_name = version[0].upper() + version[1:] + doc["kind"]
    assert hasattr(client, type_name), f"{name}: no Kubernetes model {type_name}"
    problems = check(doc, type_name, doc["kind"])
    assert not problems, "\n".join(problems)
    # The client's own deserializer enforces required fields.
    client.ApiClient()._ApiClient__deserialize(doc, type_name)


def _k8s_docs() -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((K8S / "llmgw-extproc.yaml").read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_k8s_configmaps_match_their_sources_and_envoy_validates(tmp_path: Path) -> None:
    docs = _k8s_docs()
    llmgw_text = docs["ConfigMap/llmgw-config"]["data"]["llmgw.yaml"]
    assert llmgw_text == (K8S / "llmgw-config.yaml").read_text()
    config = load_text(llmgw_text)
    envoy_text = docs["ConfigMap/llmgw-envoy"]["data"]["envoy.yaml"]
    expected = build(
        config,
        shape="original-dst",
        listen_port=8080,
        admin_port=9901,
        extproc_address="127.0.0.1:9002",
        fail_open=False,
        extproc_tls=True,  # the command's default, as `llmgw extproc`'s
    )
    assert envoy_text == render(expected, "llmgw-config.yaml")
    _validate(envoy_text, tmp_path)


def test_k8s_probes_and_metrics_annotations() -> None:
    deployment = _k8s_docs()["Deployment/llmgw"]
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    # Scraped once: the Service annotated too, pod and endpoint jobs each took every series.
    service = _k8s_docs()["Service/llmgw"]
    assert not any(
        k.startswith("prometheus.io") for k in service["metadata"].get("annotations", {})
    )
    # The endpoint picker's port, which the InferencePool's endpointPickerRef names.
    assert {"name": "grpc", "port": 9002, "targetPort": "grpc", "appProtocol": "http2"} in (
        service["spec"]["ports"]
    )
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    extproc = next(c for c in pod["spec"]["containers"] if c["name"] == "extproc")
    ports = {p["name"]: p["containerPort"] for p in extproc["ports"]}
    assert ports == {
        "grpc": 9002, "grpc-health": 9003, "health": 9004, "peers": 9005, "metrics": 9090,
    }  # fmt: skip
    # GIE's probes: gRPC health on 9003 with its service names.
    assert extproc["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert extproc["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}


def test_k8s_router_takes_new_streams_while_envoy_still_drains() -> None:
    """Both containers get SIGTERM at pod deletion, Envoy after its preStop (a graceful
    drain during which it still takes requests, each a new ext_proc stream). llmgw refused
    new streams 5 s in while Envoy drained 25 s: every request in between got 500
    `router_unavailable` on each rollout. Found by a review helper."""
    pod = _k8s_docs()["Deployment/llmgw"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    flags = dict(a.removeprefix("--").split("=", 1) for a in containers["extproc"]["args"][1:])
    pre_stop = containers["envoy"]["lifecycle"]["preStop"]["exec"]["command"][-1]
    envoy_drains = float(re.search(r"sleep (\d+)", pre_stop).group(1))  # type: ignore[union-attr]
    assert "lifecycle" not in containers["extproc"]  # its SIGTERM comes at once
    assert float(flags["drain-delay"]) >= envoy_drains
    grace = pod["terminationGracePeriodSeconds"]
    assert float(flags["drain-delay"]) + float(flags["drain-timeout"]) < grace


def test_the_k8s_router_replicas_find_each_other_as_peers() -> None:
    docs = _k8s_docs()
    pod = docs["Deployment/llmgw"]["spec"]["template"]
    assert docs["Deployment/llmgw"]["spec"]["replicas"] >= 2
    extproc = next(c for c in pod["spec"]["containers"] if c["name"] == "extproc")
    (peer_port,) = [p for p in extproc["ports"] if p["name"] == "peers"]
    service = docs["Service/llmgw-peers"]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert service["selector"] == pod["metadata"]["labels"]
    (port,) = service["ports"]
    assert port["protocol"] == peer_port["protocol"] == "UDP" and port["targetPort"] == "peers"
    config = load_file(ROOT / "deploy" / "k8s" / "llmgw-config.yaml")
    assert config.peers is not None
    assert config.peers.listen == f"0.0.0.0:{peer_port['containerPort']}"
    assert config.peers.addresses == (f"llmgw-peers.llmgw.svc.cluster.local:{port['port']}",)
    # The secret the config names reaches the container from a Secret.
    (env,) = [e for e in extproc["env"] if e["name"] == config.peers.secret_env]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "llmgw-peers", "key": "secret"}


def test_compose_stack_is_consistent_and_envoy_validates(tmp_path: Path) -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    assert set(compose["services"]) == {"sim", "extproc", "envoy"}
    assert all("image" in s for s in compose["services"].values())
    networks = {
        name: s["networks"]["llm"]["ipv4_address"] for name, s in compose["services"].items()
    }
    config = load_file(COMPOSE / "llmgw.yaml")
    assert all(e.address.startswith(networks["sim"] + ":") for e in config.models["m1"].endpoints)
    envoy_text = (COMPOSE / "envoy.yaml").read_text()
    expected = build(
        config,
        shape="override-host",
        listen_port=8080,
        admin_host="0.0.0.0",
        admin_port=9901,
        extproc_address=f"{networks['extproc']}:9002",
        fail_open=True,
        extproc_tls=True,  # the command's default, as `llmgw extproc`'s
    )
    assert envoy_text == render(expected, "llmgw.yaml")
    _validate(envoy_text, tmp_path)


def _validate(text: str, tmp_path: Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_k8s_example_lists_no_pod_address_and_routes_a_service_and_a_pool() -> None:
    for path in K8S.glob("*.yaml"):
        for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+\b", path.read_text()):
            address = ipaddress.ip_address(word)  # listeners (0.0.0.0) and localhost only
            assert address.is_loopback or address.is_unspecified, f"{path.name}: {word}"
    config = load_file(K8S / "llmgw-config.yaml")
    sources = {name: spec.discovery for name, spec in config.models.items()}
    assert all(s is not None for s in sources.values()) and not any(
        spec.endpoints for spec in config.models.values()
    )
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in yaml.safe_load_all((K8S / "models-sample.yaml").read_text())
    }
    service = sources["llama-3-8b"]
    assert service is not None and service.service is not None
    svc = docs[("Service", service.service.name)]
    assert service.service.port in [p["name"] for p in svc["spec"]["ports"]]
    pool_source = sources["qwen-coder"]
    assert pool_source is not None and pool_source.inference_pool is not None
    pool = docs[("InferencePool", pool_source.inference_pool.name)]
    selected = docs[("Deployment", "qwen-coder")]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= selected.items()


def test_the_discovery_role_grants_reads_of_slices_pods_and_pools_and_nothing_else() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((K8S / "llmgw-rbac.yaml").read_text())}
    grants = {
        (group, resource, verb)
        for rule in docs["Role"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    reads = ("get", "list", "watch")
    assert grants == {
        *(("discovery.k8s.io", "endpointslices", v) for v in reads),
        *(("", "pods", v) for v in reads),
        *(("inference.networking.k8s.io", "inferencepools", v) for v in reads),
    }
    assert docs["Role"]["metadata"]["name"] == "llmgw-discovery"  # named in the RBAC error
    assert docs["RoleBinding"]["roleRef"]["name"] == "llmgw-discovery"


def test_the_crd_check_catches_a_wrong_pool() -> None:
    schema = crd_schema(POOL_CRD, "inference.networking.k8s.io/v1")
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPortNumber": 8000},
    }
    problems = crd_problems(pool, schema)
    assert any("'targetPorts' is a required property" in p for p in problems), problems
    assert any("targetPortNumber" in p for p in problems), problems


def test_the_schema_check_catches_typos_and_wrong_types() -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x", "labels": {"a": "b"}},
        "spec": {"portz": [], "ports": [{"port": "eighty"}]},
    }
    problems = check(doc, "V1Service", "Service")
    assert "Service.spec.portz: unknown field for V1ServiceSpec" in problems
    assert "Service.spec.ports[0].port: expected int, got str" in problems


def test_the_image_installs_what_the_shipped_kubernetes_config_needs() -> None:
    """deploy/k8s follows Services and InferencePools: without the `k8s` extra the pod would
    fail at start with a missing `kubernetes` package."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    found = re.search(r"pip install [^']*'\.\[([a-z0-9,]+)\]'", dockerfile)
    assert found, "deploy/Dockerfile: no `pip install '.[extras]'` line"
    extras = set(found.group(1).split(","))
    config = load_file(K8S / "llmgw-config.yaml")
    assert "extproc" in extras
    if any(spec.discovery is not None for spec in config.models.values()):
        assert "k8s" in extras, f"deploy/Dockerfile installs {sorted(extras)}: add k8s"
