"""``relayd bench --timeline``'s table, from marks written as the probes write them."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import pytest

from relayd_bench import _timeline as tl


def _file(d: Path, name: str, side: str, job: str, skip: int, marks: list[tuple[int, str]]) -> None:
    body = "".join(f"{ns} {step}\n" for ns, step in marks)
    (d / f"{name}.tl").write_text(f"# {side}\t{job}\t{skip}\n{body}")


US = 1000  # ns


def _transfer(t0: int, hop: int) -> dict[str, list[tuple[int, str]]]:
    """One transfer's marks by process, starting at ``t0``: each step ``hop`` µs after
    the one before, but the reader's daemon's second frame, which is late."""
    return {
        "w": [(t0, tl.ANCHOR), (t0 + 1 * hop * US, "put returns")],
        "a": [(t0 + 2 * hop * US, "push starts")],
        "b": [(t0 + 3 * hop * US, "notices handled"), (t0 + 9 * hop * US, "notices handled")],
        "r": [(t0 + 4 * hop * US, "get starts"), (t0 + 5 * hop * US, "get returns")],
    }


def _run(d: Path, hops: list[int], job: str, t0: int, skip: int) -> None:
    marks: dict[str, list[tuple[int, str]]] = {"w": [], "a": [], "b": [], "r": []}
    for i, hop in enumerate(hops):
        for k, v in _transfer(t0 + i * 1000 * US, hop).items():
            marks[k] += v
    _file(d, f"w{t0}", tl.WRITER, job, skip, marks["w"])
    _file(d, f"r{t0}", tl.READER, job, skip, marks["r"])
    _file(d, f"a{t0}", tl.DAEMON, "", 0, marks["a"])
    _file(d, f"b{t0}", tl.DAEMON, "", 0, marks["b"])


def test_each_step_is_placed_by_its_median_and_its_hop_from_the_step_above(
    tmp_path: Path,
) -> None:
    # Two warm-up transfers far slower, then hops of 10, 20 and 30 µs (the last
    # transfer only ends the one before: it is not counted itself).
    _run(tmp_path, [90, 90, 10, 20, 30, 40], "relayd-mooncake, 256KiB", 0, skip=2)
    rows, transfers = tl.steps(_all(tmp_path), skip=2)
    assert transfers == 3
    got = [(r.side, r.step, r.at_us, r.hop_us, r.seen) for r in rows]
    assert got == [
        (tl.WRITER, tl.ANCHOR, 0.0, None, 3),
        (tl.WRITER, "put returns", 20.0, 20.0, 3),
        (tl.WRITER_DAEMON, "push starts", 40.0, 20.0, 3),
        (tl.READER_DAEMON, "notices handled", 60.0, 20.0, 3),  # at its first mark only
        (tl.READER, "get starts", 80.0, 20.0, 3),
        (tl.READER, "get returns", 100.0, 20.0, 3),
    ]


def _all(d: Path) -> list[tl.Mark]:
    marks: list[tl.Mark] = []
    for p in d.glob("*.tl"):
        f = tl._read(p)
        marks += [(ns, f.side, step) for ns, step in f.marks]
    return sorted(marks)


def test_a_table_per_writers_job_with_the_daemons_marks_of_its_own_time(
    tmp_path: Path,
) -> None:
    _run(tmp_path, [10, 10, 10], "relayd-mooncake, 256KiB", 0, skip=0)
    _run(tmp_path, [50, 50, 50], "relayd-mooncake, 1MiB", 10**9, skip=0)
    text = tl.report(tmp_path)
    first, second = text.split("\n\n")
    assert first.startswith("timeline, relayd-mooncake, 256KiB") and "over 2 transfers" in first
    assert second.startswith("timeline, relayd-mooncake, 1MiB") and "over 2 transfers" in second
    returns = [line.split() for line in text.splitlines() if "get returns" in line]
    assert [float(r[-3]) for r in returns] == [50.0, 250.0]  # no mark of the other job
    (tmp_path / "none").mkdir()
    assert tl.report(tmp_path / "none") == ""


def test_probes_stamp_the_start_and_end_of_a_call_and_of_a_coroutine(tmp_path: Path) -> None:
    mod = types.ModuleType("relayd_bench_probe_target")

    class Target:
        def step(self, x: int) -> int:
            return x + 1

        async def wait(self) -> str:
            await asyncio.sleep(0)
            return "done"

    mod.Target = Target  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        probes = (
            tl.Probe(mod.__name__, "Target.step", "step starts", "step ends"),
            tl.Probe(mod.__name__, "Target.wait", "wait starts"),
        )
        marks = tl.install(tmp_path, probes, tl.WRITER, "job", 3)
        try:
            t = Target()
            assert t.step(1) == 2
            assert asyncio.run(t.wait()) == "done"
            with pytest.raises(TypeError):
                t.step()  # type: ignore[call-arg]
        finally:
            marks.close()
    finally:
        del sys.modules[mod.__name__]
    [path] = tmp_path.glob("*.tl")
    f = tl._read(path)
    assert (f.side, f.job, f.skip) == (tl.WRITER, "job", 3)
    steps = [step for _, step in f.marks]
    assert steps == ["step starts", "step ends", "wait starts", "step starts", "step ends"]
    assert [ns for ns, _ in f.marks] == sorted(ns for ns, _ in f.marks)
