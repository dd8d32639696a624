"""``relayd demo`` as a newcomer runs it: it starts its own daemon, streams, stops it.

Its whole output is checked for warnings: torch warns "Failed to initialize NumPy"
once per stage process when numpy is not installed, and a newcomer reads that as
a broken install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

CHUNKS = 3


def test_demo_streams_verified_chunks_without_warnings(tmp_path: Path) -> None:
    env = {
        **os.environ,
        # The embedded default pre-faults 1/16 of RAM; the demo needs a few MiB.
        "RELAYD_SHM_POOL_SIZE": "64MiB",
        "RELAYD_NODE_ID": f"demo-{uuid.uuid4().hex[:8]}",
    }
    demo = ["demo", "--socket", str(tmp_path / "relayd.sock"), "--chunks", str(CHUNKS)]
    cp = subprocess.run(
        [sys.executable, "-m", "relayd", *demo, "--chunk-size", "256KiB"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        check=False,
    )
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert f"{CHUNKS} verified, 0 corrupted" in out, out
    assert "relayd stopped (exit 0)" in out, out
    assert "Failed to initialize NumPy" not in out, out
    assert "Warning" not in out, out
