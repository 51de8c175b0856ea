"""The step in progress: where the edge sees a stream's tokens (the proxy, Envoy with
response bodies), each one marks the end of an engine step there, and a request sent to a
busy engine starts with its next step. The latency scorer's `step_s` adds what is left of
the step in progress: a step's length less the time since the last token, half a step
where no token was seen within one, nothing on an idle engine."""

from __future__ import annotations

import pytest

from llmgw.gateway import Gateway
from llmgw.lifecycle import Lifecycle
from llmgw.registry import EndpointState, Registry
from llmgw.scheduling.scheduler import ModelRouter, Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.types import Decision, Outcome

from .helpers import FakeClock, config, context, state, static_model
from .test_scheduling_latency import NOW, STEP, request

CHAT = "/v1/chat/completions"
STREAMED = b'{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'


def publishing(s: EndpointState) -> EndpointState:
    """The engine publishes its step (20 ms at a batch of one): the phase has a length."""
    s.calibration.step.add(10 * STEP, 10.0)
    return s


def test_a_busy_engine_about_to_end_its_step_starts_the_request_sooner() -> None:
    scorer = LatencyScorer()
    a = publishing(state("a:1", waiting=0, running=4, scraped_at=NOW))
    b = publishing(state("b:1", waiting=0, running=4, scraped_at=NOW))
    a.token_at = NOW  # a step has just begun on a
    b.token_at = NOW - 0.015  # b's is 15 of its 20 ms through
    states = [a, b]
    scores = scorer.score(context(states, request=request(), now=NOW), states)
    step = scorer.terms()["step_s"]
    assert step[0] - step[1] == pytest.approx(0.015)
    assert scores[1] > scores[0]
    b.token_at = NOW - 0.001  # now a's step ends sooner (a token 1 ms ago on b)
    a.token_at = NOW - 0.019
    scores = scorer.score(context(states, request=request(), now=NOW), states)
    assert scores[0] > scores[1]


def test_step_phase_false_never_reads_the_step_in_progress() -> None:
    """`step_phase: false` (a hop that batches the streams' chunks): the two engines, one
    about to end its step and one just begun, are priced alike, at one step each."""
    scorer = LatencyScorer(step_phase=False)
    a = publishing(state("a:1", waiting=0, running=4, scraped_at=NOW))
    b = publishing(state("b:1", waiting=0, running=4, scraped_at=NOW))
    a.token_at, b.token_at = NOW, NOW - 0.015
    states = [a, b]
    scorer.score(context(states, request=request(), now=NOW), states)
    assert not scorer.step_phase
    step = scorer.terms()["step_s"]
    assert step[0] == pytest.approx(step[1])
    assert step[0] == pytest.approx(STEP * (1 + 4 * scorer.batch_factor))


def test_step_phase_is_a_strategy_param() -> None:
    strategy = {"scorers": {"latency": {"params": {"step_phase": False}}}}
    router = ModelRouter(
        "chat", config({"chat": static_model(1, strategy=strategy)}).models["chat"]
    )
    latency = next(s for s, _ in router.scorers if isinstance(s, LatencyScorer))
    assert latency.read_phase is False


def test_an_idle_engine_has_no_step_in_progress_and_an_unseen_one_half_of_one() -> None:
    scorer = LatencyScorer()
    idle = publishing(state("a:1", waiting=0, running=0, scraped_at=NOW))
    idle.token_at = NOW - 0.005  # its last stream ended: nothing runs there now
    unseen = publishing(state("b:1", waiting=0, running=4, scraped_at=NOW))  # others' traffic
    stale = publishing(state("c:1", waiting=0, running=4, scraped_at=NOW))
    stale.token_at = NOW - 1.0  # longer ago than a step: the phase is not known
    seen = publishing(state("d:1", waiting=0, running=4, scraped_at=NOW))
    seen.token_at = NOW - 0.005
    states = [idle, unseen, stale, seen]
    scorer.score(context(states, request=request(), now=NOW), states)
    step = scorer.terms()["step_s"]
    at_load = step[0] + 4 * STEP * scorer.batch_factor  # one step at a batch of four
    assert step[0] == pytest.approx(STEP)
    assert step[1] == pytest.approx(at_load + STEP / 2)
    assert step[2] == pytest.approx(at_load + STEP / 2)
    assert step[3] == pytest.approx(at_load + STEP - 0.005)


def phase_gateway() -> tuple[FakeClock, Registry, Gateway]:
    clock = FakeClock()
    registry = Registry(clock=clock)
    cfg = config({"chat": {**static_model(1), "strategy": "latency"}})
    return clock, registry, Gateway(Scheduler(cfg, registry, seed=1))


def test_each_chunk_of_a_streamed_answer_marks_a_step_end_on_its_endpoint() -> None:
    clock, registry, gw = phase_gateway()
    stream = Lifecycle(gw)
    decision = stream.route({}, CHAT, STREAMED)
    assert isinstance(decision, Decision)
    endpoint = registry.get("chat", decision.endpoint.id)
    assert endpoint is not None and endpoint.token_at == float("-inf")
    stream.response(200)
    clock.advance(0.04)
    stream.body_chunk(b"data: {}\n\n")  # the first token (after prefill) is a step's end too
    assert endpoint.token_at == clock()
    clock.advance(0.02)
    stream.body_chunk(b"data: {}\n\n")
    assert endpoint.token_at == clock()
    stream.finish()
    ended = clock()
    clock.advance(0.02)
    stream.body_chunk(b"data: {}\n\n")  # a chunk after the end (a late duplicate) is no token
    assert endpoint.token_at == ended


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, STREAMED.replace(b"true", b"false")),  # the whole answer at once
        (500, STREAMED),  # an error's body
    ],
)
def test_chunks_of_an_answer_that_is_not_a_token_stream_mark_nothing(
    status: int, body: bytes
) -> None:
    clock, registry, gw = phase_gateway()
    answer = Lifecycle(gw)
    decision = answer.route({}, CHAT, body)
    assert isinstance(decision, Decision)
    endpoint = registry.get("chat", decision.endpoint.id)
    assert endpoint is not None
    answer.response(status)
    for _ in range(3):
        clock.advance(0.01)
        answer.body_chunk(b"data: {}\n\n")
    assert endpoint.token_at == float("-inf")
    answer.finish(Outcome.SUCCESS)


def test_without_a_published_step_there_is_no_phase() -> None:
    """The params' step is a guess: a phase read against it is wrong as often as right
    (engines publishing no metrics lost up to 1.6x on shared documents)."""
    scorer = LatencyScorer()
    a = state("a:1", waiting=0, running=4, scraped_at=NOW)
    b = state("b:1", waiting=0, running=4, scraped_at=NOW)
    a.token_at = NOW - 0.019
    states = [a, b]
    scorer.score(context(states, request=request(), now=NOW), states)
    step = scorer.terms()["step_s"]
    assert step[0] == step[1] == pytest.approx(STEP * (1 + 4 * scorer.batch_factor))
