"""The machine's hand-off probe: what it measures and how the table shows it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from relayd_bench import _handoff
from relayd_bench._handoff import Handoff
from relayd_bench._table import _machine_line

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not TWO_CORES, reason="the probe needs two cores")
def test_probe_times_both_copies_and_gives_this_process_its_cores_back() -> None:
    before = os.sched_getaffinity(0)
    h = _handoff.probe(samples=5, nbytes=64 << 10)
    assert h is not None and h.nbytes == 64 << 10
    assert h.just_read_us > 0 and h.read_before_us > 0
    assert os.sched_getaffinity(0) == before  # pinned only while it measured


def test_a_process_on_one_core_skips_the_probe() -> None:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert _handoff.probe(samples=5) is None
    finally:
        os.sched_setaffinity(0, before)


def test_the_line_names_both_copies_and_their_ratio() -> None:
    h = Handoff(nbytes=256 << 10, just_read_us=27.3, read_before_us=13.0)
    assert h.line() == (
        "a 256 KiB copy into memory another core read last: 27.3 µs, "
        "into memory it read the time before: 13.0 µs (x2.1)"
    )


def test_the_machine_line_carries_it_only_when_measured() -> None:
    m = {"cpu_model": "cpu", "cores": 2, "kernel": "k", "python": "3", "torch": "t"}
    assert "another core read last" not in _machine_line(m)
    h = Handoff(nbytes=256 << 10, just_read_us=20.0, read_before_us=10.0)
    assert h.line() in _machine_line({**m, "handoff": dataclasses.asdict(h)}).splitlines()
