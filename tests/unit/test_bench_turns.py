"""The breakdown's daemon side (relayd_bench._turns): turns timed in the daemon, read back by window.

The daemon run through the wrapper, end to end, is in
tests/integration/test_bench_smoke.py (the breakdown test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayd_bench import _turns
from relayd_bench._turns import CPU_PER_TRANSFER, END, PER_TRANSFER, STEPS, TURN, Window


def _turn(end: int, turn: int, **steps: int) -> dict[str, int]:
    return {END: end, TURN: turn, **steps}


def test_a_window_summarizes_the_turns_that_ended_in_it() -> None:
    turns = [
        _turn(5, 999_000),  # before the window
        _turn(10, 3_000, _handle=2_000, _count=500),
        _turn(20, 5_000, _handle=4_000),
        _turn(30, 7_000, _handle=6_000, _count=1_500),
        _turn(41, 999_000),  # after it
    ]
    got = Window(10, 40, transfers=6).summary(turns)
    assert got[TURN] == 5.0  # µs, the median turn
    assert got["_handle"] == 4.0
    assert got["_count"] == 0.5  # a step a turn skipped counts as 0 there
    assert got["decode_frame"] == 0.0
    assert got[PER_TRANSFER] == 0.5  # 3 turns over 6 transfers
    assert got[CPU_PER_TRANSFER] == 2.5  # (3 + 5 + 7) µs over 6 transfers
    assert {where for _, where in STEPS} <= set(got)


def test_a_window_with_no_turns_has_no_medians_and_costs_nothing() -> None:
    got = Window(10, 40, transfers=6).summary([_turn(50, 1_000)])
    assert got[TURN] is None and all(got[where] is None for _, where in STEPS)
    assert (got[PER_TRANSFER], got[CPU_PER_TRANSFER]) == (0.0, 0.0)


def test_turns_are_read_back_as_written_and_none_when_the_daemon_wrote_none(
    tmp_path: Path,
) -> None:
    path = tmp_path / "turns.jsonl"
    assert _turns.read(path) == []
    rows = [_turn(1, 2, _flush=3), _turn(4, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _turns.read(path) == rows


def test_the_wrapper_runs_only_relayd(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="usage"):
        _turns.main([str(tmp_path / "out"), "python", "-m", "something-else"])
