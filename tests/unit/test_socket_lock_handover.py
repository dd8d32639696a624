"""The socket lock across a handover: a daemon stopping while the next one starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relayd import rundir
from relayd.rundir import SocketInUseError, SocketLock


def _lock(tmp_path: Path) -> SocketLock:
    sock = str(tmp_path / "run" / "relayd.sock")
    return SocketLock(sock, sock + ".session", 0o660)


def test_a_lock_file_unlinked_before_the_flock_is_not_ownership(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old owner releases (unlinks the lock file, then lets go of it) between a
    starter opening that file and taking the flock: the starter must not own the
    socket through a file no one else can find, or a third daemon owns it too."""
    old, starter, third = _lock(tmp_path), _lock(tmp_path), _lock(tmp_path)
    old.acquire()
    real_open_lock = rundir.open_lock
    opened: list[int] = []

    def open_then_old_exits(path: str, uid: int | None = None) -> int:
        fd = real_open_lock(path, uid)
        opened.append(fd)
        if old.held:
            old.release()
        return fd

    monkeypatch.setattr(rundir, "open_lock", open_then_old_exits)
    starter.acquire()
    monkeypatch.setattr(rundir, "open_lock", real_open_lock)
    try:
        assert starter.held
        lock_path = starter.socket + ".lock"
        assert os.path.exists(lock_path)
        with open(lock_path) as fh:
            assert fh.read() == f"{os.getpid()}\n"
        with pytest.raises(SocketInUseError):
            third.acquire()
        assert not third.held
    finally:
        third.release()
        starter.release()
    assert os.listdir(tmp_path / "run") == []
