"""``relayd bench --profile DIR`` (no ``--gpu``): the daemons' profiles, per transfer.

The daemons run through the wrapper, end to end, are in
tests/integration/test_bench_smoke.py (the profile test).
"""

from __future__ import annotations

import cProfile
from pathlib import Path

import pytest

from relayd_bench import _cli, _daemon_profile


def _per_transfer() -> int:
    return sum(range(10))


def _once() -> int:
    return 1


def _profile(path: Path, transfers: int) -> Path:
    """A profile of ``transfers`` calls of one step, with setup called once."""
    profile = cProfile.Profile()
    profile.enable()
    _once()
    for _ in range(transfers):
        _per_transfer()
    profile.disable()
    profile.dump_stats(path)
    return path


def _rows(text: str) -> dict[str, tuple[float, float, float]]:
    """The first table's rows, by function."""
    first = text.split("\n\n")[1].splitlines()[2:]
    return {
        parts[3]: (float(parts[0]), float(parts[1]), float(parts[2]))
        for parts in (line.split(maxsplit=3) for line in first)
    }


def test_a_report_gives_each_function_per_transfer_and_leaves_out_setup(tmp_path: Path) -> None:
    text = _daemon_profile.report(_profile(tmp_path / "d.prof", 40), 20, "daemon d")
    assert text.startswith("daemon d: 20 transfers;")
    rows = _rows(text)
    step = next(v for k, v in rows.items() if k.endswith("(_per_transfer)"))
    assert step[0] == 2.0  # 40 calls over 20 transfers
    assert step[2] >= step[1] > 0
    # called once in the run: below one call every other transfer
    assert not any(k.endswith("(_once)") for k in rows)
    assert "by with what it calls time" in text


def test_a_daemon_that_moved_nothing_is_reported_per_call(tmp_path: Path) -> None:
    text = _daemon_profile.report(_profile(tmp_path / "d.prof", 3), 0, "daemon d")
    step = next(v for k, v in _rows(text).items() if k.endswith("(_per_transfer)"))
    assert step[0] == 3.0


def test_reports_are_written_beside_the_profiles_that_exist(tmp_path: Path) -> None:
    _profile(tmp_path / "relayd-writer.prof", 4)
    sockets = {"/run/x/relayd-writer.sock": 4, "/run/x/relayd-reader.sock": 4}
    written = _daemon_profile.write_reports(tmp_path, sockets)
    assert written == [tmp_path / "relayd-writer.txt"]  # the reader's was never written
    assert written[0].read_text().startswith("daemon relayd-writer: 4 transfers;")


def test_the_profile_is_named_after_the_daemons_socket(tmp_path: Path) -> None:
    args = ["serve", "--socket", "/run/x/relayd-reader.sock", "--node-id", "n"]
    assert _daemon_profile.profile_path(tmp_path, args) == tmp_path / "relayd-reader.prof"
    with pytest.raises(SystemExit, match="--socket"):
        _daemon_profile.profile_path(tmp_path, ["serve"])


def test_the_wrapper_runs_only_relayd(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="usage"):
        _daemon_profile.main([str(tmp_path), "python", "-m", "something-else"])


@pytest.mark.parametrize(
    "more",
    [
        ["--socket", "/nonexistent.sock"],
        ["--reader-socket", "/nonexistent.sock"],
        ["--timeline"],
        ["--breakdown"],
    ],
)
def test_profile_refuses_daemons_it_does_not_start_or_that_run_another_way(
    tmp_path: Path, more: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        _cli.main(["--methods", "relayd-shm", "--profile", str(tmp_path), *more])
    assert raised.value.code == 2
    assert "--profile" in capsys.readouterr().err
