"""Prometheus text parsing and the engine metric contracts (vLLM, SGLang, TensorRT-LLM)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import load_dict
from llmgw.errors import MetricsError
from llmgw.promtext import (
    CONTRACTS,
    MetricContract,
    Sample,
    _split_sample,
    extract,
    iter_samples,
    parse,
)
from llmgw.types import Engine

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VLLM_BUSY = (FIXTURES / "metrics-vllm-0.32.0-busy.txt").read_text()

PAGE = r"""# HELP http_requests_total The total number of HTTP requests.
# TYPE http_requests_total counter
http_requests_total{method="post",code="200"} 1027 1395066363000
http_requests_total{method="post",code="400"}    3 1395066363000

# A free-form comment line
msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9
metric_without_timestamp_and_labels 12.47
something_weird{problem="division by zero"} +Inf
negative_thing -Inf
not_a_number NaN
# TYPE rpc_duration_seconds histogram
rpc_duration_seconds_bucket{le="0.05"} 24054
rpc_duration_seconds_bucket{le="+Inf"} 144320
rpc_duration_seconds_sum 53423
rpc_duration_seconds_count 144320
spaced{ a = "1" , b="x y, z}" } 7
"""


def test_parse_reads_counters_gauges_histograms_labels_escapes_and_special_values() -> None:
    got = [(s.name, dict(s.labels), s.value) for s in parse(PAGE)]
    nan = [v for n, _, v in got if n == "not_a_number"]
    assert len(nan) == 1 and math.isnan(nan[0])
    assert [g for g in got if g[0] != "not_a_number"] == [
        ("http_requests_total", {"method": "post", "code": "200"}, 1027.0),
        ("http_requests_total", {"method": "post", "code": "400"}, 3.0),
        (
            "msdos_file_access_time_seconds",
            {"path": "C:\\DIR\\FILE.TXT", "error": 'Cannot find file:\n"FILE.TXT"'},
            1.458255915e9,
        ),
        ("metric_without_timestamp_and_labels", {}, 12.47),
        ("something_weird", {"problem": "division by zero"}, math.inf),
        ("negative_thing", {}, -math.inf),
        ("rpc_duration_seconds_bucket", {"le": "0.05"}, 24054.0),
        ("rpc_duration_seconds_bucket", {"le": "+Inf"}, 144320.0),
        ("rpc_duration_seconds_sum", {}, 53423.0),
        ("rpc_duration_seconds_count", {}, 144320.0),
        ("spaced", {"a": "1", "b": "x y, z}"}, 7.0),
    ]


def test_crlf_line_endings_are_accepted() -> None:
    assert [(s.name, s.value) for s in parse('a 1\r\n# c\r\nb{x="y"} 2\r\n')] == [
        ("a", 1.0),
        ("b", 2.0),
    ]


def test_name_filter_yields_only_the_wanted_metrics() -> None:
    names = {"rpc_duration_seconds_sum", "something_weird"}
    assert [s.name for s in iter_samples(PAGE, names)] == [
        "something_weird",
        "rpc_duration_seconds_sum",
    ]


def test_name_filter_does_not_match_a_longer_name_with_the_same_prefix() -> None:
    page = 'vllm:num_requests_waiting_by_reason{reason="x"} 9\nvllm:num_requests_waiting 2\n'
    assert [s.value for s in iter_samples(page, {"vllm:num_requests_waiting"})] == [2.0]


@pytest.mark.parametrize(
    "line",
    ['m{a="1" 3', "m{a=1} 3", 'm{a="1} 3', "m", 'm{a="1"}', "m abc", 'm{a="x\\'],
    ids=[
        "unterminated-set",
        "unquoted",
        "unterminated-value",
        "no-value",
        "labels-no-value",
        "not-a-number",
        "dangling-escape",
    ],
)
def test_malformed_sample_is_a_metrics_error_with_the_line_number(line: str) -> None:
    with pytest.raises(MetricsError, match="line 2"):
        parse(f"ok 1\n{line}\n")


def test_parse_agrees_with_prometheus_client_on_the_real_vllm_page() -> None:
    ref = [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(VLLM_BUSY)
        for s in family.samples
    ]
    got = [(s.name, dict(s.labels), s.value) for s in parse(VLLM_BUSY)]
    assert len(got) == len(ref) > 300

    def same(a: float, b: float) -> bool:
        return a == b or (math.isnan(a) and math.isnan(b))

    for (gn, gl, gv), (rn, rl, rv) in zip(got, ref, strict=True):
        assert (gn, gl) == (rn, rl)
        assert same(gv, rv), (gn, gv, rv)


def _reference_values(name: str, model: str = "tiny") -> list[float]:
    return [
        s.value
        for family in text_string_to_metric_families(VLLM_BUSY)
        for s in family.samples
        if s.name == name and s.labels.get("model_name") == model
    ]


def test_vllm_contract_on_the_real_page() -> None:
    m = extract(VLLM_BUSY, CONTRACTS[Engine.VLLM], model="tiny")
    assert m.waiting == sum(_reference_values("vllm:num_requests_waiting"))
    assert m.running == sum(_reference_values("vllm:num_requests_running"))
    assert m.running > 0  # the page was taken under load
    assert m.kv_usage == max(_reference_values("vllm:kv_cache_usage_perc"))
    assert m.finished_total == sum(_reference_values("vllm:request_success_total"))


def test_vllm_page_for_another_model_is_an_error_naming_the_model() -> None:
    with pytest.raises(MetricsError, match="vllm:num_requests_waiting") as info:
        extract(VLLM_BUSY, CONTRACTS[Engine.VLLM], model="other")
    assert "'other'" in str(info.value)


VLLM_TEMPLATE = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 4.0
vllm:num_requests_running{{engine="0",model_name="m"}} 3.0
{kv}
"""


def test_deprecated_gpu_cache_usage_is_read_when_kv_cache_usage_is_absent() -> None:
    page = VLLM_TEMPLATE.format(kv='vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.4')
    assert extract(page, CONTRACTS[Engine.VLLM]).kv_usage == 0.4


def test_current_kv_cache_usage_wins_over_the_deprecated_name() -> None:
    kv = (
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.4\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.7'
    )
    assert extract(VLLM_TEMPLATE.format(kv=kv), CONTRACTS[Engine.VLLM]).kv_usage == 0.7


SGLANG_PAGE = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 5.0
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 12.0
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.31
sglang:num_requests_total{model_name="qwen"} 901.0
"""

TRTLLM_PAGE = """# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="llama"} 2
trtllm_num_requests_running{model_name="llama"} 8
trtllm_kv_cache_utilization{model_name="llama"} 0.625
"""


@pytest.mark.parametrize(
    ("engine", "page", "expected"),
    [
        (Engine.SGLANG, SGLANG_PAGE, (5.0, 12.0, 0.31, 901.0)),
        (Engine.TRTLLM, TRTLLM_PAGE, (2.0, 8.0, 0.625, None)),
    ],
    ids=["sglang", "trtllm"],
)
def test_engine_contract_reads_its_three_metrics(
    engine: Engine, page: str, expected: tuple[float, float, float, float | None]
) -> None:
    m = extract(page, CONTRACTS[engine])
    assert (m.waiting, m.running, m.kv_usage, m.finished_total) == expected


def test_a_model_label_that_names_no_model_is_read_for_the_configured_model() -> None:
    """trtllm-serve labels every series model_name="undefined": filtered by the configured
    model, the page read as serving another model, and the endpoint was left out."""
    page = TRTLLM_PAGE.replace('model_name="llama"', 'model_name="undefined"')
    m = extract(page, CONTRACTS[Engine.TRTLLM], model="llama")
    assert (m.waiting, m.running, m.kv_usage) == (2.0, 8.0, 0.625)
    with pytest.raises(MetricsError, match="for model 'other'"):  # a named model still counts
        extract(TRTLLM_PAGE, CONTRACTS[Engine.TRTLLM], model="other")


@pytest.mark.parametrize(
    ("engine", "page", "dropped"),
    [
        (
            Engine.VLLM,
            VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc 0.1"),
            "vllm:num_requests_waiting",
        ),
        (
            Engine.VLLM,
            VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc 0.1"),
            "vllm:num_requests_running",
        ),
        (Engine.VLLM, VLLM_TEMPLATE.format(kv=""), "vllm:kv_cache_usage_perc"),
        (Engine.SGLANG, SGLANG_PAGE, "sglang:num_queue_reqs"),
        (Engine.SGLANG, SGLANG_PAGE, "sglang:num_running_reqs"),
        (Engine.SGLANG, SGLANG_PAGE, "sglang:token_usage"),
        (Engine.TRTLLM, TRTLLM_PAGE, "trtllm_num_requests_waiting"),
        (Engine.TRTLLM, TRTLLM_PAGE, "trtllm_num_requests_running"),
        (Engine.TRTLLM, TRTLLM_PAGE, "trtllm_kv_cache_utilization"),
    ],
)
def test_missing_metric_is_an_error_naming_it(engine: Engine, page: str, dropped: str) -> None:
    page = "\n".join(line for line in page.splitlines() if not line.startswith(dropped))
    with pytest.raises(MetricsError, match=dropped):
        extract(page, CONTRACTS[engine])


def test_nan_value_counts_as_missing() -> None:
    page = VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc NaN")
    with pytest.raises(MetricsError, match="vllm:kv_cache_usage_perc"):
        extract(page, CONTRACTS[Engine.VLLM])


def test_finite_series_that_sum_past_a_float_are_an_error_not_infinity() -> None:
    """Two 1.7e308 waiting series read as an infinite queue that the latency strategy then
    picked (inf - inf in its arithmetic): the page is refused instead."""
    page = (
        'vllm:num_requests_waiting{engine="0"} 1.7e308\n'
        'vllm:num_requests_waiting{engine="1"} 1.7e308\n'
        "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n"
    )
    with pytest.raises(MetricsError, match="sum past a float"):
        extract(page, CONTRACTS[Engine.VLLM])


MULTI = """vllm:num_requests_waiting{engine="0",model_name="a"} 1
vllm:num_requests_waiting{engine="1",model_name="a"} 2
vllm:num_requests_waiting{engine="0",model_name="b"} 40
vllm:num_requests_running{engine="0",model_name="a"} 3
vllm:num_requests_running{engine="1",model_name="a"} 4
vllm:num_requests_running{engine="0",model_name="b"} 50
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.6
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.9
"""


def test_model_name_label_selects_one_model_of_several_on_a_page() -> None:
    a = extract(MULTI, CONTRACTS[Engine.VLLM], model="a")
    b = extract(MULTI, CONTRACTS[Engine.VLLM], model="b")
    # Queues of a model's engines add up; KV usage is their mean (their sizes add up too).
    assert (a.waiting, a.running) == (3.0, 7.0)
    assert a.kv_usage == pytest.approx(0.4)
    assert (b.waiting, b.running, b.kv_usage) == (40.0, 50.0, 0.9)


def test_model_absent_from_a_multi_model_page_is_an_error() -> None:
    with pytest.raises(MetricsError, match="'c'"):
        extract(MULTI, CONTRACTS[Engine.VLLM], model="c")


def test_overrides_replace_metric_names_and_the_model_label() -> None:
    contract = CONTRACTS[Engine.VLLM].with_overrides(
        {"waiting": "queue_len", "kv_usage": "kv_frac", "model_label": "served"}
    )
    page = (
        'queue_len{served="x"} 6\nqueue_len{served="y"} 60\n'
        'vllm:num_requests_running{served="x"} 2\nkv_frac{served="x"} 0.5\n'
        'vllm:num_requests_waiting{served="x"} 99\n'
    )
    m = extract(page, contract, model="x")
    assert (m.waiting, m.running, m.kv_usage) == (6.0, 2.0, 0.5)


def test_override_of_an_unknown_role_is_an_error() -> None:
    with pytest.raises(ValueError, match="queue"):
        CONTRACTS[Engine.VLLM].with_overrides({"queue": "q"})


def test_overrides_leave_the_built_in_contract_unchanged() -> None:
    before = CONTRACTS[Engine.SGLANG]
    before.with_overrides({"waiting": "q"})
    assert (
        CONTRACTS[Engine.SGLANG]
        == before
        == MetricContract(
            waiting=("sglang:num_queue_reqs",),
            running=("sglang:num_running_reqs",),
            kv_usage=("sglang:token_usage",),
            finished=("sglang:num_requests_total",),
            prompt_tokens=("sglang:prompt_tokens_total",),
            cached_tokens=("sglang:cached_tokens_total",),
            step_time=(
                "sglang:inter_token_latency_seconds",
                "sglang:time_per_output_token_seconds",
            ),
            ttft_time=("sglang:time_to_first_token_seconds",),
            queue_time=("sglang:queue_time_seconds",),
        )
    )


def test_the_real_vllm_page_gives_the_calibration_counters() -> None:
    page = (Path(__file__).parents[1] / "fixtures" / "metrics-vllm-0.32.0-busy.txt").read_text()
    m = extract(page, CONTRACTS[Engine.VLLM], model="tiny")
    # Numbers read off the fixture: prefill histogram, computed-token histogram, counters.
    assert (m.prefill_count, m.computed_tokens_sum) == (663.0, 8323.0)
    assert m.prefill_seconds_sum == pytest.approx(5.2653167)
    assert (m.prompt_tokens_total, m.cached_tokens_total) == (8865.0, 256.0)
    assert m.step_count == 4716.0 and m.step_seconds_sum == pytest.approx(35.8706046)
    # Time to first token (at the first token) and time queued (at the end): the prefill's
    # time where no prefill histogram is published.
    assert m.ttft_count == 685.0
    assert m.ttft_seconds_sum == pytest.approx(47.0952227)
    assert m.queue_seconds_sum == pytest.approx(0.0152071)


def test_a_page_without_the_optional_roles_still_extracts() -> None:
    page = VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc 0.5")
    m = extract(page, CONTRACTS[Engine.VLLM])
    assert m.prefill_seconds_sum is None and m.step_count is None and m.kv_usage == 0.5


def test_kv_usage_is_clamped_to_zero_one() -> None:
    page = VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc 1.7")
    assert extract(page, CONTRACTS[Engine.VLLM]).kv_usage == 1.0


def test_calibration_metric_names_are_overridable_from_the_config() -> None:

    cfg = load_dict(
        {"models": {"m": {"endpoints": ["a:1"], "metrics": {"prefill_time": "my_prefill"}}}}
    )
    contract = CONTRACTS[Engine.VLLM].with_overrides(cfg.models["m"].metrics)
    page = VLLM_TEMPLATE.format(kv="vllm:kv_cache_usage_perc 0.5") + (
        "my_prefill_sum 2.5\nmy_prefill_count 5\n"
    )
    m = extract(page, contract)
    assert (m.prefill_seconds_sum, m.prefill_count) == (2.5, 5.0)


def line_by_line(text: str, names: frozenset[str]) -> list[Sample]:
    """The straightforward name filter (what `iter_samples` did before its regex scan):
    split the page into lines, strip each, read the ones whose name is wanted."""
    out = []
    for line_no, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        end = min([k for k in (line.find("{"), line.find(" ")) if k >= 0], default=len(line))
        if line[:end] in names:
            out.append(Sample(*_split_sample(line, line_no)))
    return out


def outcome(read: Callable[[], list[Sample]]) -> object:
    try:
        return [(s.name, dict(s.labels), repr(s.value)) for s in read()]
    except MetricsError as exc:
        return str(exc)


WANTED = CONTRACTS[Engine.VLLM].names()
_piece = st.sampled_from
_line = st.builds(
    "".join,
    st.tuples(
        _piece(["", "", " ", "\t", "\xa0", "\x0b", "# ", "# TYPE ", "x", 'a{b="']),
        _piece([*sorted(WANTED)[:6], "vllm:num_requests_waiting_by_reason", "other", "vllm:"]),
        _piece(["", "_sum", "_count", "_bucket", "x"]),
        _piece(["{", " ", "\t", "", "\r", "\xa0", " {"]),
        _piece(['model_name="m"} ', 'a="x\\"y"} ', 'a="1" ', "} ", "", 'le="1" ', '"}']),
        _piece(["1", "NaN", "-Inf", "2.5 123", "abc", "", " 3", "\t4"]),
        _piece(["", " ", "\r", "\t", '"} 5']),
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=12))
@example(["# TYPE vllm:num_requests_waiting gauge", 'x{a="vllm:num_requests_waiting 1"} 2'])
@example([' \tvllm:num_requests_waiting{a="1"} 3\r', "vllm:num_requests_waiting\t4"])
@example(["ok 1", "vllm:num_requests_waiting\r", "vllm:num_requests_running \t"])
@example(["vllm:num_requests_waiting_by_reason 1", "xvllm:num_requests_waiting 2"])
def test_the_name_filter_reads_what_a_line_by_line_reading_does(lines: list[str]) -> None:
    """The filter finds the wanted lines with one regex scan, no longer splitting and
    stripping every line in Python (an 8 MB page of 80,000 unread series held the event
    loop ~50 ms a scrape): the same samples, or the same error and line number, on pages
    of wanted, near-miss and malformed lines, blanks and comments (found by a review
    helper)."""
    text = "\n".join(lines)
    assert outcome(lambda: list(iter_samples(text, WANTED))) == outcome(
        lambda: line_by_line(text, WANTED)
    )


def test_a_page_of_many_series_nobody_reads_gives_just_the_wanted_samples() -> None:
    unread = "".join(
        f'lora_request_latency_seconds_bucket{{adapter="a{i % 500}",le="{i}",model_name="m"}} {i}\n'
        for i in range(85_000)
    )
    text = f"{unread}{VLLM_BUSY}{unread}"
    got = outcome(lambda: list(iter_samples(text, WANTED)))
    assert got == outcome(lambda: line_by_line(text, WANTED))
    assert got == outcome(lambda: list(iter_samples(VLLM_BUSY, WANTED)))


def _two_rank_vllm_page(usage: tuple[float, float], blocks: int, block_size: int) -> str:
    """A vLLM page with two data-parallel ranks (`--data-parallel-size 2`): each publishes its
    own gauges and its own cache_config_info (`engine` label), as the fixture's one rank."""
    lines = []
    for rank, used in enumerate(usage):
        labels = f'engine="{rank}",model_name="m"'
        lines += [
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            f"vllm:num_requests_running{{{labels}}} 4.0",
            f"vllm:kv_cache_usage_perc{{{labels}}} {used}",
            f'vllm:cache_config_info{{block_size="{block_size}",engine="{rank}",'
            f'num_gpu_blocks="{blocks}"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


def test_kv_usage_times_kv_tokens_is_not_more_than_the_tokens_in_use_on_two_ranks() -> None:
    """`extract` reads KV usage as the fullest rank's (max) but the KV size as every rank's
    (sum); the latency scorer takes `kv_usage * kv_tokens` as the tokens in use. Two ranks of
    16,384 tokens, one 95 % full and one 5 %: 31,129 tokens read as in use (1.9x the 16,384
    really held) and 1,639 free (of 16,384), so the memory-admission wait is priced for a
    prompt that fits on the idle rank at once."""
    blocks, block_size = 1024, 16
    usage = (0.95, 0.05)
    m = extract(_two_rank_vllm_page(usage, blocks, block_size), CONTRACTS[Engine.VLLM], "m")
    assert m.kv_tokens is not None
    really_used = sum(u * blocks * block_size for u in usage)
    read_used = m.kv_usage * m.kv_tokens
    assert read_used <= really_used * 1.01, (
        f"kv_usage {m.kv_usage} x kv_tokens {m.kv_tokens:.0f} = {read_used:.0f} tokens in use; "
        f"the ranks hold {really_used:.0f}"
    )
