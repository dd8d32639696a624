"""``relayd serve`` refusing a file at its socket path that relayd did not leave there."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import pytest

from relayd.launch import serve_argv
from tests.integration.test_preflight_cli import EXIT_PREFLIGHT, run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("which", ["relayd.sock", "relayd.sock.session"])
def test_a_refused_file_at_a_socket_path_is_left_as_it_was(tmp_path: Path, which: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    foreign = run_dir / which
    content = secrets.token_bytes(4096)
    foreign.write_bytes(content)
    node = f"foreign{secrets.token_hex(4)}"
    cp = run(
        serve_argv(
            str(run_dir / "relayd.sock"), settings={"shm_pool_size": "64MiB", "node_id": node}
        ),
    )
    assert cp.returncode == EXIT_PREFLIGHT, cp.stderr
    assert f"{foreign} is not a socket left by relayd" in cp.stderr
    assert "remove it by hand" in cp.stderr
    # The daemon refused to replace it: it is still there, byte for byte.
    assert hashlib.sha256(foreign.read_bytes()).digest() == hashlib.sha256(content).digest()
    assert not (run_dir / "relayd.sock").is_socket()
    assert not (run_dir / "relayd.sock.session").is_socket()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"relayd.{node}.")] == []
