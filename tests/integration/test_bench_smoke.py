"""``python -m relayd.bench --quick`` end to end on the baselines: shape of the output only.

Timings belong in the benchmark's output, never in assertions: this checks that
every method x size produced plausible samples and that nothing is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BASELINES = ["floor", "floor-view", "shm-per-transfer", "pickle-uds", "memcpy"]
SIZES = {"4K": 4 << 10, "1M": 1 << 20}
SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[2]


def _bench_segments() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith("relayd-bench-")}


def test_quick_baselines_produce_every_cell(tmp_path: Path) -> None:
    before = _bench_segments()
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayd.bench",
            "--quick",
            "--methods",
            ",".join(BASELINES),
            "--sizes",
            ",".join(SIZES),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())

    cells = {(r["method"], r["size"]): r for r in doc["results"]}
    assert set(cells) == {(m, s) for m in BASELINES for s in SIZES.values()}
    for (method, size), r in cells.items():
        assert r["status"] == "ok", (method, size, r["reason"])
        assert r["iterations"] > 0 and r["latency_ns"]["n"] == r["iterations"]
        assert r["median_ns"] > 0, (method, size)
        assert r["p99_ns"] >= r["median_ns"], (method, size)
    for r in doc["results"]:
        if r["method"] == "floor":
            assert r["ratio_vs_floor"] == 1.0

    # the methods cleaned up after themselves (the run's final sweep found nothing)...
    assert doc["run"]["leftover_segments"] == []
    # ...and nothing of this or any other bench run is left behind
    assert not any(n.startswith(doc["run"]["shm_prefix"]) for n in os.listdir(SHM))
    assert _bench_segments() <= before
    # the resource tracker had nothing to clean up or warn about
    assert "leaked shared_memory" not in proc.stderr
    assert "floor" in proc.stdout  # the table went to stdout
