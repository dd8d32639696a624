"""``python -m relayd_bench --quick`` end to end: shape of the output only.

Timings belong in the benchmark's output, never in assertions: this checks that
every method x size produced plausible samples (a cell is "ok" only if every
transfer's payload passed the harness's check) and that nothing is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from relayd_bench import _daemon_profile
from tests._daemon import Daemon
from tests._mooncake import NO_MOONCAKE, requires_mooncake

BASELINES = ["floor", "floor-view", "shm-per-transfer", "pickle-uds", "memcpy"]
SIZES = {"4K": 4 << 10, "1M": 1 << 20}
SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[2]


def _leftovers(doc: Any) -> list[str]:
    """What the run of ``doc`` left in /dev/shm: its methods' segments and its
    daemons' arenas, all named after its run id (other runs may be going on)."""
    mark = f"bench-{doc['run']['run_id']}-"
    return [p.name for p in SHM.iterdir() if mark in p.name]


def _bench(
    tmp_path: Path, methods: list[str], sizes: list[str], more: Sequence[str] = ()
) -> tuple[Any, str]:
    """Run a quick bench; (its JSON document, its stdout)."""
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayd_bench",
            "--quick",
            "--methods",
            ",".join(methods),
            "--sizes",
            ",".join(sizes),
            "--json",
            str(out),
            *more,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the resource tracker had nothing to clean up or warn about
    assert "leaked shared_memory" not in proc.stderr
    return json.loads(out.read_text()), proc.stdout


def _assert_ok(r: dict[str, Any]) -> None:
    assert r["status"] == "ok", (r["method"], r["size"], r["reason"])
    assert r["iterations"] > 0 and r["latency_ns"]["n"] == r["iterations"]
    assert r["median_ns"] > 0, (r["method"], r["size"])
    assert r["p99_ns"] >= r["median_ns"], (r["method"], r["size"])


def test_quick_baselines_produce_every_cell(tmp_path: Path) -> None:
    doc, stdout = _bench(tmp_path, BASELINES, list(SIZES))

    cells = {(r["method"], r["size"]): r for r in doc["results"]}
    assert set(cells) == {(m, s) for m in BASELINES for s in SIZES.values()}
    for r in cells.values():
        _assert_ok(r)
    for r in doc["results"]:
        if r["method"] == "floor":
            assert r["ratio_vs_floor"] == 1.0
        # a pair's median splits into its sides; one process has none
        split = r["split_ns"]
        if r["method"] == "memcpy":
            assert split is None
        else:
            assert set(split) == {"send_ns", "trip_ns", "recv_ns"}
            assert min(split.values()) >= 0 and split["trip_ns"] > 0
    assert "where the time went" in stdout

    # the methods cleaned up after themselves (the run's final sweep found nothing)...
    assert doc["run"]["leftover_segments"] == []
    # ...and nothing of this or any other bench run is left behind
    assert not any(n.startswith(doc["run"]["shm_prefix"]) for n in os.listdir(SHM))
    assert _leftovers(doc) == []
    assert "floor" in stdout  # the table went to stdout
    # the machine's cold-call probe, in the JSON and under the machine line
    cold = doc["machine"]["cold_call"]
    assert cold["calls"] == 20 and cold["pause_s"] == 0.001
    assert cold["warm_us"] > 0 and cold["cold_us"] > 0
    assert f"{cold['cold_us']:.1f} µs after 1 ms asleep" in stdout
    # and the wake probe, wherever the bench may use two cores
    wake = doc["machine"].get("wake")
    if len(os.sched_getaffinity(0)) >= 2:
        assert wake is not None and wake["pause_s"] == 0.001
        assert wake["busy_us"] > 0 and wake["idle_us"] > 0
        assert wake["send_busy_us"] > 0 and wake["send_idle_us"] > 0
        assert f"{wake['idle_us']:.1f} µs after 1 ms idle" in stdout
        assert f"the send that wakes it: {wake['send_busy_us']:.1f} µs" in stdout
    else:
        assert wake is None
    # and the hand-off probe, the same way
    handoff = doc["machine"].get("handoff")
    if len(os.sched_getaffinity(0)) >= 2:
        assert handoff is not None and handoff["nbytes"] == 256 << 10
        assert handoff["just_read_us"] > 0 and handoff["read_before_us"] > 0
        assert f"another core read last: {handoff['just_read_us']:.1f} µs" in stdout
    else:
        assert handoff is None


def test_rounds_run_every_cell_each_round_and_summarize_the_ratios(tmp_path: Path) -> None:
    doc, stdout = _bench(tmp_path, ["floor", "memcpy"], ["4K"], ["--rounds", "2"])

    assert doc["run"]["rounds"] == 2
    per_round = doc["rounds"]["results"]
    first, second = [[(r["method"], r["size"]) for r in cells] for cells in per_round]
    assert sorted(first) == [("floor", 4096), ("memcpy", 4096)]
    assert second == first[::-1]  # the second round runs backwards
    for cells in per_round:
        for r in cells:
            _assert_ok(r)
    [ratio] = doc["rounds"]["ratios"]
    assert (ratio["method"], ratio["baseline"], ratio["size"]) == ("memcpy", "floor", 4096)
    assert len(ratio["ratios"]) == 2
    medians = {c["method"]: c["median_ns"] for c in per_round[0]}
    assert ratio["ratios"][0] == medians["memcpy"] / medians["floor"]
    assert "ratios per round (2 rounds" in stdout and "memcpy / floor: x" in stdout


@pytest.mark.parametrize("pairs", [1, 3])
def test_stream_workload_carries_every_stream_in_one_process_pair_or_one_each(
    tmp_path: Path, pairs: int
) -> None:
    """Three streams of 100 chunks each: in one writer/reader pair (coroutine lanes for
    the async client, threads sharing one client for the blocking one and the floor)
    or in a pair each. Every chunk passed the harness's payload check, and each
    process's lanes reported as one."""
    methods = ["floor", "relayd-shm", "relayd-sync"]
    more = ["--stream-methods", ",".join(methods), "--streams", "3", "--stream-rate", "100"]
    doc, stdout = _bench(
        tmp_path, ["stream"], ["4K"], [*more, "--stream-size", "64K", "--stream-pairs", str(pairs)]
    )

    assert doc["results"] == []
    streams = {s["method"]: s for s in doc["streams"]}
    assert list(streams) == methods
    for s in streams.values():
        assert s["status"] == "ok", s
        assert s["process_pairs"] == pairs
        assert s["chunks"] == s["latency_ns"]["n"] == 3 * 100  # every lane's samples
        assert s["latency_ns"]["p99_ns"] >= s["latency_ns"]["median_ns"] > 0
        # 100 chunks at 100/s: one second, whose worst is the run's
        assert s["worst_latency_ns_by_second"] == [s["latency_ns"]["max_ns"]]
    assert doc["run"]["stream"]["process_pairs"] == pairs
    shape = "in one writer/reader process pair" if pairs == 1 else "in 3 process pairs"
    assert f"stream: 3 streams x 64KiB at 100/s each {shape}" in stdout
    assert doc["run"]["leftover_segments"] == [] and doc["run"]["warnings"] == []
    assert _leftovers(doc) == []


@pytest.mark.multinode
@requires_mooncake
def test_quick_relayd_mooncake_runs_on_two_daemons_beside_raw_mooncake(tmp_path: Path) -> None:
    """relayd-mooncake reads a copy, relayd-mooncake-view reads in place (as raw
    Mooncake's reader uses its buffer), relayd-mooncake-sync through the blocking
    client; all are held against raw Mooncake, and relayd-mooncake against its
    path's floor too."""
    relayd = ["relayd-mooncake", "relayd-mooncake-view", "relayd-mooncake-sync"]
    doc, stdout = _bench(tmp_path, ["mooncake-raw", "floor-relay", *relayd], ["1M"])

    cells = {r["method"]: r for r in doc["results"]}
    assert set(cells) == {"mooncake-raw", "floor-relay", *relayd}
    for r in cells.values():
        _assert_ok(r)
    assert cells["floor-relay"]["extra"]["rt"] == "0.50"
    # its stand-ins' CPU in the daemons' place, each side's
    stand_ins = cells["floor-relay"]["daemon_cpu_ns_per_transfer"]
    assert stand_ins["writer_side"] > 0 and stand_ins["reader_side"] > 0
    pairs = [(c["method"], c["baseline"]) for c in doc["comparisons"]]
    assert pairs == [
        ("relayd-mooncake", "mooncake-raw"),
        ("relayd-mooncake", "floor-relay"),
        ("relayd-mooncake-view", "mooncake-raw"),
        ("relayd-mooncake-sync", "mooncake-raw"),
    ]
    assert "relayd-mooncake / floor-relay:" in stdout
    for cmp in doc["comparisons"]:
        assert [c["size"] for c in cmp["ratio_of_medians"]] == [1 << 20]
    for m in relayd:
        assert f"{m} / mooncake-raw:" in stdout
        assert f"1MiB   {m} " in stdout or f"       {m} " in stdout  # the whole name
        sides = cells[m]["daemon_cpu_ns_per_transfer"]
        assert sides["writer_side"] is not None and sides["reader_side"] is not None
        assert cells[m]["extra"]["push"] == "yes" and "reads" in cells[m]["extra"]

    run = doc["run"]
    writer, reader = run["daemon"], run["reader_daemon"]
    for d in (writer, reader):
        assert d["started_by_bench"] and d["exit_code"] == 0, d
        assert d["leftover_segments"] == [], d
    # every transfer (warm-up included) crossed over Mooncake
    moved = sum(cells[m]["warmup"] + cells[m]["iterations"] for m in relayd)
    assert reader["transfers_by_transport"].get("mooncake") == moved, reader
    # neither daemon's arena nor anything of the methods is left in /dev/shm
    pair = f"bench-{run['run_id']}-"
    assert not [n for n in os.listdir(SHM) if pair in n or n.startswith(run["shm_prefix"])]
    assert run["leftover_segments"] == [] and run["warnings"] == []
    assert _leftovers(doc) == []


def test_quick_late_pair_reads_announced_pushes_beside_a_late_raw_read(tmp_path: Path) -> None:
    """The ``-late`` methods hand the DataRef over after the put: relayd's pushes have
    landed by then and its reads ask nothing (announced); raw Mooncake still reads."""
    methods = ["mooncake-raw-late", "relayd-mooncake-late"]
    doc, stdout = _bench(tmp_path, methods, ["256K"])

    cells = {r["method"]: r for r in doc["results"]}
    assert set(cells) == set(methods)
    for r in cells.values():
        _assert_ok(r)
    [cmp] = doc["comparisons"]
    assert (cmp["method"], cmp["baseline"]) == ("relayd-mooncake-late", "mooncake-raw-late")
    assert "relayd-mooncake-late / mooncake-raw-late:" in stdout
    assert cells["mooncake-raw-late"]["extra"]["rt"] == "1.50"  # still one read each
    late = cells["relayd-mooncake-late"]
    moved = late["warmup"] + late["iterations"]
    landed, awaited, pulled, attached, announced = map(int, late["extra"]["reads"].split("/"))
    assert landed + awaited + pulled + attached + announced == moved
    assert announced > 0  # the push had landed and the reader was told where


@requires_mooncake
def test_timeline_follows_a_cross_node_transfer_through_its_four_processes(
    tmp_path: Path,
) -> None:
    """``--timeline``: the probes leave the transfers intact, and each of the four
    processes stamps its steps, the reader's get ending after the push started and
    after the steps inside it, for the async client and the blocking one. (Lingering
    notices, the reader's Release or a daemon's word about earlier transfers, may
    come later still.) The raw baseline runs first beside them, as in ``--methods
    mooncake-raw,relayd-mooncake``, and gets no table: it stamps no relayd step."""
    methods = ["mooncake-raw", "relayd-mooncake", "relayd-mooncake-sync"]
    doc, stdout = _bench(tmp_path, methods, ["256K"], ["--timeline"])
    cells = {r["method"]: r for r in doc["results"]}
    for r in cells.values():
        _assert_ok(r)
    assert stdout.count("timeline, ") == 2
    within = {
        "relayd-mooncake": ("get starts", "fetch call", "fetch answered", "copying out"),
        "relayd-mooncake-sync": ("get starts", "done waiting", "copying out", "copied out"),
    }
    for method, steps in within.items():
        _check_timeline(stdout, method, cells[method]["iterations"], steps)


def _check_timeline(stdout: str, method: str, iterations: int, within: tuple[str, ...]) -> None:
    at_table = stdout[stdout.index(f"timeline, {method}, 256KiB") :]
    title, header, *lines = at_table.split("\n\n")[0].splitlines()
    # Every measured transfer but the last, which only ends the one before it.
    assert f"over {iterations - 1} transfers" in title
    assert header.split() == ["process", "step", "at", "hop", "seen", "in"]
    rows = {line[:41].strip(): line[41:].split() for line in lines if line.strip()}
    sides = {key.split("  ")[0] for key in rows}
    assert sides == {"writer", "writer's daemon", "reader's daemon", "reader"}, rows
    assert rows["writer           put starts"][:1] == ["0.0"]
    for key in ("writer           put returns", "writer's daemon  push starts",
                "reader           get returns"):  # fmt: skip
        assert rows[key][-1] == "100%", (method, key, rows[key])
    at = {key: float(v[0]) for key, v in rows.items()}
    get_returns = at["reader           get returns"]
    assert get_returns > at["writer's daemon  push starts"] > at["writer           put starts"]
    # Of the steps seen in every transfer: a median over only the reads that
    # fetched (a push not yet announced) is of the slower reads, and may pass
    # the median of all the gets' ends.
    inside = [
        at[key]
        for key in at
        if key.startswith("reader ") and key.endswith(within) and rows[key][-1] == "100%"
    ]
    assert inside and get_returns > max(inside), (method, rows)


@requires_mooncake
def test_profile_reports_each_daemons_python_per_transfer(tmp_path: Path) -> None:
    """``--profile DIR``: both daemons run under cProfile while they serve, stop
    cleanly, and each report counts its own transfers; each push is published on
    the writer's side and handled on the reader's once a transfer."""
    out = tmp_path / "profiles"
    doc, stdout = _bench(tmp_path, ["relayd-mooncake"], ["256K"], ["--profile", str(out)])
    [cell] = doc["results"]
    _assert_ok(cell)
    run = doc["run"]
    reports = {}
    for role, key in (("writer", "daemon"), ("reader", "reader_daemon")):
        assert run[key]["exit_code"] == 0 and run[key]["leftover_segments"] == []
        moved = sum(run[key]["transfers_by_transport"].values())
        assert moved == cell["warmup"] + cell["iterations"]
        text = (out / f"relayd-{role}.txt").read_text()
        assert text.startswith(f"daemon relayd-{role}: {moved} transfers;")
        assert (out / f"relayd-{role}.prof").stat().st_size > 0
        assert "importlib" not in text  # profiled while it serves: no start-up
        reports[role] = text
    assert f"daemon profiles: {out}/relayd-writer.txt {out}/relayd-reader.txt" in stdout

    def calls(text: str, function: str) -> float:
        return next(float(line.split()[0]) for line in text.splitlines() if function in line)

    assert calls(reports["writer"], "(on_publish)") == 1.0
    assert calls(reports["reader"], "(on_notices)") == 1.0


def test_the_profile_wrapper_drops_an_earlier_profile_then_writes_its_own(
    tmp_path: Path,
) -> None:
    """A daemon killed before it writes its profile must leave no earlier run's in
    its place (the report would pass it off as this run's): gone once it serves."""
    out = tmp_path / "profiles"
    out.mkdir()
    stale = out / "relayd.prof"
    stale.write_bytes(b"an earlier run's")
    d = Daemon(str(tmp_path))
    d.args = [sys.executable, "-m", "relayd_bench._daemon_profile", str(out), *d.args]
    d.start()
    try:
        assert not stale.exists()
    finally:
        assert d.stop() == 0
    report = _daemon_profile.report(stale, 0, "daemon relayd")  # this run's, and readable
    assert report.startswith("daemon relayd: 0 transfers;")


def test_quick_relayd_sync_beside_the_async_client(tmp_path: Path) -> None:
    methods = ["floor", "relayd-shm", "relayd-sync"]
    # Four times --quick's transfers: the 1 MiB run outlasts several of the
    # writer's lingers (NOTICE_LINGER_S), the only thing that sends its notices.
    doc, _ = _bench(tmp_path, methods, list(SIZES), ["--iterations-scale", "0.4"])
    cells = {(r["method"], r["size"]): r for r in doc["results"]}
    for size in SIZES.values():
        _assert_ok(cells["relayd-sync", size])
    assert cells["relayd-sync", SIZES["4K"]]["extra"]["transport"] == "inline"
    assert cells["relayd-sync", SIZES["1M"]]["extra"]["transport"] == "shm"
    assert doc["run"]["leftover_segments"] == []
    # The daemon's wake-ups: none sampled for the floor; an inline put and get
    # never reach it; a leased one's notices do, in batches (a frame a linger).
    wakeups = {k: c["daemon_wakeups_per_transfer"]["writer_side"] for k, c in cells.items()}
    assert wakeups["floor", SIZES["1M"]] is None
    assert wakeups["relayd-sync", SIZES["4K"]] < 0.5
    assert wakeups["relayd-sync", SIZES["1M"]] > 0


def test_breakdown_prints_every_step_for_both_clients_warm_and_cold() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relayd_bench", "--breakdown", "--quick", "--sizes", "4K,256K"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # three tables: back to back, cold, and the daemon's lease table alone
    warm_text, cold_text, lease_text = proc.stdout.split("\n\n")
    from relayd_bench import _lease_steps, _turns
    from relayd_bench._breakdown import (
        GET_GENERAL,
        GET_STEPS,
        GET_TOTAL,
        PUT_GENERAL,
        PUT_STEPS,
        PUT_TOTAL,
    )

    for text in (warm_text, cold_text):
        lines = text.splitlines()
        assert "async 4KiB" in lines[0] and "sync 256KiB" in lines[0]
        rows = {}
        for line in lines[1:]:
            label, *values = re.split(r"\s{2,}", line.strip())
            rows[label] = values
        for label, _ in PUT_STEPS + GET_STEPS:
            assert label in rows, label
        # each total both through the lanes and down the general path, in every cell
        for label in (PUT_TOTAL, PUT_GENERAL, GET_TOTAL, GET_GENERAL):
            assert all(float(v) > 0 for v in rows[label]), label
        # the shm cells of the copy steps hold numbers for both clients
        assert all(float(v) > 0 for v in rows["copy in"][-2:])
        assert all(float(v) > 0 for v in rows["allocate + copy out"][-2:])
        assert all(float(v) > 0 for v in rows["inline: layout check, allocate + copy out"][:2])
        # what each call spent outside its steps, per transfer: a number in every cell
        assert all(float(v) == float(v) for v in rows["other"]), rows["other"]
        assert rows["transport"] == ["inline", "inline", "shm", "shm"]
        # the memcpy into as many buffers as the writer's distinct slots: only where leases were
        cycled = rows["memcpy into that many buffers in turn"]
        assert cycled[:2] == ["-", "-"] and all(float(v) > 0 for v in cycled[2:]), cycled
        assert all(int(v) >= 1 for v in rows["distinct lease slots in steady state"][2:])
        # The daemon's side, timed inside the daemon the bench started: inline
        # puts give it no turn of their own (only the clients' reports, a frame
        # each REPORT_LINGER_S at most, as a slow run may show); leases give
        # turns with every step timed.
        per_transfer = [float(v) for v in rows["daemon: turns on session frames per transfer"]]
        assert all(v <= 0.1 for v in per_transfer[:2]), per_transfer
        assert all(0 <= v <= 4 for v in per_transfer[2:]), per_transfer
        if text is warm_text:
            # Back to back, a writer reuses the run its reader just marked read
            # and needs no Freed: a quick run may end before any frame goes.
            continue
        assert all(v > 0 for v in per_transfer[2:]), per_transfer
        assert all(float(v) > 0 for v in rows["turns' CPU per transfer"][2:])
        for label, _ in _turns.STEPS:
            assert all(float(v) >= 0 for v in rows[label][2:]), label
        assert float(rows["a turn (median)"][-1]) >= float(
            rows["notices: reserve, publish, claim, release, ..."][-1]
        )
    # One column, 256 KiB (a 4 KiB put goes inline, past the lease table); the
    # total is its steps' sum.
    head, *lines = lease_text.splitlines()
    assert head.split()[-1] == "256KiB"
    table = {label: float(v) for label, v in (re.split(r"\s{2,}", ln.strip()) for ln in lines)}
    assert list(table) == [label for label, _ in _lease_steps.STEPS]
    assert all(v > 0 for v in table.values())
    assert abs(table["total"] - sum(v for k, v in table.items() if k != "total")) < 0.2
    assert cold_text.startswith("cold: each call after 1 ms asleep")
    ratios = rows["put + get, cold / warm"]
    assert len(ratios) == 4 and all(float(v.removeprefix("x")) > 0 for v in ratios)
    assert "put + get, cold / warm" not in warm_text


def _netns_unavailable() -> str:
    from relayd_bench._netns import NetnsUnavailable, check_available

    try:
        check_available()
    except NetnsUnavailable as exc:
        return str(exc)
    return NO_MOONCAKE


@pytest.mark.multinode
@pytest.mark.skipif(bool(_netns_unavailable()), reason=_netns_unavailable() or "-")
def test_quick_netns_counts_round_trips_and_models_latency(tmp_path: Path) -> None:
    methods = ["mooncake-raw", "relayd-mooncake"]
    doc, stdout = _bench(tmp_path, methods, ["256K"], ["--netns", "--netns-rate", "10gbit"])

    cells = {r["method"]: r for r in doc["results"]}
    assert set(cells) == set(methods)
    for r in cells.values():
        _assert_ok(r)
        assert float(r["extra"]["rt"]) >= 0.5  # at least the DataRef's own trip
    assert cells["mooncake-raw"]["extra"]["rt"] == "1.50"  # one read per transfer
    moved = cells["relayd-mooncake"]["warmup"] + cells["relayd-mooncake"]["iterations"]
    reads = cells["relayd-mooncake"]["extra"]["reads"]
    landed, awaited, pulled, attached, announced = map(int, reads.split("/"))
    # Every read counted by its daemon: fetched, or read where its daemon announced it.
    assert landed + awaited + pulled + attached + announced == moved
    # 256 KiB rides the Landed notice once the notice channel is up (an announced
    # read's push may have too: the count does not say).
    assert attached + announced > 0
    assert float(cells["relayd-mooncake"]["extra"]["rt+"]) >= float(
        cells["relayd-mooncake"]["extra"]["rt"]
    )

    lines = stdout.splitlines()
    [head] = [i for i, line in enumerate(lines) if line.startswith("size") and " RT " in line]
    assert lines[head].split() == [
        *("size", "method", "median", "RT", "RT+"),
        *("RTT", "50us", "RTT", "200us", "RTT", "1ms", "reads"),
    ]
    assert [lines[head + k].split()[1] for k in (1, 2)] == methods

    ns = doc["run"]["netns"]
    assert ns["rate"] == "10gbit"
    # both methods' bytes crossed the veth link, writer's side to reader's
    assert ns["link_tx_bytes"][0] >= 2 * moved * (256 << 10)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    assert not any(name in listed.stdout for name in ns["names"])  # removed at the end
    run = doc["run"]
    for d in (run["daemon"], run["reader_daemon"]):
        assert d["exit_code"] == 0 and d["leftover_segments"] == [], d
    assert run["leftover_segments"] == [] and run["warnings"] == []
    assert _leftovers(doc) == []
