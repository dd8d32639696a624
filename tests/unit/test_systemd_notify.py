from __future__ import annotations

import logging
import pathlib
import socket
import uuid
from collections.abc import Iterator

import pytest

from relayd._systemd import SystemdNotifier

RECV_TIMEOUT = 5.0


@pytest.fixture
def receiver(tmp_path: pathlib.Path) -> Iterator[tuple[socket.socket, str]]:
    """What systemd listens on: an AF_UNIX datagram socket at a path."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(RECV_TIMEOUT)
        yield sock, path


def test_messages_arrive_as_systemd_expects(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    with SystemdNotifier(path) as notifier:
        assert notifier.enabled
        assert notifier.ready("serving on /run/relayd/relayd.sock")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving on /run/relayd/relayd.sock"
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        assert notifier.status("draining\n3 leases left")
        assert sock.recv(4096) == b"STATUS=draining 3 leases left"
        assert notifier.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_abstract_socket() -> None:
    name = f"relayd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(RECV_TIMEOUT)
        with SystemdNotifier.from_environ({"NOTIFY_SOCKET": "@" + name}) as notifier:
            assert notifier.ready("up")
            assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_outside_systemd_everything_is_a_no_op() -> None:
    with SystemdNotifier.from_environ({}) as notifier:
        assert not notifier.enabled
        assert notifier.ready("x") is False
        assert notifier.stopping() is False
        assert notifier.status("x") is False
        assert notifier.watchdog() is False
        assert notifier.watchdog_interval() is None


def test_watchdog_interval_is_half_of_watchdog_usec(tmp_path: pathlib.Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "10000000"}
    assert SystemdNotifier.from_environ(env).watchdog_interval() == 5.0
    assert (
        SystemdNotifier.from_environ({**env, "WATCHDOG_PID": "4242"}, pid=4242).watchdog_interval()
        == 5.0
    )
    # The watchdog is meant for another process (e.g. a wrapper that exec'd us under a new pid).
    assert (
        SystemdNotifier.from_environ({**env, "WATCHDOG_PID": "4242"}, pid=99).watchdog_interval()
        is None
    )
    assert SystemdNotifier.from_environ({**env, "WATCHDOG_USEC": "0"}).watchdog_interval() is None
    # No socket to send to: no watchdog either.
    assert SystemdNotifier(None, 10_000_000).watchdog_interval() is None


def test_bad_environment_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relayd._systemd")
    notifier = SystemdNotifier.from_environ(
        {"NOTIFY_SOCKET": "relative/path", "WATCHDOG_USEC": "soon"}
    )
    assert not notifier.enabled
    assert notifier.watchdog_interval() is None
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring WATCHDOG_USEC='soon': not an integer",
        "NOTIFY_SOCKET 'relative/path' is not a path or @name; not notifying",
    ]


def test_send_errors_are_logged_once_not_raised(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="relayd._systemd")
    missing = str(tmp_path / "gone")
    with SystemdNotifier(missing) as notifier:
        assert notifier.watchdog() is False
        assert notifier.watchdog() is False
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "systemd notify WATCHDOG=1 failed: [Errno 2] No such file or directory"),
        ("DEBUG", "systemd notify WATCHDOG=1 failed: [Errno 2] No such file or directory"),
    ]


def test_full_receiver_never_blocks_the_sender(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    with SystemdNotifier(path) as notifier:
        # Nobody reads: the receive queue fills and a blocking send would hang here.
        for _ in range(100_000):
            if not notifier.watchdog():
                break
        else:
            pytest.fail("the receive queue never filled")
        sock.setblocking(False)
        drained = 0
        while True:
            try:
                sock.recv(4096)
            except BlockingIOError:
                break
            drained += 1
        assert drained > 0
        assert notifier.watchdog() is True
