"""The routing benchmark's workload generators: seeded, replayable, the promised shapes."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workloads import WORKLOADS, build, percentile


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


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 100) == 4.0
    assert percentile([5.0], 90) == 5.0
