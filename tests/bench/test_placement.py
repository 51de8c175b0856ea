"""bench/placement.py: conversation placement and the slowest tenth, from routing records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.placement import analyse, main


def _write(folder: Path, name: str, rows: list[dict[str, object]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}@chat.records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(
    conv: int,
    turn: int,
    replica: str,
    sent: float,
    ttft: float | None,
    chars: int,
    status: int = 200,
) -> dict[str, object]:
    """A record as bench/routing.py writes it (`RequestRecord.to_json`)."""
    return {
        "conversation": conv,
        "turn": turn,
        "session_id": None,
        "replica": replica,
        "sent_s": sent,
        "ttft_s": ttft,
        "e2e_s": None if ttft is None else ttft + 0.5,
        "prompt_chars": chars,
        "status": status,
        "output_tokens": 1,
    }


def test_counts_homes_moves_history_and_the_slowest_tenth(tmp_path: Path) -> None:
    # Conversation 0 homes on replica 0 and its second turn moves to 1 (slow); 1 and 2
    # home on replica 1; replica 2 gets nothing in this seed but exists in the other.
    _write(
        tmp_path / "s1",
        "r",
        [
            _row(0, 0, "0", 0.0, 0.05, 100),
            _row(0, 1, "1", 0.3, 0.90, 300),
            _row(1, 0, "1", 0.0, 0.05, 100),
            _row(1, 1, "1", 1.2, 0.06, 200),
            _row(2, 0, "1", 0.1, 0.07, 100),
            _row(2, 1, "1", 2.0, 0.05, 100, status=500),  # failed: not placed
        ],
    )
    _write(tmp_path / "s2", "r", [_row(0, 0, "2", 0.0, 0.05, 100)])
    result = analyse(tmp_path, "chat")
    s1, s2 = result["r"]["seeds"]
    assert s1.conversations == 3 and s1.per_replica == [0, 1, 2]
    assert s1.moved_turns == 1
    # final histories: 300 on replica 0's conversation, 200 + 100 on replica 1's
    assert s1.history_imbalance == round(300 / (600 / 3), 2)
    assert s2.per_replica == [0, 0, 1]
    tail = result["r"]["tail"]
    assert tail.requests == 6
    # the slowest request is the moved second turn, which met replica 1's first turns in flight
    assert tail.moved == (1, 1) and tail.first_turns == (0, 4)
    assert tail.inflight[0] == 2.0


def test_a_folder_without_the_cell_is_a_usage_error(tmp_path: Path) -> None:
    _write(tmp_path / "s1", "r", [_row(0, 0, "0", 0.0, 0.05, 100)])
    with pytest.raises(SystemExit, match=r"no \*@other\.records\.jsonl"):
        main([str(tmp_path), "--cell", "other"])


def test_the_p90_is_routings_of_the_same_records(tmp_path: Path) -> None:
    """The p90 took another rank (the 4th of 5, routing's nearest rank the 5th) and
    dropped failed requests, which routing counts as slower than any: 2 timeouts in 10
    read 80 ms here, `fail` there. (found by a review helper)"""
    _write(tmp_path / "s1", "a", [_row(k, 0, "0", 0.0, (k + 1) / 100, 10) for k in range(5)])
    rows = [_row(k, 0, "0", 0.0, (k + 1) / 100, 10) for k in range(8)]
    rows += [_row(8, 0, "0", 0.0, None, 10, status=0), _row(9, 0, "0", 0.0, None, 10, status=0)]
    _write(tmp_path / "s1", "b", rows)
    result = analyse(tmp_path, "chat")
    assert result["a"]["seeds"][0].ttft_p90_ms == 50.0
    assert math.isinf(result["b"]["seeds"][0].ttft_p90_ms)
    assert result["b"]["tail"].requests == 8 and math.isinf(result["b"]["tail"].p90_ms)
    out = tmp_path / "p.json"
    main([str(tmp_path), "--cell", "chat", "--out", str(out)])
    assert json.loads(out.read_text())["b"]["seeds"][0]["ttft_p90_ms"] is None
