"""``relayd serve`` with an arena too small for one slot: a configuration error, said
before anything is created."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

from tests.integration.test_preflight_cli import EXIT_PREFLIGHT, run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("flags", "setting"),
    [
        (("--shm-pool-size", "64MiB", "--shm-segment-size", "64KiB"), "shm_segment_size"),
        (("--shm-pool-size", "100KiB"), "shm_pool_size"),
        (("--shm-pool-size", "1MiB", "--slot-size", "1MiB"), "shm_pool_size"),
    ],
)
def test_an_arena_with_no_slot_is_refused_as_configuration(
    tmp_path: Path, flags: tuple[str, ...], setting: str
) -> None:
    node = f"layout{secrets.token_hex(4)}"
    run_dir = tmp_path / "run"
    cp = run(
        [
            sys.executable,
            "-m",
            "relayd",
            "serve",
            "--socket",
            str(run_dir / "relayd.sock"),
            "--node-id",
            node,
            *flags,
        ],
    )
    assert cp.returncode == EXIT_PREFLIGHT, cp.stderr
    assert "Traceback" not in cp.stderr
    assert setting in cp.stderr
    assert not run_dir.exists() or os.listdir(run_dir) == []
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"relayd.{node}.")] == []
