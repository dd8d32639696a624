"""A session's announcement socket, both ends: which frames go there, and how they are read.

The daemon tells a push's landing or decline there first and on the session
socket only when it does not take the frame (full, closed, none); the client
reads whole frames from it, never waiting past its bound, and takes a closed
or vanished daemon end for "nothing more comes here".
"""

from __future__ import annotations

import array
import concurrent.futures
import os
import socket
import threading
import time
import types
from typing import Any, cast

import pytest
from relayd_client._apart import AnnouncementSocket, Waiter
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.events import Aborted, Declined, Freed, Landed, LocalLease
from relayd.rpc.frames import frame_sink
from relayd.rpc.session import SessionProtocol
from tests._daemon import wait_until

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


def _landed(lease_id: int) -> bytes:
    return pb.SessionFrame(landed=[pb.LandedPush(lease_id=lease_id)]).SerializeToString()


class _Gets:
    """Waiters on one announcement socket, each told when its lease id is heard."""

    def __init__(self, apart: AnnouncementSocket, *lease_ids: int) -> None:
        self.apart = apart
        self.waiters = {n: Waiter() for n in lease_ids}
        self.heard_on: dict[int, threading.Thread] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(len(lease_ids))

    def hear(self, frames: list[pb.SessionFrame]) -> None:
        for frame in frames:
            n = frame.landed[0].lease_id
            self.heard_on[n] = threading.current_thread()
            self.waiters[n].tell()

    def start(self, n: int, timeout: float = 30.0) -> concurrent.futures.Future[bool]:
        return self.pool.submit(self.apart.wait, self.waiters[n], timeout, self.hear)

    def waiting(self, n: int) -> None:
        wait_until(lambda: len(self.apart._waiters) == n, 10, f"{n} gets waiting")

    def one_reading_one_waiting(
        self,
    ) -> tuple[concurrent.futures.Future[bool], concurrent.futures.Future[bool]]:
        """Get 1 reading the socket, then get 2 waiting while it does."""
        first = self.start(1)
        wait_until(self.apart.lock.locked, 10, "the first get to read")
        second = self.start(2)
        self.waiting(2)
        return first, second


def test_one_get_reads_and_wakes_each_other_get_whose_frame_it_hears() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    gets = _Gets(apart, 1, 2)
    with theirs, gets.pool:
        first, second = gets.one_reading_one_waiting()
        theirs.send(_landed(2))
        assert second.result(10) is True  # told by the first get's thread
        assert not first.done()
        theirs.send(_landed(1))
        assert first.result(10) is True
    assert gets.heard_on[1] is gets.heard_on[2]
    assert apart._waiters == {}
    apart.close()


def test_a_get_that_leaves_hands_the_reading_to_one_still_waiting() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    gets = _Gets(apart, 1, 2)
    with theirs, gets.pool:
        first, second = gets.one_reading_one_waiting()
        theirs.send(_landed(1))
        assert first.result(10) is True
        gets.waiting(1)
        wait_until(apart.lock.locked, 10, "the second get to read in its turn")
        theirs.send(_landed(2))
        assert second.result(10) is True
    assert gets.heard_on[2] is not gets.heard_on[1]  # read on its own thread
    apart.close()


def test_a_get_not_told_in_time_says_so_and_the_socket_ended_leaves_it_to_the_loop() -> None:
    ours, theirs = _pair()
    apart = AnnouncementSocket(ours)
    gets = _Gets(apart, 1, 2)
    with gets.pool:
        assert gets.start(1, 0.01).result(10) is False
        theirs.close()  # the session ends: nothing more comes on the socket
        late = gets.start(2, 30.0)
        wait_until(lambda: apart._sock is None, 10, "the get to find the socket ended")
        gets.waiters[2].tell()  # as the loop thread tells it, from the session socket
        assert late.result(10) is True
    apart.close()


class _Transport:
    """What ``_send_with_rings`` asks of a transport: its socket, nothing unsent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.written = b""

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> socket.socket:
        return self.sock

    def write(self, data: bytes) -> None:
        self.written += data


def _descriptors(ancillary: Any) -> array.array[int]:
    """The descriptors an ``SCM_RIGHTS`` item of ``ancillary`` passes, in order."""
    fds = array.array("i")
    for _level, _kind, item in ancillary:
        fds.frombytes(item[: len(item) - len(item) % fds.itemsize])
    return fds


def _bind(daemon_end: socket.socket) -> tuple[SessionProtocol, list[Any]]:
    """A session protocol on ``daemon_end`` whose manager keeps the rings it
    attaches (in the list returned), as the daemon's does."""
    rings: list[Any] = []
    manager = types.SimpleNamespace(
        freed=types.SimpleNamespace(attach_ring=lambda sid, ring: rings.append(ring)),
        releases=types.SimpleNamespace(attach=lambda sid, ring: rings.append(ring)),
    )
    proto = SessionProtocol(cast(Any, manager), cast(Any, None), cast(Any, None))
    proto.transport = cast(Any, _Transport(daemon_end))
    return proto, rings


def _send_bound(proto: SessionProtocol, client_end: socket.socket) -> tuple[bytes, Any]:
    """Send BOUND with the rings and an announcement socket; what ``client_end`` got."""
    frame = pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_BOUND)])
    client_end.settimeout(10)  # what did not go by sendmsg is not read here: fail, not hang
    proto._send_with_rings(frame, cast(Any, types.SimpleNamespace(id="s")), True, True)
    data, ancillary, _, _ = client_end.recvmsg(4096, socket.CMSG_SPACE(16))
    return data, ancillary


@pytest.mark.parametrize("pair_fails", [False, True])
def test_bound_comes_with_the_rings_and_the_announcement_socket_or_the_rings_alone(
    pair_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's end follows the rings' descriptors; a daemon that cannot make
    the pair still sends the rings, and tells pushes on the session socket."""
    daemon_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proto, rings = _bind(daemon_end)
    if pair_fails:

        def no_pair(*args: object) -> tuple[socket.socket, socket.socket]:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(socket, "socketpair", no_pair)
    with daemon_end, client_end:
        data, ancillary = _send_bound(proto, client_end)
        fds = _descriptors(ancillary)
        try:
            assert len(rings) == 2 and data
            if pair_fails:
                assert len(fds) == 2 and proto.apart is None
                return
            assert len(fds) == 3 and proto.apart is not None
            theirs = socket.socket(fileno=os.dup(fds[2]))
            with theirs:
                assert theirs.type == socket.SOCK_SEQPACKET
                assert proto.send_apart(pb.SessionFrame(declined=[pb.LandedPush(lease_id=9)]))
                assert theirs.recv(4096)
                with pytest.raises(BrokenPipeError):  # the daemon's end reads nothing
                    theirs.send(b"x")
        finally:
            for fd in fds:
                os.close(fd)
            for ring in rings:
                ring.close()
            proto._close_apart()


def test_the_daemons_end_reads_nothing_before_the_clients_end_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client may write into its end the moment it has it, before the daemon has
    done anything after the send: the daemon's end must refuse that write already."""
    tried: list[str] = []
    real = socket.socket.sendmsg

    def sendmsg(self: socket.socket, buffers: Any, ancdata: Any = (), *rest: Any) -> int:
        client_end = _descriptors(ancdata)[-1]  # about to go to the client
        with socket.socket(fileno=os.dup(client_end)) as theirs:
            try:
                theirs.send(b"x")
                tried.append("taken")
            except BrokenPipeError:
                tried.append("refused")
        return real(self, buffers, ancdata, *rest)

    monkeypatch.setattr(socket.socket, "sendmsg", sendmsg)
    daemon_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proto, rings = _bind(daemon_end)
    with daemon_end, client_end:
        _, ancillary = _send_bound(proto, client_end)
    for fd in _descriptors(ancillary):
        os.close(fd)
    for ring in rings:
        ring.close()
    proto._close_apart()
    assert tried == ["refused"]
