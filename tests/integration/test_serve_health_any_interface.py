"""``--health-address :PORT``: an empty host means every interface, as preflight and
the metrics port read it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._daemon import Daemon, free_port

pytestmark = pytest.mark.timeout(120)


def test_health_on_every_interface_with_an_empty_host(tmp_path: Path) -> None:
    port = free_port()
    d = Daemon(str(tmp_path), "--health-address", f":{port}")
    d.start()
    cp = subprocess.run(
        [sys.executable, "-m", "relayd", "health", "--address", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cp.returncode == 0 and cp.stdout.strip() == "SERVING", cp.stderr
    assert d.stop() == 0
    assert d.segments() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log"]
