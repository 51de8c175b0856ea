"""`limits.upstream_*`: the embedded proxy's connection pool settings, validated by path."""

from __future__ import annotations

import pytest

from llmgw.config import load_dict
from llmgw.errors import ConfigError

_MODELS = {"m": {"endpoints": ["127.0.0.1:9000"]}}


def test_upstream_limits_have_defaults() -> None:
    limits = load_dict({"models": _MODELS}).limits
    assert limits.upstream_max_connections == 512
    assert limits.upstream_connect_timeout == 5.0


def test_upstream_limits_can_be_set() -> None:
    config = load_dict(
        {"models": _MODELS, "limits": {"upstream_max_connections": 8, "upstream_read_timeout": 30}}
    )
    assert config.limits.upstream_max_connections == 8
    assert config.limits.upstream_read_timeout == 30.0


def test_zero_upstream_connections_is_rejected_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"limits\.upstream_max_connections"):
        load_dict({"models": _MODELS, "limits": {"upstream_max_connections": 0}})
