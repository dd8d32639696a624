"""A session's announcement socket, both ends: which frames go there, and how they are read.

The daemon tells a push's landing or decline there first and on the session
socket only when it does not take the frame (full, closed, none); the client
reads whole frames from it, never waiting past its bound, and takes a closed
or vanished daemon end for "nothing more comes here".
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
from typing import Any, cast

import pytest
from relayd_client._apart import AnnouncementSocket
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.events import Aborted, Declined, Freed, Landed, LocalLease
from relayd.rpc.frames import frame_sink
from relayd.rpc.session import SessionProtocol

ORIGIN = ("node-a", "epoch-a", 7 << 32 | 1, 7 << 32 | 1)
LANDED = Landed(ORIGIN, LocalLease(3 << 32 | 1, 0, 4, 4, 4096, 300_000), "req", "talker")
DECLINED = Declined(ORIGIN, "talker")


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


@pytest.mark.parametrize("takes", [True, False])
def test_a_push_is_told_apart_first_and_on_the_session_socket_if_not_taken(takes: bool) -> None:
    sent: list[pb.SessionFrame] = []
    apart: list[pb.SessionFrame] = []

    def tell_apart(frame: pb.SessionFrame) -> bool:
        apart.append(frame)
        return takes

    sink = frame_sink(sent.append, tell_apart)
    for event in (LANDED, DECLINED, Freed((1, 2)), Aborted("req")):
        sink(event)
    assert [len(f.landed) + len(f.declined) for f in apart] == [1, 1]  # pushes only
    assert apart[0].landed[0].lease.length == 300_000
    assert apart[1].declined[0].to_stage == "talker"
    assert len(sent) == (2 if takes else 4)
    assert [bool(f.freed.lease_ids) for f in sent[-2:]] == [True, False]
    assert sent[-1].aborted[0].request_id == "req"


def _daemon_end(sock: socket.socket | None) -> SessionProtocol:
    """A session connection with only its announcement socket set (nothing else is used)."""
    proto = SessionProtocol(cast(Any, None), cast(Any, None), cast(Any, None))
    if sock is not None:
        sock.setblocking(False)
    proto.apart = sock
    return proto


def test_the_daemon_never_waits_for_a_full_announcement_socket() -> None:
    ours, theirs = _pair()
    with ours, theirs:
        proto = _daemon_end(ours)
        frame = pb.SessionFrame(landed=[pb.LandedPush(lease_id=1, to_stage="talker")])
        taken = 0
        while proto.send_apart(frame):  # the client reads none: the socket fills
            taken += 1
            assert taken < 100_000
        assert taken > 10  # a few hundred fit (the message count is not the cap)
        assert proto.apart is ours  # full is not gone: it drains at the reader's next get
        assert theirs.recv(4096) == frame.SerializeToString()
        assert proto.send_apart(frame)  # room again


def test_an_announcement_socket_its_client_closed_is_dropped() -> None:
    ours, theirs = _pair()
    theirs.close()
    proto = _daemon_end(ours)
    assert not proto.send_apart(pb.SessionFrame(declined=[pb.LandedPush(lease_id=1)]))
    assert proto.apart is None and ours.fileno() == -1  # closed, never tried again
    assert not _daemon_end(None).send_apart(pb.SessionFrame())


def test_the_client_reads_whole_frames_in_order_and_skips_a_malformed_one() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    try:
        frames = [pb.SessionFrame(landed=[pb.LandedPush(lease_id=n)]) for n in range(1, 4)]
        theirs.send(frames[0].SerializeToString())
        theirs.send(b"\xff\xff\xff")  # no SessionFrame
        for frame in frames[1:]:
            theirs.send(frame.SerializeToString())
        with apart.lock:
            got = apart.listen(0.0)
            assert got is not None
            assert [f.landed[0].lease_id for f in got] == [1, 2, 3]
            assert apart.listen(0.0) == []  # nothing more, and no wait
    finally:
        apart.close()
        theirs.close()


def test_a_listen_waits_at_most_its_bound_and_ends_with_the_daemons_end() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    with apart.lock:
        started = time.monotonic()
        assert apart.listen(0.005) == []
        waited = time.monotonic() - started
        assert 0.004 <= waited < 1.0
        theirs.close()  # the daemon's end: its session is over
        assert apart.listen(5.0) == []  # at once, not after its bound
        assert apart.listen(5.0) is None  # and nothing more comes
    apart.close()
    assert ours.fileno() == -1
    with apart.lock:
        assert apart.listen(5.0) is None


def test_a_descriptor_that_is_no_packet_socket_is_refused_and_closed() -> None:
    r, w = os.pipe()
    os.close(w)
    assert AnnouncementSocket.adopt(r) is None
    with pytest.raises(OSError):
        os.fstat(r)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = a.detach()
    b.close()
    assert AnnouncementSocket.adopt(fd) is None
    with pytest.raises(OSError):
        os.fstat(fd)
    ours, theirs = _pair()
    ours.set_inheritable(True)  # as recvmsg hands it over (no MSG_CMSG_CLOEXEC)
    fd = ours.detach()
    apart = AnnouncementSocket.adopt(fd)
    assert apart is not None
    assert not os.get_inheritable(fd)
    apart.close()
    theirs.close()


def test_a_close_wakes_a_thread_listening_rather_than_wait_out_its_poll() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    got: list[object] = []
    polling = threading.Event()

    def listen() -> None:
        with apart.lock:
            polling.set()
            got.append(apart.listen(3600.0))

    with theirs, concurrent.futures.ThreadPoolExecutor(1) as pool:
        listening = pool.submit(listen)
        assert polling.wait(10)
        started = time.monotonic()
        apart.close()  # once the listener let go: it woke at the shutdown
        listening.result(10)
        assert time.monotonic() - started < 60
    assert got == [[]] and ours.fileno() == -1
