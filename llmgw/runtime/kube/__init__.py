"""Kubernetes plumbing shared by discovery and the on-demand control plane: the client,
configured the standard way, and API errors turned into messages that say what to fix."""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from llmgw.runtime.controlplanes import StartError

_config_module: Any = k8s_config  # untyped in the client (mypy --strict)

DISCOVERY_ROLE = "llmgw-discovery"
DISCOVERY_RBAC = "deploy/k8s/llmgw-rbac.yaml"


def load_client() -> k8s.ApiClient:
    """In-cluster service account credentials, else KUBECONFIG, else ~/.kube/config."""
    try:
        _config_module.load_incluster_config()
    except ConfigException:
        try:
            # KUBECONFIG read now, not when the client was imported (its default).
            _config_module.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        except Exception as exc:  # ConfigException, OSError, a YAML or decoding error
            where = os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise StartError(
                f"no Kubernetes credentials: not running in a cluster and no usable "
                f"kubeconfig ({where}): {type(exc).__name__}: {exc}"
            ) from None
    return k8s.ApiClient()


def status_message(exc: ApiException) -> str:
    """The API's `Status.message`, else the HTTP status and reason."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"{exc.status} {exc.reason}".strip()


def forbidden(verb: str, resource: str, namespace: str, exc: ApiException) -> StartError:
    """RBAC refused: name the verb, the resource and the Role that grants it (401: the
    credentials themselves were rejected, which no Role fixes)."""
    if exc.status == 401:
        return StartError(
            f"Kubernetes rejected llmgw's credentials on {verb} {resource} in namespace "
            f"{namespace!r}: check the service account token (mounted, not expired) or the "
            f"kubeconfig ({status_message(exc)})"
        )
    return StartError(
        f"RBAC: llmgw's service account may not {verb} {resource} in namespace "
        f"{namespace!r}; apply the Role {DISCOVERY_ROLE!r} and its RoleBinding from "
        f"{DISCOVERY_RBAC} in that namespace (get, list, watch on endpointslices, pods and "
        f"inferencepools) ({status_message(exc)})"
    )


def unreachable(exc: BaseException, api_client: Any) -> str:
    host = getattr(getattr(api_client, "configuration", None), "host", "?")
    return f"cannot reach the Kubernetes API at {host}: {type(exc).__name__}: {exc}"
