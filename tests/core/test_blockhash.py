"""The block hasher's remembered openings never change a hash: every prompt gets exactly
the plain chain, whatever prompts came before (shared openings, early exits, short ones)."""

from __future__ import annotations

import random

import mmh3
import pytest

from llmgw.scheduling.blockhash import BlockHasher


def plain_chain(prompt: str, size: int, max_blocks: int) -> list[int]:
    data = prompt.encode("utf-8", "surrogatepass")
    out, prev = [], 0
    for i in range(min(len(data) // size, max_blocks)):
        prev = mmh3.hash64(data[i * size : (i + 1) * size], seed=prev & 0xFFFFFFFF)[0]
        out.append(prev)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_hashes_equal_the_plain_chain_after_any_history(seed: int) -> None:
    rng = random.Random(seed)
    hasher = BlockHasher(16, 12, openings=3, opening_blocks=5)  # small: evictions, caps
    openings = ["".join(rng.choices("ab", k=rng.choice((16, 40, 90)))) for _ in range(5)]
    for _ in range(600):
        tail = "".join(rng.choices("abcé\udc80", k=rng.randint(0, 200)))
        prompt = rng.choice(openings)[: rng.randint(0, 90)] + tail
        assert hasher.hashes(prompt) == plain_chain(prompt, 16, 12)


def test_a_shared_opening_shrinks_to_what_prompts_share_and_stays_bounded() -> None:
    hasher = BlockHasher(4, 64, openings=2, opening_blocks=3)
    hasher.hashes("sys-sys-AAAAuser")
    hasher.hashes("sys-sys-BBBBuser")
    assert [len(h) for _, h in hasher._openings.values()] == [2]  # "sys-sys-" is shared
    hasher.hashes("one-")
    hasher.hashes("two-")
    assert len(hasher._openings) == 2  # the oldest first block was evicted


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockHasher(0, 4)
