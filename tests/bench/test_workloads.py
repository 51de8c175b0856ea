"""The routing benchmark's workload generators: seeded, replayable, the promised shapes."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workloads import (
    WORKLOADS,
    Conversation,
    Turn,
    Workload,
    build,
    percentile,
    quantile_interval,
)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_gives_identical_workload(name: str) -> None:
    assert (
        build(name, seed=3, scale=0.2).fingerprint() == build(name, seed=3, scale=0.2).fingerprint()
    )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_other_seed_gives_other_workload(name: str) -> None:
    assert (
        build(name, seed=3, scale=0.2).fingerprint() != build(name, seed=4, scale=0.2).fingerprint()
    )


def test_fingerprint_tells_unstreamed_and_stopped_turns_from_streamed_ones() -> None:
    """Turn.stream and Turn.stop_after were left out: an unstreamed workload, or one whose
    client stops after 3 chunks, had the streamed one's fingerprint. (found by a review
    helper)"""
    turns = [Turn("hi", "", 16, 0.0), Turn("hi", "", 16, 0.0, stream=False)]
    turns += [Turn("hi", "", 16, 0.0, stop_after=3), Turn("hi", "", 16, 0.0, stop_after=4)]
    prints = {
        Workload("w", 1, "", (Conversation(0, "s", 0.0, "sys", (t,)),), 1.0).fingerprint()
        for t in turns
    }
    assert len(prints) == len(turns)


def test_chat_turns_resend_the_growing_history_with_the_shared_system_prompt() -> None:
    wl = build("chat", seed=1, scale=0.2)
    systems = {c.system for c in wl.conversations}
    assert len(systems) == 1
    for conv in wl.conversations:
        assert 4 <= len(conv.turns) <= 10
        assert conv.session_id is not None
        for k in range(1, len(conv.turns)):
            before, now = conv.messages(k - 1), conv.messages(k)
            assert now[: len(before)] == before  # turn k extends turn k-1's prompt
            assert now[len(before)] == {"role": "assistant", "content": conv.turns[k - 1].reply}
    assert len({c.session_id for c in wl.conversations}) == len(wl.conversations)


def test_hot_sessions_concentrate_traffic_on_few_keys() -> None:
    wl = build("hot", seed=1)
    per_key = Counter(c.session_id for c in wl.conversations for _ in c.turns)
    top = per_key.most_common(1)[0][1]
    # The hottest key carries several replicas' fair share (8 replicas) of all requests.
    assert top / wl.requests > 2 / 8
    # Conversations of the same key share its context prefix.
    by_key: dict[str | None, str] = {}
    for c in wl.conversations:
        assert by_key.setdefault(c.session_id, c.system) == c.system


def test_shared_prefix_requests_have_no_session_and_few_prefixes() -> None:
    wl = build("prefix", seed=1, scale=0.5)
    assert all(c.session_id is None and len(c.turns) == 1 for c in wl.conversations)
    assert 1 < len({c.system for c in wl.conversations}) <= 12
    assert min(len(c.system) for c in wl.conversations) >= 1500 * 4


def test_mixed_has_short_sessions_and_long_one_shot_requests() -> None:
    wl = build("mixed", seed=1)
    long_ones = [c for c in wl.conversations if c.session_id is None]
    short = [c for c in wl.conversations if c.session_id is not None]
    assert long_ones and short
    assert min(c.prompt_chars(0) for c in long_ones) > 3 * max(c.prompt_chars(0) for c in short)


def test_arrivals_are_poisson_at_the_rate_and_rescalable() -> None:
    wl = build("prefix", seed=2)
    starts = [c.start_s for c in wl.conversations]
    assert starts == sorted(starts)
    rate = (len(starts) - 1) / starts[-1]
    assert 0.85 * wl.arrival_rate < rate < 1.15 * wl.arrival_rate
    faster = wl.with_rate(wl.arrival_rate * 2)
    assert faster.duration_s == pytest.approx(wl.duration_s / 2)
    assert [c.turns for c in faster.conversations] == [c.turns for c in wl.conversations]


def test_scale_changes_size_not_shape() -> None:
    small, full = build("chat", seed=1, scale=0.25), build("chat", seed=1)
    assert len(small.conversations) == 50 and len(full.conversations) == 200


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: chat"):
        build("nope")


def test_quantile_interval_covers_the_true_p90_as_often_as_it_says() -> None:
    rng = random.Random(7)
    true_p90 = math.log(10)  # of an exponential with mean 1
    for n in (30, 160):
        covered = 0
        for _ in range(400):
            sample = [rng.expovariate(1.0) for _ in range(n)]
            lo, hi = quantile_interval(sample, 90)
            assert lo <= percentile(sample, 90) <= hi
            covered += lo <= true_p90 <= hi
        assert 0.91 <= covered / 400 <= 0.99, (n, covered)
    wide = quantile_interval([rng.expovariate(1.0) for _ in range(100)], 90)
    narrow = quantile_interval([rng.expovariate(1.0) for _ in range(10_000)], 90)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 4
    assert quantile_interval([5.0], 90) == (5.0, 5.0)
    assert all(math.isnan(v) for v in quantile_interval([], 90))
    # The ranks themselves (1-based 23 and 30 of 30, 136 and 152 of 160): the binomial
    # count's 2.5 % and 97.5 % points, which the coverage above could not pin to one.
    assert quantile_interval([float(i) for i in range(30)], 90) == (22.0, 29.0)
    assert quantile_interval([float(i) for i in range(160)], 90) == (135.0, 151.0)
    assert quantile_interval([float(i) for i in range(1000)], 90) == (880.0, 918.0)
    for bad_q in (0, 100):
        with pytest.raises(ValueError, match="inside"):
            quantile_interval([1.0, 2.0], bad_q)
    with pytest.raises(ValueError, match="NaN"):
        quantile_interval([1.0, math.nan], 90)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 100) == 4.0
    assert percentile([5.0], 90) == 5.0


def test_nearest_rank_is_exact_where_floats_would_round_up() -> None:
    """ceil(q / 100 * n) in floats read 0.14 * 50 as 7.000000000000001: the 14th
    percentile of 1..50 was the 8th value, not the 7th (ttft_quantiles_ms asks q = 14, 28,
    56, ...). (found by a review helper)"""
    values = [float(v) for v in range(1, 51)]
    assert percentile(values, 14) == 7.0
    assert percentile(values, 28) == 14.0
    assert percentile(values, 56) == 28.0
    assert percentile(values, 14.1) == 8.0  # a fractional q keeps its decimal meaning


# -- the regime grid (bench/workloads/grid.py) ------------------------------------------

from bench.loadclient import ring_picker, round_robin_picker  # noqa: E402
from bench.workloads.grid import (  # noqa: E402
    EXTRA_REGIMES,
    MIXES,
    OVER_REGIMES,
    REGIMES,
    SESSION_KINDS,
    EngineSpeed,
    Regime,
    regime_workload,
)

SPEED = EngineSpeed(
    replicas=4,
    prefill_s_per_token=60e-6,
    decode_step_s=0.025,
    decode_batch_factor=0.03,
    max_num_seqs=8,
    kv_tokens_per_replica=4096 * 16,
)


def small(name: str, **changes: object) -> Regime:
    return Regime(**{**REGIMES[name].__dict__, "window_s": 2.0, **changes})


@pytest.mark.parametrize("name", sorted(REGIMES))
def test_regime_workloads_replay_identically_and_differ_by_seed(name: str) -> None:
    one = regime_workload(small(name), SPEED, seed=3)
    assert one.fingerprint() == regime_workload(small(name), SPEED, seed=3).fingerprint()
    assert one.fingerprint() != regime_workload(small(name), SPEED, seed=4).fingerprint()


def test_the_grid_covers_every_level_of_every_axis() -> None:
    cells = REGIMES.values()
    assert {r.load for r in cells} == {0.3, 0.6, 0.85}
    assert {r.mix for r in cells} == set(MIXES)
    assert {r.sessions for r in cells} == set(SESSION_KINDS)
    assert any(r.pressure < 1 for r in cells) and any(r.pressure >= 2 for r in cells)
    history = [r for r in cells if r.mix == "history" and r.sessions == "cold"]
    assert any(r.load == 0.6 for r in history)  # multi-turn chat at moderate load


def test_extra_regimes_are_short_chat_sharing_system_prompts_without_sessions() -> None:
    """Issue 13's third workload, outside the real grid: short one-shot chat requests, no
    session header, requests sharing system prompts (a few popular ones, Zipf)."""
    assert not set(EXTRA_REGIMES) & set(REGIMES)
    for regime in EXTRA_REGIMES.values():
        wl = regime_workload(regime, SPEED, seed=1)
        assert {c.session_id for c in wl.conversations} == {None}
        assert regime.mix == "short"
        systems = Counter(c.system for c in wl.conversations)  # Zipf over the contexts
        assert len(systems) < len(wl.conversations)
        assert systems.most_common(1)[0][1] >= 0.04 * len(wl.conversations)  # 13-39 of 230-340


def test_over_regimes_offer_more_than_the_fleet_serves() -> None:
    """The overload cells offer 1.1-1.2x the capacity the grid's own cells are sized by,
    one per mix but prefill-heavy, under their own names."""
    assert not set(OVER_REGIMES) & (set(REGIMES) | set(EXTRA_REGIMES))
    for regime in OVER_REGIMES.values():
        params = regime_workload(regime, SPEED, seed=1).params
        offered, capacity = float(params["offered_req_s"]), float(params["capacity_req_s"])
        assert offered > 1.05 * capacity, regime.name
    assert {r.mix for r in OVER_REGIMES.values()} == set(MIXES) - {"prefill-heavy"}


@pytest.mark.parametrize(
    ("sessions", "expect"), [("none", "no header"), ("cold", "one each"), ("hot", "shared")]
)
def test_session_kinds_shape_the_session_ids(sessions: str, expect: str) -> None:
    wl = regime_workload(small("chat-light", sessions=sessions), SPEED, seed=1)
    ids = [c.session_id for c in wl.conversations]
    if expect == "no header":
        assert set(ids) == {None}
        assert all(len(c.turns) == 1 for c in wl.conversations)
    elif expect == "one each":
        assert None not in ids and len(set(ids)) == len(ids)
    else:
        assert None not in ids and len(set(ids)) < len(ids)
        by_id: dict[str | None, set[str]] = {}
        for c in wl.conversations:
            by_id.setdefault(c.session_id, set()).add(c.system)
        assert all(len(systems) == 1 for systems in by_id.values())  # a user, a context


@pytest.mark.parametrize("load", [0.3, 0.6, 0.85])
def test_offered_rate_is_the_load_fraction_of_computed_capacity(load: float) -> None:
    wl = regime_workload(small("chat-heavy", load=load), SPEED, seed=1)
    params = wl.params
    assert params["offered_req_s"] == pytest.approx(
        load * float(params["capacity_req_s"]), rel=0.02
    )


def test_history_mix_grows_the_prompt_over_four_to_eight_turns_with_think_time() -> None:
    wl = regime_workload(small("chat-history"), SPEED, seed=1)
    for conv in wl.conversations:
        assert 4 <= len(conv.turns) <= 8
        for k in range(1, len(conv.turns)):
            assert conv.messages(k)[: len(conv.messages(k - 1))] == conv.messages(k - 1)
    thinks = [t.think_s for c in wl.conversations for t in c.turns[:-1]]
    assert 0.6 < sum(thinks) / len(thinks) < 1.4


def test_high_pressure_cells_overflow_the_cache_and_low_ones_fit() -> None:
    small_kv = EngineSpeed(**{**SPEED.__dict__, "kv_tokens_per_replica": 768 * 16})
    high = regime_workload(REGIMES["docs-pressure"], small_kv, seed=1)
    low = regime_workload(REGIMES["docs-shared"], SPEED, seed=1)
    assert float(high.params["working_set_over_kv"]) >= 2.0
    assert float(low.params["working_set_over_kv"]) < 1.0


def test_client_side_ring_is_sticky_per_session_and_spreads_requests_without() -> None:
    urls = [f"http://127.0.0.1:{18100 + i}" for i in range(4)]
    pick = ring_picker(urls)
    wl = regime_workload(small("hot-zipf"), SPEED, seed=1)
    for conv in wl.conversations:
        assert len({pick(conv, t) for t in range(len(conv.turns))}) == 1
    assert pick(wl.conversations[0], 0) == ring_picker(urls)(wl.conversations[0], 0)
    docs = regime_workload(small("docs-shared"), SPEED, seed=1)
    assert len({pick(c, 0) for c in docs.conversations}) == 4
    rr = round_robin_picker(urls)
    assert [rr(docs.conversations[0], 0) for _ in range(5)][4] == urls[0] + "/v1/chat/completions"
