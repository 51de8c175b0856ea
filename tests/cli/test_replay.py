"""`llmgw replay` without a network: parsing, the trace-to-request mapping, the ring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.cli.replay import engine_args, main
from llmgw.cli.replay_mirror import apply, correction
from llmgw.cli.replay_sim import IDLE_SCRAPES, mirror_corrections, replay_config, simulate
from llmgw.cli.replay_trace import (
    Arrival,
    TraceRing,
    _costs,
    fit_engine,
    prompt_text,
    read_trace,
)
from llmgw.hashring import HashRing, ring_position
from llmgw.registry import EndpointState, Registry, fresh_metrics_of
from llmgw.runtime.trace import session_hash
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.sim.model import EngineConfig
from llmgw.types import EngineMetrics, Outcome, RequestInfo

ENDPOINTS = [f"10.0.0.{i + 1}:8000" for i in range(4)]


def line(t: float, session: str | None, blocks: list[int], **extra: Any) -> str:
    row = {
        "t": t,
        "model": "m1",
        "session": session_hash(session) if session else None,
        "rid": None if session else session_hash(f"req-{t}"),
        "prompt_tokens": 64 * len(blocks) + 10,
        "blocks": blocks,
        "decision": {"endpoint": ENDPOINTS[0]},
        "outcome": {"ttft_ms": 20.0, "duration_ms": 120.0},
        **extra,
    }
    return json.dumps(row)


def test_engine_args_set_replicas_and_engine_fields() -> None:
    replicas, engine = engine_args("replicas=3, max_num_seqs=8,kv_blocks=512,decode_ms=2.5")
    assert replicas == 3
    assert (engine.max_num_seqs, engine.kv_blocks, engine.decode_ms) == (8, 512, 2.5)
    assert engine_args("")[1] == EngineConfig()


@pytest.mark.parametrize(
    ("text", "fix"),
    [("warp=9", "unknown"), ("replicas", "key=value"), ("replicas=0", ">= 1")],
)
def test_bad_engine_args_say_what_to_fix(text: str, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        engine_args(text)


@pytest.mark.parametrize(
    "text",
    ["decode_ms=nan", "prefill_us_per_token=inf", "decode_ms=-inf", "decode_batch_factor=nan"],
)
def test_non_finite_engine_args_are_refused_as_engine_args(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN and inf were taken: inf replayed for ever, nan was reported as a bad trace line
    (found by a review helper)."""
    key = text.partition("=")[0]
    with pytest.raises(ValueError, match=f"--engine-args {key}: must be a finite number"):
        engine_args(text)
    path = tmp_path / "t.jsonl"
    path.write_text(line(0.5, "a", [1]) + "\n")
    assert main([str(path), "--engine-args", text]) == 2
    err = capsys.readouterr().err
    assert "--engine-args" in err and "not a trace line" not in err


def test_an_engine_arg_of_the_wrong_type_is_named() -> None:
    with pytest.raises(ValueError, match="--engine-args kv_blocks: '2k' is not an integer"):
        engine_args("kv_blocks=2k")


def test_a_traced_session_sits_where_the_ring_put_its_key() -> None:
    ring, traced = HashRing(ENDPOINTS), TraceRing(ENDPOINTS)
    for key in ("alice", "bob", "user-17", "x"):
        assert traced.candidates(f"@{session_hash(key)}") == ring.candidates(key)
    assert TraceRing.position("plain") == ring_position("plain")


def test_synthetic_prompts_share_blocks_exactly_where_the_traced_ones_did() -> None:
    index = PrefixIndex(block_chars=256, max_blocks=256)
    a = Arrival(0.0, "m1", None, 64 * 3 + 5, (11, 22, 33), 8)
    b = Arrival(0.0, "m1", None, 64 * 3 + 5, (11, 22, 44), 8)
    ha, hb = index.hashes(prompt_text(a, 0)), index.hashes(prompt_text(b, 1))
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert len(prompt_text(a, 0)) == (64 * 3 + 5) * 4


def test_read_trace_orders_arrivals_and_estimates_output_length(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line(12.5, "bob", [1]), line(10.0, "alice", [1, 2]), ""]))
    arrivals = read_trace([path], decode_ms=4.0, output_tokens=None)
    assert [a.t for a in arrivals] == [0.0, 2.5]
    assert arrivals[0].session == f"@{session_hash('alice')}"
    assert arrivals[0].output_tokens == 25  # (120 - 20) ms / 4 ms
    assert read_trace([path], 4.0, 7)[0].output_tokens == 7


def test_a_line_that_is_not_a_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line(1.0, "a", []) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace line"):
        read_trace([path], 4.0, None)
    assert main([str(path)]) == 2


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "extra",
    [
        {"outcome": "ok"},
        {"decision": "x"},
        {"fleet": "x"},
        {"blocks": [None]},
        {"blocks": 5},
        {"engines": {"e": 5}},
        {"decision": {"endpoint": 5}},
        {"prompt_tokens": 10**10},
        {"t": float("inf")},
        {"t": float("nan")},
        # read unchecked before: a traceback (TypeError, OverflowError, a zip of unequal
        # rows in --mirror) or a replay 'over inf s' (found by a review helper)
        {"outcome": {"ttft_ms": "20", "duration_ms": 120.0}},
        {"outcome": {"ttft_ms": [], "duration_ms": 120.0}},
        {"outcome": {"ttft_ms": INF, "duration_ms": 120.0}},
        {"outcome": {"ttft_ms": 20.0, "duration_ms": INF}},
        {"outcome": {"ttft_ms": 20.0, "duration_ms": NAN}},
        {"t_pick": INF},
        {"t_pick": INF, "outcome": {}},
        {"t_pick": "1.0"},
        {"clock": {"pick": INF, "first": None, "end": 2.0}},
        {"clock": {"pick": 1.0, "first": "x", "end": 2.0}},
        {"clock": {"pick": 1.0, "first": None, "end": NAN}},
        {"engines": {ENDPOINTS[0]: [1.0, 2.0]}},
        {"engines": {ENDPOINTS[0]: [0.0, 1.0, 0.1, NAN, 1.0]}},
        {"engines": {ENDPOINTS[0]: [0.0, 1.0, 0.1, "0", 1.0]}},
        {"prompt_tokens": INF},
        {"output_tokens": INF},
        {"blocks": [INF]},
    ],
    ids=json.dumps,
)
def test_a_line_of_the_wrong_shape_is_named_not_a_traceback(
    tmp_path: Path, extra: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace of another version, or corrupt: each of these was a traceback (AttributeError,
    TypeError, MemoryError) or, for an infinite time, a replay that never ended."""
    path = tmp_path / "t.jsonl"
    bad = {**json.loads(line(1.0, "b", [1])), **extra}
    path.write_text(line(0.5, "a", [1]) + "\n" + json.dumps(bad) + "\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2: not a trace line" in err and "Traceback" not in err


def test_an_infinite_fleet_speed_is_not_a_measured_speed(tmp_path: Path) -> None:
    """An infinite prefill cost or step in `fleet` became the replay's engine speed: a
    replay that never ended (found by a review helper)."""
    path = tmp_path / "t.jsonl"
    fleet = {"prefill_us_per_token": INF, "step_ms": INF}
    path.write_text(line(0.5, "a", [1], fleet=fleet) + "\n")
    (arrival,) = read_trace([path], 4.0, None)
    assert (arrival.prefill_us_per_token, arrival.step_ms) == (None, None)


def test_a_long_idle_gap_replays_without_stepping_through_it(tmp_path: Path) -> None:
    """Two requests 10,000 s apart: scrapes every 50 ms of an idle fleet made it minutes."""
    path = tmp_path / "t.jsonl"
    path.write_text(line(0.0, "a", [1]) + "\n" + line(10_000.0, "a", [1, 2]) + "\n")
    arrivals = read_trace([path], 4.0, None)
    result = simulate(arrivals, ENDPOINTS, "latency", EngineConfig(decode_ms=4.0))
    assert len(result.e2e_s) == 2 and not result.errors
    # Stepping through the gap would be 10,000 s / 50 ms = 200,000 scrapes a replica; the
    # gap is skipped to IDLE_SCRAPES before the second arrival (and a few around each).
    assert result.scrapes < len(ENDPOINTS) * 4 * IDLE_SCRAPES


def test_every_strategy_replays_every_request_at_the_same_times(tmp_path: Path) -> None:
    lines = [
        line(i * 0.01, f"s{i % 5}" if i % 3 else None, list(range(i % 5, i % 5 + 4)))
        for i in range(120)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines))
    arrivals = read_trace([path], 4.0, None)
    engine = EngineConfig(max_num_seqs=8, decode_ms=4.0)
    results = {
        s: simulate(arrivals, ENDPOINTS, s, engine, name=s)
        for s in ("latency", "ring", "round-robin")
    }
    for result in results.values():
        assert len(result.e2e_s) == 120 and not result.errors
        assert sum(result.per_replica.values()) == 120
    assert results["round-robin"].per_replica == dict.fromkeys(ENDPOINTS, 30)
    # Same arrivals, same engines: the strategy is the only difference, and it shows.
    assert results["latency"].hit_rate > results["round-robin"].hit_rate
    again = simulate(arrivals, ENDPOINTS, "latency", engine)
    assert again.per_replica == results["latency"].per_replica  # deterministic


def test_replay_shapes_its_engines_to_the_speed_the_trace_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    speeds = [(300.0, 12.0), (200.0, 9.0), (250.0, 10.0)]
    fleet = [{"prefill_us_per_token": p, "step_ms": s} for p, s in speeds]
    path.write_text("\n".join(line(i * 0.1, f"s{i}", [i], fleet=f) for i, f in enumerate(fleet)))
    arrivals = read_trace([path], 4.0, None)
    fitted = fit_engine(arrivals, EngineConfig())  # medians
    assert (fitted.prefill_us_per_token, fitted.decode_ms) == (250.0, 10.0)
    assert fit_engine(arrivals, EngineConfig(decode_ms=4.0), {"decode_ms"}).decode_ms == 4.0

    def engine(*argv: str) -> dict[str, Any]:
        capsys.readouterr()
        assert main([str(path), "--json", *argv]) == 0
        shape: dict[str, Any] = json.loads(capsys.readouterr().out)["engine"]
        return shape

    assert engine()["decode_ms"] == 10.0 and engine()["prefill_us_per_token"] == 250.0
    assert engine("--engine-args", "decode_ms=4")["decode_ms"] == 4.0  # the user's wins
    assert engine("--nominal")["decode_ms"] == EngineConfig().decode_ms


def test_recorded_timing_holds_each_request_for_its_recorded_duration() -> None:
    # Three requests held 2 s each in the recorded run, then a fourth at 0.5 s. Simulated,
    # the first three ended long before (1 output token); held as recorded, they still
    # occupy three replicas, and least-load must send the fourth to the idle one.
    arrivals = [
        Arrival(i * 0.01, "m1", None, 16, (), 1, request_key=f"r{i}", duration_ms=2000.0)
        for i in range(3)
    ]
    arrivals.append(Arrival(0.5, "m1", None, 16, (), 1, request_key="r3", duration_ms=10.0))
    engine = EngineConfig(decode_ms=1.0)
    picks = []
    for seed in range(6):
        held = simulate(arrivals, ENDPOINTS, "least-load", engine, seed=seed, timing="recorded")
        assert sorted(held.per_replica.values()) == [1, 1, 1, 1]
        free = simulate(arrivals, ENDPOINTS, "least-load", engine, seed=seed)
        picks.append(sorted(free.per_replica.values()))
    assert picks[0] != [1, 1, 1, 1] or len({str(p) for p in picks}) > 1  # not forced free


def test_an_exact_tie_is_broken_the_way_the_recorded_run_broke_it() -> None:
    # One request onto four idle replicas: least-load ties them all. The recorded run's
    # random draw chose the third; a replay repeats that choice, whatever its own seed.
    arrival = Arrival(0.0, "m1", None, 16, (), 4, endpoint=ENDPOINTS[2], request_key="r0")
    for seed in range(8):
        result = simulate([arrival], ENDPOINTS, "least-load", EngineConfig(), seed=seed)
        assert result.per_replica[ENDPOINTS[2]] == 1 and result.same == 1
    # Round-robin ties everything by design: its order stays its own.
    rr = simulate([arrival], ENDPOINTS, "round-robin", EngineConfig())
    assert rr.per_replica[ENDPOINTS[0]] == 1


def test_a_replay_ends_each_request_as_the_lifecycle_does() -> None:
    # Lifecycle.finish marks the prefill over before releasing (a no-op if seen): on an
    # edge that never sees first tokens this releases the pending prefill, but must not
    # tell the registry the endpoint reports them (that would switch the latency scorer's
    # queue to pending prefill tokens).
    registry = Registry(clock=lambda: 0.0)
    scheduler = Scheduler(replay_config({"m1": ENDPOINTS}, "latency"), registry, seed=1)
    decision = scheduler.pick(RequestInfo(model="m1", request_id="r", prompt="x" * 400))
    lease = scheduler.acquire(decision)
    state = registry.get("m1", decision.endpoint.id)
    assert state is not None and state.pending_prefill > 0 and not state.reports_first_token
    lease.end(Outcome.SUCCESS)
    assert state.pending_prefill == 0 and not state.reports_first_token and state.inflight == 0


def test_mirroring_gives_the_router_the_engine_queues_the_recorded_run_saw() -> None:
    # The recorded host kept 50 requests waiting on three replicas (CPU starvation the
    # simulated engines do not have), so the recorded router sent all twelve concurrent
    # requests to the fourth. Mirrored, the replay sees those queues and does the same;
    # without, the fourth's own growing queue sends some elsewhere.
    busy = (50.0, 1.0, 0.1, 0.0)
    view = {e: (busy if e != ENDPOINTS[3] else (0.0, 1.0, 0.1, 0.0)) for e in ENDPOINTS}
    arrivals = [
        Arrival(
            0.2 + 0.002 * i,
            "m1",
            None,
            100,
            (),
            4,
            endpoint=ENDPOINTS[3],
            request_key=f"r{i}",
            duration_ms=1000.0,
            engines=view,
        )
        for i in range(12)
    ]
    engine = EngineConfig(decode_ms=2.0)
    fixes = mirror_corrections(arrivals, ENDPOINTS, engine)
    mirrored = simulate(
        arrivals, ENDPOINTS, "latency", engine, timing="recorded", corrections=fixes
    )
    assert mirrored.per_replica[ENDPOINTS[3]] == 12
    plain = simulate(arrivals, ENDPOINTS, "latency", engine, timing="recorded")
    assert plain.per_replica[ENDPOINTS[3]] < 12


def test_mirroring_needs_the_recorded_views_and_endpoints(tmp_path: Path) -> None:
    arrivals = [Arrival(0.0, "m1", None, 16, (), 4, endpoint=ENDPOINTS[0])]
    with pytest.raises(ValueError, match="no `engines` views"):
        mirror_corrections(arrivals, ENDPOINTS, EngineConfig())
    path = tmp_path / "t.jsonl"
    path.write_text(line(0.0, "a", [1]))
    assert main([str(path), "--mirror"]) == 2  # an old trace: says why, exits 2


def scraped_fleet(now: float) -> tuple[Registry, Scheduler, list[EndpointState]]:
    """A `latency` router over ENDPOINTS, each scraped at `now`: 2 running, none waiting."""
    registry = Registry(clock=lambda: now)
    scheduler = Scheduler(replay_config({"m1": ENDPOINTS}, "latency"), registry, seed=1)
    for s in registry.states("m1"):
        registry.record_scrape("m1", s.id, EngineMetrics(waiting=0.0, running=2.0, kv_usage=0.1))
    return registry, scheduler, registry.states("m1")


def test_a_mirrored_pick_sees_metrics_as_stale_or_fresh_as_the_recorded_pick_did() -> None:
    now = 10.0
    registry, scheduler, states = scraped_fleet(now)
    states[3].scraped_at = now - 60  # the simulated scrape of the last went stale
    fix = correction(
        {e: None if e == ENDPOINTS[0] else (4.0, 2.0, 0.5, 0.0) for e in ENDPOINTS},
        None,
        {e: None if e == ENDPOINTS[3] else (0.0, 2.0, 0.1, 0.0) for e in ENDPOINTS},
        (None, None, None, None),
    )
    undo = apply(fix, states, [sc for sc, _ in scheduler.routers["m1"].scorers], now)
    seen = fresh_metrics_of(states, now, registry.staleness)
    assert seen[states[0]] is None  # stale as recorded
    shifted = seen[states[1]]
    assert shifted is not None and shifted.waiting == 4.0  # plus the recorded residual
    assert shifted.kv_usage == pytest.approx(0.5)
    assert seen[states[3]] is not None  # fresh as recorded
    undo()
    seen = fresh_metrics_of(states, now, registry.staleness)
    restored = seen[states[1]]
    assert seen[states[0]] is not None and restored is not None and restored.waiting == 0.0
    assert seen[states[3]] is None


def test_a_mirrored_pick_sees_the_prefills_the_recorded_engines_count_left_open() -> None:
    """Recorded behind Envoy without first tokens: endpoint 0's engine count had left 2,000
    tokens open, its scrape 0.05 s old; endpoint 1 was fresh but not counted (the
    time-drained queue). The replay's own counts differ; the pick sees the recorded ones."""
    now = 10.0
    _, scheduler, states = scraped_fleet(now)
    for s in states:
        s.counts_first_tokens, s.counted_prefill = True, 500.0  # the simulated engines' view
    view = (0.0, 2.0, 0.1, 0.0, 2.0)
    recorded = {e: view for e in ENDPOINTS} | {ENDPOINTS[0]: (*view, 2000.0, 0.05)}
    fix = correction(recorded, None, {e: view for e in ENDPOINTS}, (None, None, None, None))
    scorers = [sc for sc, _ in scheduler.routers["m1"].scorers]
    latency = next(sc for sc in scorers if isinstance(sc, LatencyScorer))
    undo = apply(fix, states, scorers, now)
    try:
        assert states[0].counted_prefill == 2000.0 and states[0].scraped_at == now - 0.05
        assert not states[1].counts_first_tokens  # as the recorded router saw it
        scheduler.pick(RequestInfo(model="m1", request_id="r", prompt="x" * 400))
        queue = latency.terms()["queue_s"]
        assert queue[0] == pytest.approx(2000 * latency.prefill_s - 0.05)
        assert queue[1] == 0.0  # busy_until never set: nothing sent there
    finally:
        undo()
    assert states[0].counted_prefill == 500.0 and states[0].scraped_at == now
    assert all(s.counts_first_tokens for s in states)


def test_a_mirrored_pick_knows_where_the_recorded_router_knew_the_batch() -> None:
    """The recorded router had seen endpoint 0 full at its peak of 2 with requests waiting
    (the peak is its batch), endpoint 1 not; the replay's own scrapes know neither. A trace
    from before `batches` leaves the simulated knowledge alone."""
    now = 10.0
    _, _, states = scraped_fleet(now)
    view = (0.0, 2.0, 0.1, 0.0, 2.0)
    states[1].peak_is_batch = True  # the simulated scrapes' own conclusion
    recorded = dict.fromkeys(ENDPOINTS, view)
    none = (None, None, None, None)
    fix = correction(recorded, None, recorded, none, frozenset({ENDPOINTS[0]}))
    undo = apply(fix, states, [], now)
    assert [s.peak_is_batch for s in states[:2]] == [True, False]
    undo()
    assert [s.peak_is_batch for s in states[:2]] == [False, True]
    undo = apply(correction(recorded, None, recorded, none), states, [], now)
    assert [s.peak_is_batch for s in states[:2]] == [False, True]
    undo()


def test_a_mirrored_pick_reads_the_step_phase_the_recorded_pick_read() -> None:
    """The recording edge had relayed a token from endpoint 0 15 ms before the pick and
    none lately from the others; the simulated engines' own tokens say otherwise. The
    latency scorer reads the phase then whatever its own calibration says. A trace without
    `tokens` (a pick that did not read the phase, or from before it) leaves the simulated
    phases alone and the phase off: the replay's calibration measured the step 16 picks
    sooner than the recorded router's, and 1 run in 8 of the e2e replay test diverged."""
    now = 10.0
    _, scheduler, states = scraped_fleet(now)
    scorers = [sc for sc, _ in scheduler.routers["m1"].scorers]
    latency = next(sc for sc in scorers if isinstance(sc, LatencyScorer))
    for s in states:
        s.token_at = now - 0.001
    recorded = dict.fromkeys(ENDPOINTS, (0.0, 2.0, 0.1, 0.0))
    none = (None, None, None, None)
    fix = correction(recorded, None, recorded, none, tokens={ENDPOINTS[0]: 0.015})
    assert not latency.step_phase  # no engine here publishes its step
    undo = apply(fix, states, scorers, now)
    assert [s.token_at for s in states] == [now - 0.015] + [float("-inf")] * 3
    assert latency.step_phase
    undo()
    assert [s.token_at for s in states] == [now - 0.001] * 4
    assert latency.phase_override is None and not latency.step_phase
    for s in states:
        s.calibration.step.add(0.2, 10.0)  # now they do
    scheduler.pick(RequestInfo(model="m1", request_id="r", prompt="x" * 400))
    assert latency.step_phase
    undo = apply(correction(recorded, None, recorded, none), states, scorers, now)
    assert [s.token_at for s in states] == [now - 0.001] * 4
    assert not latency.step_phase
    undo()
    assert latency.step_phase


def test_a_mirrored_pick_prices_the_replicas_the_recorded_router_saw_slower() -> None:
    """The recorded router saw endpoint 2 at 1.9x the fastest (the demo's starved engines
    run unevenly); the replay's own engines are alike. Mirrored, the pick prices endpoint
    2's prefill at that multiple; undone, alike again."""
    now = 10.0
    _, scheduler, states = scraped_fleet(now)
    scorers = [sc for sc, _ in scheduler.routers["m1"].scorers]
    latency = next(sc for sc in scorers if isinstance(sc, LatencyScorer))
    view = (0.0, 2.0, 0.1, 0.0, 2.0)
    recorded = dict.fromkeys(ENDPOINTS, view)
    none = (None, None, None, None)
    fix = correction(recorded, None, recorded, none, None, {ENDPOINTS[2]: 1.9})
    info = RequestInfo(model="m1", request_id="r", prompt="x" * 4000)
    undo = apply(fix, states, scorers, now)
    try:
        scheduler.pick(info)
        prefill = latency.terms()["prefill_s"]
        assert prefill[2] == pytest.approx(1.9 * prefill[0]) and prefill[1] == prefill[0]
    finally:
        undo()
    assert latency.speeds_override is None
    scheduler.pick(info)
    assert len(set(latency.terms()["prefill_s"])) == 1


def test_a_mirrored_pick_prices_a_sessionless_prompt_at_the_recorded_net_cost() -> None:
    # Recorded behind Envoy: the engines' ratio said 200 us a token, the net cost 20, and a
    # sessionless prompt was priced at 20. A replay that kept only the ratio priced it 10x
    # higher; old traces (the speed's four alone) still replay at the ratio.
    now = 10.0
    registry = Registry(clock=lambda: now)
    scheduler = Scheduler(replay_config({"m1": ENDPOINTS}, "latency"), registry, seed=1)
    states = registry.states("m1")
    scorers = [sc for sc, _ in scheduler.routers["m1"].scorers]
    latency = next(sc for sc in scorers if isinstance(sc, LatencyScorer))
    speed = (None, None, None, None)
    prompt = "x" * 4000  # 1,000 tokens, none cached anywhere
    uncached = 1000

    def priced(costs: tuple[float | None, ...]) -> float:
        undo = apply(correction({}, costs, {}, speed), states, scorers, now)
        try:
            request = RequestInfo(model="m1", request_id="r", prompt=prompt, prompt_tokens=1000)
            scheduler.pick(request)
        finally:
            undo()
        return max(latency.terms()["prefill_s"]) / uncached

    recorded = (200e-6, 0.02, 500.0, 1.0, 1.0, None, 20e-6)
    assert priced(recorded) == pytest.approx(20e-6)
    assert priced(recorded[:4]) == pytest.approx(200e-6)
    # The first tokens' slope, where the recorded edge saw first tokens, wins over the net.
    assert priced((*recorded[:5], 30e-6, 20e-6)) == pytest.approx(30e-6)


def test_a_trace_costs_line_reads_back_every_price() -> None:
    row = {"prefill_us_per_token": 200.0, "step_ms": 20.0, "tokens_per_prefill": 500.0,
           "service_ms": 1000.0, "engine_tokens": 1.25, "observed_us_per_token": None,
           "marginal_us_per_token": 20.0}  # fmt: skip
    assert _costs(row) == pytest.approx((200e-6, 0.02, 500.0, 1.0, 1.25, None, 20e-6))
    old = {k: row[k] for k in ("prefill_us_per_token", "step_ms", "tokens_per_prefill")}
    assert _costs(old)[4:] == (None, None, None)


def test_a_line_ended_unknown_at_the_pick_replays_the_default_output_length(
    tmp_path: Path,
) -> None:
    """A gateway that reports no response (NGINX Gateway Fabric) ends the lease at the pick
    as `unknown`: its line's duration is the pick's, and replay read it as a 1-token answer
    (a trace recorded behind NGF replayed as an idle fleet). Found by a review helper."""
    from llmgw.config import TraceSpec  # noqa: PLC0415
    from llmgw.extproc.translate import Exchange  # noqa: PLC0415
    from llmgw.gateway import Gateway  # noqa: PLC0415
    from llmgw.lifecycle import Hooks  # noqa: PLC0415
    from llmgw.runtime.trace import close_trace, traced  # noqa: PLC0415
    from llmgw.testing.extproc import make_config, request_body, request_headers  # noqa: PLC0415

    trace = tmp_path / "trace.jsonl"
    config = make_config().model_copy(update={"trace": TraceSpec(path=str(trace))})
    hooks = traced(Hooks(edge="extproc"), config.trace)
    exchange = Exchange(Gateway(Scheduler(config)), hooks)
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "write a long story"}]}'
    exchange.handle(request_headers({"content-type": "application/json", "x-request-id": "n1"}))
    exchange.handle(request_body(body, end_of_stream=True))
    exchange.close()  # NGF's stream ends right after the pick
    close_trace(hooks)
    (line,) = trace.read_text().splitlines()
    assert json.loads(line)["outcome"]["outcome"] == "unknown"
    (arrival,) = read_trace([trace], decode_ms=4.0, output_tokens=None)
    assert arrival.output_tokens == 16


def test_a_file_appended_after_a_reboot_replays_in_arrival_order(tmp_path: Path) -> None:
    """The trace path is fixed and opened for append, so a router restarted on another
    node (same volume) or after a host reboot adds its lines to the same file; its
    monotonic `clock` restarted near zero. The replay trusts `clock` whenever the trace is
    one file with clocks on every line, so Tuesday's requests replay before Monday's."""
    rows = []
    for i in range(3):  # Monday: a host up for 14 hours
        wall, clock = 1_700_000_000.0 + i, 50_000.0 + i
        rows.append((wall, clock, f"monday-{i}"))
    for i in range(3):  # Tuesday, after a reboot: the host up for 2 minutes
        wall, clock = 1_700_086_400.0 + i, 120.0 + i
        rows.append((wall, clock, f"tuesday-{i}"))
    lines = [
        json.dumps(
            {
                "t": wall,
                "t_pick": wall,
                "clock": {"pick": clock, "first": clock + 0.02, "end": clock + 0.1},
                "model": "m1",
                "session": session_hash(key),
                "rid": None,
                "prompt_tokens": 100,
                "blocks": [],
                "decision": {"endpoint": "10.0.0.1:8000"},
                "outcome": {"ttft_ms": 20.0, "duration_ms": 100.0},
            }
        )
        for wall, clock, key in rows
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    arrivals = read_trace([path], 4.0, None)
    order = [a.session for a in arrivals]
    assert order == [f"@{session_hash(key)}" for _, _, key in rows], "replayed out of order"
