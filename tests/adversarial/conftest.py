from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._daemon import Daemon
from tests._fixtures import separate_processes
from tests.adversarial._users import DAEMON, User, ensure_users, shared_dir
from tests.faults._support import start_daemon, unique_node

__all__ = ["daemon", "daemon_options", "run_dir", "separate_processes", "users"]


@pytest.fixture
def users() -> dict[str, User]:
    """The real users the uid tests run as (created once)."""
    return ensure_users()


@pytest.fixture
def run_dir(users: dict[str, User]) -> Iterator[str]:
    """Like systemd's /run/relayd: the daemon user's, under root's /run, open to enter."""
    path = shared_dir(users[DAEMON], 0o755, parent="/run" if os.path.isdir("/run") else "/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_options() -> dict[str, Any]:
    """How ``daemon`` starts (``start_daemon``'s keywords, flags under ``args``); a test
    module overrides this fixture for its own pool or flags."""
    return {"pool": "64MiB"}


@pytest.fixture
def daemon(tmp_path: Path, daemon_options: dict[str, Any]) -> Iterator[Daemon]:
    # Function-scoped: tests/conftest.py kills every daemon a test leaves running.
    options = dict(daemon_options)
    d = start_daemon(str(tmp_path), unique_node(), *options.pop("args", ()), **options)
    yield d
    d.stop()
