"""The in-process fleet simulation: deterministic, conserves requests, uses the real core."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.fleetsim import (
    ALL_BUT_KV_SIZE,
    COUNTERS_ONLY,
    GAUGES_ONLY,
    MODEL,
    TTFT_ONLY,
    GreedyOracle,
    PreparedWorkload,
    make_contender,
    only,
    prepare,
    simulate,
)
from bench.fleetsim_grid import load_strategy_file
from bench.workloads.regimes import chat_long
from llmgw.calibration import pooled
from llmgw.registry import Registry
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.sim.metrics import ModelObservations, ServedModel, make_registry, render
from llmgw.sim.model import EngineConfig, EngineModel, SeqRequest

ENGINE = EngineConfig(
    max_num_seqs=8,
    max_queue=256,
    kv_blocks=4096,
    block_size=16,
    prefill_us_per_token=200.0,
    decode_ms=10.0,
    max_model_len=16384,
)


def _chat(
    conversations: int = 12, rate: float = 2.0, engine: EngineConfig = ENGINE
) -> PreparedWorkload:
    wl = chat_long(seed=5, scale=conversations / 100).with_rate(rate)
    return prepare(wl, [engine] * 4)


@pytest.fixture(scope="module")
def chat() -> PreparedWorkload:
    return _chat()


@pytest.mark.parametrize("name", ["llmgw:chat", "sglang-cache-aware", "least-requests"])
def test_same_seed_gives_the_same_table(chat: PreparedWorkload, name: str) -> None:
    first = simulate(chat, make_contender(name), seed=3)
    second = simulate(chat, make_contender(name), seed=3)
    assert first.row() == second.row()
    assert first.ttft_s == second.ttft_s
    assert first.per_replica == second.per_replica


@pytest.mark.parametrize("name", ["llmgw:chat", "llmgw:random", "consistent-hash", "round-robin"])
def test_every_request_finishes_once_and_inflight_returns_to_zero(
    chat: PreparedWorkload, name: str
) -> None:
    result = simulate(chat, make_contender(name), seed=1)
    assert result.finished_once
    assert result.errors == 0
    assert len(result.ttft_s) == len(result.e2e_s) == chat.total
    assert sum(result.per_replica) == chat.total
    if name.startswith("llmgw:"):
        assert result.registry_inflight == [0, 0, 0, 0]
        assert result.scrapes > 0


def test_scrapes_reach_the_registry_through_the_scraper_parse_path(
    chat: PreparedWorkload,
) -> None:
    contender = make_contender("llmgw:least-load")
    simulate(chat, contender, seed=1)
    registry = getattr(contender, "scheduler").registry  # noqa: B009
    assert isinstance(registry, Registry)
    states = registry.states(MODEL)
    assert all(s.metrics is not None and s.scrape_error is None for s in states)
    assert all(s.metrics is not None and s.metrics.finished_total for s in states)


def test_queue_full_is_backpressure_counted_as_error_and_released() -> None:
    tiny = replace(ENGINE, max_queue=1, max_num_seqs=1)
    prepared = _chat(conversations=30, rate=30.0, engine=tiny)
    contender = make_contender("llmgw:round-robin")
    result = simulate(prepared, contender, seed=1)
    assert result.errors > 0
    # 429s are BACKPRESSURE outcomes: they feed the breaker, which then opens (503s).
    assert result.error_kinds.get("429 queue full", 0) > 0
    assert set(result.error_kinds) <= {"429 queue full", "503 no_healthy_endpoint"}
    assert result.finished_once
    assert result.registry_inflight == [0, 0, 0, 0]
    assert len(result.ttft_s) + result.errors == prepared.total


def test_llmgw_ring_preset_routes_exactly_like_client_side_consistent_hashing(
    chat: PreparedWorkload,
) -> None:
    ring = simulate(chat, make_contender("llmgw:ring"), seed=1)
    reference = simulate(chat, make_contender("consistent-hash"), seed=1)
    assert ring.per_replica == reference.per_replica
    assert ring.ttft_s == reference.ttft_s


def test_consistent_hash_keeps_conversations_cached_better_than_round_robin() -> None:
    prepared = _chat(conversations=24, rate=3.0)
    sticky = simulate(prepared, make_contender("consistent-hash"), seed=1)
    spread = simulate(prepared, make_contender("round-robin"), seed=1)
    assert sticky.prefix_hit_rate > spread.prefix_hit_rate + 0.15
    assert sticky.row()["ttft_p50_ms"] < spread.row()["ttft_p50_ms"]


def test_strategy_file_adds_a_custom_contender(tmp_path: Path, chat: PreparedWorkload) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nscorers: {session: 3, load: 1}\n")
    custom = load_strategy_file(str(path))
    assert list(custom) == ["custom:mine"]
    result = simulate(chat, make_contender("custom:mine", custom=custom), seed=1)
    assert result.finished_once and result.errors == 0


def test_the_greedy_oracle_forecasts_the_first_token_exactly_and_touches_nothing() -> None:
    """The oracle's forecast for a request is the time the engine, left alone, gives its
    first token: mid-step (the step in progress ends first), behind a queue, under chunked
    prefill; the engine itself is not changed by the forecast."""
    engine = EngineModel(replace(ENGINE, max_num_seqs=4, max_num_batched_tokens=512))
    prompt = tuple(bytes([k]) * 8 for k in range(40))
    for k in range(6):  # the token budget admits one, five queue
        engine.submit(SeqRequest(600 + 50 * k, 20, prompt[: 10 + k]), 0.0)
    step_end = engine.schedule(0.0)
    assert engine.in_step and len(engine.waiting) == 5
    request = SeqRequest(900, 5, prompt[:30])
    now = step_end / 2
    forecast = GreedyOracle.first_token(engine, step_end, request, now)
    assert engine.in_step and len(engine.waiting) == 5  # untouched
    seq = engine.submit(request, now)
    at = step_end
    engine.complete(at)
    while seq.first_token_time is None:
        at += engine.schedule(at)
        engine.complete(at)
    assert forecast == pytest.approx(at) and at > step_end
    idle = EngineModel(ENGINE)  # no step in progress: prefill starts now
    assert GreedyOracle.first_token(idle, 0.0, request, 1.0) == pytest.approx(
        1.0 + 900 * ENGINE.prefill_us_per_token / 1e6
    )


@pytest.mark.parametrize("name", ["oracle-greedy", "oracle-greedy-blind"])
def test_the_greedy_oracles_route_every_request_once(chat: PreparedWorkload, name: str) -> None:
    result = simulate(chat, make_contender(name), seed=1)
    assert result.contender == name
    assert result.finished_once and result.errors == 0
    assert sum(result.per_replica) == chat.total


def test_unknown_contender_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown contender"):
        make_contender("llmgw:nope")


def _latency_index(contender: object) -> PrefixIndex:
    scheduler = getattr(contender, "scheduler")  # noqa: B009
    scorer = next(s for s, _ in scheduler.router(MODEL).scorers if isinstance(s, LatencyScorer))
    index: PrefixIndex = scorer.index
    return index


def test_approximate_index_without_kv_size_keeps_its_default_capacity(
    chat: PreparedWorkload,
) -> None:
    # The default index follows each engine's KV size (4096 blocks of 16 = 1024 of 64 tokens);
    # `latency-nokvsize` believes every routed block is still cached.
    bounded, unbounded = make_contender("llmgw:latency"), make_contender("llmgw:latency-nokvsize")
    simulate(chat, bounded, seed=1)
    simulate(chat, unbounded, seed=1)
    index = _latency_index(bounded)
    assert [index.room(f"10.0.0.{i}:8000") + index.size(f"10.0.0.{i}:8000") for i in (1, 2)] == [
        1024,
        1024,
    ]
    free = _latency_index(unbounded)
    assert free.room("10.0.0.1:8000") + free.size("10.0.0.1:8000") == free.capacity == 16384


def _families(page: str) -> set[str]:
    """The families a page declares (`# TYPE` lines; a counter's is `<family>_total`)."""
    names = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")}
    return {n.removesuffix("_total") for n in names if not n.endswith("_created")}


def test_the_no_kv_size_page_is_the_full_page_without_the_cache_config() -> None:
    """`ALL_BUT_KV_SIZE` names what to drop, so a family the simulator adds later is still
    published in that variant; the listed sets keep their families, comments included (a
    counter's `# TYPE` line names `<family>_total`), and nothing else."""
    engine = EngineModel(EngineConfig())
    page = render(make_registry("vllm", [ServedModel(MODEL, engine, ModelObservations())]))
    full = page.decode()
    assert "vllm:cache_config_info" in _families(full)
    no_size = only(full, ALL_BUT_KV_SIZE)
    assert _families(no_size) == _families(full) - {"vllm:cache_config_info"}
    assert "vllm:cache_config_info" not in no_size
    kept = [line for line in full.splitlines() if "cache_config_info" not in line]
    assert no_size.splitlines() == kept
    assert _families(only(full, GAUGES_ONLY)) == set(GAUGES_ONLY)
    assert _families(only(full, TTFT_ONLY)) == set(TTFT_ONLY)
    counters = only(full, COUNTERS_ONLY)
    assert "# TYPE vllm:prompt_tokens_total counter" in counters
    assert "# TYPE vllm:prompt_tokens_created gauge" in counters


def test_engines_publishing_less_calibrate_what_their_metrics_allow(
    chat: PreparedWorkload,
) -> None:
    """`metrics=GAUGES_ONLY` stands for a minimal simulator: the router still sees load and
    KV use, but no histogram, counter or cache config (the latency scorer's per-token cost
    comes from the first tokens it sees, its typical prefill from its own picks), while the
    full page calibrates every endpoint and `COUNTERS_ONLY` (SGLang's set) the typical
    prefill. How long a request holds its batch slot comes from Little's law without the
    histogram (over the engine's finished counter, else the requests this router saw end):
    within 25 % of what the histogram says. With time to first token but no prefill
    histogram (`TTFT_ONLY`), the per-token cost is TTFT less the time queued (from its
    histogram, where published): within 25 % of what the prefill histogram gives."""
    runs = {}
    for label, families in (
        ("full", None),
        ("gauges", GAUGES_ONLY),
        ("counters", COUNTERS_ONLY),
        ("ttft", TTFT_ONLY),
    ):
        contender = make_contender("llmgw:latency")
        simulate(chat, contender, seed=1, metrics=families)
        registry = getattr(contender, "scheduler").registry  # noqa: B009
        runs[label] = registry.states(MODEL)
    gauges = runs["gauges"]
    assert all(s.metrics is not None and s.metrics.running is not None for s in gauges)
    assert all(s.calibration.prefill.value is None for s in gauges)
    assert all(s.calibration.kv_tokens is None for s in gauges)
    assert all(s.calibration.tokens.value is None for s in gauges)
    assert all(s.calibration.prefill.value is not None for s in runs["full"])
    assert all(s.calibration.kv_tokens is not None for s in runs["full"])
    # Counters without histograms (SGLang's set): the typical prefill, not its seconds.
    counters = runs["counters"]
    assert all(s.calibration.tokens.value is not None for s in counters)
    assert all(s.calibration.prefill.value is None for s in counters)
    full = pooled([s.calibration for s in runs["full"]])
    assert full.per_token is not None
    # Gauges only, but the edge sees first tokens: the router's own fit of time to first
    # token against prefill tokens. A least-squares slope over the router's predicted
    # tokens ahead, which carry its errors, so it reads low: 0.66-0.73x the engine's cost
    # over seeds 1-4 with 36 conversations; 0.53-0.70x over the 72 first tokens of the
    # 12 above (too few to assert on).
    longer = make_contender("llmgw:latency")
    simulate(_chat(conversations=36), longer, seed=1, metrics=GAUGES_ONLY)
    registry = getattr(longer, "scheduler").registry  # noqa: B009
    fit = pooled([s.calibration for s in registry.states(MODEL)]).per_token
    assert fit is not None and 0.6 * full.per_token < fit < 1.1 * full.per_token
    assert pooled([s.calibration for s in runs["ttft"]]).per_token == pytest.approx(
        full.per_token, rel=0.25
    )
    full_service = full.service
    assert full_service is not None
    for label in ("counters", "gauges"):
        assert pooled([s.calibration for s in runs[label]]).service == pytest.approx(
            full_service, rel=0.25
        ), label


def test_robust_variants_change_one_thing_of_the_base_engine() -> None:
    """Each variant of bench/fleetsim_robust.py differs from the real grid's engine in what
    it names and in nothing else, and its capacity model follows that engine."""
    from bench.fleetsim_robust import VARIANTS, variant_engine  # noqa: PLC0415

    base_cfg, base_speed = variant_engine(VARIANTS["base"], "low")
    # An engine counting tokens unlike the router's chars / 4 counts its per-token cost and
    # sizes in its own tokens: per character the same time and cache as the base engine.
    units = {"prefill_us_per_token", "kv_blocks", "max_num_batched_tokens", "max_model_len"}
    for name, variant in VARIANTS.items():
        cfg, speed = variant_engine(variant, "low")
        changed = {k for k in vars(base_cfg) if getattr(cfg, k) != getattr(base_cfg, k)}
        scale = variant.chars_per_token / 4
        assert changed == set(variant.engine) | (units if scale != 1 else set()), name
        if not variant.slow_replicas:
            assert speed.prefill_s_per_token == pytest.approx(
                cfg.prefill_us_per_token / scale / 1e6
            )
        assert speed.max_num_seqs == cfg.max_num_seqs
        assert speed.replicas == variant.replicas
        if scale != 1:
            assert speed == base_speed, name
            assert cfg.kv_blocks * scale == pytest.approx(base_cfg.kv_blocks, rel=0.01)
    assert variant_engine(VARIANTS["8-replicas"], "low")[1].replicas == 2 * base_speed.replicas
    # Two replicas 2x slower: the fleet has 3 base replicas' capacity, sized as 4 at 4/3.
    mixed = VARIANTS["mixed-speed"]
    cfg, speed = variant_engine(mixed, "low")
    engines = mixed.engines(cfg)
    assert [e.prefill_us_per_token / cfg.prefill_us_per_token for e in engines] == [1, 1, 2, 2]
    assert [e.decode_ms / cfg.decode_ms for e in engines] == [1, 1, 2, 2]
    assert speed.prefill_s_per_token == pytest.approx(base_speed.prefill_s_per_token * 4 / 3)
    assert speed.decode_step_s == pytest.approx(base_speed.decode_step_s * 4 / 3)


def test_an_engine_counting_its_own_tokens_is_calibrated_in_the_routers(
    chat: PreparedWorkload,
) -> None:
    """The same fleet, its engines counting 6 characters a token (a third fewer tokens,
    each costing 1.5x): the router reads 2/3 an engine token per token of its own, and the
    per-token cost and typical prefill it uses are the base fleet's (within 10 %)."""
    sparse = replace(ENGINE, prefill_us_per_token=300.0, kv_blocks=4096 * 4 // 6)
    costs = {}
    for label, workload in (("base", chat), ("sparse", prepare(chat.workload, [sparse] * 4, 6.0))):
        contender = make_contender("llmgw:latency")
        simulate(workload, contender, seed=1)
        registry = getattr(contender, "scheduler").registry  # noqa: B009
        costs[label] = pooled([s.calibration for s in registry.states(MODEL)])
    base, sparse_costs = costs["base"], costs["sparse"]
    assert base.engine_tokens == pytest.approx(1.0, rel=0.1)
    assert sparse_costs.engine_tokens == pytest.approx(4 / 6, rel=0.1)
    for field in ("per_token", "tokens_per_prefill"):
        assert getattr(sparse_costs, field) == pytest.approx(getattr(base, field), rel=0.1), field


def test_robust_cells_below_the_minimum_get_longer_windows() -> None:
    """A cell with few requests at the bench's window (slow prefill: a quarter of the base
    engine's capacity) is stretched to hold at least 90 % of `min_requests` (not ten times
    more); one that already holds them keeps its window."""
    from bench.fleetsim_robust import run_cell  # noqa: PLC0415

    short = run_cell("slow-prefill", "docs-shared", ["round-robin"], 1, 3.0, {})
    assert short["requests"] < 200
    stretched = run_cell("slow-prefill", "docs-shared", ["round-robin"], 1, 3.0, {}, 400)
    assert 360 <= stretched["requests"] <= 1000
    assert stretched["runs"][0]["requests"] == stretched["requests"]
    kept = run_cell("slow-prefill", "docs-shared", ["round-robin"], 1, 3.0, {}, 100)
    assert kept["requests"] == short["requests"]


def test_robust_cells_scrape_at_llmgws_default_unless_told() -> None:
    """The router in a robustness cell scrapes as often as llmgw does by default (what a
    user runs), and `--scrape` reaches both the router's config and the simulation: a
    slower scrape changes llmgw's picks, never a reference router's (it reads no metrics)."""
    import inspect  # noqa: PLC0415

    from bench.fleetsim_robust import run_cell  # noqa: PLC0415
    from llmgw.config import ScrapeSpec  # noqa: PLC0415

    default = inspect.signature(run_cell).parameters["scrape_interval"].default
    assert default == ScrapeSpec().interval
    names = ["llmgw:latency", "round-robin"]
    runs = {
        interval: run_cell("base", "decode-heavy", names, 1, 0.5, {}, scrape_interval=interval)
        for interval in (0.05, 1.0)
    }
    fast, slow = (runs[i]["runs"] for i in (0.05, 1.0))
    assert fast[1]["ttft_p90_ms"] == slow[1]["ttft_p90_ms"]
    assert fast[0]["per_replica"] != slow[0]["per_replica"]


def test_robust_reuse_reruns_one_contender_and_keeps_the_others_runs(tmp_path: Path) -> None:
    """`--reuse`: a rerun of one contender takes the others' runs from the old file (runs
    are deterministic), so the merged cell equals a run of all of them; a cell the old file
    ran with other requests (another window) is refused rather than mixed."""
    from bench.fleetsim_robust import reuse_runs, run_cell  # noqa: PLC0415

    names = ["round-robin", "least-requests"]
    both = run_cell("base", "decode-heavy", names, 1, 0.3, {})
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"cells": [both]}))
    fresh = run_cell("base", "decode-heavy", ["least-requests"], 1, 0.3, {})
    merged = reuse_runs([fresh], ["least-requests"], old)
    assert merged == names
    assert sorted(fresh["runs"], key=lambda r: r["contender"]) == sorted(
        both["runs"], key=lambda r: r["contender"]
    )
    other = run_cell("base", "decode-heavy", ["least-requests"], 1, 0.6, {})
    with pytest.raises(SystemExit, match="other requests"):
        reuse_runs([other], ["least-requests"], old)


def test_robust_report_names_the_runs_that_refused_requests() -> None:
    """The ratio tables time answered requests only; a run that shed some (429 queue full)
    is listed with its count, so it cannot read as fast unremarked."""
    from bench.fleetsim_robust import errors_report  # noqa: PLC0415

    cell = {"variant": "base", "cell": "hot-zipf", "seed": 1, "requests": 500}
    clean = [{**cell, "runs": [{"contender": "round-robin", "errors": 0}]}]
    assert errors_report(clean) == "errors: none in any run"
    shed = [{**cell, "runs": [{"contender": "round-robin", "errors": 0},
                              {"contender": "least-requests", "errors": 7}]}]  # fmt: skip
    report = errors_report(shed)
    assert "least-requests 7 of 500" in report and "round-robin" not in report
