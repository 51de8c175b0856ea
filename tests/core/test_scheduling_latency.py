"""The latency scorer: predicted TTFT in seconds, one table of cases; its calibration."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmgw.calibration import Calibration, hits_confirmed, pooled
from llmgw.promtext import CONTRACTS, extract
from llmgw.registry import EndpointState, Registry
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.types import Engine, EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock, config, context, state, static_model

NOW = 10.0
PER_TOKEN = 100e-6  # the scorer's default: 100 us per prefill token
STEP = 0.02  # ... and 20 ms per step for a batch of one
HISTORY = "history " * 2000  # 16,000 chars: 4,000 tokens, 62 blocks of 64 tokens


def request(prompt: str = HISTORY, session: str | None = None, rid: str = "r") -> RequestInfo:
    return RequestInfo("m", rid, session_key=session, prompt=prompt, prompt_tokens=len(prompt) // 4)


def predicted(scorer: LatencyScorer) -> dict[str, tuple[float, ...]]:
    return scorer.terms()


@dataclass
class Case:
    name: str
    candidates: list[EndpointState]
    want_best: str
    cached_on: str | None = None  # the endpoint the prompt was sent to before
    busy: dict[str, float] = field(default_factory=dict)  # seconds of queued prefill


CASES = [
    Case(
        "idle-fleet-cached-history-wins",
        [state("a:1"), state("b:1")],
        want_best="b:1",
        cached_on="b:1",
    ),
    Case(
        "short-queue-does-not-outweigh-a-4000-token-prefill",
        [state("a:1"), state("b:1")],
        want_best="b:1",
        cached_on="b:1",
        busy={"b:1": 0.2},  # 0.2 s queued vs 0.4 s to prefill the history on a:1
    ),
    Case(
        "long-queue-outweighs-the-prefill",
        [state("a:1"), state("b:1")],
        want_best="a:1",
        cached_on="b:1",
        busy={"b:1": 2.0},
    ),
    Case(
        "no-cache-anywhere-least-queued-wins",
        [state("a:1"), state("b:1"), state("c:1")],
        want_best="c:1",
        busy={"a:1": 0.3, "b:1": 0.1},
    ),
    Case(
        "engine-waiting-count-is-queueing-too",
        [
            state("a:1", waiting=6, running=4, scraped_at=NOW),
            state("b:1", waiting=0, running=4, scraped_at=NOW),
        ],
        want_best="b:1",
    ),
    Case(
        "a-larger-batch-means-slower-steps",
        [
            state("a:1", waiting=0, running=30, scraped_at=NOW),
            state("b:1", waiting=0, running=2, scraped_at=NOW),
        ],
        want_best="b:1",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_latency_scorer_table(case: Case) -> None:
    scorer = LatencyScorer()
    req = request()
    if case.cached_on is not None:
        chosen = next(s for s in case.candidates if s.id == case.cached_on)
        scorer.index.insert(chosen.id, scorer.index.hashes(req.prompt))
    for s in case.candidates:
        s.busy_until = NOW + case.busy.get(s.id, 0.0)
    scores = scorer.score(context(case.candidates, request=req, now=NOW), case.candidates)
    assert all(0 < x <= 1 for x in scores)
    best = case.candidates[scores.index(max(scores))].id
    assert best == case.want_best, predicted(scorer)


def test_prediction_is_in_seconds_from_the_terms() -> None:
    """Idle, uncached: ttft = tokens x per-token cost + one step, on the defaults."""
    scorer = LatencyScorer()
    states = [state("a:1")]
    scorer.score(context(states, request=request(), now=NOW), states)
    terms = {name: values[0] for name, values in scorer.terms().items()}
    assert terms["prefill_s"] == pytest.approx(4000 * PER_TOKEN)
    assert terms["queue_s"] == 0.0
    assert terms["step_s"] == pytest.approx(STEP)
    assert terms["ttft_s"] == pytest.approx(4000 * PER_TOKEN + STEP)


def test_choosing_an_endpoint_queues_its_prefill_there() -> None:
    """Two identical long prompts at once: the second sees the first one's prefill queued."""
    scorer = LatencyScorer()
    states = [state("a:1"), state("b:1")]
    first = context(states, request=request(rid="1"), now=NOW)
    scorer.score(first, states)
    scorer.observe(first, states[0])
    assert states[0].busy_until == pytest.approx(NOW + 4000 * PER_TOKEN)
    assert first.prediction is not None and first.prediction[0] == states[0].busy_until
    # Same prompt again: a:1 has it cached now, but its queue holds the first prefill.
    second = context(states, request=request(rid="2"), now=NOW)
    scores = scorer.score(second, states)
    queue = scorer.terms()["queue_s"]
    assert queue[0] == pytest.approx(4000 * PER_TOKEN) and queue[1] == 0.0
    # Waiting 0.4 s for a cached prompt ~ prefilling it elsewhere in 0.4 s, but that second
    # copy is 0.4 s of work imposed on the fleet (work_weight): stay.
    assert scores[0] > scores[1]
    # TTFT alone (no work weight, none for queues either): the uncached peer is a hair faster.
    scorer.work_weight, scorer.queue_weighting = 0.0, False
    assert scorer.score(second, states)[1] == 1.0


def test_queues_make_duplicated_work_dearer() -> None:
    """Once the model's replicas hold queues, duplicating a cached prompt's prefill costs the
    requests queued behind it too: the same choice flips from move to stay."""
    scorer = LatencyScorer(work_weight=0.0)
    states = [state("a:1"), state("b:1")]
    req = request()
    scorer.index.insert("a:1", scorer.index.hashes(req.prompt))
    states[0].busy_until = NOW + 0.45  # a:1 (cached) queued 0.45 s, b:1 idle
    first = scorer.score(context(states, request=req, now=NOW), states)
    assert first[1] > first[0]  # no queues seen yet: 0.45 s wait vs 0.4 s prefill, move
    # The first pick saw a mean queue of 0.225 s, about half a typical prefill deep.
    again = scorer.score(context(states, request=req, now=NOW), states)
    assert again[0] > again[1]


def test_queued_prefill_drains_with_time() -> None:
    scorer = LatencyScorer()
    states = [state("a:1")]
    states[0].busy_until = NOW + 0.5
    scorer.score(context(states, request=request(), now=NOW + 0.3), states)
    assert scorer.terms()["queue_s"][0] == pytest.approx(0.2)


def test_an_early_first_token_cuts_the_modelled_queue() -> None:
    clock = FakeClock(NOW)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}),
        Registry(clock=clock),
    )
    decision = sched.pick(request())
    assert decision.ready_at == pytest.approx(NOW + 4000 * PER_TOKEN)
    assert decision.predicted_ttft == pytest.approx(4000 * PER_TOKEN + STEP)
    lease = sched.acquire(decision)
    state_a = sched.registry.get("m", "a:1")
    assert state_a is not None
    clock.advance(0.1)  # the engine was 4x faster than the model said
    lease.first_token()
    assert state_a.busy_until == pytest.approx(NOW + 0.1)
    lease.finish(Outcome.SUCCESS)
    assert state_a.inflight == 0


def test_decision_summary_names_the_dominant_term() -> None:
    sched = Scheduler(config({"m": {"endpoints": ["a:1", "b:1"], "strategy": "latency"}}))
    decision = sched.pick(request())
    summary = decision.describe()
    assert "ttft_ms=420.0" in summary and "dominant=prefill" in summary
    scores = decision.rationale.as_dict()["scores"]["a:1"]["latency"]
    assert scores["ttft_s"] == pytest.approx(0.42)


def test_published_costs_replace_the_params_pooled_over_the_model() -> None:
    """Engines that publish 1 ms per prefill token are predicted 10x slower per token than
    the default; one replica's numbers count for all (a busy one's would feed back)."""
    scorer = LatencyScorer()
    a, b, quiet = state("a:1"), state("b:1"), state("c:1")
    for s, (seconds, tokens) in ((a, (1.0, 1000.0)), (b, (3.5, 3000.0))):
        s.calibration.on_scrape(metrics())
        s.calibration.on_scrape(metrics(prefill_s=seconds, tokens=tokens, prefills=4))
    states = [a, b, quiet]
    scorer.score(context(states, request=request(), now=NOW), states)
    assert scorer.terms()["prefill_s"] == pytest.approx((4.0, 4.0, 4.0))
    assert LatencyScorer(calibrate=False).score(context(states, request=request(), now=NOW), states)
    uncalibrated = LatencyScorer(calibrate=False)
    uncalibrated.score(context(states, request=request(), now=NOW), states)
    assert uncalibrated.terms()["prefill_s"][0] == pytest.approx(4000 * PER_TOKEN)


def test_pooled_costs_are_the_tightest_upper_bound_and_tokens_a_pooled_mean() -> None:
    """Each engine's per-token cost is inflated by prefills sharing its steps: the least
    inflated (lowest) is the best estimate for the model."""
    a, b = Calibration(), Calibration()
    for cal, (seconds, tokens) in ((a, (1.0, 1000.0)), (b, (0.9, 9000.0))):
        cal.on_scrape(metrics())
        cal.on_scrape(metrics(prefill_s=seconds, tokens=tokens, prefills=4))
    per_token, step, typical, service, engine_tokens, observed, marginal = pooled([a, b])
    assert per_token == pytest.approx(1e-4) and step is None
    assert typical == pytest.approx(10000 / 8)
    assert service is None and engine_tokens == 1.0 and observed is None
    assert marginal is None  # no step published: nothing to take out
    assert pooled([]) == (None, None, None, None, 1.0, None, None)


def test_the_marginal_cost_of_a_token_leaves_out_the_step_each_prefill_shares() -> None:
    """A step of 20 ms at a batch of one, 26 ms at a batch of four (batch factor 0.1): 10
    prefills of 100 tokens each wait out a step and add 10 us a token: 0.27 s for 1,000
    tokens. The ratio says 270 us a token; the marginal cost is the 10 us a token adds."""
    cal = Calibration()
    cal.on_scrape(metrics(running=4.0), batch_factor=0.1)
    cal.on_scrape(metrics(steps=100, step_s=2.6, running=4.0), batch_factor=0.1)
    assert cal.step.value == pytest.approx(0.02)
    cal.on_scrape(
        metrics(steps=100, step_s=2.6, prefill_s=0.27, tokens=1000, prefills=10, running=4.0),
        batch_factor=0.1,
    )
    costs = pooled([cal])
    assert costs.per_token == pytest.approx(2.7e-4)
    assert costs.marginal == pytest.approx(10e-6)
    # A window whose step is all the prefills took (no token adds anything): no marginal.
    flat = Calibration()
    flat.on_scrape(metrics())
    flat.on_scrape(metrics(steps=100, step_s=2.0))
    flat.on_scrape(metrics(steps=100, step_s=2.0, prefill_s=0.2, tokens=1000, prefills=10))
    assert flat.net.value == pytest.approx(0.0) and pooled([flat]).marginal is None


def metrics(
    *,
    prefill_s: float = 0.0,
    tokens: float = 0.0,
    prefills: float = 0.0,
    steps: float = 0.0,
    step_s: float = 0.0,
    waiting: float = 0.0,
    running: float = 0.0,
) -> EngineMetrics:
    return EngineMetrics(
        waiting=waiting,
        running=running,
        kv_usage=0.0,
        prefill_seconds_sum=prefill_s,
        prefill_count=prefills,
        computed_tokens_sum=tokens,
        step_seconds_sum=step_s,
        step_count=steps,
    )


def test_calibration_ratios_of_counter_deltas() -> None:
    cal = Calibration()
    cal.on_scrape(metrics())
    assert cal.prefill.value is None and cal.step.value is None
    cal.on_scrape(metrics(prefill_s=0.5, tokens=5000, prefills=10, steps=100, step_s=2.0))
    assert cal.prefill.value == pytest.approx(1e-4)
    assert cal.tokens.value == pytest.approx(500)
    assert cal.step.value == pytest.approx(0.02)  # batch of one (running 0)


def test_calibration_ignores_counter_resets_and_tiny_windows() -> None:
    cal = Calibration()
    cal.on_scrape(metrics(prefill_s=5.0, tokens=50_000))
    cal.on_scrape(metrics(prefill_s=0.1, tokens=100))  # engine restarted: counters fell
    assert cal.prefill.value is None
    cal.on_scrape(metrics(prefill_s=0.2, tokens=104, prefills=1))  # 4 tokens: too few yet
    assert cal.prefill.value is None


def test_calibration_pairs_seconds_and_tokens_seen_in_different_windows() -> None:
    """Prompt tokens count at admission, prefill time at finish: neither may be dropped."""
    cal = Calibration()
    cal.on_scrape(metrics())
    cal.on_scrape(metrics(tokens=1000))  # admitted, not finished yet
    assert cal.prefill.value is None
    cal.on_scrape(metrics(tokens=1000, prefill_s=0.2, prefills=1))  # finished a window later
    assert cal.prefill.value == pytest.approx(2e-4)


def test_token_counters_pair_with_the_requests_that_started_not_those_that_finished() -> None:
    """Prompt and cached token counters count a request when it enters the batch, the
    prefill histogram when it finishes: while the batch fills, a window's tokens belong
    to more requests than finished in it. 8 requests of 1000 computed tokens start, 2 of
    them finish (0.1 s of prefill each): 100 us a token and 1000 tokens a request, not
    8000 / 2 tokens a prefill (25 us a token)."""

    def page(prompt: float, finished: float, running: float, seconds: float) -> EngineMetrics:
        return EngineMetrics(
            waiting=0.0,
            running=running,
            kv_usage=0.0,
            finished_total=finished,
            prompt_tokens_total=prompt,
            cached_tokens_total=0.0,
            prefill_seconds_sum=seconds,
            prefill_count=finished,
        )

    cal = Calibration()
    cal.on_scrape(page(0, 0, 0, 0.0))
    cal.on_scrape(page(8000, 2, 6, 0.2))
    assert cal.prefill.value == pytest.approx(1e-4)
    assert cal.tokens.value == pytest.approx(1000)
    cal.on_scrape(page(8000, 8, 0, 0.8))  # the other 6 finish; nothing new starts
    assert cal.prefill.value == pytest.approx(1e-4)
    # With the computed-tokens histogram (counted at the finish, like the seconds) the
    # finished prefills own the tokens.
    finish = Calibration()
    finish.on_scrape(replace(metrics(), finished_total=0.0))
    done = metrics(prefill_s=0.2, tokens=2000, prefills=2)
    finish.on_scrape(replace(done, running=6, finished_total=2.0))
    assert finish.prefill.value == pytest.approx(1e-4)
    assert finish.tokens.value == pytest.approx(1000)


def test_without_a_prefill_histogram_token_counters_over_finished_requests_give_typical() -> None:
    """SGLang and TRT-LLM publish no prefill-time histogram: prompt and cached token
    counters over finished requests still give the typical computed tokens per request,
    and no seconds per token are made up. A histogram that vanished mid-run (a restart
    into a different build) pairs nothing."""

    def page(prompt: float, cached: float, finished: float) -> EngineMetrics:
        return EngineMetrics(
            waiting=0.0,
            running=0.0,
            kv_usage=0.0,
            finished_total=finished,
            prompt_tokens_total=prompt,
            cached_tokens_total=cached,
        )

    cal = Calibration()
    cal.on_scrape(page(0, 0, 0))
    cal.on_scrape(page(5000, 3000, 4))
    assert cal.tokens.value == pytest.approx(500)  # (5000 - 3000) / 4
    assert cal.prefill.value is None
    gone = Calibration()
    gone.on_scrape(metrics(prefill_s=0.1, tokens=100, prefills=1))
    gone.on_scrape(page(5000, 3000, 4))
    assert gone.tokens.value is None


def test_without_a_service_histogram_littles_law_gives_the_time_in_the_batch() -> None:
    """No time-in-batch histogram (SGLang, TRT-LLM): requests in the batch x seconds over
    the requests that left it. 4 running for 2 s (no finish: no estimate yet), then 2 of
    them done within the third: 4 + 4 + 3 = 11 request-seconds / 2 = 5.5 s each, the
    windows without a finish included. A counter reset starts the sum again; a histogram,
    where published, wins; with no counter, the requests this router saw end count."""

    def page(running: float, finished: float) -> EngineMetrics:
        return EngineMetrics(waiting=0.0, running=running, kv_usage=0.0, finished_total=finished)

    cal = Calibration()
    cal.on_scrape(page(4, 0), at=0.0)
    cal.on_scrape(page(4, 0), at=1.0)
    assert cal.service.value is None
    cal.on_scrape(page(4, 0), at=2.0)
    cal.on_scrape(page(2, 2), at=3.0)  # (4 + 2) / 2 over the last second
    assert cal.service.value == pytest.approx((4 + 4 + 3) / 2)
    reset = Calibration()
    reset.on_scrape(page(4, 10), at=0.0)
    reset.on_scrape(page(4, 0), at=1.0)  # restarted: the 4 request-seconds pair with nothing
    reset.on_scrape(page(4, 2), at=2.0)
    assert reset.service.value == pytest.approx(4 / 2)
    timed = Calibration()
    hist = EngineMetrics(
        waiting=0.0, running=4.0, kv_usage=0.0, finished_total=0.0,
        service_seconds_sum=0.0, service_count=0.0,
    )  # fmt: skip
    timed.on_scrape(hist, at=0.0)
    timed.on_scrape(
        replace(hist, finished_total=2.0, service_seconds_sum=1.0, service_count=2.0), at=1.0
    )
    assert timed.service.value == pytest.approx(0.5)
    # No finished counter either: the requests this router saw end there.
    own = Calibration()
    gauges = EngineMetrics(waiting=0.0, running=4.0, kv_usage=0.0)
    own.on_scrape(gauges, at=0.0, released=0)
    own.on_scrape(gauges, at=1.0, released=0)
    assert own.service.value is None
    own.on_scrape(gauges, at=2.0, released=4)
    assert own.service.value == pytest.approx(8 / 4)


def test_without_a_prefill_histogram_the_time_to_first_token_less_the_queue_prices_tokens() -> None:
    """No prefill histogram (vLLM look-alikes, SGLang), but time to first token: 10
    requests computed 5,000 tokens in 1.5 s of TTFT, 0.5 s of it queued: 200 us a token.
    Without a queue histogram the queue counts too (an upper bound); a prefill histogram,
    where published, wins; with neither, no seconds are made up."""

    def page(**counters: Any) -> EngineMetrics:
        return EngineMetrics(waiting=0.0, running=4.0, kv_usage=0.0, **counters)

    start = {"prompt_tokens_total": 0.0, "cached_tokens_total": 0.0, "finished_total": 0.0}
    end = {"prompt_tokens_total": 8000.0, "cached_tokens_total": 3000.0, "finished_total": 10.0}
    ttft = ({"ttft_seconds_sum": 0.0, "ttft_count": 0.0},
            {"ttft_seconds_sum": 1.5, "ttft_count": 10.0})  # fmt: skip
    queue = ({"queue_seconds_sum": 0.0}, {"queue_seconds_sum": 0.5})
    cal = Calibration()
    cal.on_scrape(page(**start, **ttft[0], **queue[0]), at=0.0)
    cal.on_scrape(page(**end, **ttft[1], **queue[1]), at=1.0)
    assert cal.prefill.value == pytest.approx(1.0 / 5000)
    assert cal.tokens.value == pytest.approx(500.0)
    unqueued = Calibration()
    unqueued.on_scrape(page(**start, **ttft[0]), at=0.0)
    unqueued.on_scrape(page(**end, **ttft[1]), at=1.0)
    assert unqueued.prefill.value == pytest.approx(1.5 / 5000)
    timed = Calibration()
    timed.on_scrape(page(**start, **ttft[0], prefill_seconds_sum=0.0, prefill_count=0.0), at=0.0)
    timed.on_scrape(page(**end, **ttft[1], prefill_seconds_sum=0.4, prefill_count=10.0), at=1.0)
    assert timed.prefill.value == pytest.approx(0.4 / 5000)
    bare = Calibration()
    bare.on_scrape(page(**start), at=0.0)
    bare.on_scrape(page(**end), at=1.0)
    assert bare.prefill.value is None
    assert bare.tokens.value == pytest.approx(500.0)


def test_an_engine_smaller_than_the_index_forgets_what_it_must_have_evicted() -> None:
    """The engine says its KV cache holds 128 tokens (2 index blocks): older prompts routed
    there no longer count as cached."""
    scorer = LatencyScorer()
    states = [state("a:1")]
    states[0].calibration.kv_tokens = 128.0
    old, new = request("old " * 200), request("new " * 200)  # 800 chars: 3 blocks each
    scorer.index.insert("a:1", scorer.index.hashes(old.prompt))
    scorer.score(context(states, request=new, now=NOW), states)  # syncs the capacity
    assert scorer.index.size("a:1") == 2
    assert scorer.index.match(scorer.index.hashes(old.prompt)) == {}


def counters_page(prompt: float, cached: float) -> EngineMetrics:
    """An engine's page with its prompt-token and cached-token counters at these totals."""
    return EngineMetrics(
        waiting=0, running=0, kv_usage=0.0, prompt_tokens_total=prompt, cached_tokens_total=cached
    )


def test_the_engines_hit_counter_checks_the_share_the_index_predicted_for_the_same_prompts() -> (
    None
):
    """Picks wait until the engine's prompt counter has counted their tokens (it counts at
    admission, a queue later); then its cached-token counter says what it found of them."""
    page = counters_page
    cal = Calibration()
    cal.on_scrape(page(0.0, 0.0))
    cal.picked(1000.0, 800.0)
    cal.picked(1000.0, 800.0)
    cal.on_scrape(page(0.0, 0.0))  # queued: nothing admitted, nothing compared
    assert hits_confirmed(cal) is None and len(cal.sent) == 2
    cal.on_scrape(page(1000.0, 200.0))  # the first admitted: a fifth found, 0.8 predicted
    assert hits_confirmed(cal) == pytest.approx(0.25) and len(cal.sent) == 1
    cal.on_scrape(page(1500.0, 600.0))  # half the second (a chunk): the rest waits
    assert cal.predicted_hits.den == pytest.approx(1000 * 0.98 + 500) and cal.sent[0] == [500, 400]
    cal.on_scrape(page(0.0, 0.0))  # a restart: the counters fell, nothing is paired
    assert len(cal.sent) == 1
    gauges = Calibration()  # an engine without the counters: nothing to pair picks with
    gauges.on_scrape(EngineMetrics(waiting=0, running=0, kv_usage=0.0))
    assert not gauges.pairs_picks and cal.pairs_picks
    gauges.picked(1000.0, 800.0)
    assert not gauges.sent


def test_cache_hits_counted_before_their_prompts_tokens_are_carried_to_them() -> None:
    """vLLM counts a prompt's cache hits when it admits it and its prompt tokens at its first
    token, a scrape or more later (chunked prefills). The hits of a window without a first
    token were dropped: the engine's share read a fraction of the truth, the index was cut
    to a sliver, and on engines without `cache_config_info` sessions spread (2.3-9x the
    best TTFT p90 in `bench/fleetsim_robust.py`, variants no-kv-size, counters-only)."""
    page = counters_page
    cal = Calibration()
    cal.on_scrape(page(0.0, 0.0))
    prompt = cached = 0.0
    for _ in range(20):  # each prompt: 1,000 tokens, 900 found cached, over two scrapes
        cal.picked(1000.0, 900.0)
        cached += 900.0
        cal.on_scrape(page(prompt, cached))  # admitted: its hits counted, not its tokens
        prompt += 1000.0
        cal.on_scrape(page(prompt, cached))  # its first token: its tokens counted
    assert cal.hits.value == pytest.approx(0.9)
    assert hits_confirmed(cal) == pytest.approx(1.0)


def _filled(scorer: LatencyScorer, endpoint: str, prompts: int) -> list[list[int]]:
    """`prompts` distinct 4-block prompts routed to `endpoint`, oldest first."""
    chains = [scorer.index.hashes(f"doc{i} " * 205) for i in range(prompts)]  # 1,025+ chars
    for k, hashes in enumerate(chains):
        scorer.index.insert(endpoint, hashes, now=float(k))
    return chains


def test_an_engine_hiding_its_kv_size_keeps_the_share_of_the_index_its_hits_confirm() -> None:
    """No KV size published (no `cache_config_info`): where the engine's hit counter found
    half the tokens the index predicted, the index forgets its oldest blocks (at most a
    quarter of them a step); where it found them all and the index is full, it may hold
    more. Each step waits for a new count (shares of
    the same prompts: the engine's found, the index's predicted)."""
    scorer = LatencyScorer()
    states = [state("a:1")]
    chains = _filled(scorer, "a:1", 20)
    assert scorer.index.size("a:1") == 80
    cal = states[0].calibration
    cal.hits.add(8_000.0, 20_000.0)  # the engine found 40 % of the prompts' tokens ...
    cal.predicted_hits.add(16_000.0, 20_000.0)  # ... where the index predicted 80 %
    scorer.score(context(states, request=request("new " * 100), now=NOW), states)
    assert scorer.index.size("a:1") == scorer.index.limit("a:1") == 60
    assert scorer.index.held("a:1", chains[0]) == 0 and scorer.index.held("a:1", chains[-1]) == 4
    assert cal.hits.den == cal.predicted_hits.den == 0.0  # a new count starts
    scorer.score(context(states, request=request("new " * 100), now=NOW + 1), states)
    assert scorer.index.limit("a:1") == 60  # nothing new counted: no step
    cal.hits.add(16_000.0, 20_000.0)  # all found, the index full: room for more
    cal.predicted_hits.add(16_000.0, 20_000.0)
    scorer.score(context(states, request=request("new " * 100), now=NOW + 2), states)
    assert scorer.index.limit("a:1") == 81 and scorer.index.size("a:1") == 60


def test_an_engine_publishing_its_kv_size_is_not_fitted_from_its_hits() -> None:
    scorer = LatencyScorer()
    states = [state("a:1")]
    states[0].calibration.kv_tokens = 64.0 * 50  # 50 index blocks
    _filled(scorer, "a:1", 20)
    states[0].calibration.hits.add(1_000.0, 20_000.0)
    states[0].calibration.predicted_hits.add(16_000.0, 20_000.0)
    scorer.score(context(states, request=request("new " * 100), now=NOW), states)
    assert scorer.index.limit("a:1") == 50


def test_an_engine_that_caches_nothing_empties_the_index_there() -> None:
    """Prefix caching off: the counter stays at 0 however much the index predicts, so the
    index there shrinks step by step and a session's home stops being a reason to stay."""
    scorer = LatencyScorer()
    states = [state("a:1")]
    _filled(scorer, "a:1", 20)
    for k in range(20):
        states[0].calibration.hits.add(0.0, 20_000.0)
        states[0].calibration.predicted_hits.add(16_000.0, 20_000.0)
        scorer.score(context(states, request=request("new " * 100), now=NOW + k), states)
    assert scorer.index.size("a:1") <= 1


def test_the_kv_cache_size_comes_from_the_cache_config_info_labels() -> None:
    page = (Path(__file__).parents[1] / "fixtures" / "metrics-vllm-0.32.0-busy.txt").read_text()
    cal = Calibration()
    cal.on_scrape(extract(page, CONTRACTS[Engine.VLLM], model="tiny"))
    assert cal.kv_tokens == 8192 * 128  # num_gpu_blocks x block_size on that page


def test_pending_prefill_is_the_queue_where_the_edge_reports_first_tokens() -> None:
    """Tokens sent stay queued until their first token, however long that takes; a request
    that ends without one (an error) releases them too."""
    clock = FakeClock(NOW)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    a = sched.registry.get("m", "a:1")
    assert a is not None
    first = sched.acquire(sched.pick(request(rid="1")))
    assert a.pending_prefill == 4000 and not a.reports_first_token
    first.first_token()
    assert a.pending_prefill == 0 and a.reports_first_token
    slow = sched.acquire(sched.pick(request("other " * 1000, rid="2")))  # 1,500 tokens
    clock.advance(5.0)  # far past the time-drained model's guess: still pending here
    scorer = sched.routers["m"].scorers[0][0]
    assert isinstance(scorer, LatencyScorer)
    sched.pick(request(rid="3"))
    assert scorer.terms()["queue_s"][0] == pytest.approx(1500 * PER_TOKEN)
    slow.finish(Outcome.FAILURE)
    assert a.pending_prefill == 0


def _scrape_first_tokens(registry: Registry, count: float) -> None:
    registry.record_scrape(
        "m", "a:1", EngineMetrics(waiting=0.0, running=1, kv_usage=0.1, ttft_count=count)
    )


def _one_endpoint(clock: FakeClock) -> tuple[Scheduler, EndpointState, LatencyScorer]:
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    a = sched.registry.get("m", "a:1")
    scorer = sched.routers["m"].scorers[0][0]
    assert a is not None and isinstance(scorer, LatencyScorer)
    return sched, a, scorer


def test_the_engines_first_token_count_closes_the_oldest_prefills_where_the_edge_sees_none() -> (
    None
):
    """Behind Envoy without response bodies: each scrape's new first tokens (the engine's
    TTFT histogram count) close this router's oldest open prefills; once a request ended
    with no first token seen, the queue is what is left open, less the time since that
    scrape; a request that ends releases nothing twice; an engine that restarted (its
    count went back) closes nothing."""
    clock = FakeClock(NOW)
    sched, a, scorer = _one_endpoint(clock)
    _scrape_first_tokens(sched.registry, 10.0)  # before any request: a baseline only
    sizes = {"1": 4000, "2": 1500, "3": 500}
    leases = {
        rid: sched.acquire(sched.pick(request(rid * 4 * n, rid=rid))) for rid, n in sizes.items()
    }
    assert a.counted_prefill == pytest.approx(6000, abs=3)
    clock.advance(0.3)
    _scrape_first_tokens(sched.registry, 11.0)  # one first token: the oldest request's
    assert a.counted_prefill == pytest.approx(2000, abs=3)
    assert not a.counts_first_tokens  # the edge may still see first tokens: not yet used
    leases["1"].end(Outcome.SUCCESS)  # no first token seen: this edge sees none
    assert a.misses_first_tokens and not a.reports_first_token
    assert a.counted_prefill == pytest.approx(2000, abs=3)  # "1" was closed by the count
    _scrape_first_tokens(sched.registry, 11.0)
    assert a.counts_first_tokens
    clock.advance(0.05)
    sched.pick(request(rid="probe"))
    assert scorer.terms()["queue_s"][0] == pytest.approx(2000 * PER_TOKEN - 0.05, abs=1e-3)
    leases["2"].end(Outcome.SUCCESS)  # ended before a scrape counted it: closed here
    assert a.counted_prefill == pytest.approx(500, abs=3)
    _scrape_first_tokens(sched.registry, 3.0)  # restarted: counts from 0, closes nothing
    assert a.counted_prefill == pytest.approx(500, abs=3)
    clock.advance(1.0)  # long past the scrape: the queue does not go below 0
    sched.pick(request(rid="probe2"))
    assert scorer.terms()["queue_s"][0] == 0.0
    _scrape_first_tokens(sched.registry, 5.0)  # two more: "2" (ended) and "3"
    assert a.counted_prefill == 0
    leases["3"].finish(Outcome.FAILURE)
    assert a.counted_prefill == 0 and not any(e.open for e in a.prefills)
    assert a.pending_prefill == 0  # the edge's own account, as before


def test_first_tokens_of_other_traffic_close_only_this_routers_share() -> None:
    """Another router sends as many requests to the engine: its first tokens are half the
    count, so half of them close this router's prefills."""
    clock = FakeClock(NOW)
    sched, a, _ = _one_endpoint(clock)
    count = 0.0
    _scrape_first_tokens(sched.registry, count)
    open_counts = []
    for k in range(40):
        for j in range(2):
            sched.acquire(sched.pick(request(chr(65 + j) * 400 + f"{k}", rid=f"{k}-{j}")))
        clock.advance(0.1)
        count += 4.0  # this router's two and the other router's two
        _scrape_first_tokens(sched.registry, count)
        open_counts.append(sum(e.open for e in a.prefills))
    assert max(open_counts[-20:]) <= 2  # keeping up: at most the last scrape's two open
    assert a.counted_prefill <= 2 * 101


def test_an_edge_that_sees_first_tokens_ignores_the_engines_count() -> None:
    clock = FakeClock(NOW)
    sched, a, _ = _one_endpoint(clock)
    _scrape_first_tokens(sched.registry, 0.0)
    sched.acquire(sched.pick(request(rid="1"))).first_token()  # the edge saw it
    waiting = sched.acquire(sched.pick(request("z" * 16000, rid="2")))
    assert waiting.prefill is None  # nothing for scrapes to count
    _scrape_first_tokens(sched.registry, 2.0)
    assert a.pending_prefill == 4000 and not a.counts_first_tokens


def test_engines_without_a_per_token_cost_get_the_one_this_router_sees() -> None:
    """No engine metrics: the edge's first tokens give time to first token against the
    prefill tokens ahead of a request plus its own; the slope of that is the per-token
    cost (here 50 us a token on top of a 30 ms step), once 20 have come back. Requests
    sent behind others count the tokens ahead; an unseen first token (the request ended
    without one) teaches nothing; a published prefill histogram wins."""
    clock = FakeClock(NOW)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    a = sched.registry.get("m", "a:1")
    assert a is not None
    sizes = [400 * (1 + k % 5) for k in range(24)]  # 100-500 tokens, all uncached
    own: list[float] = []  # tokens of the first of each pair, sent with nothing ahead
    for k, chars in enumerate(sizes):
        first = sched.acquire(sched.pick(request("q" * chars, rid=f"a{k}")))
        behind = sched.acquire(sched.pick(request("r" * chars, rid=f"b{k}")))
        assert behind.ahead == first.prefill_tokens and first.ahead == 0
        own.append(first.prefill_tokens)
        for lease in (first, behind):
            assert lease.prefill_tokens is not None and lease.started == NOW
            clock.now = NOW + 0.03 + 50e-6 * (lease.ahead + lease.prefill_tokens)
            lease.first_token()
            lease.finish(Outcome.SUCCESS)
        clock.now = NOW
        if k == 8:
            assert pooled([a.calibration]).per_token is None  # 18 samples: not yet
    assert pooled([a.calibration]).per_token == pytest.approx(50e-6)
    # The first of each pair went with nothing ahead: 24 samples of its own tokens alone.
    unqueued, weights = a.calibration.unqueued, [0.98**k for k in range(23, -1, -1)]
    assert unqueued.n == pytest.approx(sum(weights))
    xy = sum(w * t * (0.03 + 50e-6 * t) for w, t in zip(weights, own, strict=True))
    assert unqueued.through_origin(10) == pytest.approx(
        xy / sum(w * t * t for w, t in zip(weights, own, strict=True))
    )
    seen = a.calibration.observed.n
    unseen = sched.acquire(sched.pick(request("s" * 800, rid="c")))
    unseen.end(Outcome.SUCCESS)  # no first token seen: nothing learnt
    assert a.calibration.observed.n == seen
    a.calibration.prefill.add(1.0, 10_000.0)  # the engine says 100 us
    assert pooled([a.calibration]).per_token == pytest.approx(100e-6)


def test_an_engine_counting_tokens_unlike_this_router_is_priced_in_this_routers_tokens() -> None:
    """The engine's tokenizer counts 1.5 tokens where this router estimates 1 (chars / 4):
    its 100 us an engine token is 150 us a router token, its typical prefill of 1,500
    engine tokens is 1,000 router tokens, and its KV cache of 96,000 engine tokens holds
    64,000 router tokens (1,000 index blocks of 64). Nothing converts before 20 requests
    on both sides."""
    clock = FakeClock(NOW)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    a = sched.registry.get("m", "a:1")
    scorer = sched.routers["m"].scorers[0][0]
    assert a is not None and isinstance(scorer, LatencyScorer)

    def scrape(n: int) -> None:
        """The engine's counters after n finished requests of 1,500 of its tokens."""
        clock.advance(0.1)
        sched.registry.record_scrape(
            "m",
            "a:1",
            replace(
                metrics(prefill_s=n * 1500 * 100e-6, tokens=n * 1500.0, prefills=n),
                prompt_tokens_total=n * 1500.0,
                finished_total=float(n),
                kv_tokens=96_000.0,
            ),
        )

    def send(first: int, count: int) -> None:
        for k in range(first, first + count):
            sched.pick(request(f"{k:06d}" * 666 + "xxxx", rid=f"r{k}"))  # 4,000 chars

    scrape(0)
    send(0, 10)
    scrape(10)
    costs = pooled([a.calibration])
    assert costs.engine_tokens == 1.0  # 10 requests a side: too few
    assert costs.per_token == pytest.approx(100e-6)
    send(10, 14)
    scrape(24)
    costs = pooled([a.calibration])
    assert costs.engine_tokens == pytest.approx(1.5)
    assert costs.per_token == pytest.approx(150e-6)
    assert costs.tokens_per_prefill == pytest.approx(1000.0)
    clock.advance(1.0)  # the scorer re-reads the costs, and the cache size, at most every 0.1 s
    sched.pick(request(rid="last"))
    assert scorer.costs_in_use.per_token == pytest.approx(150e-6)
    assert scorer.index.room("a:1") == 1000 - scorer.index.size("a:1")


def test_the_token_ratio_is_per_request_so_other_clients_traffic_does_not_move_it() -> None:
    """Another router sends the engine twice as many requests of the same mix: the engine's
    totals triple, its tokens per request do not."""
    cal = Calibration()
    cal.on_scrape(replace(metrics(), prompt_tokens_total=0.0, finished_total=0.0))
    cal.sent_tokens, cal.sent_count = 30 * 400.0, 30.0  # this router's: 400 tokens each
    cal.on_scrape(replace(metrics(), prompt_tokens_total=90 * 600.0, finished_total=90.0))
    assert pooled([cal]).engine_tokens == pytest.approx(1.5)
    assert cal.sent_tokens == 0.0 and cal.sent_count == 0.0  # folded in once


def test_the_token_ratio_holds_through_an_idle_spell() -> None:
    """Idle scrapes decayed both sides until too few requests were left: the ratio snapped
    back to 1 after a minute or so of quiet, and the first requests after it were priced
    by 1.0 until 20 more came (found by a review helper)."""
    cal = Calibration()
    page = replace(metrics(), prompt_tokens_total=0.0, finished_total=0.0)
    cal.on_scrape(page)
    cal.sent_tokens, cal.sent_count = 30 * 400.0, 30.0
    page = replace(page, prompt_tokens_total=30 * 600.0, finished_total=30.0)
    cal.on_scrape(page)
    assert pooled([cal]).engine_tokens == pytest.approx(1.5)
    for _ in range(2000):  # 200 s of scrapes every 0.1 s with nothing sent or served
        cal.on_scrape(page)
    assert pooled([cal]).engine_tokens == pytest.approx(1.5)


def test_a_token_ratio_near_one_is_left_at_one() -> None:
    """An engine counting 5 % more tokens than this router estimates (a chat template's
    markers) keeps its published costs; 20 % more converts."""
    for engine_tokens, used in ((420.0, 1.0), (480.0, 1.2)):
        cal = Calibration()
        cal.on_scrape(replace(metrics(), prompt_tokens_total=0.0, finished_total=0.0))
        cal.sent_tokens, cal.sent_count = 30 * 400.0, 30.0
        total = 30 * engine_tokens
        cal.on_scrape(replace(metrics(), prompt_tokens_total=total, finished_total=30.0))
        assert pooled([cal]).engine_tokens == pytest.approx(used)


def test_the_token_ratio_counts_the_requests_that_entered_the_batch() -> None:
    """Engines count prompt tokens as requests enter the batch: 30 did in this window, of
    which 10 finished and 20 still run (the batch grew by 20), 600 engine tokens each."""
    cal = Calibration()
    start = replace(metrics(), prompt_tokens_total=0.0, finished_total=0.0)
    cal.on_scrape(start)
    cal.sent_tokens, cal.sent_count = 30 * 400.0, 30.0
    cal.on_scrape(replace(start, prompt_tokens_total=30 * 600.0, finished_total=10.0,
                          running=20.0))  # fmt: skip
    assert pooled([cal]).engine_tokens == pytest.approx(1.5)


def test_a_full_batch_queues_for_slots_not_for_prefill_work() -> None:
    """Decode-bound: every batch slot is taken (running at its peak) and 3 wait. Each waits
    for a running request to end, one every service / running seconds (2 s / 8), not for
    3 short prefills; with the batch below its peak the waiting count means prefill work."""
    scorer = LatencyScorer()
    full, short, idle = (
        state("a:1", waiting=3, running=8, scraped_at=NOW),
        state("b:1", waiting=3, running=4, scraped_at=NOW),
        state("c:1", waiting=0, running=0, scraped_at=NOW),
    )
    for s in (full, short):
        s.peak_running = 8
        s.calibration.service.add(2.0, 1.0)  # a request holds its slot 2 s
    states = [full, short, idle]
    req = request("hi " * 400)  # 300 tokens
    scores = scorer.score(context(states, request=req, now=NOW), states)
    queue = scorer.terms()["queue_s"]
    assert queue[0] == pytest.approx(3 * 2.0 / 8)
    assert queue[1] == pytest.approx(3 * 300 * PER_TOKEN)  # typical prefill: this one's
    assert scores.index(max(scores)) == 2


def full_home_and_room(*, service: float, room_running: int) -> tuple[EndpointState, EndpointState]:
    """a:1 runs all 8 of its (peak) slots and this router has sent it 4 more since the
    scrape; b:1 runs `room_running`. A running request holds its slot `service` seconds."""
    home = state("a:1", waiting=0, running=8, inflight=12, scraped_at=NOW)
    room = state("b:1", waiting=0, running=room_running, inflight=room_running, scraped_at=NOW)
    for s in (home, room):
        s.peak_running = 8
        s.calibration.service.add(service, 1.0)
    return home, room


def test_requests_beyond_the_batch_wait_for_slots_before_the_engine_shows_them() -> None:
    """The last scrape says a:1 runs 8 of its 8 (peak) slots with none waiting, but this
    router has since sent it 4 more; the history is cached there. Those 4 wait for slots
    (one freed every 2 s / 8) and so would this request: 1 s, more than prefilling the
    history on b:1, which has a slot free (0.4 s, and as much again charged for the
    duplicated work). Without the excess, the cached home wins."""
    scorer = LatencyScorer()
    home, other = full_home_and_room(service=2.0, room_running=7)
    req = request()
    scorer.index.insert(home.id, scorer.index.hashes(req.prompt))
    states = [home, other]
    scores = scorer.score(context(states, request=req, now=NOW), states)
    queue = scorer.terms()["queue_s"]
    assert queue[0] == pytest.approx(4 * 2.0 / 8) and queue[1] == 0.0
    assert scores[1] > scores[0]
    home.inflight = 8
    scores = scorer.score(context(states, request=req, now=NOW), states)
    assert scorer.terms()["queue_s"] == (0.0, 0.0)
    assert scores[0] > scores[1]


def home_or_idle(
    req: RequestInfo,
    *,
    home_queue: float,
    mean_queue: float,
    idle_room: int | None,
    typical: float | None = None,
    owner: str | None = None,
    idle_touched: float = NOW,
    reuse: float | None = None,
) -> str:
    """The prompt is cached on a:1 (its home, `home_queue` s queued); b:1 is idle, its cache
    full of `idle_room` blocks of others (None: no capacity known), last touched at
    `idle_touched`. The fleet's mean queue at the last pick is `mean_queue`; `typical`:
    computed tokens per prefill, if published; `reuse`: seconds after which earlier prompts
    came back to their blocks, if any did. Which one the scorer picks."""
    scorer = LatencyScorer()
    home, idle = state("a:1"), state("b:1")
    if typical is not None:
        for s in (home, idle):
            s.calibration.tokens.add(typical, 1.0)
    if reuse is not None:
        earlier = [-1, -2]  # another prompt's blocks, hit again `reuse` seconds later
        scorer.index.insert("c:1", earlier, now=NOW - 5 - reuse)
        scorer.index.insert("c:1", earlier, now=NOW - 5)
    scorer.index.insert(home.id, scorer.index.hashes(req.prompt), owner, now=NOW)
    if idle_room is not None:
        scorer.index.set_capacity(idle.id, idle_room)
        # Full of other blocks.
        scorer.index.insert(idle.id, list(range(idle_room)), now=idle_touched)
    home.busy_until, idle.busy_until = NOW + home_queue, NOW
    scorer._mean_queue = mean_queue
    states = [home, idle]
    scores = scorer.score(context(states, request=req, now=NOW), states)
    return states[scores.index(max(scores))].id


def test_a_session_moves_off_a_queued_home_when_its_history_fits_in_an_idle_cache() -> None:
    """The fleet holds queues (0.6 s mean at the last pick) and the session's home holds
    1.2 s of them; the other replica is idle. Duplicating the 4,000-token history costs the
    fleet's queue only where requests wait behind it: none wait on the idle replica, and the
    copy becomes the session's second home, so it moves. If that cache is full (the copy
    would evict others' blocks), the fleet's charge stays and so does the session."""
    req = request(session="alice")
    assert home_or_idle(req, home_queue=1.2, mean_queue=0.6, idle_room=None) == "b:1"
    assert home_or_idle(req, home_queue=1.2, mean_queue=0.6, idle_room=40) == "a:1"


def test_a_session_moves_into_an_idle_cache_full_of_blocks_long_unused() -> None:
    """A router that has run a while holds a full index for every replica, mostly of
    traffic long gone. Prompts have come back to their blocks within 2 s; b:1's cache is
    full of blocks last touched 60 s ago: cold, so alice's history takes their place as it
    would free room, and she moves off her queued home. Touched 1 s ago they are in use and
    she stays; with no prompt seen coming back yet, nothing counts as cold."""
    req = request(session="alice")

    def best(touched: float, reuse: float | None = 2.0) -> str:
        return home_or_idle(
            req, home_queue=1.2, mean_queue=0.6, idle_room=200, idle_touched=touched, reuse=reuse
        )

    assert best(touched=NOW - 60) == "b:1"
    assert best(touched=NOW - 1) == "a:1"
    assert best(touched=NOW - 60, reuse=None) == "a:1"
    assert best(touched=NOW - 60, reuse=40.0) == "a:1"  # 60 s is within twice 40


def test_a_shared_document_leaves_a_busy_replica_when_typical_prefills_are_cache_hits() -> None:
    """Sessionless: the 4,000-token document is cached on a:1, which has 1.5 s queued; b:1
    is idle. Most prefills are cache hits (90 computed tokens each), so 0.5 s of mean
    queue reads as ~56 typical requests waiting behind a copy, which would price the 0.4 s
    copy at ~23 s and keep the document on a:1 for ever. The queue is held by long misses:
    counted in requests of this one's size (1.25 of them), the copy costs ~1.3 s, below
    a:1's 1.5 s of queue, and the document moves. A session keeps the typical count (b:1's
    cache is full of other blocks, so its history's copy would not be a free second home)."""

    def best(session: str | None) -> str:
        req = request(session=session)
        return home_or_idle(
            req, home_queue=1.5, mean_queue=0.5, idle_room=40, typical=90.0, owner=session
        )

    assert best(session=None) == "b:1"
    assert best(session="alice") == "a:1"


def test_without_engine_counters_the_typical_prefill_is_this_routers_own() -> None:
    """Engines that publish only gauges: a:1 holds alice's 4,000-token history and reports
    3 requests waiting; b:1 is idle. With nothing known of typical prefills, each waiting
    request counts as this one (0.4 s: 1.2 s of queue) and alice moves. Once this router
    has made picks of 100 uncached tokens, the 3 waiting are ~0.03 s and she stays home."""
    scorer = LatencyScorer()
    home = state("a:1", waiting=3, running=1, scraped_at=NOW)
    idle = state("b:1", waiting=0, scraped_at=NOW)
    states = [home, idle]
    alice = request(session="alice")
    scorer.index.insert(home.id, scorer.index.hashes(alice.prompt), "alice")

    def best() -> str:
        scores = scorer.score(context(states, request=alice, now=NOW), states)
        return states[scores.index(max(scores))].id

    assert best() == "b:1"
    other = [state("c:1")]  # the earlier picks: short prompts, one a second (no queue left)
    for i in range(20):
        ctx = context(other, request=request("word " * 80, rid=f"w{i}"), now=NOW - 20 + i)
        scorer.score(ctx, other)
        scorer.observe(ctx, other[0])
    assert best() == "a:1"


def test_without_a_session_a_token_costs_what_first_tokens_show_it_drains_in() -> None:
    """The engines' ratio says 200 us a prefill token (each prefill carries a whole step);
    the first tokens this router saw drained 20 us a token. The 4,000-token prompt is
    cached on a:1, whose batch is full with 4 more requests waiting for slots (0.5 s);
    b:1 has room. Without a session the copy costs 4,000 x 20 us = 0.08 s (and as much
    again charged for the work): it moves. A session's history is priced at the ratio,
    0.8 s: its later turns would pay for a move, so it stays."""

    def pick(session: str | None) -> tuple[str, float]:
        scorer = LatencyScorer()
        home, room = full_home_and_room(service=1.0, room_running=4)
        for s in (home, room):
            s.calibration.prefill.add(0.2, 1000.0)
        for k in range(30):  # (tokens ahead + own, seconds to the first token)
            tokens = 500.0 + 100.0 * k
            home.calibration.observed.add(tokens, 0.005 + 20e-6 * tokens)
        req = request(session=session)
        scorer.index.insert(home.id, scorer.index.hashes(req.prompt), session)
        states = [home, room]
        scores = scorer.score(context(states, request=req, now=NOW), states)
        return states[scores.index(max(scores))].id, scorer.terms()["prefill_s"][1]

    assert pooled([]).observed is None
    best, copy = pick(session=None)
    assert best == "b:1" and copy == pytest.approx(4000 * 20e-6)
    best, copy = pick(session="alice")
    assert best == "a:1" and copy == pytest.approx(4000 * 200e-6)


def test_without_first_tokens_a_token_costs_what_it_adds_to_the_engines_prefills() -> None:
    """Behind Envoy without response bodies there are no first tokens to fit; the engines'
    own prefill seconds net of the step each shares say 20 us a token where their ratio
    says 200 (most prefills there were cache hits that still waited out a step). The case
    of the test above: the sessionless copy is priced at 20 us a token and moves; a
    session's history keeps the ratio and stays."""

    def pick(session: str | None) -> tuple[str, float]:
        scorer = LatencyScorer()
        home, room = full_home_and_room(service=1.0, room_running=4)
        for s in (home, room):
            s.calibration.prefill.add(0.2, 1000.0)
            s.calibration.net.add(0.02, 1000.0)
        req = request(session=session)
        scorer.index.insert(home.id, scorer.index.hashes(req.prompt), session)
        states = [home, room]
        scores = scorer.score(context(states, request=req, now=NOW), states)
        assert scorer.costs_in_use.observed is None
        return states[scores.index(max(scores))].id, scorer.terms()["prefill_s"][1]

    best, copy = pick(session=None)
    assert best == "b:1" and copy == pytest.approx(4000 * 20e-6)
    best, copy = pick(session="alice")
    assert best == "a:1" and copy == pytest.approx(4000 * 200e-6)


def test_a_prompt_that_does_not_fit_in_free_kv_memory_waits_for_running_requests_to_end() -> None:
    """a:1 holds alice's 4,000-token history but 85 % of its 12,000-token KV cache is
    taken by 3 running requests (3,400 tokens each; below the 90 % "full" mark and below
    its peak batch, so neither older rule sees a wait). Admission needs 4,000 tokens of
    the 1,800 free: one running request must end first, one every 3 s / 3 = 1 s, more than
    prefilling the history on b:1 (0.4 s, and as much again charged for the work), so she
    moves. One request waiting ahead needs a typical prefill's memory too (this one's, none
    being published): two must end (2 s). With half the cache free the prompt fits and she
    stays home."""
    scorer = LatencyScorer()
    home = state("a:1", waiting=0, running=3, kv=0.85, inflight=3, scraped_at=NOW)
    room = state("b:1", waiting=0, running=1, kv=0.2, inflight=1, scraped_at=NOW)
    for s in (home, room):
        s.peak_running = 8
        s.calibration.service.add(3.0, 1.0)
        s.calibration.kv_tokens = 12_000.0
    alice = request(session="alice")
    scorer.index.insert(home.id, scorer.index.hashes(alice.prompt), "alice")
    states = [home, room]

    def best() -> str:
        scores = scorer.score(context(states, request=alice, now=NOW), states)
        return states[scores.index(max(scores))].id

    assert best() == "b:1"
    queue = scorer.terms()["queue_s"]
    assert queue[0] == pytest.approx(1.0) and queue[1] == 0.0
    assert home.metrics is not None
    home.metrics = replace(home.metrics, waiting=1.0)
    best()
    assert scorer.terms()["queue_s"][0] == pytest.approx(2.0)
    home.metrics = replace(home.metrics, waiting=0.0, kv_usage=0.5)
    assert best() == "a:1"
    assert scorer.terms()["queue_s"][0] == 0.0


def test_the_step_taken_out_of_each_prefill_is_the_decode_step_not_the_stalled_mean() -> None:
    """Windows where prefill chunks stalled the decodes read 100 ms a step; the decode step
    is 20 ms. The mean step follows the stalls; the step taken out of each prefill follows
    the fastest window down at once and a slower one up by 1 % of the gap a scrape."""
    cal = Calibration()
    cal.on_scrape(metrics())
    total = 0.0
    for k, per_step in enumerate((0.02, 0.1, 0.1, 0.1), start=1):
        total += 100 * per_step
        cal.on_scrape(metrics(steps=100 * k, step_s=total))
    assert cal.step.value is not None and cal.step.value > 0.05
    assert cal.floor == pytest.approx(0.02 + 0.08 * (1 - 0.99**3))
    total += 100 * 0.01
    cal.on_scrape(metrics(steps=500, step_s=total))
    assert cal.floor == pytest.approx(0.01)
    cal.on_scrape(metrics(steps=501, step_s=total + 0.001))  # a lone step: ignored
    assert cal.floor == pytest.approx(0.01)


def test_an_ended_requests_first_token_count_does_not_close_a_later_prefill() -> None:
    """Behind Envoy without response bodies a request that ended before the next scrape was
    closed at its end; the engine's count of its first token then closed the next open
    prefill, one not even started, and the queue term forgot it. Found by a review helper."""
    clock = FakeClock(NOW)
    sched, a, _ = _one_endpoint(clock)
    _scrape_first_tokens(sched.registry, 0.0)
    warm = sched.acquire(sched.pick(request("w" * 400, rid="w")))
    clock.advance(0.05)
    warm.end(Outcome.SUCCESS)  # no first token seen: this edge sees none
    _scrape_first_tokens(sched.registry, 1.0)
    assert a.counts_first_tokens and a.counted_prefill == 0.0
    short = sched.acquire(sched.pick(request("a" * 400, rid="a")))
    long_decision = sched.pick(request("b" * 64000, rid="b"))
    long_lease = sched.acquire(long_decision)
    for _ in range(3):  # more requests arrive (and end) before the scrape
        sched.acquire(sched.pick(request("c" * 400, rid="c"))).end(Outcome.FAILURE)
    clock.advance(0.05)
    short.end(Outcome.SUCCESS)
    _scrape_first_tokens(sched.registry, 2.0)  # the one first token: the short request's
    assert long_decision.prefill_tokens is not None
    assert a.counted_prefill == pytest.approx(long_decision.prefill_tokens)
    assert long_lease.prefill is not None and long_lease.prefill.open


def _with_speed(address: str, step: float, per_token: float, service: float) -> EndpointState:
    s = state(address)
    s.calibration.floor = step
    s.calibration.prefill_long.add(per_token * 10_000, 10_000)
    s.calibration.service.add(service, 1.0)
    return s


@pytest.mark.parametrize(
    ("published", "inflight", "expect"),
    [
        # milliseconds for seconds (1000x): 2 beyond its 8 slots, one freed each 4 s / 8
        (2000.0, 10, lambda q: q < 10.0),
        # 0 s: its full batch (32 beyond its slots) read as freeing slots at once
        (0.0, 40, lambda q: q > 1.0),
    ],
    ids=["1000x", "zero"],
)
def test_a_slower_replicas_own_time_in_batch_is_checked_as_the_pooled_one(
    published: float, inflight: int, expect: Callable[[float], bool]
) -> None:
    """A replica at or past speed_band took its own published time in batch unchecked (the
    pooled value leaves one 10x off out): 500 s of slot wait, or none with 32 waiting.
    Found by a review helper."""
    fleet = [_with_speed(f"{c}:1", 0.02, 100e-6, 2.0) for c in "abc"]
    odd = _with_speed("d:1", 0.04, 200e-6, published)
    states = [*fleet, odd]
    for s in states:
        s.peak_running = 8.0
        s.inflight = 4
    odd.inflight = inflight
    scorer = LatencyScorer(speed_band=1.5)
    req = RequestInfo("m", "r", prompt="word " * 800, prompt_tokens=1000)
    scorer.score(context(states, request=req, now=NOW), states)
    queue = scorer.terms()["queue_s"][3]
    assert expect(queue), queue


def test_a_replica_whose_metrics_fail_does_not_draw_a_burst_behind_envoy() -> None:
    """Behind Envoy without body events, with engines that count first tokens: the queue
    was the prefill counted since the last good scrape less the time since that scrape.
    While one replica's /metrics failed, that time grew without bound and erased every
    prefill sent there, so its queue read 0 and a burst of 40 new sessions sent it 34.
    Without a fresh count, time drains the work, as on engines that count none. Found by
    a review helper."""
    n, burst = 4, 40
    clock = FakeClock()
    cfg = config({"m": static_model(n)}, seed=1)
    registry = Registry(clock=clock, staleness=cfg.scrape.staleness)
    scheduler = Scheduler(cfg, registry)
    ids = [s.id for s in registry.states("m")]
    counts = dict.fromkeys(ids, 0.0)

    def scrape(endpoint: str) -> None:
        counts[endpoint] += 1  # the engine's first-token count grows as it serves
        metrics = EngineMetrics(waiting=0, running=0, kv_usage=0.0, ttft_count=counts[endpoint])
        registry.record_scrape("m", endpoint, metrics)

    rng = random.Random(1)

    def chat(i: int) -> RequestInfo:
        text = "".join(rng.choices("abcdefghij ", k=2000))
        return build_request(
            cfg,
            {"content-type": "application/json", "x-session-id": f"s{i}"},
            "/v1/chat/completions",
            orjson.dumps(
                {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": text}],
                }
            ),
            request_id=f"r{i}",
        )

    for endpoint in ids:
        scrape(endpoint)
    leases = [scheduler.acquire(scheduler.pick(chat(1000 + k))) for k in range(n)]
    clock.advance(0.05)
    for lease in leases:  # ended without a first token seen (Envoy, no body events)
        lease.end(Outcome.SUCCESS)
    for _ in range(2):
        clock.advance(0.1)
        for endpoint in ids:
            scrape(endpoint)
    broken = ids[0]
    for _ in range(30):  # 3 s of scrapes: the first replica's all fail
        clock.advance(0.1)
        registry.record_scrape_error("m", broken, "HTTP 500")
        for endpoint in ids[1:]:
            scrape(endpoint)
    got = dict.fromkeys(ids, 0)
    for i in range(burst):  # 2 ms apart: within one scrape interval
        decision = scheduler.pick(chat(i))
        scheduler.acquire(decision)
        got[decision.endpoint.id] += 1
        clock.advance(0.002)
    assert got[broken] <= 2 * burst / n, got


@pytest.mark.parametrize(
    ("extra", "reads", "salt"),
    [
        ({}, True, None),
        ({"prompt_logprobs": 0}, False, None),
        ({"skip_reading_prefix_cache": True}, False, None),
        ({"cache_salt": "tenant-b"}, True, "tenant-b"),
    ],
)
def test_the_body_says_whether_and_under_which_salt_the_engine_reads_its_cache(
    extra: dict[str, object], reads: bool, salt: str | None
) -> None:
    cfg = config({"m": static_model(1)})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    info = build_request(cfg, {}, "/v1/chat/completions", body)
    assert (info.reads_cache, info.cache_salt) == (reads, salt)
    completion = {"model": "m", "prompt": "hi", "echo": True, "logprobs": 1}
    assert not build_request(cfg, {}, "/v1/completions", orjson.dumps(completion)).reads_cache


def test_requests_that_read_no_cache_or_another_salt_are_credited_no_hits() -> None:
    """vLLM reads no cache for prompt logprobs or `skip_reading_prefix_cache`, and a salted
    request reuses only blocks computed under its salt: credited the history's hits, such
    a request was kept on a busy home that had nothing for it (found by a review helper)."""
    scorer = LatencyScorer()
    states = [state("a:1"), state("b:1")]
    home = context(states, request=request(session="s"), now=NOW)
    scorer.score(home, states)
    scorer.observe(home, states[0])  # the history is cached on a:1
    states[0].busy_until = NOW  # its prefill done

    def cached(req: RequestInfo) -> tuple[float, ...]:
        scorer.score(context(states, request=req, now=NOW), states)
        return scorer.terms()["cached_tokens"]

    assert cached(request(session="s", rid="2"))[0] > 0
    plain = request(session="s", rid="3")
    assert cached(replace(plain, reads_cache=False)) == (0.0, 0.0)
    salted = context(states, request=replace(plain, request_id="4", cache_salt="t1"), now=NOW)
    scorer.score(salted, states)
    assert scorer.terms()["cached_tokens"] == (0.0, 0.0)
    scorer.observe(salted, states[1])  # computed under salt t1 on b:1
    assert cached(replace(plain, request_id="5", cache_salt="t1"))[1] > 0  # the same salt hits
    assert cached(replace(plain, request_id="6", cache_salt="t2")) == (0.0, 0.0)
