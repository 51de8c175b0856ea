"""The routing benchmarks measure every contender alike: pooling does not turn llmgw's
decision trace on, an earlier run's records are not pooled as this one's, and xsim's hot
sessions hash anew per seed. Nothing here starts a process or a benchmark: the processes
are replaced by fakes, the workload generators run in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import routing
from bench.loadclient import RequestRecord
from bench.routing import Contender, pool, records_file, seed_records
from bench.workloads.grid import REGIMES, regime_workload
from bench.xsim.workloads import build as xsim_build


@pytest.fixture(autouse=True)
def _default_loop_policy() -> Iterator[None]:
    yield
    asyncio.set_event_loop_policy(None)  # routing.main installs uvloop's


def _record(ttft: float) -> RequestRecord:
    return RequestRecord(
        conversation=0, turn=0, session_id="s", sent_s=0.0, ttft_s=ttft, e2e_s=ttft,
        status=200, output_tokens=8, prompt_chars=100,
    )  # fmt: skip


# -- 1. `--seeds` turns llmgw's decision trace on for llmgw contenders only ----------------


def test_seeds_without_trace_option_do_not_turn_on_llmgw_decision_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--trace DIR` is the option that writes llmgw's decision trace (100 % sampling, ~50 us
    of router CPU a request, README "Cost at 100 % sampling"). A pooled run (`--seeds`,
    how every headline table since session 39 was made) without `--trace` must not write
    one: the peers and client-side contenders write none, so only llmgw would pay it."""
    seen: list[tuple[str, Path | None]] = []

    @contextlib.contextmanager
    def fake_spawn(args: list[str], stdout: Any = None) -> Iterator[Any]:
        yield types.SimpleNamespace(urls=["http://127.0.0.1:9"])

    @contextlib.contextmanager
    def fake_start(
        contender: Contender,
        upstreams: list[str],
        peers: dict[str, str],
        scratch: Path,
        trace_dir: Path | None = None,
    ) -> Iterator[str]:
        seen.append((contender.name, trace_dir))
        yield ""  # no warm-up needed

    async def fake_run_one(
        base: str, upstreams: list[str], workload: Any, timeout_s: float,
        pick_url: Any = None, metrics_path: str = "/metrics", records_to: Path | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        records = [_record(0.1)]
        if records_to is not None:
            records_to.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
        return routing.summarize(records, 1.0, [], [], [])

    monkeypatch.setattr(routing, "spawn", fake_spawn)
    monkeypatch.setattr(routing, "start_contender", fake_start)
    monkeypatch.setattr(routing, "run_one", fake_run_one)
    monkeypatch.setattr(routing, "ensure_peers", lambda install=False: {})
    monkeypatch.setattr(routing, "write_results", lambda name, data: Path("/dev/null"))
    monkeypatch.setattr(routing, "heatmap", lambda results, path: None)

    rc = routing.main(
        ["--seeds", "1,2", "--cells", "chat-light", "--only", "envoy:latency", "--window", "1"]
    )
    assert rc == 0
    assert [name for name, _ in seen] == ["envoy:latency", "envoy:latency"]
    # The records folder each seed pools from is handed over as the decision-trace folder.
    assert [trace for _, trace in seen] == [None, None]


# -- 2. records an earlier run left in `--trace DIR` are pooled as this run's ----------------


def test_pool_leaves_out_a_contender_that_wrote_no_records_this_run(tmp_path: Path) -> None:
    """`pool`: "A contender missing a seed's records (it failed to start) is left out of that
    cell." With `--trace DIR --seeds 1,2` run twice into the same DIR, a contender that fails
    in seed 2 the second time (replicas still busy, a peer that does not start) has its
    seed-2 requests taken from the first run's file, silently, as if measured now."""
    ring = Contender("client:ring", "client", policy="ring")
    cell = "chat-light"
    # Run 1: both seeds ran; seed 2's p90 was 5 s (say, another load on the machine).
    with seed_records([1, 2], tmp_path) as folders:
        for folder, ttft in zip(folders, (0.1, 5.0), strict=True):
            assert folder is not None
            path = records_file(folder, ring.name, cell)
            path.write_text(json.dumps(_record(ttft).to_json()) + "\n")
    # Run 2 into the same DIR: seed 1 runs, seed 2 fails to start (nothing written).
    with seed_records([1, 2], tmp_path) as folders:
        assert folders[0] is not None
        records_file(folders[0], ring.name, cell).write_text(
            json.dumps(_record(0.1).to_json()) + "\n"
        )
        pooled = pool(tmp_path, [1, 2], [cell], [ring])
    assert ring.name not in pooled[cell], pooled[cell].get(ring.name)


# -- 3. xsim hot-sessions: the seed does not change which replica a user hashes to ---------


def test_xsim_hot_sessions_session_ids_change_with_the_seed() -> None:
    """Every other seeded workload names its sessions with the seed (`chat-{seed}-{i}`,
    `agent-{seed}-{i}`, the grid's `{cell}-{seed}-u{user}`), so a new seed is a new draw of
    the hash ring's placement. xsim's hot-sessions keys sessions `user-{u}` with user 0 the
    hottest in every seed: consistent hashing (client:ring, vllm-router consistent_hash,
    envoy:ring) puts the same users on the same replicas in every seed, so `--seeds 1,2,3`
    repeats one placement three times and the `*` rule's "slower in every seed" is one
    draw, not three."""
    ids = [{c.session_id for c in xsim_build("hot-sessions", s).conversations} for s in (1, 2)]
    assert not ids[0] & ids[1], sorted(str(i) for i in ids[0] & ids[1])[:5]
    # As the real grid's hot cells do:
    speed = routing.engine_speed("low")
    grid = [
        {c.session_id for c in regime_workload(REGIMES["hot-zipf"], speed, seed=s).conversations}
        for s in (1, 2)
    ]
    assert not grid[0] & grid[1]
