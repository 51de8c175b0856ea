"""The latency scorer on replicas of unequal speed: an endpoint whose engine runs slower than
the fastest's is priced at that multiple."""

from __future__ import annotations

import pytest

from llmgw.calibration import Calibration, pooled
from llmgw.registry import EndpointState
from llmgw.scheduling.scorers import LatencyScorer, slower_endpoints
from llmgw.types import EngineMetrics, RequestInfo

from .helpers import context, state

NOW = 10.0
PROMPT = "word " * 800  # 4,000 chars: 1,000 tokens


def request(session: str | None = None) -> RequestInfo:
    return RequestInfo("m", "r", session_key=session, prompt=PROMPT, prompt_tokens=1000)


def with_speed(address: str, step: float | None, per_token: float = 100e-6) -> EndpointState:
    """An endpoint whose engine steps `step` s at best and prefills at `per_token` s a token."""
    s = state(address)
    s.calibration.floor = step
    s.calibration.prefill_long.add(per_token * 10_000, 10_000)
    return s


def test_only_endpoints_slower_by_both_signals_count_as_slower() -> None:
    states = [
        with_speed("a:1", 0.020),
        with_speed("b:1", 0.026, per_token=130e-6),  # 1.3x: within the band
        with_speed("c:1", 0.045, per_token=200e-6),
        with_speed("d:1", None),  # publishes no time between tokens
        with_speed("e:1", 0.080, per_token=110e-6),  # stalled steps, prefill at full speed
    ]
    # The lesser of the two multiples: c's step 2.25x, its prefill 2x.
    assert slower_endpoints(states, 1.5) == {"c:1": pytest.approx(2.0)}
    assert slower_endpoints(states, 1.25) == {"b:1": pytest.approx(1.3), "c:1": pytest.approx(2.0)}
    assert slower_endpoints(states[:1], 1.5) == {}  # nothing to compare with
    assert slower_endpoints(states[3:4], 1.5) == {}


def _scores(scorer: LatencyScorer, states: list[EndpointState], req: RequestInfo) -> list[float]:
    return scorer.score(context(states, request=req, now=NOW), states)


def test_a_slower_endpoint_is_priced_at_its_multiple() -> None:
    states = [with_speed("a:1", 0.02), with_speed("b:1", 0.04, per_token=200e-6)]
    scorer = LatencyScorer(speed_band=1.5)
    scores = _scores(scorer, states, request())
    terms = scorer.terms()
    assert terms["prefill_s"][1] == pytest.approx(2 * terms["prefill_s"][0])
    assert terms["step_s"][1] == pytest.approx(2 * terms["step_s"][0])
    assert scores[0] == 1.0 and scores[1] < 1.0
    # Off: both priced alike.
    same = LatencyScorer(speed_band=0)
    _scores(same, states, request())
    assert same.terms()["prefill_s"][0] == same.terms()["prefill_s"][1]


def test_a_history_stays_on_a_slower_home_when_moving_costs_more() -> None:
    home, other = with_speed("b:1", 0.04, per_token=200e-6), with_speed("a:1", 0.02)
    states = [other, home]
    scorer = LatencyScorer(speed_band=1.5)
    req = request(session="alice")
    scorer.index.insert(home.id, scorer.index.hashes(req.prompt), "alice")
    scores = _scores(scorer, states, req)
    assert scores[1] == 1.0  # 2x the step of a cached prompt < the whole prefill elsewhere


def test_work_queued_on_a_slower_endpoint_drains_at_its_speed() -> None:
    states = [with_speed("a:1", 0.02), with_speed("b:1", 0.04, per_token=200e-6)]
    for s in states:
        s.reports_first_token = True
        s.pending_prefill = 2000.0  # tokens sent there, no first token yet
    scorer = LatencyScorer(speed_band=1.5)
    _scores(scorer, states, request())
    queue = scorer.terms()["queue_s"]
    assert queue[1] == pytest.approx(2 * queue[0]) and queue[0] > 0


def test_a_slower_endpoints_slots_free_at_its_own_pace() -> None:
    """More requests than its batch holds: the excess waits for slots, one freed every time
    in batch / slots seconds; a slower replica's own time in batch, not the model's."""
    fast, slow = with_speed("a:1", 0.02), with_speed("b:1", 0.04, per_token=200e-6)
    fast.calibration.service.add(1.6, 1.0)
    slow.calibration.service.add(3.2, 1.0)
    states = [fast, slow]
    for s in states:
        s.inflight, s.peak_running = 10, 8.0
    scorer = LatencyScorer(speed_band=1.5)
    _scores(scorer, states, request())
    queue = scorer.terms()["queue_s"]
    assert queue[1] == pytest.approx(2 * 3.2 / 8)
    assert queue[0] == pytest.approx(2 * 2.4 / 8)  # the model's: both endpoints' pooled


def test_a_slower_endpoints_waiting_queue_is_the_longer_of_its_two_estimates() -> None:
    """Two waiting on a full engine: each a typical prefill at its multiple (2 x 0.1 s), or
    one running request ending every 1.2 s / 8: the longer, 0.4 s."""
    fast, slow = with_speed("a:1", 0.02), with_speed("b:1", 0.04, per_token=200e-6)
    slow.calibration.service.add(1.2, 1.0)
    for s in (fast, slow):
        s.metrics = EngineMetrics(waiting=2.0, running=8.0, kv_usage=0.5)
        s.scraped_at, s.peak_running = NOW, 8.0
    scorer = LatencyScorer(speed_band=1.5)
    _scores(scorer, [fast, slow], request())
    assert scorer.terms()["queue_s"][1] == pytest.approx(2 * 2 * 1000 * 100e-6)


def test_a_full_fast_replica_loses_to_a_slow_one_with_room_once_its_batch_is_known() -> None:
    """The fast replica runs all 8 slots of its batch (this router's 8 requests), the 2x
    slower one 6: this request would wait there for a slot, one freed every 3.6 s / 8 (the
    model's time in batch, both endpoints' pooled), more than twice the slow one's step. Until the fast one's peak is known to be its
    batch (seen full with requests waiting), a full batch could still have room, and the
    faster step wins."""
    fast, slow = with_speed("a:1", 0.02), with_speed("b:1", 0.04, per_token=200e-6)
    fast.calibration.service.add(2.4, 1.0)
    slow.calibration.service.add(4.8, 1.0)
    fast.inflight, slow.inflight = 8, 6
    for s in (fast, slow):
        s.peak_running = 8.0
    states = [fast, slow]
    short = RequestInfo("m", "r", prompt="word " * 40, prompt_tokens=50)
    scorer = LatencyScorer(speed_band=1.5)
    scores = _scores(scorer, states, short)
    assert scorer.terms()["queue_s"] == (0.0, 0.0) and scores[0] > scores[1]
    fast.peak_is_batch = slow.peak_is_batch = True
    scores = _scores(scorer, states, short)
    queue = scorer.terms()["queue_s"]
    assert queue[0] == pytest.approx(3.6 / 8) and queue[1] == 0.0
    assert scores[1] > scores[0]


# -- engines that publish no speed: this router's own first tokens -------------------------
def first_tokens(
    address: str, per_token: float, samples: int = 12, queued_extra: float = 0.0
) -> EndpointState:
    """An endpoint that publishes nothing, whose first tokens took a step (250 tokens' worth:
    5 ms at 20 us) + `per_token` a token with nothing ahead of them, and the 1,000 tokens
    ahead plus `queued_extra` s (batch slots waited for) more when sent behind those."""
    s = state(address)
    for k in range(samples):
        tokens = 200.0 + 100.0 * k
        s.calibration.saw_first_token(0.0, tokens, per_token * (250.0 + tokens))
        s.calibration.saw_first_token(1000.0, tokens, per_token * (1250.0 + tokens) + queued_extra)
    return s


def test_without_engine_speeds_first_tokens_show_a_slower_endpoint() -> None:
    states = [
        first_tokens("a:1", 20e-6),
        first_tokens("b:1", 22e-6),
        first_tokens("c:1", 40e-6),  # 2x slower hardware
        first_tokens("d:1", 33e-6),  # 1.6x: too near to tell from load
    ]
    found = slower_endpoints(states, 1.5)
    assert set(found) == {"c:1"} and found["c:1"] == pytest.approx(2.0, rel=0.05)
    # The engines' own signals win where at least two endpoints publish them.
    for s in states[:2]:
        s.calibration.floor = 0.02
        s.calibration.prefill_long.add(1.0, 10_000.0)
    assert slower_endpoints(states, 1.5) == {}


def test_a_busy_endpoint_is_not_read_as_slower_nor_one_seen_too_little() -> None:
    """b's requests sent behind others waited 0.3 s more for batch slots (hot sessions held
    them); its requests sent with nothing ahead ran as fast as a's: equal. c is 2x slower
    but has shown 8 first tokens of each kind, too few to say."""
    states = [
        first_tokens("a:1", 20e-6),
        first_tokens("b:1", 20e-6, queued_extra=0.3),
        first_tokens("c:1", 40e-6, samples=4),
    ]
    assert slower_endpoints(states, 1.5) == {}
    late = first_tokens("c:1", 40e-6, samples=12)
    assert slower_endpoints([*states[:2], late], 1.5) == {"c:1": pytest.approx(2.0, rel=0.05)}


def test_a_slower_endpoints_first_tokens_stay_out_of_the_cost_it_is_priced_a_multiple_of() -> None:
    """No engine publishes a prefill cost: a token costs what the fast endpoints' first tokens
    show (20 us), and the slow one is priced at its multiple of that (not of a fit that
    half-counts its own)."""
    states = [first_tokens("a:1", 20e-6), first_tokens("b:1", 20e-6), first_tokens("c:1", 40e-6)]
    scorer = LatencyScorer(speed_band=1.5)
    _scores(scorer, states, request())
    assert scorer.costs_in_use.per_token == pytest.approx(20e-6, rel=0.01)
    prefill = scorer.terms()["prefill_s"]
    assert prefill[0] == pytest.approx(1000 * 20e-6, rel=0.01)
    assert prefill[2] == pytest.approx(2 * prefill[0], rel=0.05)


def test_first_tokens_of_one_prompt_size_give_no_per_token_cost() -> None:
    """Requests of one size sent with nothing pending ahead (a templated workload, a fixed
    -length benchmark, at low load) say nothing about seconds per token: every sample has
    the same x, and `_slope` means to answer None there (`spread <= 0`). In floats,
    n x sum(x^2) - sum(x)^2 is a rounding residue (+-2^-k), not 0, and the slope of noise
    over it is taken as the model's cost: 61-366 us a token at 993-1039 tokens, by the
    prompt's size, for engines that publish no prefill cost (the `per_token` every prefill
    and queue is priced at), and as `observed` for requests without a session."""
    ys = [0.12 + 0.001 * ((k * 7) % 5 - 2) for k in range(30)]
    invented = {}
    for tokens in (997.0, 999.0, 1018.0, 1036.0):
        cals = [Calibration(), Calibration()]
        for k in range(15):
            for j, cal in enumerate(cals):
                cal.saw_first_token(0.0, tokens, ys[2 * k + j])
        costs = pooled(cals)
        if costs.per_token is not None or costs.observed is not None:
            invented[tokens] = costs.per_token
    assert invented == {}, f"seconds per token fitted to one x: {invented}"
