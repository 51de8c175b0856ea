"""The approximate prefix index: chained block hashes, longest-prefix match, bounded LRU."""

from __future__ import annotations

import pytest

from llmgw.scheduling.prefix import PrefixIndex
from llmgw.scheduling.scorers import PrefixScorer
from llmgw.types import RequestInfo

from .helpers import bytes_kept, context, long_session_key, state


def blocks(*chunks: str, size: int = 8) -> str:
    assert all(len(c) == size for c in chunks)
    return "".join(chunks)


def test_equal_prefixes_give_equal_hashes_and_a_divergence_changes_the_rest() -> None:
    idx = PrefixIndex(block_chars=8)
    a = idx.hashes(blocks("AAAAAAAA", "BBBBBBBB", "CCCCCCCC"))
    b = idx.hashes(blocks("AAAAAAAA", "XXXXXXXX", "CCCCCCCC"))
    assert len(a) == len(b) == 3
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # chained: block 3 differs though its text is equal


def test_partial_tail_block_is_not_hashed_and_max_blocks_caps_the_length() -> None:
    idx = PrefixIndex(block_chars=8, max_blocks=2)
    assert len(idx.hashes("A" * 7)) == 0
    assert len(idx.hashes("A" * 15)) == 1
    assert len(idx.hashes("A" * 80)) == 2


# (case id, blocks each endpoint was given, request's blocks, expected matches)
MATCH_CASES: list[tuple[str, dict[str, str], str, dict[str, int]]] = [
    ("no-history", {}, "ABCD", {}),
    ("full-match", {"e1": "ABCD"}, "ABCD", {"e1": 4}),
    ("longest-leading-run", {"e1": "AB", "e2": "ABC", "e3": "X"}, "ABCD", {"e1": 2, "e2": 3}),
    ("later-blocks-alone-do-not-count", {"e1": "XBCD"}, "ABCD", {}),
    ("request-shorter-than-history", {"e1": "ABCDEF"}, "AB", {"e1": 2}),
]


@pytest.mark.parametrize(
    ("given", "asked", "want"), [c[1:] for c in MATCH_CASES], ids=[c[0] for c in MATCH_CASES]
)
def test_match(given: dict[str, str], asked: str, want: dict[str, int]) -> None:
    idx = PrefixIndex(block_chars=8)

    def text(letters: str) -> str:
        return "".join(ch * 8 for ch in letters)

    for eid, letters in given.items():
        idx.insert(eid, idx.hashes(text(letters)))
    assert idx.match(idx.hashes(text(asked))) == want


def test_index_stays_bounded_under_100k_distinct_prompts() -> None:
    idx = PrefixIndex(block_chars=16, max_blocks=4, capacity=500)
    endpoints = [f"e{i}" for i in range(4)]
    for n in range(100_000):
        prompt = f"{n:016d}" * 3  # 3 blocks, the first unique per prompt
        idx.insert(endpoints[n % 4], idx.hashes(prompt))
    assert all(idx.size(e) <= 500 for e in endpoints)
    assert idx.size() <= 4 * 500
    assert len(idx._owners) <= 4 * 500  # no hash outlives every endpoint's LRU
    recent = f"{99_999:016d}" * 3
    assert idx.match(idx.hashes(recent)) == {"e3": 3}  # the newest is still there


def test_lru_evicts_the_least_recently_used_blocks() -> None:
    idx = PrefixIndex(block_chars=8, capacity=2)
    a, b, c = (idx.hashes(ch * 8) for ch in "ABC")
    idx.insert("e", a)
    idx.insert("e", b)
    idx.insert("e", a)  # touch A: B is now the oldest
    idx.insert("e", c)
    assert idx.match(a) == {"e": 1} and idx.match(c) == {"e": 1}
    assert idx.match(b) == {}


def test_forget_drops_an_endpoint() -> None:
    idx = PrefixIndex(block_chars=8)
    h = idx.hashes("A" * 16)
    idx.insert("e1", h)
    idx.insert("e2", h)
    idx.forget("e1")
    assert idx.match(h) == {"e2": 2}
    assert idx.size("e1") == 0


def test_shared_depth_counts_the_leading_blocks_several_sessions_used() -> None:
    idx = PrefixIndex(block_chars=8, shared_at=3)
    system = "S" * 16  # two blocks every session opens with
    prompts = {k: system + k * 8 + "x" * 8 for k in "abc"}
    for turn in range(4):  # one session alone, however often, shares nothing
        idx.insert("e1", idx.hashes(prompts["a"]), "a", float(turn))
    assert idx.shared_depth(idx.hashes(prompts["a"])) == 0
    idx.insert("e2", idx.hashes(prompts["b"]), "b", 5.0)
    assert idx.shared_depth(idx.hashes(prompts["a"])) == 0  # two sessions: not yet
    idx.insert("e1", idx.hashes(prompts["c"]), "c", 6.0)
    for k in "abc":  # the system prompt's two blocks; each history stays its own
        assert idx.shared_depth(idx.hashes(prompts[k])) == 2
    for k in "abcab":  # sessions interleaving past the threshold change nothing
        idx.insert("e2", idx.hashes(prompts[k]), k, 7.0)
    assert idx.shared_depth(idx.hashes(prompts["c"])) == 2
    assert idx.shared_depth(idx.hashes("T" * 32)) == 0


def test_long_session_keys_are_not_kept_per_block() -> None:
    """Each block kept the last session key that used it as sent: a distinct 60 KB session
    id per one-block prompt pinned ~1 GB per endpoint (16,384 blocks; found by a review
    helper)."""
    idx = PrefixIndex(block_chars=8)
    kept = bytes_kept(lambda i: idx.insert("e1", idx.hashes(f"{i:08d}"), long_session_key(i)))
    assert kept < 4_000, f"{kept:.0f} bytes kept per insert"
    shared = idx.hashes("S" * 8)
    for n, i in enumerate((0, 0, 1, 2)):  # sessions still told apart: the third shares
        idx.insert("e2", shared, long_session_key(i))
        assert idx.shared_depth(shared) == (1 if n == 3 else 0)


@pytest.mark.parametrize(
    "kw", [{"block_chars": 0}, {"max_blocks": 0}, {"capacity": 0}, {"shared_at": 0}]
)
def test_non_positive_sizes_are_rejected(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(**kw)


def test_prefix_scorer_scores_the_share_of_leading_blocks_cached() -> None:
    states = [state("a:1"), state("b:1")]
    scorer = PrefixScorer(block_chars=8)
    first = RequestInfo("m", "r1", prompt="A" * 8 + "B" * 8)
    scorer.observe(context(states, request=first), states[0])
    second = RequestInfo("m", "r2", prompt="A" * 8 + "B" * 8 + "C" * 8 + "D" * 8)
    assert scorer.score(context(states, request=second), states) == [0.5, 0.0]


def test_prefix_scorer_reads_each_request_prompt_even_when_request_ids_repeat() -> None:
    # Request ids can come from a client's x-request-id header: they need not be unique.
    states = [state("a:1"), state("b:1")]
    scorer = PrefixScorer(block_chars=8)
    cached = RequestInfo("m", "same-id", prompt="A" * 16)
    scorer.observe(context(states, request=cached), states[1])
    other = RequestInfo("m", "same-id", prompt="Z" * 16)
    assert scorer.score(context(states, request=other), states) == [0.0, 0.0]
    assert scorer.score(context(states, request=cached), states) == [0.0, 1.0]


def test_match_deeper_than_keeps_only_endpoints_past_that_depth() -> None:
    idx = PrefixIndex(block_chars=4)
    shared, own = idx.hashes("abcdefgh"), idx.hashes("abcdefghijklmnop")
    idx.insert("a", shared)
    idx.insert("b", own)
    assert idx.match(own) == {"a": 2, "b": 4}
    assert idx.match(own, deeper_than=2) == {"b": 4}
    assert idx.match(own, deeper_than=4) == {}


def test_prefix_scorer_credits_blocks_only_under_the_same_salt_and_when_the_cache_is_read() -> None:
    """vLLM shares blocks only among requests of one `cache_salt` and reads none for a
    request that skips the cache (prompt logprobs): the `prefix` scorer keyed the bare
    prompt, crediting a salted tenant with another tenant's blocks."""
    states = [state("a:1"), state("b:1")]
    scorer = PrefixScorer(block_chars=8)
    prompt = "A" * 8 + "B" * 8
    salted = RequestInfo("m", "r1", prompt=prompt, cache_salt="tenant-1")
    scorer.observe(context(states, request=salted), states[0])
    assert scorer.score(context(states, request=RequestInfo("m", "r2", prompt=prompt)), states) == [
        0.0,
        0.0,
    ]
    same = RequestInfo("m", "r3", prompt=prompt, cache_salt="tenant-1")
    assert scorer.score(context(states, request=same), states) == [1.0, 0.0]
    skips = RequestInfo("m", "r4", prompt=prompt, cache_salt="tenant-1", reads_cache=False)
    assert scorer.score(context(states, request=skips), states) == [0.0, 0.0]
