"""One request's lifecycle, driven the same way by both edges (sans-I/O, like h11's Connection).

    lifecycle = Lifecycle(gateway, hooks)
    result = lifecycle.route(headers, path, body)      # Decision | LlmgwError | AwaitActivation
    # AwaitActivation: the edge awaits `llmgw.runtime.driver.activate(lifecycle, result)`,
    # which waits for the on-demand model once and picks a second (and last) time.
    lifecycle.first_byte()                             # the first response byte arrived
    lifecycle.body_chunk(data)                         # (or: each body chunk, the first too)
    lifecycle.answered_by("10.0.0.2:8000")             # Envoy retried on a fallback
    lifecycle.fall_back(Outcome.BACKPRESSURE)          # an edge that forwards itself retries
    lifecycle.response(status); lifecycle.finish()     # outcome from the status, exactly once

It owns: pick, lease, the keep-alive of on-demand models, fallback accounting (the host
that really answered is charged), the outcome, telemetry hooks, the decision log line and
the stage timings. The edges only translate their protocol to and from it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from llmgw.config import Config
from llmgw.errors import InternalError, LlmgwError, ModelNotReady
from llmgw.gateway import Gateway, Snapshot
from llmgw.logs import log_decision
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Lease
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo, outcome_for_status

# Wire names both edges use.
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the chosen endpoint, ip:port
METADATA_NAMESPACE = "envoy.lb"  # Envoy dynamic metadata: primary + fallbacks
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in METADATA_NAMESPACE, from the gateway
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # filter metadata: the endpoints allowed
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DECISION_HEADER = "x-llmgw-decision"  # to the inner app, and (debug_headers) to the client
# Envoy adds this response header (route `response_headers_to_add: %UPSTREAM_HOST%`) so
# the outcome is charged to the host that really answered after retries.
UPSTREAM_HEADER = "x-llmgw-upstream"
# Set by llmgw for itself: dropped when a client sends them, never forwarded upstream.
INTERNAL_HEADERS = frozenset({DESTINATION_HEADER, DECISION_HEADER, UPSTREAM_HEADER})


# Paths whose answer is generated token by token: without `"stream": true` in the body
# the whole answer comes at once. (An embedding's first byte does follow its prefill.)
GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


# A chunk of a streamed answer that carries a generated token: text, a reasoning or
# tool-call delta, a finish reason. JSON with or without spaces.
_TOKEN = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning|delta|arguments)"\s*:\s*"[^"]'
    rb'|"tool_calls"\s*:\s*\[\s*\{|"finish_reason"\s*:\s*"'
)
# What an event stream sends before its first token: a chat role (`"delta": {"role":
# "assistant", "content": ""}`), the Responses API's `response.created` and
# `response.in_progress` (vLLM 0.32 sends both with the headers, before the prefill).
_ROLE = re.compile(rb'"role"\s*:')
_ANNOUNCE = re.compile(rb'"type"\s*:\s*"response\.')
# A role chunk this long after the response head came with the first output (vLLM sends
# it then, and nothing more until a tool-call or reasoning parser lets a token through);
# sooner, the server sent it with the head, before the prefill.
ROLE_WITH_HEAD_S = 0.005
# An unfinished line longer than this before the first token is decided as it stands.
_MAX_PENDING = 1 << 20


def _comments_only(data: bytes) -> bool:
    """Empty, or SSE comment lines only (`: keep-alive`): no event, so no engine step."""
    return all(not line or line.startswith(b":") for line in data.strip().splitlines())


def _line_holds_token(line: bytes, role_counts: bool) -> bool:
    """Whether one whole line of an event stream, before any token, carries the first
    one: a `data:` line with a token, `[DONE]` (an answer without tokens), or anything
    not known to come before them; not comments, `event:` / `id:` / `retry:` lines, nor
    data announcing an answer without any of it (a role alone, unless `role_counts`)."""
    line = line.strip()
    if not line or line.startswith((b":", b"event:", b"id:", b"retry:")):
        return False
    if not line.startswith(b"data:"):
        return True  # not an event stream's line: whatever it is, it is an answer
    data = line[5:].strip()
    if data == b"[DONE]" or _TOKEN.search(data) is not None:
        return True
    if _ANNOUNCE.search(data) is not None:
        return False
    if _ROLE.search(data) is not None:
        return role_counts
    return True


def _unstreamed(request: RequestInfo, streamed: bool | None = None) -> bool:
    """A generation answered whole at once: its body asked so, or, unread, its answer is not
    an event stream (`streamed`: what the response's content type said, None unknown)."""
    if not request.path.split("?", 1)[0].startswith(GENERATING_PATHS):
        return False
    if request.body_size > 0:
        return not request.stream
    return streamed is False


@dataclass(slots=True)
class Hooks:
    """What a lifecycle reports (metrics); all optional. `edge` names it in decision logs."""

    edge: str = "core"
    decision: Callable[[Decision, str], object] | None = None
    error: Callable[[LlmgwError], None] | None = None
    outcome: Callable[[str, str, Outcome], None] | None = None
    stage: Callable[[str, float], None] | None = None
    # (model, observed time to first byte, predicted TTFT or None): seconds.
    ttft: Callable[[str, float, float | None], None] | None = None
    # A dispatched request ended (once, after its lease is released): the decision trace.
    finished: Callable[[Lifecycle, Outcome], None] | None = None
    # (model, outcome) once per dispatched request, however many endpoints it tried.
    ended: Callable[[str, Outcome], None] | None = None
    # A request was dispatched (its lease taken, the registry as the pick saw it): the trace.
    dispatched: Callable[[Lifecycle], None] | None = None


NO_HOOKS = Hooks()


@dataclass(frozen=True, slots=True)
class AwaitActivation:
    """`route` could not pick yet: the on-demand `model` must start first."""

    model: str


def debug_summary(decision: Decision, answered: Endpoint | None = None) -> str:
    """The `x-llmgw-decision` response value (both edges): the primary picked, the fallback
    that answered if another did, and why."""
    primary = decision.endpoint.address
    if answered is not None and answered.address != primary:
        return f"endpoint={primary} answered={answered.address} {decision.describe()}"
    return f"endpoint={primary} {decision.describe()}"


class Lifecycle:
    """One request from routing to its outcome. Not thread-safe; every step is idempotent
    where an edge may see the same event twice (a stream closing after the response ended)."""

    __slots__ = (
        "_attempt",
        "_head_at",
        "_in_use",
        "_pending",
        "_sent_at",
        "_started",
        "_status",
        "_streamed",
        "decision",
        "endpoint",
        "gateway",
        "hooks",
        "lease",
        "request",
        "snapshot",
        "ttft",
    )

    def __init__(
        self, gateway: Gateway, hooks: Hooks = NO_HOOKS, started: float | None = None
    ) -> None:
        self.gateway = gateway
        self.snapshot: Snapshot = gateway.snapshot  # one config for the whole request
        self.hooks = hooks
        self.request: RequestInfo | None = None
        self.decision: Decision | None = None
        self.endpoint: Endpoint | None = None
        self.lease: Lease | None = None
        self._attempt = 0
        self._status: int | None = None
        self._streamed: bool | None = None  # the answer is an event stream (None: unknown)
        self._head_at: float | None = None  # when the response head came (registry clock)
        self._pending = b""  # an event stream's unfinished line, before its first token
        self.ttft: float | None = None  # seconds from dispatch to the first response byte
        # When the first attempt was sent (registry clock): a fallback's answer is timed
        # from there, as its client waited (the time lost on a failed primary included).
        self._sent_at: float | None = None
        self._in_use = False
        self._started = time.perf_counter() if started is None else started

    @property
    def config(self) -> Config:
        return self.snapshot.config

    # -- routing -------------------------------------------------------------------------
    def route(
        self,
        headers: Mapping[str, str],
        path: str,
        body: bytes | None,
        *,
        subset: Collection[str] | None = None,
    ) -> Decision | LlmgwError | AwaitActivation:
        """Parse and pick. Headers are lower-cased names; `body` None = not read; `subset`:
        the gateway allows only these endpoint addresses (empty: none)."""
        t0 = time.perf_counter()
        try:
            request = build_request(self.snapshot.config, headers, path, body)
            if subset is not None:
                request = replace(request, subset=frozenset(subset))
            self.request = request
            t1 = time.perf_counter()
            decision = self.snapshot.scheduler.pick(request)
        except ModelNotReady as exc:
            if self.request is not None and self.gateway.manages(self.request.model):
                return AwaitActivation(self.request.model)
            return self.refuse(exc)
        except LlmgwError as exc:
            return self.refuse(exc)
        except Exception as exc:  # a router bug must not break the client's request
            return self.refuse(InternalError(f"router error: {type(exc).__name__}: {exc}"))
        self._dispatch(decision)
        stage = self.hooks.stage
        if stage is not None:
            t2 = time.perf_counter()
            stage("parse", t1 - t0)
            stage("schedule", t2 - t1)
            stage("total", t2 - self._started)
        return decision

    def activated(self) -> Decision | LlmgwError:
        """The on-demand model is ready (the driver waited): the second and last pick."""
        assert self.request is not None
        try:
            decision = self.snapshot.scheduler.pick(self.request)
        except LlmgwError as exc:
            return self.refuse(exc)
        except Exception as exc:  # as in route: a router bug answers 500, not a dead stream
            return self.refuse(InternalError(f"router error: {type(exc).__name__}: {exc}"))
        self._dispatch(decision)
        if self.hooks.stage is not None:  # the routing answer came after the model's start
            self.hooks.stage("total", time.perf_counter() - self._started)
        return decision

    def refuse(self, error: LlmgwError) -> LlmgwError:
        """The request is answered with `error` (nothing was dispatched)."""
        if self.hooks.error is not None:
            self.hooks.error(error)
        return error

    def _dispatch(self, decision: Decision) -> None:
        superseded = self.lease
        if superseded is not None and not superseded.done:
            # Routed twice (ext_proc: a body routed without headers, then headers that
            # Envoy never sends after it): the first lease ends here, or its endpoint
            # would count it in flight for ever. One request still: its end (metrics, the
            # trace) is reported once, at `finish`.
            self._release(superseded, Outcome.CANCELLED, end=True)
            self._end_use(superseded.model)
        self.decision = decision
        self.endpoint = decision.endpoint
        request = self.request
        self.lease = self.snapshot.scheduler.acquire(
            decision, unstreamed=request is not None and _unstreamed(request)
        )
        self._sent_at = self.lease.started
        activation = self.gateway.activation
        if activation is not None and activation.manages(decision.model):
            activation.use_begin(decision.model)  # keeps the model alive until finish
            self._in_use = True
        request_id = request.request_id if request is not None else ""
        if self.hooks.dispatched is not None:
            self.hooks.dispatched(self)
        if self.hooks.decision is not None:
            self.hooks.decision(decision, request_id)
        log_decision(decision, request_id, self.hooks.edge)

    # -- the response --------------------------------------------------------------------
    @property
    def attempts(self) -> int:
        """Endpoints this request has been sent to so far (1 = no fallback yet)."""
        return self._attempt + 1

    @property
    def done(self) -> bool:
        return self.lease is None or self.lease.done

    def first_byte(self) -> None:
        """The first response byte arrived (idempotent). For a generation asked not to
        stream it is the last token, and for an error status (a prompt over the context
        length, an engine refusing) there was no generation: either way nothing is pending
        there any more, but it is no time to first token (no TTFT observation, no
        calibration point, and it does not mean the edge sees first tokens). An error
        answered at once would otherwise read as a prefill that took no time."""
        lease = self.lease
        if lease is None or lease.first_token_seen or lease.done:
            return
        request, status = self.request, self._status
        if (request is not None and _unstreamed(request, self._streamed)) or (
            status is not None and not 200 <= status < 300
        ):
            # An error answered: no generation, no first token for the engine to count.
            lease.first_token(observed=False, counted=status is None or 200 <= status < 300)
            return
        lease.first_token()
        lease.answered()  # a half-open probe's verdict, if it still waits for one
        hook, decision = self.hooks.ttft, self.decision
        sent_at = self._sent_at if self._sent_at is not None else lease.started
        if sent_at is not None:
            self.ttft = lease.registry.clock() - sent_at
        if hook is not None and self.ttft is not None and decision is not None:
            observed = self.ttft
            # The prediction is for the primary; a fallback's wait says nothing about it.
            primary = lease.endpoint_id == decision.endpoint.id
            hook(decision.model, observed, decision.predicted_ttft if primary else None)

    def body_chunk(self, data: bytes) -> None:
        """A response body chunk reached the edge (call it for each one, empty or not). The
        first is the first byte (`first_byte`), but in a good event stream the first that
        holds a token (`_first_token_in`: not a role sent with the head, an announcement
        or a comment); in a streamed generation every later one with an event marks the
        end of an engine step there (`Lease.token`), which the latency scorer reads as the
        step's phase. The proxy and Envoy with response bodies streamed see every chunk."""
        lease = self.lease
        if lease is None:
            return
        if not lease.first_token_seen:
            status = self._status
            if (
                self._streamed
                and status is not None
                and 200 <= status < 300
                and not self._first_token_in(data, lease)
            ):
                return
            self.first_byte()
        elif data and lease.streaming and not lease.done:
            # A keep-alive comment between tokens is the server's timer, not a step's end.
            if data[:1] == b":" and _comments_only(data):
                return
            lease.token()

    def _first_token_in(self, data: bytes, lease: Lease) -> bool:
        """Whether this chunk of a good event stream brings its first token. Decided by
        whole lines: an edge passes on what one read brought, and an announcement with
        long instructions or tools echoed (the Responses API's `response.created`) comes
        in pieces, whose tail no longer says what it is; the unfinished line waits for
        the next chunk (decided as it stands past `_MAX_PENDING`, or when it shows a
        token already)."""
        if self._pending:
            data = self._pending + data
            self._pending = b""
        head_at = self._head_at
        role_counts = head_at is not None and lease.registry.clock() - head_at >= ROLE_WITH_HEAD_S
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: b"" when the chunk ends a line
        for line in lines:
            if _line_holds_token(line, role_counts):
                return True
        if not tail:
            return False
        if _TOKEN.search(tail) is not None or len(tail) > _MAX_PENDING:
            return True
        self._pending = tail
        return False

    def revise_status(self, status: int) -> None:
        """The answer's trailers said what its head did not (a gRPC error after a 200):
        `finish` decides the outcome by `status` instead."""
        self._status = status

    def response(
        self, status: int, *, content_type: str | None = None, bodies_seen: bool = True
    ) -> None:
        """The response status seen by the edge (decides the outcome at `finish`), and its
        content type where known: a generation whose body was not read (the model came in a
        header) is known unstreamed when its answer is not an event stream. `bodies_seen`:
        the edge will see this answer's body (the proxy; Envoy with response bodies)."""
        self._status = status
        if content_type is not None:
            self._streamed = content_type.lstrip().lower().startswith("text/event-stream")
        lease = self.lease
        self._pending = b""
        self._head_at = lease.registry.clock() if lease is not None else None
        # A half-open probe is decided before its last token: held to the end of a long
        # stream, its slot kept the endpoint refused for minutes. An event stream whose
        # tokens the edge sees is decided at its first token (`first_byte`): engines send
        # the head before the prefill, and one that sends heads and then nothing (its API
        # server up, its engine stuck) was given all its traffic back.
        if (
            lease is not None
            and lease.probe
            and outcome_for_status(status) is Outcome.SUCCESS
            and not (bodies_seen and self._streamed)
        ):
            lease.answered()

    def fall_back(self, outcome: Outcome) -> Endpoint | None:
        """Finish the current attempt with `outcome` and lease the next fallback endpoint.

        Returns it, or None when no fallback is left (the lease stays where it was).
        """
        decision, lease = self.decision, self.lease
        if decision is None or lease is None:
            return None
        # The fallbacks were listed at the pick; a breaker may have opened since (a fleet
        # failing together): skip those that would not admit a request now.
        registry = self.snapshot.scheduler.registry
        now = registry.clock()
        fallbacks = decision.fallbacks
        for index in range(self._attempt, len(fallbacks)):
            state = registry.get(decision.model, fallbacks[index].id)
            if state is not None and state.breaker.available(now):
                self._attempt = index
                return self._move(decision, lease, fallbacks[index], outcome)
        return None

    def answered_by(self, address: str) -> None:
        """The response came from `address` (Envoy retried on a fallback): the attempts
        before it failed; the rest of the request is charged to it."""
        decision, lease = self.decision, self.lease
        if decision is None or lease is None or lease.done or address == lease.endpoint_id:
            return
        for index, endpoint in enumerate(decision.fallbacks):
            if endpoint.address == address:
                self._attempt = index
                self._move(decision, lease, endpoint, Outcome.FAILURE)
                return
        # Envoy's own pick on a retry (no fallback list sent, or the list ran out): still an
        # endpoint of the model, charged as a listed fallback would be, also while it
        # drains (a reload removed it). An address llmgw does not know may be one of its
        # endpoints spelt otherwise (a host name Envoy resolved): left on the primary.
        state = self.snapshot.scheduler.registry.find(decision.model, address)
        if state is not None:
            self._attempt = len(decision.fallbacks)
            self._move(decision, lease, state.endpoint, Outcome.FAILURE)

    def _move(
        self, decision: Decision, lease: Lease, target: Endpoint, outcome: Outcome
    ) -> Endpoint:
        self._release(lease, outcome)
        self._attempt += 1
        self.endpoint = target
        self.lease = self.snapshot.scheduler.acquire(decision, target)
        return target

    def _release(self, lease: Lease, outcome: Outcome, *, end: bool = False) -> None:
        """Release an attempt: `end` for the request's last (`Lease.end`), else a failed
        attempt before a fallback (`Lease.finish`: its prefill was never done)."""
        if end:
            # A 4xx is a success for the breaker, yet no generation: no first token counted.
            # An `unknown` end (a gateway that reports no response, at the pick) was sent
            # on: the engine will count its first token, which its entry waits for.
            status = self._status
            good = status is None or 200 <= status < 300
            generated = outcome is Outcome.SUCCESS or outcome is Outcome.UNKNOWN
            lease.end(outcome, counted=generated and good)
        else:
            lease.finish(outcome)
        if self.hooks.outcome is not None:
            self.hooks.outcome(lease.model, lease.endpoint_id, outcome)

    def passed_on(self, endpoint: Endpoint, status: int, failed: Outcome) -> None:
        """End the request with an earlier attempt's answer: `status` from `endpoint` (an
        engine's 429 or 503 held while the fallbacks after it were tried, none answering).
        The current attempt is charged `failed`, its own outcome; the request ends as
        `status` says, credited to `endpoint` (the decision header and the trace name it)."""
        self._status = status
        self.endpoint = endpoint
        self.finish(charge=failed)

    def finish(self, outcome: Outcome | None = None, *, charge: Outcome | None = None) -> None:
        """End the request (once): `outcome`, else the status seen, else CANCELLED. `charge`:
        the current attempt's own outcome, when its endpoint did not give the answer."""
        lease = self.lease
        if lease is None or lease.done:
            return
        if outcome is None:
            status = self._status
            outcome = Outcome.CANCELLED if status is None else outcome_for_status(status)
        self._release(lease, outcome if charge is None else charge, end=True)
        self._end_use(lease.model)
        if self.hooks.ended is not None:
            self.hooks.ended(lease.model, outcome)
        if self.hooks.finished is not None:
            self.hooks.finished(self, outcome)

    def _end_use(self, model: str) -> None:
        """The on-demand model's use that `_dispatch` began is over (once)."""
        if self._in_use:
            self._in_use = False
            activation = self.gateway.activation
            if activation is not None:
                activation.use_end(model)

    @property
    def status(self) -> int | None:
        """The response status the edge saw, if any."""
        return self._status

    @property
    def started(self) -> float:
        """`time.perf_counter()` when the request's first message arrived."""
        return self._started
