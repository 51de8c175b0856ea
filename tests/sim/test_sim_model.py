"""The pure engine model: batching, FIFO queue, KV blocks, prefix cache, timing."""

from __future__ import annotations

import pytest

from llmgw.sim.kvcache import KVCache
from llmgw.sim.model import (
    EngineConfig,
    EngineModel,
    QueueFullError,
    RequestTooLargeError,
    SeqRequest,
    Sequence,
)
from llmgw.sim.tokens import OutputText, block_hashes, count_tokens


def h(*names: str) -> tuple[bytes, ...]:
    """Stand-in chained hashes: block i's hash names the whole prefix up to it."""
    return tuple("/".join(names[: i + 1]).encode() for i in range(len(names)))


def run_until_idle(model: EngineModel, now: float = 0.0, max_steps: int = 10_000) -> float:
    """Step the model to the end with an injected clock; returns the final time."""
    for _ in range(max_steps):
        if not model.has_work:
            return now
        duration = model.schedule(now)
        now += duration
        model.complete(now)
    raise AssertionError("model did not go idle")


def step(model: EngineModel, now: float) -> float:
    duration = model.schedule(now)
    model.complete(now + duration)
    return now + duration


def config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = {
        "max_num_seqs": 4,
        "max_queue": 8,
        "kv_blocks": 64,
        "block_size": 4,
        "prefill_us_per_token": 1000.0,
        "decode_ms": 10.0,
        "decode_batch_factor": 0.0,
    }
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_at_most_max_num_seqs_run_and_the_rest_wait_in_fifo_order() -> None:
    model = EngineModel(config(max_num_seqs=2))
    seqs = [model.submit(SeqRequest(4, 2), now=0.0) for _ in range(5)]
    model.schedule(0.0)
    assert model.running == seqs[:2]
    assert list(model.waiting) == seqs[2:]
    model.complete(0.01)
    run_until_idle(model, 0.01)
    admitted = sorted(seqs, key=lambda s: (s.scheduled_time, s.seq_id))
    assert admitted == seqs


def test_queue_full_raises_backpressure() -> None:
    model = EngineModel(config(max_num_seqs=1, max_queue=2))
    model.submit(SeqRequest(4, 1), 0.0)
    model.submit(SeqRequest(4, 1), 0.0)
    with pytest.raises(QueueFullError):
        model.submit(SeqRequest(4, 1), 0.0)
    assert model.stats.rejected == 1


def test_request_larger_than_the_kv_pool_or_context_is_refused() -> None:
    model = EngineModel(config(kv_blocks=4, block_size=4, max_model_len=100))
    with pytest.raises(RequestTooLargeError):
        model.submit(SeqRequest(prompt_tokens=10, max_tokens=10), 0.0)
    with pytest.raises(RequestTooLargeError):
        model.submit(SeqRequest(prompt_tokens=90, max_tokens=20), 0.0)


def test_ttft_is_queue_wait_plus_prefill_of_the_prompt() -> None:
    model = EngineModel(config(prefill_us_per_token=1000.0))
    seq = model.submit(SeqRequest(prompt_tokens=20, max_tokens=3), now=1.0)
    end = run_until_idle(model, now=1.5)
    assert seq.scheduled_time == 1.5
    assert seq.ttft == pytest.approx(0.5 + 20 * 0.001)
    # Then two decode steps of 10 ms each.
    assert end == pytest.approx(1.5 + 0.020 + 2 * 0.010)
    assert seq.finish_reason == "length"
    assert seq.output_tokens == 3


def test_a_request_waits_for_kv_blocks_and_runs_when_they_are_freed() -> None:
    model = EngineModel(config(kv_blocks=4, block_size=4, max_num_seqs=8))
    first = model.submit(SeqRequest(prompt_tokens=8, max_tokens=8), 0.0)  # all 4 blocks
    second = model.submit(SeqRequest(prompt_tokens=4, max_tokens=4), 0.0)
    model.schedule(0.0)
    assert model.running == [first]
    assert list(model.waiting) == [second]
    assert model.kv.usage() == 1.0
    model.complete(0.01)
    end = run_until_idle(model, 0.01)
    assert second.scheduled_time is not None
    assert first.finished_time is not None
    assert second.scheduled_time >= first.finished_time
    assert end > second.scheduled_time
    assert model.kv.usage() == 0.0


def test_repeated_prefix_is_served_from_cache_and_lowers_ttft() -> None:
    model = EngineModel(config(block_size=4, prefill_us_per_token=1000.0))
    prompt = h("a", "b", "c", "d", "e")  # 5 full blocks = 20 tokens
    cold = model.submit(SeqRequest(prompt_tokens=22, max_tokens=1, block_hashes=prompt), 0.0)
    now = run_until_idle(model)
    warm = model.submit(SeqRequest(prompt_tokens=22, max_tokens=1, block_hashes=prompt), now)
    run_until_idle(model, now)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 20
    assert cold.ttft == pytest.approx(0.022)
    assert warm.ttft == pytest.approx(0.002)
    assert model.stats.prefix_queries_tokens == 44
    assert model.stats.prefix_hits_tokens == 20


def test_a_shared_head_hits_only_up_to_the_first_different_block() -> None:
    model = EngineModel(config(block_size=4))
    model.submit(SeqRequest(16, 1, h("sys", "x", "y", "z")), 0.0)
    now = run_until_idle(model)
    other = model.submit(SeqRequest(16, 1, h("sys", "x", "q", "z")), now)
    run_until_idle(model, now)
    assert other.cached_tokens == 8


def test_a_fully_cached_prompt_hits_whole_blocks_and_computes_its_last_block_again() -> None:
    """vLLM's hit stops before the prompt's last token and at a block boundary: a prompt of
    exactly two cached blocks hits one. The simulator hit 7 of 8 tokens, a part of a block,
    which vLLM never reports (found by a review helper)."""
    model = EngineModel(config(block_size=4))
    model.submit(SeqRequest(8, 1, h("a", "b")), 0.0)
    now = run_until_idle(model)
    again = model.submit(SeqRequest(8, 1, h("a", "b")), now)
    run_until_idle(model, now)
    assert again.cached_tokens == 4
    longer = model.submit(SeqRequest(9, 1, h("a", "b")), now)  # one token past the blocks
    run_until_idle(model, now)
    assert longer.cached_tokens == 8
    assert model.stats.prefix_hits_tokens == 12


def test_concurrent_sequences_share_cached_blocks_instead_of_copying() -> None:
    model = EngineModel(config(block_size=4, kv_blocks=64))
    prompt = h("a", "b", "c")
    model.submit(SeqRequest(13, 3, prompt), 0.0)
    step(model, 0.0)
    used_by_one = model.kv.used_blocks
    model.submit(SeqRequest(13, 3, prompt), 1.0)
    step(model, 1.0)
    # The second sequence reuses 3 full prompt blocks and adds only the block holding its
    # last prompt token and its output (a hit stops before the last token, as in vLLM).
    assert model.kv.used_blocks == used_by_one + 1


def test_lru_eviction_keeps_the_recently_used_prefix() -> None:
    kv = KVCache(num_blocks=4)
    old = kv.allocate(h("old1", "old2"), 2)
    kv.free(old)
    recent = kv.allocate(h("new1", "new2"), 2)
    kv.free(recent)
    # Touch "old" so that "new" becomes the least recently used.
    kv.free(kv.allocate(h("old1", "old2"), 2))
    assert kv.cached_free_blocks == 4
    kv.free(kv.allocate(h("other1", "other2"), 2))
    assert kv.match_prefix(h("old1", "old2")) == 2
    assert kv.match_prefix(h("new1", "new2")) == 0


def test_eviction_drops_the_tail_of_a_prompt_before_its_head() -> None:
    kv = KVCache(num_blocks=3)
    kv.free(kv.allocate(h("a", "b", "c"), 3))
    kv.free(kv.allocate((), 1))
    assert kv.match_prefix(h("a", "b", "c")) == 2


def test_disabled_prefix_caching_never_hits() -> None:
    model = EngineModel(config(enable_prefix_caching=False))
    model.submit(SeqRequest(8, 1, h("a", "b")), 0.0)
    now = run_until_idle(model)
    again = model.submit(SeqRequest(8, 1, h("a", "b")), now)
    run_until_idle(model, now)
    assert again.cached_tokens == 0


def test_decode_step_time_grows_with_batch_size() -> None:
    def decode_step(batch: int) -> float:
        model = EngineModel(config(max_num_seqs=64, max_queue=64, decode_batch_factor=0.1))
        for _ in range(batch):
            model.submit(SeqRequest(4, 5), 0.0)
        now = step(model, 0.0)  # prefill step
        return model.schedule(now)

    assert decode_step(1) == pytest.approx(0.010)
    assert decode_step(11) == pytest.approx(0.020)


def test_time_scale_and_slowdown_multiply_step_time() -> None:
    fast = EngineModel(config(time_scale=0.0))
    fast.submit(SeqRequest(100, 10), 0.0)
    assert run_until_idle(fast) == 0.0
    slow = EngineModel(config(time_scale=0.5))
    slow.slowdown = 4.0
    slow.submit(SeqRequest(10, 1), 0.0)
    assert run_until_idle(slow) == pytest.approx(10 * 0.001 * 0.5 * 4)


def test_abort_releases_blocks_and_is_not_counted_as_finished() -> None:
    """vLLM drops an aborted request's state without recording it as finished; the
    simulator counted it in request_success{finished_reason="abort"} (found by a review
    helper)."""
    model = EngineModel(config())
    running = model.submit(SeqRequest(8, 100), 0.0)
    step(model, 0.0)
    waiting = model.submit(SeqRequest(8, 100), 0.1)
    assert model.kv.used_blocks > 0
    model.abort(running, 0.2)
    model.abort(waiting, 0.2)
    assert not model.has_work
    assert model.kv.used_blocks == 0
    assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort")
    assert model.stats.finished == {}


def test_natural_stop_reports_stop_and_max_tokens_reports_length() -> None:
    model = EngineModel(config())
    natural: Sequence = model.submit(SeqRequest(4, 3, natural_stop=True), 0.0)
    capped = model.submit(SeqRequest(4, 3), 0.0)
    run_until_idle(model)
    assert (natural.finish_reason, capped.finish_reason) == ("stop", "length")


def test_block_hashes_are_chained_and_only_cover_full_blocks() -> None:
    block = "x" * 16  # 4 tokens of 4 characters
    assert block_hashes(block * 2 + "tail", block_size=4)[:2] == block_hashes(block * 2, 4)
    assert len(block_hashes(block * 2 + "tail", 4)) == 2
    changed_head = block_hashes("y" + block[1:] + block, 4)
    assert changed_head[1] != block_hashes(block * 2, 4)[1]
    assert block_hashes("short", 4) == ()
    assert count_tokens("") == 1
    assert count_tokens("abcdefgh") == 2


def test_output_text_is_deterministic_given_the_seed() -> None:
    assert OutputText(7).pieces(20) == OutputText(7).pieces(20)
    assert OutputText(7).pieces(20) != OutputText(8).pieces(20)


@pytest.mark.parametrize("field", ["max_num_seqs", "kv_blocks", "block_size", "max_model_len"])
def test_config_rejects_non_positive_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: 0})  # type: ignore[arg-type]


# Chunked prefill: (budget, prompts, steps until each first token, step durations in ms).
# config(): 1 ms a prefill token, 10 ms a decode step, no batch factor, 4 seqs at most.
CHUNKED_CASES = [
    # Off: the whole 40-token prompt in one 40 ms step.
    pytest.param(None, [40], [1], [40.0], id="off-one-step"),
    # Budget 16: 16 + 16 + 8 tokens over three steps; the token comes after the last chunk.
    pytest.param(16, [40], [3], [16.0, 16.0, 8.0], id="long-prompt-in-chunks"),
    # Two prompts share the budget in FIFO order: the second starts in the first's last
    # step (4 + 12 tokens) and ends alone in the third (2 tokens).
    pytest.param(16, [20, 14], [2, 3], [16.0, 16.0, 2.0], id="fifo-shares-budget"),
    # A prompt within the budget behaves as without chunking.
    pytest.param(64, [40], [1], [40.0], id="fits-in-budget"),
]


@pytest.mark.parametrize(("budget", "prompts", "first_token_step", "durations_ms"), CHUNKED_CASES)
def test_chunked_prefill_spreads_long_prompts_over_steps(
    budget: int | None,
    prompts: list[int],
    first_token_step: list[int],
    durations_ms: list[float],
) -> None:
    model = EngineModel(config(max_num_batched_tokens=budget, kv_blocks=256))
    seqs = [model.submit(SeqRequest(p, 1), 0.0) for p in prompts]
    now = 0.0
    durations: list[float] = []
    first_steps: dict[int, int] = {}
    for index in range(1, len(durations_ms) + 1):
        duration = model.schedule(now)
        now += duration
        durations.append(round(duration * 1e3, 6))
        for seq in model.complete(now).emitted:
            first_steps.setdefault(seq.seq_id, index)
    assert [first_steps.get(s.seq_id) for s in seqs] == first_token_step
    assert durations == durations_ms
    assert not model.has_work


def test_chunked_prefill_keeps_running_sequences_decoding() -> None:
    model = EngineModel(config(max_num_batched_tokens=8, kv_blocks=256))
    short = model.submit(SeqRequest(4, 5), 0.0)
    now = step(model, 0.0)  # short prefilled, first token
    long = model.submit(SeqRequest(30, 1), now)
    for _ in range(4):  # 1 decode token + 7 prefill tokens a step
        duration = model.schedule(now)
        assert round(duration * 1e3, 6) == 7.0 + 10.0
        now += duration
        model.complete(now)
    assert short.output_tokens == 5
    assert (long.prefill_remaining, long.first_token_time) == (2, None)
    now = step(model, now)
    assert long.first_token_time == now


def test_chunked_prefill_counts_a_prompt_once_and_caches_its_blocks() -> None:
    model = EngineModel(config(max_num_batched_tokens=4, kv_blocks=64, block_size=4))
    model.submit(SeqRequest(16, 1, h("a", "b", "c", "d")), 0.0)
    run_until_idle(model)
    assert model.stats.prompt_tokens == 16
    assert model.stats.prefix_queries_tokens == 16
    again = model.submit(SeqRequest(16, 1, h("a", "b", "c", "d")), 1.0)
    run_until_idle(model, 1.0)
    assert again.cached_tokens == 12  # whole blocks; the last one is computed again


def test_chunked_prefill_budget_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        config(max_num_batched_tokens=2, max_num_seqs=4)


def test_prompt_tokens_are_counted_at_the_first_token_and_cache_queries_at_admission() -> None:
    """vLLM 0.32 (IterationStats.update_from_output) counts a prompt's tokens when its first
    token comes out, its prefix-cache query when it is scheduled; the simulator counted both
    at admission, so a scrape during a long prefill read its prompt too early (found by a
    review helper)."""
    model = EngineModel(config(max_num_batched_tokens=4, block_size=4))
    model.submit(SeqRequest(10, 2), 0.0)
    now = step(model, 0.0)  # 4 of 10 prompt tokens
    assert (model.stats.prefix_queries_tokens, model.stats.prompt_tokens) == (10, 0)
    now = step(model, now)
    assert model.stats.prompt_tokens == 0
    step(model, now)  # the last 2, and the first token
    assert model.stats.prompt_tokens == 10
    run_until_idle(model, now)
    assert model.stats.prompt_tokens == 10
