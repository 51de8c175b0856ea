"""Lifecycle: one request from pick to outcome, without a network (both edges drive it)."""

from __future__ import annotations

import logging
import random

import pytest

from llmgw.breaker import BreakerState
from llmgw.errors import ConfigError, LlmgwError, ModelNotReady
from llmgw.gateway import Gateway
from llmgw.lifecycle import AwaitActivation, Hooks, Lifecycle, debug_summary
from llmgw.registry import EndpointState, Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, EngineMetrics, Outcome

from .helpers import FakeClock, config, static_model

CHAT = "/v1/chat/completions"
HEADERS = {"x-llmgw-model": "chat", "x-session-id": "s1"}
LAZY = {"launch": {"command": "true {port}"}, "scaling": {"min": 0, "max": 1}}
LAZY_ADDRESS = "127.0.0.1:9"


class FakeActivation:
    """Records what the lifecycle asks of the on-demand side; `start()` plays the control plane."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.uses: list[tuple[str, str]] = []

    def manages(self, model: str) -> bool:
        return model == "lazy"

    def use_begin(self, model: str) -> None:
        self.uses.append(("begin", model))

    def use_end(self, model: str) -> None:
        self.uses.append(("end", model))

    async def ensure_ready(self, model: str) -> None:
        self.start()

    def start(self) -> None:
        self.registry.set_endpoints("lazy", [Endpoint(LAZY_ADDRESS, "lazy")])


class CountingScheduler(Scheduler):
    picks = 0

    def pick(self, request: object) -> Decision:
        self.picks += 1
        return super().pick(request)  # type: ignore[arg-type]


def gateway(
    models: dict[str, object] | None = None, *, on_demand: bool = False
) -> tuple[Gateway, CountingScheduler, FakeActivation | None]:
    cfg = config(models or {"chat": static_model(4), "lazy": LAZY})
    registry = Registry(clock=FakeClock())
    scheduler = CountingScheduler(cfg, registry, seed=1)
    activation = FakeActivation(registry) if on_demand else None
    return Gateway(scheduler, activation=activation), scheduler, activation


def inflight(gw: Gateway, model: str = "chat") -> dict[str, int]:
    return {s.id: s.inflight for s in gw.scheduler.registry.states(model)}


def test_static_request_is_picked_leased_and_finished_once() -> None:
    gw, _, _ = gateway()
    outcomes: list[tuple[str, Outcome]] = []
    lifecycle = Lifecycle(gw, Hooks(outcome=lambda _m, e, o: outcomes.append((e, o))))
    decision = lifecycle.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision)
    assert inflight(gw)[decision.endpoint.id] == 1
    lifecycle.response(200)
    lifecycle.finish()
    lifecycle.finish(Outcome.FAILURE)  # a stream closing after the response ended
    assert outcomes == [(decision.endpoint.id, Outcome.SUCCESS)]
    assert set(inflight(gw).values()) == {0}


def test_on_demand_model_is_picked_once_before_and_once_after_the_wait() -> None:
    gw, scheduler, activation = gateway(on_demand=True)
    assert activation is not None
    lifecycle = Lifecycle(gw)
    pending = lifecycle.route({"x-llmgw-model": "lazy"}, CHAT, None)
    assert pending == AwaitActivation("lazy") and scheduler.picks == 1
    activation.start()  # what the runtime driver awaits
    decision = lifecycle.activated()
    assert isinstance(decision, Decision) and decision.endpoint.address == LAZY_ADDRESS
    assert scheduler.picks == 2
    assert activation.uses == [("begin", "lazy")]  # the model is kept alive while in use
    lifecycle.finish(Outcome.SUCCESS)
    assert activation.uses == [("begin", "lazy"), ("end", "lazy")]


def test_a_router_bug_at_the_pick_after_the_wait_is_a_500_not_a_raise() -> None:
    """As at the first pick: the edge answers the client's request (Envoy would otherwise
    see the ext_proc stream die, the proxy a crash)."""
    gw, scheduler, activation = gateway(on_demand=True)
    assert activation is not None
    lifecycle = Lifecycle(gw)
    assert lifecycle.route({"x-llmgw-model": "lazy"}, CHAT, None) == AwaitActivation("lazy")
    activation.start()

    def broken(request: object) -> Decision:
        raise KeyError("bug")

    scheduler.pick = broken  # type: ignore[method-assign]
    error = lifecycle.activated()
    assert isinstance(error, LlmgwError) and error.status == 500
    assert "router error: KeyError" in str(error)
    assert activation.uses == []  # nothing dispatched: nothing kept in use


def test_not_ready_model_without_activation_is_an_error_not_a_wait() -> None:
    gw, _, _ = gateway()
    errors: list[LlmgwError] = []
    result = Lifecycle(gw, Hooks(error=errors.append)).route({"x-llmgw-model": "lazy"}, CHAT, None)
    assert isinstance(result, ModelNotReady) and errors == [result]


def test_envoy_fallback_charges_the_host_that_answered() -> None:
    gw, _, _ = gateway()
    outcomes: list[tuple[str, Outcome]] = []
    lifecycle = Lifecycle(gw, Hooks(outcome=lambda _m, e, o: outcomes.append((e, o))))
    decision = lifecycle.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision) and len(decision.fallbacks) == 2
    second = decision.fallbacks[1]
    lifecycle.answered_by(second.address)
    lifecycle.answered_by(second.address)  # the same news twice changes nothing
    assert lifecycle.endpoint == second
    assert inflight(gw)[second.id] == 1 and inflight(gw)[decision.endpoint.id] == 0
    lifecycle.response(200)
    lifecycle.finish()
    assert outcomes == [(decision.endpoint.id, Outcome.FAILURE), (second.id, Outcome.SUCCESS)]


def test_forwarding_edge_falls_back_in_order_then_runs_out() -> None:
    gw, _, _ = gateway()
    lifecycle = Lifecycle(gw)
    decision = lifecycle.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision)
    tried = [lifecycle.fall_back(Outcome.BACKPRESSURE) for _ in range(3)]
    assert tried == [*decision.fallbacks, None]
    assert lifecycle.attempts == 3 and lifecycle.endpoint == decision.fallbacks[-1]
    assert sum(inflight(gw).values()) == 1  # only the last attempt is in flight


def test_a_fallback_whose_breaker_opened_since_the_pick_is_skipped() -> None:
    """Fallbacks are listed at the pick; when replicas fail together, one that opened its
    breaker meanwhile must not be sent the request (nor a half-open one an extra probe)."""
    gw, _, _ = gateway()
    lifecycle = Lifecycle(gw)
    decision = lifecycle.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision) and len(decision.fallbacks) >= 2
    registry = gw.scheduler.registry
    first = registry.get("chat", decision.fallbacks[0].id)
    assert first is not None
    for _ in range(10):
        first.breaker.record(False, registry.clock())
    assert not first.breaker.available(registry.clock())
    assert lifecycle.fall_back(Outcome.FAILURE) == decision.fallbacks[1]
    assert first.inflight == 0 and inflight(gw)[decision.fallbacks[1].id] == 1


def test_first_token_reaches_the_lease_once_and_before_finish() -> None:
    gw, scheduler, _ = gateway()
    marks: list[str] = []
    acquire = scheduler.acquire

    def acquire_with_hook(
        decision: Decision, endpoint: Endpoint | None = None, *, unstreamed: bool = False
    ) -> object:
        lease = acquire(decision, endpoint, unstreamed=unstreamed)
        lease.on_first_token = lambda: marks.append(lease.endpoint_id)
        return lease

    scheduler.acquire = acquire_with_hook  # type: ignore[assignment]
    streamed = Lifecycle(gw)
    first = streamed.route(HEADERS, CHAT, None)
    assert isinstance(first, Decision)
    streamed.first_byte()
    streamed.first_byte()
    streamed.finish(Outcome.SUCCESS)
    silent = Lifecycle(gw)  # the client left before any byte: marked once, at finish
    second = silent.route({**HEADERS, "x-session-id": "s2"}, CHAT, None)
    assert isinstance(second, Decision)
    silent.finish()
    assert marks == [first.endpoint.id, second.endpoint.id]


def test_each_decision_is_logged_once_with_the_edge(caplog: pytest.LogCaptureFixture) -> None:
    gw, _, _ = gateway()
    with caplog.at_level(logging.DEBUG, logger="llmgw.decision"):
        Lifecycle(gw, Hooks("asgi")).route({**HEADERS, "x-request-id": "r1"}, CHAT, None)
    records = [r for r in caplog.records if r.name == "llmgw.decision"]
    assert [(r.__dict__["edge"], r.__dict__["request_id"]) for r in records] == [("asgi", "r1")]


def test_debug_summary_names_the_primary_and_the_fallback_that_answered() -> None:
    gw, _, _ = gateway()
    decision = Lifecycle(gw).route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision)
    assert debug_summary(decision).startswith(f"endpoint={decision.endpoint.address} strategy=")
    moved = debug_summary(decision, decision.fallbacks[0])
    assert f"answered={decision.fallbacks[0].address}" in moved


def test_reload_is_one_swap_and_a_started_request_keeps_its_snapshot() -> None:
    gw, _, _ = gateway({"chat": static_model(4), "other": static_model(2)})
    before = gw.snapshot
    ring_router = before.scheduler.routers["chat"]
    started = Lifecycle(gw)
    decision = started.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision)
    gw.reload(config({"chat": static_model(4), "other": static_model(1)}, debug_headers=True))
    assert gw.snapshot is not before and gw.config.debug_headers
    assert gw.scheduler.routers["chat"] is ring_router  # unchanged model: ring kept
    assert [s.id for s in gw.scheduler.registry.states("other")] == ["10.0.0.1:8000"]
    assert started.config is before.config  # the request in flight finishes as it began
    started.finish(Outcome.SUCCESS)
    assert set(inflight(gw).values()) == {0}
    assert Lifecycle(gw).config.debug_headers


def test_reload_that_changes_launch_settings_changes_nothing() -> None:
    gw, _, _ = gateway(on_demand=True)
    before = gw.snapshot
    changed = {**LAZY, "scaling": {"min": 0, "max": 2}}
    with pytest.raises(ConfigError, match=r"models\.lazy"):
        gw.reload(config({"chat": static_model(4), "lazy": changed}))
    assert gw.snapshot is before


def test_reload_that_changes_the_decision_trace_is_rejected_as_restart_only() -> None:
    # The edges open the trace file once at start: a reload could not apply a new one.
    gw = Gateway(Scheduler(config({"chat": static_model(2)}), Registry(), seed=1))
    before = gw.snapshot
    traced = config({"chat": static_model(2)}, trace={"path": "/tmp/llmgw-trace.jsonl"})
    with pytest.raises(ConfigError, match=r"trace: .*restart"):
        gw.reload(traced)
    assert gw.snapshot is before
    gw.reload(config({"chat": static_model(3)}))  # the same trace (none): applied
    assert gw.snapshot is not before


def test_a_reload_that_changes_the_seed_reseeds_the_random_choices() -> None:
    """The reload was accepted and the old random state kept: the new seed was neither
    applied nor refused (found by a review helper)."""
    gw = Gateway(Scheduler(config({"chat": static_model(2)}, seed=1)))
    rng = gw.scheduler.rng
    gw.reload(config({"chat": static_model(3)}, seed=1))
    assert gw.scheduler.rng is rng  # the same seed: the random choices carry on
    gw.reload(config({"chat": static_model(3)}, seed=2))
    assert gw.scheduler.rng.getstate() == random.Random(2).getstate()


def test_first_byte_reports_observed_and_predicted_ttft_once() -> None:
    clock = FakeClock()
    registry = Registry(clock=clock)
    cfg = config({"chat": {**static_model(2), "strategy": "latency"}})
    seen: list[tuple[str, float, float | None]] = []
    gw = Gateway(Scheduler(cfg, registry, seed=1))
    hooks = Hooks(ttft=lambda model, observed, predicted: seen.append((model, observed, predicted)))
    lifecycle = Lifecycle(gw, hooks)
    body = (
        b'{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "'
        + b"x" * 4000
        + b'"}]}'
    )
    decision = lifecycle.route({}, CHAT, body)
    assert isinstance(decision, Decision) and decision.predicted_ttft is not None
    clock.advance(0.25)
    lifecycle.first_byte()
    lifecycle.first_byte()
    lifecycle.finish(Outcome.SUCCESS)
    assert len(seen) == 1
    model, observed, predicted = seen[0]
    assert (model, predicted) == ("chat", decision.predicted_ttft)
    assert observed == pytest.approx(0.25)


def test_a_first_token_inferred_at_finish_does_not_claim_the_edge_reports_them() -> None:
    """Behind Envoy without body events a request ends without a first byte: the registry
    must keep the time-drained queue estimate, not switch to pending prefill tokens (which
    would count every decoding request's prompt as queued until it ends)."""
    gw, scheduler, _ = gateway()
    silent = Lifecycle(gw)
    decision = silent.route(HEADERS, CHAT, None)
    assert isinstance(decision, Decision)
    silent.finish(Outcome.SUCCESS)
    state = scheduler.registry.get(decision.model, decision.endpoint.id)
    assert state is not None and not state.reports_first_token
    streamed = Lifecycle(gw)
    second = streamed.route(HEADERS, CHAT, None)
    assert isinstance(second, Decision)
    streamed.first_byte()
    seen = scheduler.registry.get(second.model, second.endpoint.id)
    assert seen is not None and seen.reports_first_token


def timed_gateway() -> tuple[FakeClock, Registry, Gateway, Hooks, list[float]]:
    """One `latency` model on one endpoint, a fake clock, and hooks that collect every
    observed time to first token."""
    clock = FakeClock()
    registry = Registry(clock=clock)
    cfg = config({"chat": {**static_model(1), "strategy": "latency"}})
    seen: list[float] = []
    gw = Gateway(Scheduler(cfg, registry, seed=1))
    hooks = Hooks(ttft=lambda model, observed, predicted: seen.append(observed))
    return clock, registry, gw, hooks, seen


def routed_streamed(
    lifecycle: Lifecycle, registry: Registry, chars: int, path: str = CHAT
) -> EndpointState:
    """Route a streamed chat request of `chars` characters (the Responses API reads its
    `input`); its endpoint's state, which now holds its pending prefill."""
    body = b'{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "'
    decision = lifecycle.route({}, path, body + b"x" * chars + b'"}], "input": "x"}')
    assert isinstance(decision, Decision)
    state = registry.get("chat", decision.endpoint.id)
    assert state is not None and state.pending_prefill > 0
    return state


def test_an_unstreamed_answers_first_byte_is_its_end_not_a_first_token() -> None:
    """`"stream": false` (or no `stream`): the first byte comes with the last token. Timed
    as a first token it would report the whole generation as TTFT, feed it to the per-token
    fit, and switch the endpoint to counting prefill as pending until first tokens."""
    clock, registry, gw, hooks, seen = timed_gateway()
    prompt = b'"messages": [{"role": "user", "content": "' + b"x" * 4000 + b'"}]}'
    whole = Lifecycle(gw, hooks)
    decision = whole.route({}, CHAT, b'{"model": "chat", "stream": false, ' + prompt)
    assert isinstance(decision, Decision)
    state = registry.get("chat", decision.endpoint.id)
    assert state is not None and state.pending_prefill > 0
    clock.advance(3.0)  # prefill and a long decode, then the whole JSON answer
    whole.first_byte()
    assert (seen, state.reports_first_token, state.pending_prefill) == ([], False, 0.0)
    assert state.calibration.observed.n == 0
    whole.finish(Outcome.SUCCESS)
    streamed = Lifecycle(gw, hooks)  # the same prompt, streamed: a first token
    assert isinstance(
        streamed.route({}, CHAT, b'{"model": "chat", "stream": true, ' + prompt), Decision
    )
    clock.advance(0.2)
    streamed.first_byte()
    assert seen == [pytest.approx(0.2)] and state.reports_first_token
    assert state.calibration.observed.n == 1


VLLM_ROLE = b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
SPACED_TOKEN = b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": null}]}\n\n'
RESPONSES_START = (
    b'event: response.created\ndata: {"type":"response.created","response":{"status":'
    b'"in_progress","output":[],"instructions":"be brief","text":{"format":{"type":"text"}}}}'
    b'\n\nevent: response.in_progress\ndata: {"type":"response.in_progress","response":{}}\n\n'
)
RESPONSES_DELTA = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"Hi","item_id":"m1","output_index":0,"content_index":0}\n\n'
)


INSTRUCTIONS = b"You are a coding agent. " * 600  # ~14 KB, echoed by response.created
RESPONSES_CREATED_LONG = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","created_at":1,'
    b'"instructions":"' + INSTRUCTIONS + b'","model":"m","object":"response","output":[],'
    b'"tools":[],"status":"in_progress","text":{"format":{"type":"text"}}},'
    b'"sequence_number":0,"type":"response.created"}\n\n'
)
EVENT_LINE = b"event: response.created\n"
TOOL_CALL = (
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t1",'
    b'"type":"function","function":{"name":"get_weather","arguments":""}}]}}]}\n\n'
)
EMPTY_DELTA = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":""}}]}\n\n'


@pytest.mark.parametrize(
    ("path", "ahead", "token"),
    [
        (CHAT, [VLLM_ROLE], SPACED_TOKEN),  # a role chunk sent with the headers
        (CHAT, [b": keep-alive\n\n", b""], VLLM_ROLE + SPACED_TOKEN),  # vLLM: role + token
        ("/v1/responses", [RESPONSES_START], RESPONSES_DELTA),  # vLLM 0.32's Responses API
        # An edge passes on what one read brought: an announcement in pieces, the piece
        # past its marker no longer says what it is.
        (
            "/v1/responses",
            [RESPONSES_CREATED_LONG[:8192], RESPONSES_CREATED_LONG[8192:]],
            RESPONSES_DELTA,
        ),
        ("/v1/responses", [EVENT_LINE, RESPONSES_CREATED_LONG[len(EVENT_LINE) :]], RESPONSES_DELTA),
        (CHAT, [VLLM_ROLE[:70], VLLM_ROLE[70:]], SPACED_TOKEN),
        # Instructions that say "[DONE]" are no end of the answer.
        (
            "/v1/responses",
            [RESPONSES_CREATED_LONG.replace(b"coding agent.", b"agent. Say [DONE].")],
            RESPONSES_DELTA,
        ),
    ],
)
def test_the_first_token_is_the_first_chunk_that_holds_one(
    path: str, ahead: list[bytes], token: bytes
) -> None:
    """Chunks an event stream sends before its first token (a chat role with the head,
    comments, the Responses API's `response.created`, whole or in pieces) are no first
    token: timed there, a prefill behind a queue read as taking no time, and its pending
    work left the queue estimate."""
    clock, registry, gw, hooks, seen = timed_gateway()
    lifecycle = Lifecycle(gw, hooks)
    state = routed_streamed(lifecycle, registry, 4000, path)
    clock.advance(0.01)
    lifecycle.response(200, content_type="text/event-stream; charset=utf-8")
    for chunk in ahead:
        lifecycle.body_chunk(chunk)
    assert (seen, state.pending_prefill > 0, state.token_at) == ([], True, float("-inf"))
    clock.advance(0.3)  # the prefill ends
    lifecycle.body_chunk(token)
    assert seen == [pytest.approx(0.31)] and state.pending_prefill == 0.0
    lifecycle.body_chunk(SPACED_TOKEN)  # a later token: the step in progress ended now
    assert state.token_at == clock()
    stepped = clock()
    clock.advance(0.02)
    lifecycle.body_chunk(b": keep-alive\n\n")  # the server's timer between two tokens
    assert state.token_at == stepped
    lifecycle.finish(Outcome.SUCCESS)


@pytest.mark.parametrize(
    ("first", "steps", "token"),
    [
        (VLLM_ROLE, 8, TOOL_CALL),
        (VLLM_ROLE, 1, SPACED_TOKEN),
        (VLLM_ROLE + EMPTY_DELTA, 1, SPACED_TOKEN),
    ],
)
def test_a_role_chunk_after_the_prefill_is_the_first_token(
    first: bytes, steps: int, token: bytes
) -> None:
    """vLLM sends the role chunk with its first output, after the prefill, and then nothing
    while a tool-call or reasoning parser holds tokens back (`<tool_call>`, `<think>`):
    the role chunk, come well after the head, is the first token; waiting for the first
    visible one timed the prefill several steps long."""
    clock, registry, gw, hooks, seen = timed_gateway()
    lifecycle = Lifecycle(gw, hooks)
    routed_streamed(lifecycle, registry, 4000)
    lifecycle.response(200, content_type="text/event-stream")
    clock.advance(0.3)
    lifecycle.body_chunk(first)
    clock.advance(0.03 * steps)
    lifecycle.body_chunk(token)
    lifecycle.finish(Outcome.SUCCESS)
    assert seen == [pytest.approx(0.3)]


@pytest.mark.parametrize(
    ("status", "content_type"), [(200, "application/json"), (200, None), (500, "text/event-stream")]
)
def test_outside_a_good_event_stream_the_first_chunk_is_the_first_byte(
    status: int, content_type: str | None
) -> None:
    """A role in a whole JSON answer, an answer of unknown type or an error is no stream
    to wait in: the first chunk ends the pending prefill as it did."""
    _, registry, gw, hooks, _ = timed_gateway()
    lifecycle = Lifecycle(gw, hooks)
    state = routed_streamed(lifecycle, registry, 2)
    lifecycle.response(status, content_type=content_type)
    lifecycle.body_chunk(VLLM_ROLE)
    assert state.pending_prefill == 0.0
    lifecycle.finish()


def test_an_unstreamed_prefill_leaves_the_queue_before_its_answer_ends() -> None:
    """Where the edge sees first tokens, the pending prefill is the queue. An unstreamed
    request shows no first token, so its prefill once stayed pending until its whole answer
    came, seconds later: its replica looked busy and sessions moved off it (chat beside
    unstreamed document jobs: the proxy 1.19x the best). Now a later request's first token
    there, or the first scrape past its predicted first token, ends it; its own end does
    not subtract it twice."""
    clock, registry, gw, _, _ = timed_gateway()
    doc = b'"messages": [{"role": "user", "content": "' + b"d" * 8000 + b'"}]}'
    chat = b'"messages": [{"role": "user", "content": "' + b"c" * 400 + b'"}]}'

    def send(stream: bool, prompt: bytes) -> Lifecycle:
        life = Lifecycle(gw)
        flag = b"true" if stream else b"false"
        assert isinstance(
            life.route({}, CHAT, b'{"model": "chat", "stream": ' + flag + b", " + prompt), Decision
        )
        return life

    warm = send(True, chat)  # the edge is seen to report first tokens
    clock.advance(0.05)
    warm.first_byte()
    warm.finish(Outcome.SUCCESS)
    state = registry.get("chat", warm.endpoint.id if warm.endpoint else "")
    assert state is not None and state.reports_first_token and state.pending_prefill == 0.0

    job = send(False, doc)
    doc_tokens = state.pending_prefill
    assert doc_tokens > 1000
    behind = send(True, chat)
    assert state.pending_prefill > doc_tokens
    clock.advance(0.3)
    behind.first_byte()  # sent after the job and through prefill: so is the job
    assert state.pending_prefill == 0.0
    clock.advance(3.0)
    job.first_byte()  # the whole answer: nothing left to subtract
    job.finish(Outcome.SUCCESS)
    assert state.pending_prefill == 0.0
    behind.finish(Outcome.SUCCESS)

    # Another document, no request behind it: the scrape past its prediction ends it.
    alone = send(False, doc.replace(b"d", b"e"))
    assert alone.decision is not None and alone.decision.ready_at is not None
    assert state.pending_prefill == pytest.approx(doc_tokens)
    idle = EngineMetrics(waiting=0.0, running=1.0, kv_usage=0.1)
    registry.record_scrape("chat", state.id, idle)  # before its predicted first token
    assert state.pending_prefill == pytest.approx(doc_tokens)
    clock.advance(alone.decision.ready_at - clock() + 0.01)
    registry.record_scrape("chat", state.id, idle)
    assert state.pending_prefill == 0.0
    alone.finish(Outcome.SUCCESS)
    assert state.pending_prefill == 0.0 and not state.blind


@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_an_error_answer_is_no_first_token(status: int) -> None:
    """A prompt over the context length (400) or a refusing engine answers at once: taken
    for a first token it read as a long prefill that took no time, pulling the per-token
    fit towards 0 and the TTFT telemetry down. It only ends the request's pending prefill."""
    clock, registry, gw, hooks, seen = timed_gateway()
    refused = Lifecycle(gw, hooks)
    state = routed_streamed(refused, registry, 40000)
    assert state.pending_prefill > 5000
    clock.advance(0.002)
    refused.response(status)
    refused.first_byte()
    assert (seen, state.reports_first_token, state.pending_prefill) == ([], False, 0.0)
    assert state.calibration.observed.n == 0
    refused.finish()
    answered = Lifecycle(gw, hooks)  # a 200's first byte is still a first token
    routed_streamed(answered, registry, 5)
    clock.advance(0.05)
    answered.response(200)
    answered.first_byte()
    assert seen == [pytest.approx(0.05)] and state.reports_first_token


def _half_open_gateway(n: int, **top: object) -> tuple[Gateway, FakeClock, EndpointState]:
    """n endpoints (strategy ring); the first one's breaker just half-opened."""
    clock = FakeClock()
    cfg = config({"chat": static_model(n, strategy="ring")}, **top)
    gw = Gateway(Scheduler(cfg, Registry(clock=clock), seed=1))
    state = gw.scheduler.registry.get("chat", "10.0.0.1:8000")
    assert state is not None
    for _ in range(3):  # failure_threshold
        state.breaker.record(False, clock())
    clock.advance(1.0)  # base_cooldown
    assert state.breaker.available(clock()) and state.breaker.state is BreakerState.HALF_OPEN
    return gw, clock, state


def test_a_half_open_endpoint_is_no_fallback_so_envoy_retries_cannot_flood_its_probes() -> None:
    """Every pick listed it as a fallback while its one probe slot was free; Envoy retries
    (no breaker asked) landed one probe per failed primary there (3 with half_open_probes 1).
    Found by a review helper."""
    gw, _, state = _half_open_gateway(3, destination_fallbacks=True)
    primaries = 0
    for i in range(60):
        lifecycle = Lifecycle(gw)
        decision = lifecycle.route({"x-llmgw-model": "chat", "x-session-id": f"s{i}"}, CHAT, None)
        assert isinstance(decision, Decision)
        if decision.endpoint.id == state.id:  # the probe itself, as a primary
            primaries += 1
            lifecycle.finish(Outcome.CANCELLED)
            continue
        assert state.id not in [f.id for f in decision.fallbacks]
        lifecycle.answered_by(state.endpoint.address)  # Envoy's own pick on a retry
        assert state.breaker.probes_inflight <= state.breaker.settings.half_open_probes
        lifecycle.finish(Outcome.CANCELLED)
    assert primaries > 0  # it still takes probes as the primary


@pytest.mark.parametrize("bodies_seen", [True, False])
def test_a_probe_is_decided_by_its_first_token_or_head_not_its_last_token(
    bodies_seen: bool,
) -> None:
    """One replica, half-open after a blip: its probe answered 200 and streamed, yet every
    other request was a 503 no_healthy_endpoint until the stream's last token (minutes for
    a long generation). Found by a review helper. Where the edge sees the stream's tokens
    the first one decides it; where it does not (Envoy without response bodies), the head."""
    gw, clock, state = _half_open_gateway(1)
    probes = []
    for _ in range(2):  # success_threshold 2
        probe = Lifecycle(gw)
        assert isinstance(probe.route({"x-llmgw-model": "chat"}, CHAT, None), Decision)
        assert state.breaker.probes_inflight == 1
        probe.response(200, content_type="text/event-stream", bodies_seen=bodies_seen)
        if bodies_seen:
            assert state.breaker.probes_inflight == 1  # the head alone decides nothing
            clock.advance(0.2)
            probe.body_chunk(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        assert state.breaker.probes_inflight == 0
        probes.append(probe)
    assert state.breaker.state is BreakerState.CLOSED
    clock.advance(60.0)
    probes[0].finish(Outcome.FAILURE)  # cut mid-stream a minute later: an ordinary failure
    probes[1].finish()
    assert state.breaker.state is BreakerState.CLOSED and state.inflight == 0


def test_an_engine_that_sends_heads_and_then_nothing_gets_no_traffic_back() -> None:
    """Its API server answers 200 heads, its engine is stuck: each probe times out at the
    read timeout. Decided at the head, two empty heads closed the breaker and gave it every
    request, and the backoff never grew (found by a review helper). Now the probe holds its
    slot until a token comes, and each timed-out probe doubles the cooldown."""
    gw, clock, state = _half_open_gateway(1)
    cooldowns = []
    for _ in range(4):
        admitted = []
        for _ in range(20):
            lifecycle = Lifecycle(gw)
            if isinstance(lifecycle.route({"x-llmgw-model": "chat"}, CHAT, None), Decision):
                lifecycle.response(200, content_type="text/event-stream")  # then silence
                admitted.append(lifecycle)
        assert (state.breaker.state, len(admitted)) == (BreakerState.HALF_OPEN, 1)
        admitted[0].finish(Outcome.FAILURE)  # the read timeout
        assert state.breaker.state is BreakerState.OPEN
        cooldowns.append(state.breaker.opened_until - clock())
        clock.advance(cooldowns[-1])
    assert cooldowns == [2.0, 4.0, 8.0, 16.0]


def test_a_probe_answered_with_an_error_status_is_decided_at_its_end() -> None:
    gw, _, state = _half_open_gateway(1)
    probe = Lifecycle(gw)
    assert isinstance(probe.route({"x-llmgw-model": "chat"}, CHAT, None), Decision)
    probe.response(500)
    seen = [state.breaker.state]
    assert state.breaker.probes_inflight == 1
    probe.finish()
    seen.append(state.breaker.state)
    assert seen == [BreakerState.HALF_OPEN, BreakerState.OPEN]


def test_a_fallbacks_first_byte_is_timed_from_the_first_attempt_and_the_request_ends_once() -> None:
    """The observed TTFT of a request answered by a fallback left out the time lost on the
    failed primary (0.6 s of an engine's slow 503: 1 ms recorded); and the requests panel
    summed per-attempt outcomes, two for one request. Found by a review helper."""
    clock = FakeClock()
    gw = Gateway(Scheduler(config({"chat": static_model(3)}), Registry(clock=clock), seed=1))
    seen: list[float] = []
    ended: list[tuple[str, Outcome]] = []
    hooks = Hooks(
        ttft=lambda _m, observed, _p: seen.append(observed), ended=lambda m, o: ended.append((m, o))
    )
    lifecycle = Lifecycle(gw, hooks)
    assert isinstance(lifecycle.route(HEADERS, CHAT, None), Decision)
    clock.advance(0.6)  # the primary answers 503 after 0.6 s
    assert lifecycle.fall_back(Outcome.BACKPRESSURE) is not None
    clock.advance(0.05)
    lifecycle.response(200, content_type="text/event-stream")
    lifecycle.first_byte()
    lifecycle.finish()
    assert seen == [pytest.approx(0.65)]
    assert ended == [("chat", Outcome.SUCCESS)]


def test_an_unknown_end_at_the_pick_owes_the_engine_its_first_token() -> None:
    """A gateway that reports no response (NGINX Gateway Fabric) ends the lease at the pick
    as `unknown`; the request still goes to the engine, which counts its first token. Its
    entry was dropped (not owed), so that count closed another request's prefill and the
    queue term forgot that work. Found by a review helper."""
    clock = FakeClock(10.0)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    sched.registry.record_scrape(
        "m", "a:1", EngineMetrics(waiting=0.0, running=1, kv_usage=0.1, ttft_count=0.0)
    )
    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "xx"}]}'
    lifecycle = Lifecycle(Gateway(sched))
    assert isinstance(lifecycle.route({}, CHAT, body), Decision)
    lifecycle.finish(Outcome.UNKNOWN)
    assert lifecycle.lease is not None and lifecycle.lease.prefill is not None
    assert lifecycle.lease.prefill.owed


def test_an_error_answered_without_body_events_owes_the_engine_no_first_token() -> None:
    """Envoy without response bodies: a 400 (a prompt past the context) is a success for the
    breaker, so its end kept its prefill entry owed a first token the engine never
    counts, and that entry took a real request's count. Found by a review helper."""
    clock = FakeClock(10.0)
    sched = Scheduler(
        config({"m": {"endpoints": ["a:1"], "strategy": "latency"}}), Registry(clock=clock)
    )
    gw = Gateway(sched)

    def scrape(count: float) -> None:
        sched.registry.record_scrape(
            "m", "a:1", EngineMetrics(waiting=0.0, running=1, kv_usage=0.1, ttft_count=count)
        )

    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "xx"}]}'
    scrape(0.0)
    for status, owed in ((200, True), (400, False)):
        lifecycle = Lifecycle(gw)
        assert isinstance(lifecycle.route({}, CHAT, body), Decision)
        lifecycle.response(status, content_type="text/event-stream")
        lifecycle.finish()  # the stream's end, no body seen
        assert lifecycle.lease is not None and lifecycle.lease.prefill is not None
        assert lifecycle.lease.prefill.owed is owed, status
