"""The CLI in a child process, the background-thread fleet, and flag validation."""

from __future__ import annotations

import contextlib
import signal

import httpx
import pytest

from llmgw.sim import SimFleet
from llmgw.sim.cli import build_parser, main
from llmgw.sim.fleet import spawn


def test_cli_serves_several_replicas_and_a_crash_fault_exits_the_process() -> None:
    args = ["--replicas", "3", "--base-port", "0", "--time-scale", "0", "--models", "a,b"]
    with spawn(args) as sim:
        assert len(set(sim.ports)) == 3
        for index, url in enumerate(sim.urls):
            response = httpx.get(url + "/health")
            assert response.status_code == 200
            assert response.headers["x-sim-replica"] == str(index)
        chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(sim.urls[2] + "/v1/chat/completions", json=chat).status_code == 200
        # The answer is written before the exit, so it may or may not arrive.
        with contextlib.suppress(httpx.TransportError):
            httpx.post(sim.urls[1] + "/admin/faults", json={"crash": True})
        assert sim.process.wait(10) == 70


def test_cli_stops_cleanly_on_sigterm_and_applies_fault_flags() -> None:
    with spawn(["--port", "0", "--engine", "sglang", "--fault-status", "429"]) as sim:
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(sim.urls[0] + "/v1/chat/completions", json=chat).status_code == 429
        assert "sglang:num_queue_reqs" in httpx.get(sim.urls[0] + "/metrics").text
        sim.process.send_signal(signal.SIGTERM)
        assert sim.process.wait(10) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "0", "--replicas", "2"],
        ["--engine", "tgi"],
        ["--error-rate", "3"],
        ["--kv-blocks", "0"],
        ["--model", "a", "--models", "a,b"],
        ["--max-num-batched-tokens", "8", "--max-num-seqs", "16"],
    ],
)
def test_bad_flags_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_parser_defaults_are_sane() -> None:
    args = build_parser().parse_args([])
    assert (args.host, args.base_port, args.replicas, args.engine) == (
        "127.0.0.1",
        8100,
        1,
        "vllm",
    )


def test_fleet_in_a_background_thread_for_sync_tests() -> None:
    with SimFleet.start_in_thread(replicas=2, model="m1", time_scale=0) as fleet:
        assert httpx.get(fleet.urls[1] + "/health").status_code == 200
        fleet.set_faults(1, status=503)
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(fleet.urls[1] + "/v1/chat/completions", json=chat).status_code == 503
        assert httpx.post(fleet.urls[0] + "/v1/chat/completions", json=chat).status_code == 200
        fleet.reset(1)
        assert httpx.post(fleet.urls[1] + "/v1/chat/completions", json=chat).status_code == 200


def test_chunked_prefill_flag_reaches_the_engine_config() -> None:
    from llmgw.sim.cli import _fleet  # noqa: PLC0415

    args = build_parser().parse_args(["--max-num-batched-tokens", "512"])
    assert _fleet(args).options.engine_config.max_num_batched_tokens == 512
    assert build_parser().parse_args([]).max_num_batched_tokens is None


def test_kv_events_flag_publishes_on_a_free_port_per_replica() -> None:
    from llmgw.sim.cli import _fleet  # noqa: PLC0415

    assert _fleet(build_parser().parse_args(["--kv-events"])).options.kv_events_port == 0
    assert _fleet(build_parser().parse_args([])).options.kv_events_port is None


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--port", "70000"], "70000 is not a port"),
        (["--base-port", "65535", "--replicas", "2"], "passes port 65535"),
    ],
)
def test_ports_out_of_range_are_refused(
    argv: list[str], phrase: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--port 70000 listened on 4464; the second of two replicas at 65535 on a random port."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and phrase in capsys.readouterr().err
