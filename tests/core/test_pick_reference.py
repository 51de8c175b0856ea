"""Speed-ups of `Scheduler.pick` must not change a decision: the `latency` preset replays a
seeded scenario (`pick_scenario.py`) and must give the frozen endpoints, fallbacks,
predictions and Rationale values exactly."""

from __future__ import annotations

import json

import pytest

from . import pick_scenario


@pytest.mark.parametrize("fleet", pick_scenario.FLEETS, ids=lambda f: f"{f[0]}-endpoints")
def test_latency_preset_makes_the_frozen_reference_decisions(
    fleet: tuple[int, int, int],
) -> None:
    endpoints, picks, seed = fleet
    expected = json.loads(pick_scenario.FIXTURE.read_text())[f"{endpoints}x{picks}@{seed}"]
    got = pick_scenario.run_fleet(endpoints, picks, seed)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        # The first pick that differs, with both records: the later ones follow from it.
        assert g == e, f"pick {i} changed: got {g}, reference {e}"
