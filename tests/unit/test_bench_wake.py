"""The machine's wake probe: what it measures and how the table shows it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from relayd_bench import _wake
from relayd_bench._stats import cpuidle_info, machine_info, tcp_info
from relayd_bench._table import _machine_line
from relayd_bench._wake import Wake

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not TWO_CORES, reason="the probe needs two cores")
def test_probe_times_a_wake_up_on_another_core_and_gives_this_process_its_cores_back() -> None:
    before = os.sched_getaffinity(0)
    w = _wake.probe(samples=5, pause=0.0005, short=0.00005)
    assert w is not None and (w.pause_s, w.short_pause_s) == (0.0005, 0.00005)
    assert w.busy_us > 0 and w.short_us > 0 and w.idle_us > 0
    assert w.send_busy_us > 0 and w.send_short_us > 0 and w.send_idle_us > 0
    assert os.sched_getaffinity(0) == before  # pinned only while it measured


def test_a_process_on_one_core_skips_the_probe() -> None:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert _wake.probe(samples=5, pause=0.0005) is None
    finally:
        os.sched_setaffinity(0, before)


def test_the_line_names_each_wake_up_and_its_idle_time() -> None:
    w = Wake(pause_s=0.001, busy_us=12.3, idle_us=70.4, send_busy_us=1.4, send_idle_us=19.4,
             short_pause_s=50e-6, short_us=44.6, send_short_us=16.9)  # fmt: skip
    assert w.line().splitlines() == [
        "wake-up on another core: 12.3 µs, 44.6 µs after 50 µs idle, 70.4 µs after 1 ms idle "
        "(a message's send to its read)",
        "the send that wakes it: 1.4 µs, 16.9 µs after 50 µs idle, 19.4 µs after 1 ms idle "
        "(the waker's CPU)",
    ]


def test_a_result_from_before_the_short_idle_point_still_reads() -> None:
    # JSON of an older run has no short_* keys: the line shows what it measured.
    w = Wake(**{"pause_s": 0.001, "busy_us": 12.3, "idle_us": 70.4, "send_busy_us": 1.4,
                "send_idle_us": 19.4})  # fmt: skip
    assert w.line().splitlines() == [
        "wake-up on another core: 12.3 µs, 70.4 µs after 1 ms idle (a message's send to its read)",
        "the send that wakes it: 1.4 µs, 19.4 µs after 1 ms idle (the waker's CPU)",
    ]


def test_the_machine_line_carries_it_only_when_measured() -> None:
    m = {"cpu_model": "cpu", "cores": 2, "kernel": "k", "python": "3", "torch": "t"}
    assert "wake-up" not in _machine_line(m)
    w = Wake(pause_s=0.001, busy_us=10.0, idle_us=70.0, send_busy_us=1.0, send_idle_us=18.0)
    lines = _machine_line({**m, "wake": dataclasses.asdict(w)}).splitlines()
    assert lines[-2:] == w.line().splitlines()


def test_a_process_that_may_not_pin_itself_skips_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(pid: int, cpus: object) -> None:
        raise PermissionError("not allowed here")

    monkeypatch.setattr(_wake.os, "sched_setaffinity", refused)
    monkeypatch.setattr(_wake, "two_cores", lambda: (0, 1))
    assert _wake.probe(samples=5, pause=0.0005) is None


def _sysfs(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(root)


def test_how_idle_cores_sleep_is_read_from_sysfs_and_shown_under_the_probe(
    tmp_path: Path,
) -> None:
    idle = "devices/system/cpu/cpuidle"
    guest = _sysfs(
        tmp_path / "guest",
        {
            f"{idle}/current_driver": "haltpoll",
            f"{idle}/current_governor_ro": "haltpoll",
            "module/haltpoll/parameters/guest_halt_poll_ns": "0",
        },
    )
    info = cpuidle_info(guest)
    assert info == {"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": 0}
    m = {"cpu_model": "cpu", "cores": 2, "cpuidle": info}
    assert _machine_line(m).splitlines()[-1] == (
        "idle cores: cpuidle driver haltpoll, governor haltpoll, polling 0 µs before a halt"
    )
    host = _sysfs(
        tmp_path / "host",
        {f"{idle}/current_driver": "intel_idle", f"{idle}/current_governor": "menu"},
    )
    assert cpuidle_info(host) == {
        "driver": "intel_idle",
        "governor": "menu",
        "guest_halt_poll_ns": None,
    }
    assert _machine_line({**m, "cpuidle": cpuidle_info(host)}).endswith("governor menu")
    assert cpuidle_info(str(tmp_path / "none")) is None  # no cpuidle: no line
    assert "idle cores" not in _machine_line({**m, "cpuidle": None})


def test_the_tcp_congestion_control_is_read_from_proc_and_said_when_it_paces(
    tmp_path: Path,
) -> None:
    cc = "sys/net/ipv4/tcp_congestion_control"
    bbr = tcp_info(_sysfs(tmp_path / "bbr", {cc: "bbr"}))
    cubic = tcp_info(_sysfs(tmp_path / "cubic", {cc: "cubic"}))
    assert bbr == {"congestion_control": "bbr", "paced": True}
    assert cubic == {"congestion_control": "cubic", "paced": False}
    m = {"cpu_model": "cpu", "cores": 2}
    assert _machine_line({**m, "tcp": bbr}).splitlines()[-1] == (
        "tcp: congestion control bbr, which paces every connection, loopback's too"
    )
    assert _machine_line({**m, "tcp": cubic}).splitlines()[-1] == "tcp: congestion control cubic"
    assert tcp_info(str(tmp_path / "none")) is None  # no such file: no line
    assert "tcp:" not in _machine_line({**m, "tcp": None})
    # this machine's own, as the bench's JSON carries it
    own = machine_info()["tcp"]
    assert own is None or own == tcp_info()
