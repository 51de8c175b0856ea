"""Config validation (path-indexed messages), YAML loading, normalize() and the scaling modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.config import (
    Config,
    ModelMode,
    ScalingSpec,
    endpoints_of,
    host_port,
    launch_argv,
    load_dict,
    load_file,
    load_text,
    model_mode,
    normalize,
)
from llmgw.discovery import join
from llmgw.errors import ConfigError
from llmgw.types import Endpoint, Engine

EP = ["10.0.0.1:8000"]
NAN = float("nan")
LAUNCH = {"command": "vllm serve m --port {port}"}


def one_model(**fields: Any) -> dict[str, Any]:
    return {"models": {"chat": fields}}


def problems_of(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    return info.value.problems


# (case id, config, the exact path of the problem, a phrase its message must contain)
INVALID: list[tuple[str, Any, str, str]] = [
    (
        "scaling-max-below-min",
        one_model(launch=LAUNCH, scaling={"min": 2, "max": 1}),
        "models.chat.scaling.max",
        "must be >= min (2)",
    ),
    ("unknown-top-level-field", {**one_model(endpoints=EP), "bogus": 1}, "bogus", "unknown field"),
    (
        "metrics-path-relative",
        one_model(endpoints=EP, metrics={"path": "metrics"}),
        "models.chat.metrics.path",
        "must start with '/'",
    ),
    (
        "peers-v6-address-v4-listen",
        {
            **one_model(endpoints=EP),
            "peers": {"listen": "0.0.0.0:9005", "addresses": ["[::1]:9005"]},
        },
        "peers.addresses",
        "listen on [::]:PORT",
    ),
    (
        "peers-v4-address-one-v6-listen",
        {
            **one_model(endpoints=EP),
            "peers": {"listen": "[fd00::1]:9005", "addresses": ["10.0.0.2:9005"]},
        },
        "peers.addresses",
        "is IPv4",
    ),
    (
        "model-header-blank",
        {**one_model(endpoints=EP), "model_header": " "},
        "model_header",
        "must name a header",
    ),
    (
        "unknown-model-field",
        one_model(endpoints=EP, replicas=3),
        "models.chat.replicas",
        "unknown field",
    ),
    (
        "unknown-session-field",
        one_model(endpoints=EP, session={"header": "x"}),
        "models.chat.session.header",
        "unknown field",
    ),
    (
        "unknown-endpoint-field",
        one_model(endpoints=[{"address": "a:1", "zone": "x"}]),
        "models.chat.endpoints.0.zone",
        "unknown field",
    ),
    (
        "address-without-port",
        one_model(endpoints=["10.0.0.1"]),
        "models.chat.endpoints.0.address",
        "host:port",
    ),
    (
        "address-port-zero",
        one_model(endpoints=["h:0"]),
        "models.chat.endpoints.0.address",
        "host:port",
    ),
    (
        "address-port-too-big",
        one_model(endpoints=["h:65536"]),
        "models.chat.endpoints.0.address",
        "'h:65536'",
    ),
    (
        "address-is-a-url",
        one_model(endpoints=["a:1", "http://h:80"]),
        "models.chat.endpoints.1.address",
        "host:port",
    ),
    (
        "duplicate-endpoints",
        one_model(endpoints=["a:1", "b:2", {"address": "a:1", "weight": 2}]),
        "models.chat.endpoints",
        "duplicate address a:1",
    ),
    (
        "zero-weight",
        one_model(endpoints=[{"address": "a:1", "weight": 0}]),
        "models.chat.endpoints.0.weight",
        "greater than 0",
    ),
    ("unknown-engine", one_model(endpoints=EP, engine="tgi"), "models.chat.engine", "'vllm'"),
    (
        "unknown-strategy-preset",
        one_model(endpoints=EP, strategy="fastest"),
        "models.chat.strategy",
        "unknown strategy preset 'fastest'",
    ),
    (
        "unknown-scorer",
        one_model(endpoints=EP, strategy={"scorers": {"telepathy": 1}}),
        "models.chat.strategy.scorers.telepathy",
        "unknown scorer",
    ),
    (
        "unknown-filter",
        one_model(endpoints=EP, strategy={"filters": ["healthy", "gpu"]}),
        "models.chat.strategy.filters.1",
        "unknown filter 'gpu'",
    ),
    (
        "unknown-picker",
        one_model(endpoints=EP, strategy={"picker": "best"}),
        "models.chat.strategy.picker.type",
        "unknown picker 'best'",
    ),
    (
        "picker-bad-param",
        one_model(endpoints=EP, strategy={"picker": {"type": "softmax", "params": {"t": 1}}}),
        "models.chat.strategy.picker.params",
        "unknown param 't' (accepted: temperature)",
    ),
    (
        "picker-negative-temperature",
        one_model(endpoints=EP, strategy={"picker": {"type": "softmax", "temperature": -1}}),
        "models.chat.strategy.picker.params",
        "temperature must be >= 0",
    ),
    (
        "unknown-strategy-field",
        one_model(endpoints=EP, strategy={"scorer": {"queue": 1}}),
        "models.chat.strategy.scorer",
        "unknown field",
    ),
    (
        "negative-scorer-weight",
        one_model(endpoints=EP, strategy={"scorers": {"queue": -1}}),
        "models.chat.strategy.scorers.queue.weight",
        "greater than or equal to 0",
    ),
    (
        "unknown-scorer-param",
        one_model(endpoints=EP, strategy={"scorers": {"queue": {"params": {"smooth": 1}}}}),
        "models.chat.strategy.scorers.queue.params",
        "smooth",
    ),
    (
        "kv-ceiling-out-of-range",
        one_model(endpoints=EP, strategy={"scorers": {"kv": {"params": {"ceiling": 2}}}}),
        "models.chat.strategy.scorers.kv.params",
        "ceiling",
    ),
    # Plugin params: each one's type checked against its plugin's signature, alike in the
    # Python sources (which took any type) and the compiled build (found by a review helper).
    (
        "plugin-param-wrong-type",
        one_model(
            endpoints=EP,
            strategy={"scorers": {"latency": {"params": {"work_weight": 1.0, "step_ms": "x"}}}},
        ),
        "models.chat.strategy.scorers.latency.params.step_ms",
        "must be a number, got 'x'",
    ),
    (
        "plugin-param-nan",  # was four problems at `.float`, `.int`, `.str`, `.bool`
        one_model(endpoints=EP, strategy={"scorers": {"latency": {"params": {"step_ms": NAN}}}}),
        "models.chat.strategy.scorers.latency.params.step_ms",
        "must be a finite number, got nan",
    ),
    (
        "plugin-param-string-for-a-bool",  # calibration stayed on with the Python sources
        one_model(
            endpoints=EP, strategy={"scorers": {"latency": {"params": {"calibrate": "false"}}}}
        ),
        "models.chat.strategy.scorers.latency.params.calibrate",
        "must be true or false, got 'false'",
    ),
    (
        "session-bounded-load-true",  # every pick raised with the Python sources (a 500)
        one_model(
            endpoints=EP, strategy={"scorers": {"session": {"params": {"bounded_load": True}}}}
        ),
        "models.chat.strategy.scorers.session.params.bounded_load",
        "must be a number, got True",
    ),
    (
        "picker-param-bool",
        one_model(endpoints=EP, strategy={"picker": {"type": "softmax", "temperature": True}}),
        "models.chat.strategy.picker.params.temperature",
        "must be a number, got True",
    ),
    (
        "zero-smoothing",
        one_model(endpoints=EP, strategy={"scorers": {"queue": {"params": {"smoothing": 0}}}}),
        "models.chat.strategy.scorers.queue.params",
        "smoothing",
    ),
    (
        "negative-fallbacks",
        one_model(endpoints=EP, session={"num_fallback_replicas": -1}),
        "models.chat.session.num_fallback_replicas",
        "greater than or equal to 0",
    ),
    (
        "zero-virtual-nodes",
        one_model(endpoints=EP, session={"num_virtual_nodes": 0}),
        "models.chat.session.num_virtual_nodes",
        "greater than or equal to 1",
    ),
    (
        "bounded-load-below-one",
        one_model(endpoints=EP, session={"bounded_load": 0.5}),
        "models.chat.session.bounded_load",
        "greater than or equal to 1",
    ),
    (
        "no-session-headers",
        one_model(endpoints=EP, session={"headers": []}),
        "models.chat.session.headers",
        "at least one header",
    ),
    (
        "unknown-metric-role",
        one_model(endpoints=EP, metrics={"queue": "q"}),
        "models.chat.metrics.queue",
        "unknown metric role",
    ),
    ("model-without-endpoints-or-launch", one_model(), "models.chat.endpoints", "needs endpoints"),
    (
        "scaling-up-without-launch",
        one_model(endpoints=EP, scaling={"min": 0, "max": 2}),
        "models.chat.launch",
        "needs a launch spec",
    ),
    # An omitted max becomes >= 1 in normalize(), so it needs a launch spec just the same.
    (
        "omitted-max-without-launch",
        one_model(endpoints=EP, scaling={"min": 1}),
        "models.chat.launch",
        "needs a launch spec",
    ),
    (
        "launch-with-both-kinds",
        one_model(launch={**LAUNCH, "deployment": "d"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "exactly one",
    ),
    (
        "launch-with-neither-kind",
        one_model(launch={"port": 80}, scaling={"max": 1}),
        "models.chat.launch.command",
        "exactly one",
    ),
    (
        "negative-min",
        one_model(launch=LAUNCH, scaling={"min": -1}),
        "models.chat.scaling.min",
        "greater than or equal to 0",
    ),
    (
        "max-cooldown-below-base",
        {**one_model(endpoints=EP), "breaker": {"base_cooldown": 10, "max_cooldown": 5}},
        "breaker.max_cooldown",
        "must be >= base_cooldown (10.0)",
    ),
    (
        "zero-failure-threshold",
        {**one_model(endpoints=EP), "breaker": {"failure_threshold": 0}},
        "breaker.failure_threshold",
        "greater than or equal to 1",
    ),
    (
        "zero-staleness",
        {**one_model(endpoints=EP), "scrape": {"staleness": 0}},
        "scrape.staleness",
        "greater than 0",
    ),
    (
        "kv-ceiling-above-one",
        one_model(endpoints=EP, saturation={"kv_ceiling": 1.5}),
        "models.chat.saturation.kv_ceiling",
        "less than or equal to 1",
    ),
    (
        "infinite-start-seconds",  # was accepted; Retry-After then overflowed at request time
        one_model(launch={**LAUNCH, "expected_start_seconds": float("inf")}, scaling={"max": 1}),
        "models.chat.launch.expected_start_seconds",
        "finite number",
    ),
    (
        "infinite-bounded-load",  # was accepted; every session pick then overflowed
        one_model(endpoints=EP, session={"bounded_load": float("inf")}),
        "models.chat.session.bounded_load",
        "finite number",
    ),
    (
        "nan-timeout",
        {**one_model(endpoints=EP), "activation_timeout": float("nan")},
        "activation_timeout",
        "finite number",
    ),
    (
        "launch-json-argument-unescaped",  # passed, then every start failed with a KeyError
        one_model(launch={"command": "vllm serve m --kv '{\"on\": true}'"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "write a literal brace as {{ or }}",
    ),
    (
        "launch-placeholder-typo",
        one_model(launch={"command": "vllm serve m --port {prot}"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "unknown placeholder {prot} (known: {port}, {host}, {model}",
    ),
    (
        "launch-attribute-placeholder",  # an AttributeError traceback from check-config
        one_model(launch={"command": "vllm serve m --port {port.foo}"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "unknown placeholder {port.foo} (known: {port}, {host}, {model}",
    ),
    (
        "launch-index-placeholder",  # a TypeError traceback; `{host[0]}` took one letter
        one_model(launch={"command": "vllm serve m --host {host[0]}"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "unknown placeholder {host[0]}",
    ),
    (
        "picker-shorthand-params-not-a-mapping",  # a TypeError traceback from check-config
        one_model(
            endpoints=EP,
            strategy={"picker": {"type": "softmax", "temperature": 0.2, "params": [1]}},
        ),
        "models.chat.strategy.picker.params",
        "valid dictionary",
    ),
    (
        "launch-unclosed-quote",
        one_model(launch={"command": "vllm serve 'm --port {port}"}, scaling={"max": 1}),
        "models.chat.launch.command",
        "No closing quotation",
    ),
    (
        "launch-host-not-a-host",
        one_model(launch={**LAUNCH, "host": "bad host"}, scaling={"max": 1}),
        "models.chat.launch.host",
        "must be an IP address or a host name",
    ),
    (
        "strategy-name-with-a-newline",  # broke every response carrying the debug header
        one_model(endpoints=EP, strategy={"name": "custom\r\nx-injected: 1"}),
        "models.chat.strategy.name",
        "should match pattern",
    ),
    # Found by a review helper: each loaded, then failed or did nothing at run time.
    (
        "launch-health-path-relative",  # `GET health`: a 400, every start failed at timeout
        one_model(launch={**LAUNCH, "health_path": "health"}, scaling={"max": 1}),
        "models.chat.launch.health_path",
        "must start with '/'",
    ),
    (
        "session-header-empty",  # a header name that never matches: affinity silently off
        one_model(endpoints=EP, session={"headers": ["x-a", ""]}),
        "models.chat.session.headers.1",
        "must be an HTTP header name (RFC 9110 token), got ''",
    ),
    (
        "session-header-trailing-colon",
        one_model(endpoints=EP, session={"headers": ["x-session-id:"]}),
        "models.chat.session.headers.0",
        "RFC 9110 token",
    ),
    (
        "session-header-spaces",
        one_model(endpoints=EP, session={"headers": ["x session id"]}),
        "models.chat.session.headers.0",
        "RFC 9110 token",
    ),
    (
        "model-header-spaces",
        {**one_model(endpoints=EP), "model_header": "x model"},
        "model_header",
        "must be an HTTP header name (RFC 9110 token), got 'x model'",
    ),
    (
        "bracketed-address-not-ipv6",  # the proxy resolved "1:2" as a host name
        one_model(endpoints=["[1:2]:8000"]),
        "models.chat.endpoints.0.address",
        "an IPv6 address in the brackets",
    ),
    (
        "bracketed-ipv4",
        one_model(endpoints=["[10.0.0.1]:8000"]),
        "models.chat.endpoints.0.address",
        "an IPv6 address in the brackets",
    ),
    (
        "launch-and-endpoints",  # routed to the static endpoint, status "off", never launched
        one_model(endpoints=EP, launch=LAUNCH, scaling={"min": 0, "max": 1}),
        "models.chat.endpoints",
        "give either endpoints or launch, not both",
    ),
    (
        "picker-param-given-twice",  # one of the two silently won
        one_model(
            endpoints=EP,
            strategy={
                "picker": {"type": "softmax", "temperature": 0.1, "params": {"temperature": 0.5}}
            },
        ),
        "models.chat.strategy.picker.params.temperature",
        "given twice, beside type and in params",
    ),
    (
        "launch-deployment-not-a-name",  # failed at the first request instead
        one_model(launch={"deployment": "My Model"}, scaling={"max": 1}),
        "models.chat.launch.deployment",
        "must be a Kubernetes object name",
    ),
    (
        "launch-namespace-not-a-name",
        one_model(launch={"deployment": "vllm-big", "namespace": "Prod"}, scaling={"max": 1}),
        "models.chat.launch.namespace",
        "must be a Kubernetes namespace name",
    ),
    (
        "launch-service-not-a-name",
        one_model(launch={"deployment": "vllm-big", "service": "big_svc"}, scaling={"max": 1}),
        "models.chat.launch.service",
        "must be a Kubernetes object name",
    ),
    ("no-models", {"models": {}}, "models", "at least one model"),
    ("models-missing", {"breaker": {}}, "models", "required field is missing"),
]


@pytest.mark.parametrize(
    ("data", "path", "phrase"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_config_names_the_path_of_the_problem(data: Any, path: str, phrase: str) -> None:
    problems = problems_of(data)
    assert len(problems) == 1, problems
    got_path, _, message = problems[0].partition(": ")
    assert got_path == path
    assert phrase in message


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            one_model(launch=LAUNCH, scaling={"min": True}),
            "models.chat.scaling.min: Input should be a valid integer",
        ),
        (
            one_model(endpoints=[{"address": EP[0], "weight": True}]),
            "models.chat.endpoints.0.weight: Input should be a valid number",
        ),
        (
            {**one_model(endpoints=EP), "scrape": {"interval": True}},
            "scrape.interval: Input should be a valid number",
        ),
        ({**one_model(endpoints=EP), "seed": True}, "seed: Input should be a valid integer"),
        (
            one_model(endpoints=EP, strategy={"scorers": {"queue": True}}),
            "models.chat.strategy.scorers.queue.weight: Input should be a valid number",
        ),
        (
            {**one_model(endpoints=EP), "limits": {"max_body_bytes": "1048576"}},
            "limits.max_body_bytes: Input should be a valid integer",
        ),
        (
            one_model(launch=LAUNCH, scaling={"max": 1.5}),
            "models.chat.scaling.max: Input should be a valid integer",
        ),
        (
            one_model(discovery={"service": {"name": "vllm", "port": True}}),
            "models.chat.discovery.service.port: must be a port name or a number in 1..65535, "
            "got True",
        ),
        (
            {**one_model(endpoints=EP), "debug_headers": "yes"},
            "debug_headers: Input should be a valid boolean",
        ),
    ],
    ids=[
        "scaling.min",
        "weight",
        "scrape.interval",
        "seed",
        "scorer-weight",
        "string-number",
        "float-for-int",
        "discovery-port",
        "string-bool",
    ],
)
def test_a_boolean_or_a_string_where_a_number_belongs_is_refused(
    data: dict[str, Any], problem: str
) -> None:
    """YAML `yes`/`on`/`true` was read as 1: `scaling.min: true` started a replica at boot,
    `weight: on` was weight 1 (found by a review helper)."""
    assert problems_of(data) == [problem]


def test_an_int_where_a_float_belongs_still_loads() -> None:
    cfg = load_dict({**one_model(endpoints=[{"address": EP[0], "weight": 2}]), "seed": 7})
    assert cfg.models["chat"].endpoints[0].weight == 2.0 and cfg.seed == 7


def test_peers_of_a_family_the_listen_address_reaches_load() -> None:
    for listen, address in (("[::]:9005", "10.0.0.2:9005"), ("0.0.0.0:9005", "peers:9005")):
        loaded = load_dict(
            {**one_model(endpoints=EP), "peers": {"listen": listen, "addresses": [address]}}
        )
        assert loaded.peers is not None and loaded.peers.addresses == (address,)


def test_model_header_is_read_lower_cased() -> None:
    assert (
        load_dict({**one_model(endpoints=EP), "model_header": " X-Model "}).model_header
        == "x-model"
    )


def test_scaling_message_is_exactly_the_documented_one() -> None:
    problems = problems_of(one_model(launch=LAUNCH, scaling={"min": 1, "max": 0}))
    assert problems == ["models.chat.scaling.max: must be >= min (1)"]


def test_every_problem_is_reported_at_once() -> None:
    data = {
        "models": {
            "a": {"endpoints": ["nohost"]},
            "b": {"endpoints": EP, "strategy": "nope"},
        },
        "breaker": {"half_open_probes": 0},
    }
    paths = sorted(p.partition(": ")[0] for p in problems_of(data))
    assert paths == [
        "breaker.half_open_probes",
        "models.a.endpoints.0.address",
        "models.b.strategy",
    ]


def test_config_error_message_lists_the_problems_and_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        load_text("models: {}\n", source="router.yaml")
    assert "router.yaml" in str(info.value)
    assert "models: must configure at least one model" in str(info.value)


def test_yaml_syntax_error_names_line_and_column() -> None:
    text = "models:\n  chat:\n\tendpoints: [a:1]\n"  # a tab cannot indent YAML (line 3, col 1)
    with pytest.raises(ConfigError) as info:
        load_text(text)
    (problem,) = info.value.problems
    assert problem.startswith("<yaml>: line 3, column 1: ")


def test_yaml_nested_past_the_recursion_limit_is_a_config_error() -> None:
    """Not a RecursionError traceback from check-config, nor a dead reload watcher."""
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_text("models: " + "[" * 5000 + "]" * 5000)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "models:\n  chat:\n    endpoints: [10.0.0.1:8000]\n"
            "  chat:\n    endpoints: [10.0.0.2:8000]\n",
            "line 4, column 3: duplicate key 'chat'",
        ),
        (
            "models:\n  chat:\n    endpoints: [10.0.0.1:8000]\n    endpoints: [10.0.0.2:8000]\n",
            "line 4, column 5: duplicate key 'endpoints'",
        ),
    ],
    ids=["model-twice", "field-twice"],
)
def test_a_key_given_twice_is_refused(text: str, where: str) -> None:
    """PyYAML kept the last of two equal keys: a model block copied without renaming it
    replaced the first model, and check-config called the file valid (found by a review
    helper)."""
    with pytest.raises(ConfigError) as info:
        load_text(text)
    assert info.value.problems == [f"<yaml>: {where}"]


def test_a_merged_key_may_still_be_overridden() -> None:
    text = (
        "models:\n  chat: &base\n    endpoints: [10.0.0.1:8000]\n"
        "  code:\n    <<: *base\n    endpoints: [10.0.0.2:8000]\n"
    )
    assert load_text(text).models["code"].endpoints[0].address == "10.0.0.2:8000"


def test_unclosed_flow_sequence_is_a_yaml_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_text("models:\n  chat: {endpoints: [a:1\n")
    assert info.value.problems[0].startswith("<yaml>: line ")


@pytest.mark.parametrize(
    ("text", "type_name"),
    [("- a\n- b\n", "list"), ("42\n", "int"), ("", "NoneType"), ("just text\n", "str")],
    ids=["list", "int", "empty", "scalar"],
)
def test_root_must_be_a_mapping(text: str, type_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(text)
    assert info.value.problems == [f"<root>: must be a mapping, got {type_name}"]


def test_load_file_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.yaml"
    path.write_text(
        "models:\n  chat:\n    endpoints: ['10.0.0.1:8000', {address: '10.0.0.2:8000', weight: 2}]\n"
    )
    cfg = load_file(path)
    assert [(e.address, e.weight) for e in cfg.models["chat"].endpoints] == [
        ("10.0.0.1:8000", 1.0),
        ("10.0.0.2:8000", 2.0),
    ]


def test_missing_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_file(tmp_path / "absent.yaml")
    assert info.value.problems[0].startswith("<file>: cannot read")
    assert "absent.yaml" in info.value.problems[0]


def test_defaults_follow_the_issue() -> None:
    cfg = load_dict(one_model(endpoints=EP))
    spec = cfg.models["chat"]
    assert cfg.activation_timeout == 45.0
    assert cfg.activation_poll_interval == 0.25
    assert cfg.scrape.staleness == 2.0
    assert spec.session.headers == ("x-session-id",)
    assert spec.session.num_fallback_replicas == 2
    assert spec.session.num_virtual_nodes == 100
    assert spec.session.bounded_load is None
    assert spec.engine is Engine.VLLM
    assert spec.strategy.name == "latency"


def test_shorthands_expand_and_headers_are_lowercased() -> None:
    cfg = load_dict(
        one_model(
            endpoints=EP,
            session={"headers": ["X-Conversation-ID", "X-Session-Id"]},
            strategy={
                "scorers": {"queue": 2, "kv": {"weight": 1, "params": {"ceiling": 0.8}}},
                "picker": "p2c",
            },
        )
    )
    spec = cfg.models["chat"]
    assert spec.session.headers == ("x-conversation-id", "x-session-id")
    assert spec.strategy.scorers["queue"].weight == 2.0
    assert spec.strategy.scorers["kv"].params == {"ceiling": 0.8}
    assert spec.strategy.picker.type == "p2c"


def test_ipv6_and_hostname_addresses_are_accepted() -> None:
    cfg = load_dict(one_model(endpoints=["[::1]:8000", "vllm-0.vllm.svc:8000", "h:65535"]))
    assert len(cfg.models["chat"].endpoints) == 3


def test_endpoints_of_builds_endpoints_with_the_model_engine_and_weight() -> None:
    cfg = load_dict(one_model(engine="sglang", endpoints=["a:1", {"address": "b:2", "weight": 3}]))
    assert endpoints_of("chat", cfg.models["chat"]) == [
        Endpoint("a:1", "chat", pool="chat", engine=Engine.SGLANG, weight=1.0),
        Endpoint("b:2", "chat", pool="chat", engine=Engine.SGLANG, weight=3.0),
    ]


# (case id, model fields, max after normalize, mode)
SCALING: list[tuple[str, dict[str, Any], int | None, ModelMode]] = [
    ("static-endpoints-no-stanza", {"endpoints": EP}, None, ModelMode.STATIC),
    (
        "static-endpoints-explicit-off",
        {"endpoints": EP, "scaling": {"min": 0, "max": 0}},
        0,
        ModelMode.OFF,
    ),
    ("static-endpoints-max-zero-only", {"endpoints": EP, "scaling": {"max": 0}}, 0, ModelMode.OFF),
    ("launched-no-stanza-is-off", {"launch": LAUNCH}, None, ModelMode.OFF),
    (
        "launched-min0-max0-is-off",
        {"launch": LAUNCH, "scaling": {"min": 0, "max": 0}},
        0,
        ModelMode.OFF,
    ),
    (
        "launched-min0-max2-on-demand",
        {"launch": LAUNCH, "scaling": {"min": 0, "max": 2}},
        2,
        ModelMode.ON_DEMAND,
    ),
    (
        "launched-min0-omitted-max-on-demand",
        {"launch": LAUNCH, "scaling": {"min": 0}},
        1,
        ModelMode.ON_DEMAND,
    ),
    ("launched-empty-stanza-on-demand", {"launch": LAUNCH, "scaling": {}}, 1, ModelMode.ON_DEMAND),
    (
        "launched-min3-omitted-max-always-on",
        {"launch": LAUNCH, "scaling": {"min": 3}},
        3,
        ModelMode.ALWAYS_ON,
    ),
    (
        "launched-min1-max4-always-on",
        {"launch": LAUNCH, "scaling": {"min": 1, "max": 4}},
        4,
        ModelMode.ALWAYS_ON,
    ),
]


@pytest.mark.parametrize(
    ("fields", "max_after", "mode"), [c[1:] for c in SCALING], ids=[c[0] for c in SCALING]
)
def test_normalize_and_model_mode_follow_the_scaling_rules(
    fields: dict[str, Any], max_after: int | None, mode: ModelMode
) -> None:
    spec = load_dict(one_model(**fields)).models["chat"]
    assert (spec.scaling.max if spec.scaling is not None else None) == max_after
    assert model_mode(spec) is mode


def test_normalize_never_turns_an_explicit_zero_max_into_a_default() -> None:
    raw = Config.model_validate(one_model(launch=LAUNCH, scaling={"min": 0, "max": 0}))
    once = normalize(raw)
    assert once.models["chat"].scaling == ScalingSpec(min=0, max=0)
    assert normalize(once) == once


def test_explicit_zero_max_from_yaml_stays_off() -> None:
    cfg = load_text(
        "models:\n  big:\n    launch: {command: 'run {port}'}\n    scaling: {min: 0, max: 0}\n"
    )
    assert cfg.models["big"].scaling is not None
    assert cfg.models["big"].scaling.max == 0
    assert model_mode(cfg.models["big"]) is ModelMode.OFF


def test_normalize_fills_an_omitted_max_and_is_idempotent() -> None:
    raw = Config.model_validate(one_model(launch=LAUNCH, scaling={"min": 0}))
    assert raw.models["chat"].scaling is not None and raw.models["chat"].scaling.max is None
    once = normalize(raw)
    assert once.models["chat"].scaling is not None and once.models["chat"].scaling.max == 1
    assert normalize(once) == once


def test_picker_params_like_scorers_and_the_flat_shorthand() -> None:
    explicit = {"picker": {"type": "softmax", "params": {"temperature": 0.2}}}
    flat = {"picker": {"type": "softmax", "temperature": 0.2}}
    for strategy in (explicit, flat):
        picker = (
            load_dict(one_model(endpoints=EP, strategy=strategy)).models["chat"].strategy.picker
        )
        assert picker.type == "softmax"
        assert picker.params == {"temperature": 0.2}


@pytest.mark.parametrize(
    ("strategy", "preset"),
    [
        ({"scorers": {"latency": {"params": {"step_ms": 20}}}}, "latency"),
        ({"scorers": {"latency": 1}}, "latency"),
        ({"scorers": {"queue": 1, "inflight": 1, "kv": {"params": {"ceiling": 0.9}}}}, "batch"),
        ({"scorers": {"session": 1}, "filters": ["healthy"]}, None),  # ring or bounded-ring
    ],
)
def test_a_strategy_with_one_presets_scorers_is_that_preset_tuned(
    strategy: dict[str, Any], preset: str | None
) -> None:
    """README's `strategy: {scorers: {latency: {params: {...}}}}` got the generic filters
    (not-saturated, no blind-imbalance) and the name `custom` (found by a review helper)."""
    tuned = load_dict(one_model(endpoints=EP, strategy=strategy)).models["chat"].strategy
    if preset is None:
        assert tuned.name == "custom"
        return
    expected = load_dict(one_model(endpoints=EP, strategy=preset)).models["chat"].strategy
    assert (tuned.name, tuned.filters, tuned.picker) == (
        expected.name,
        expected.filters,
        expected.picker,
    )
    assert set(tuned.scorers) == set(expected.scorers)


def test_a_tuned_presets_explicit_filters_picker_and_name_win() -> None:
    def spec_of(**fields: Any) -> Any:
        strategy = {"scorers": {"latency": {"params": {"step_ms": 20}}}, **fields}
        return load_dict(one_model(endpoints=EP, strategy=strategy)).models["chat"].strategy

    own = spec_of(filters=["healthy", "not-saturated"])
    assert own.filters == ("healthy", "not-saturated") and own.name == "custom"
    same = spec_of(filters=["healthy", "model-serves", "blind-imbalance"])
    assert same.name == "latency"  # the README's KV-events example: the preset, tuned
    softmax = spec_of(picker={"type": "softmax", "temperature": 0.2})
    assert softmax.name == "custom" and softmax.filters[-1] == "blind-imbalance"
    named = spec_of(name="fast")
    assert named.name == "fast" and named.filters[-1] == "blind-imbalance"
    reweighted = load_dict(one_model(endpoints=EP, strategy={"scorers": {"latency": 2}}))
    assert reweighted.models["chat"].strategy.name == "custom"
    # Scorers no preset has alone, or two presets share: the generic defaults.
    for scorers in ({"latency": 1, "kv": 1}, {"session": 1}):
        generic = load_dict(one_model(endpoints=EP, strategy={"scorers": scorers}))
        strategy = generic.models["chat"].strategy
        assert strategy.name == "custom" and "not-saturated" in strategy.filters


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_launch_host_gives_a_bracketed_endpoint_address(host: str) -> None:
    """`::1` was joined as `::1:24900`, an address nothing downstream could parse."""
    cfg = load_dict(one_model(launch={**LAUNCH, "host": host}, scaling={"max": 1}))
    launch = cfg.models["chat"].launch
    assert launch is not None and launch.host == "::1"
    assert join(launch.host, 24900) == "[::1]:24900"
    assert host_port(join(launch.host, 24900))


def test_a_launch_command_with_escaped_braces_fills_its_placeholders() -> None:
    argv = launch_argv("vllm serve {model} --port {port} --kv '{{\"on\": true}}'",
                       port=9000, host="h", model="m")  # fmt: skip
    assert argv == ["vllm", "serve", "m", "--port", "9000", "--kv", '{"on": true}']


@pytest.mark.parametrize(
    "pair",
    [("Node-A:8000", "node-a:8000"), ("10.0.0.1:8000", "10.0.0.1:08000"),
     ("[::1]:8000", "[0:0:0:0:0:0:0:1]:8000"), ("10.0.0.1:8000", "[::ffff:10.0.0.1]:8000")],
)  # fmt: skip
def test_two_spellings_of_one_endpoint_are_a_duplicate(pair: tuple[str, str]) -> None:
    """The IPv4-mapped spelling of an IPv4 endpoint was another server: two ring replicas
    of one (found by a review helper)."""
    with pytest.raises(ConfigError, match="duplicate address"):
        load_dict(one_model(endpoints=list(pair)))


def test_an_ipv4_mapped_endpoint_is_spelled_as_its_ipv4_address() -> None:
    cfg = load_dict(one_model(endpoints=["[::FFFF:10.0.0.1]:8000"]))
    assert cfg.models["chat"].endpoints[0].address == "10.0.0.1:8000"


ONE_MODEL = "models: {m: {endpoints: ['10.0.0.1:8000']}}\n"


@pytest.mark.parametrize(
    "text",
    [
        ONE_MODEL + "scrape: {interval: 1e-1}\n",
        ONE_MODEL + "limits: {upstream_read_timeout: 6e2}\n",
        # A JSON config (read as YAML): 6e1 is a JSON number.
        '{"models": {"m": {"endpoints": ["10.0.0.1:8000"]}}, "activation_timeout": 6e1}',
    ],
)
def test_exponent_numbers_load_as_numbers(text: str) -> None:
    """YAML 1.1 reads `1e-1` (no dot) as a string: the strict numbers refused what loaded
    before (lax pydantic coerced it), a JSON config's exponent too. Found by a review
    helper."""
    load_text(text)


@pytest.mark.parametrize("word", ["yes", "on", "no", "off", "Yes", "ON"])
def test_a_switch_refuses_yaml_1_1_words(word: str) -> None:
    """The README: anything but true/false for a switch is refused. YAML 1.1 read these as
    booleans before pydantic saw them, so `debug_headers: on` was called valid. Found by a
    review helper."""
    with pytest.raises(ConfigError, match="debug_headers"):
        load_text(ONE_MODEL + f"debug_headers: {word}\n")
    text = f"models: {{m: {{endpoints: ['10.0.0.1:8000'], kv_events: {{discover: {word}}}}}}}\n"
    with pytest.raises(ConfigError, match=r"kv_events\.discover"):
        load_text(text)


@pytest.mark.parametrize("name", ["off", "no", "on", "yes"])
def test_a_model_named_like_a_yaml_1_1_boolean_is_that_name(name: str) -> None:
    """A model named `off` was the boolean False, and its error named no model."""
    assert name in load_text(f"models:\n  {name}:\n    endpoints: [10.0.0.1:8000]\n").models


@pytest.mark.parametrize("word", ["true", "True", "TRUE", "false", "False", "FALSE"])
def test_a_switch_takes_yaml_1_2_booleans(word: str) -> None:
    assert load_text(ONE_MODEL + f"debug_headers: {word}\n").debug_headers is (
        word.lower() == "true"
    )


def test_a_plugin_param_in_exponent_notation_is_a_number() -> None:
    text = (
        "models: {m: {endpoints: ['10.0.0.1:8000'], strategy: "
        "{scorers: {latency: {params: {batch_factor: 2e-2}}}}}}\n"
    )
    strategy = load_text(text).models["m"].strategy
    assert strategy.scorers["latency"].params["batch_factor"] == 0.02


def test_a_chained_merge_is_no_duplicate_key() -> None:
    """No key is written twice: `b` overrides a merged key and `c` merges `b`; PyYAML
    flattened `b` into `c` first and the check, at construction, read `p` twice. Found by
    a review helper."""
    text = "x:\n  deep:\n    b: &B\n      <<: {p: 1, q: 2}\n      p: 3\nc:\n  <<: *B\n"
    with pytest.raises(ConfigError) as info:
        load_text(text)  # not a config (unknown fields), but no YAML duplicate either
    assert not any("duplicate key" in p for p in info.value.problems), info.value.problems


def test_a_placeholder_inside_a_format_spec_is_a_config_problem() -> None:
    """`{port:{host.x}}` formats `{host.x}` too: its AttributeError escaped the load as a
    traceback. Found by a review helper."""
    with pytest.raises(ConfigError, match="unknown placeholder"):
        load_dict(
            {
                "models": {
                    "m": {"launch": {"command": "srv --p {port:{host.x}}"}, "scaling": {"max": 1}}
                }
            }
        )


def test_a_huge_integer_for_a_float_param_is_a_config_problem() -> None:
    with pytest.raises(ConfigError, match="finite number"):
        load_dict(
            {
                "models": {
                    "m": {
                        "endpoints": ["10.0.0.1:8000"],
                        "strategy": {"scorers": {"queue": {"params": {"smoothing": 10**400}}}},
                    }
                }
            }
        )
