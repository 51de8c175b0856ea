"""Bad input never crashes the core: random and mutated inputs give typed errors only."""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.config import load_dict, load_text
from llmgw.errors import BadRequest, BodyTooLarge, ConfigError, LlmgwError, MetricsError
from llmgw.promtext import CONTRACTS, extract, parse
from llmgw.request import build_request, parse_body
from llmgw.types import Engine

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)

VALID: dict[str, Any] = {
    "models": {
        "chat": {
            "engine": "vllm",
            "endpoints": ["127.0.0.1:8000", {"address": "127.0.0.1:8001", "weight": 2}],
            "session": {
                "headers": ["x-session-id"],
                "num_fallback_replicas": 2,
                "bounded_load": 1.25,
            },
            "strategy": {
                "scorers": {"queue": 1, "kv": 2},
                "picker": {"type": "softmax", "temperature": 0.3},
            },
        },
        "lazy": {"launch": {"command": "sim --port {port}"}, "scaling": {"min": 0, "max": 1}},
    },
    "breaker": {"failure_threshold": 3},
    "activation_timeout": 45,
}


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, (*prefix, i))
    return out


ALL_PATHS = paths(VALID)[1:]


@FUZZ
@given(data=json_values)
def test_config_loader_gives_only_config_errors_on_random_data(data: Any) -> None:
    try:
        load_dict(data)
    except ConfigError as exc:
        assert exc.problems and all(": " in p for p in exc.problems)


@FUZZ
@given(path=st.sampled_from(ALL_PATHS), value=json_values)
def test_config_loader_gives_path_indexed_errors_on_mutated_configs(
    path: tuple[Any, ...], value: Any
) -> None:
    data = copy.deepcopy(VALID)
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        load_dict(data)
    except ConfigError as exc:
        assert all(": " in p for p in exc.problems)


@FUZZ
@given(text=st.text(max_size=300))
def test_yaml_text_gives_only_config_errors(text: str) -> None:
    with contextlib.suppress(ConfigError):
        load_text(text)


@FUZZ
@given(body=st.binary(max_size=300))
def test_body_parser_gives_only_typed_errors_on_random_bytes(body: bytes) -> None:
    try:
        fields = parse_body(body, max_bytes=200, prefix_chars=100)
    except (BadRequest, BodyTooLarge) as exc:
        assert exc.status in (400, 413) and exc.message
    else:
        assert fields.model and len(fields.prompt) <= 100


@FUZZ
@given(
    payload=st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "stream", "x"]), json_values
    )
)
def test_body_parser_gives_only_typed_errors_on_odd_json_objects(payload: dict[str, Any]) -> None:
    try:
        parse_body(json.dumps(payload).encode(), max_bytes=1 << 20, prefix_chars=1000)
    except BadRequest as exc:
        assert exc.status == 400


def test_deep_json_and_invalid_utf8_are_400() -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "\xff\xfe"}', b"\xc3\x28"):
        try:
            parse_body(body, max_bytes=1 << 20, prefix_chars=100)
        except BadRequest as exc:
            assert exc.status == 400
        else:
            raise AssertionError(f"accepted {body[:20]!r}")


@FUZZ
@given(headers=st.dictionaries(st.text(max_size=30), st.text(max_size=2000), max_size=8))
def test_request_builder_survives_huge_and_odd_headers(headers: dict[str, str]) -> None:
    config = load_dict(VALID)
    try:
        build_request(config, headers, "/v1/chat/completions", b'{"model": "chat"}')
    except LlmgwError as exc:
        assert 400 <= exc.status < 600


prom_line = st.one_of(
    st.text(max_size=80),
    st.builds(
        lambda n, k, v, val: f'{n}{{{k}="{v}"}} {val}',
        st.sampled_from(["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "x"]),
        st.text(alphabet='abc_="\\{}', max_size=8),
        st.text(max_size=10),
        st.one_of(
            st.floats().map(str), st.text(max_size=5), st.sampled_from(["NaN", "+Inf", "-Inf"])
        ),
    ),
)


@FUZZ
@given(lines=st.lists(prom_line, max_size=12))
def test_prometheus_parser_gives_only_metrics_errors(lines: list[str]) -> None:
    text = "\n".join(lines)
    with contextlib.suppress(MetricsError):
        parse(text)
    for engine in Engine:
        try:
            m = extract(text, CONTRACTS[engine], model="m")
        except MetricsError:
            continue
        assert 0.0 <= m.kv_usage <= 1.0
