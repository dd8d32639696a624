"""The machine's cold-call probe: what it measures and how the table shows it."""

from __future__ import annotations

import dataclasses

from relayd_bench import _coldcall
from relayd_bench._coldcall import ColdCall
from relayd_bench._table import _machine_line


def test_probe_times_the_same_work_warm_and_after_the_pause() -> None:
    c = _coldcall.probe(samples=5, pause=0.0005)
    assert (c.calls, c.pause_s) == (_coldcall.PROBE_CALLS, 0.0005)
    assert c.warm_us > 0 and c.cold_us > 0
    assert c.ratio == c.cold_us / c.warm_us


def test_the_line_names_the_work_the_pause_and_the_ratio() -> None:
    c = ColdCall(calls=20, pause_s=0.001, warm_us=0.9, cold_us=9.0)
    assert c.line() == (
        "cold calls: 20 Python calls take 0.9 µs back to back, 9.0 µs after 1 ms asleep (x10.0)"
    )


def test_the_machine_line_carries_it_only_when_measured() -> None:
    m = {"cpu_model": "cpu", "cores": 2, "kernel": "k", "python": "3", "torch": "t"}
    assert "cold calls" not in _machine_line(m)
    c = ColdCall(calls=20, pause_s=0.001, warm_us=1.0, cold_us=4.0)
    with_cold = _machine_line({**m, "cold_call": dataclasses.asdict(c)})
    assert with_cold.splitlines()[-1] == c.line()
