"""Speed-ups of `Scheduler.pick` must not change a decision: the `latency` preset replays a
seeded scenario (`pick_scenario.py`) and must give the frozen endpoints, fallbacks,
predictions and Rationale values exactly."""

from __future__ import annotations

import json

import pytest

from llmgw.hashring import HashRing, ring_position
from llmgw.scheduling.prefix import PrefixIndex

from . import pick_scenario


@pytest.mark.parametrize("fleet", pick_scenario.FLEETS, ids=lambda f: pick_scenario.fleet_key(*f))
def test_latency_preset_makes_the_frozen_reference_decisions(
    fleet: tuple[int, int, int, bool],
) -> None:
    expected = json.loads(pick_scenario.FIXTURE.read_text())[pick_scenario.fleet_key(*fleet)]
    got = pick_scenario.run_fleet(*fleet)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        # The first pick that differs, with both records: the later ones follow from it.
        assert g == e, f"pick {i} changed: got {g}, reference {e}"


def test_exact_fleet_reference_holds_exact_and_approximate_cache_hits() -> None:
    # The exact fleet's records end with the chosen endpoint's cached_tokens and exact
    # terms: the frozen picks must include exact hits from KV events and approximate ones,
    # so the reference keeps covering both paths of the latency scorer.
    fleet = next(f for f in pick_scenario.FLEETS if f[3])
    records = json.loads(pick_scenario.FIXTURE.read_text())[pick_scenario.fleet_key(*fleet)]
    picked = [r for r in records if r[0] != "error"]
    assert sum(1 for r in picked if r[-1] == 1.0 and r[-2] > 0) > len(picked) // 2
    assert any(r[-1] == 0.0 and r[-2] > 0 for r in picked)


def test_prefix_and_ring_hashes_keep_their_values() -> None:
    # Traces record both (block hashes, session ring positions), and a rotation of every
    # ring position (signed instead of unsigned) would leave every decision unchanged: so
    # the values themselves are pinned, as the code before the speed-ups computed them.
    text = "".join(chr(33 + (i * 7) % 90) for i in range(700)) + "é" * 200
    assert PrefixIndex(block_chars=256).hashes(text) == [
        -2703057965073965199,
        5260840908211505115,
        8774221177607816528,
        3206664643824942011,
    ]
    assert ring_position("session-42") == 10838242494130830437
    ring = HashRing([f"10.0.0.{i}:8000" for i in range(1, 9)])
    assert ring.candidates("session-42") == ["10.0.0.7:8000", "10.0.0.4:8000", "10.0.0.5:8000"]
    assert ring.candidates("session-42") == ring.candidates("session-42")  # (cached walk)
