"""The fake Kubernetes API server and an official client on it, for this folder's
discovery and control-plane tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from llmgw.testing.fake_k8s import FakeKubernetes


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubernetes]:
    async with FakeKubernetes() as fake:
        yield fake


@pytest.fixture
def api(kube: FakeKubernetes) -> Iterator[Any]:
    from kubernetes import client  # noqa: PLC0415 (only the Kubernetes tests need it)

    api_client: Any = client.ApiClient(client.Configuration(host=kube.host))
    yield api_client
    api_client.close()
