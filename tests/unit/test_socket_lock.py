"""One daemon per socket: the lock beside it, the sockets it owns, on a real directory."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from relayd.rundir import SocketInUseError, SocketLock


def _lock(tmp_path: Path) -> SocketLock:
    sock = str(tmp_path / "run" / "relayd.sock")
    return SocketLock(sock, sock + ".session", 0o660)


def test_a_second_owner_is_refused_and_told_who_holds_it(tmp_path: Path) -> None:
    first, second = _lock(tmp_path), _lock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(SocketInUseError, match=f"pid {os.getpid()}"):
            second.acquire()
        assert first.held and not second.held
    finally:
        first.release()
    second.acquire()  # free again once released
    second.release()


def test_leftover_sockets_are_replaced_and_release_removes_them(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    lock.acquire()
    lock.release()
    with socket.socket(socket.AF_UNIX) as left:  # a dead daemon's socket file
        left.bind(lock.socket)
    lock.acquire()
    assert not os.path.exists(lock.socket)
    with lock.creating(), socket.socket(socket.AF_UNIX) as s:
        s.bind(lock.session_socket)
        assert os.stat(lock.session_socket).st_mode & 0o777 == 0o660
    lock.release()
    assert sorted(os.listdir(tmp_path / "run")) == []
