"""To an older daemon, the Publish and Release of a large lease go at once; a
small lease's linger. To one that takes a Reserve over a read lease, all linger.

A Release that reaches the daemon before its lease's Publish waits for it, so a
writer that waits for the daemon's Freed gets a large run back before its next
put only when neither notice lingers; the rest batch, the Release by the
session's ring (see :mod:`relayd_client._notices`). A writer that takes the
run back on its reader's read mark waits for neither.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import pytest
from relayd_client._checks import ReadChecks
from relayd_client._notices import Notices
from relayd_client._session import SessionChannel
from relayd_client.wire.errors import StaleRefError
from relayd_client.wire.framing import PROMPT_NOTICE_BYTES
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import CLAIM_BIT, IdRing

from tests.unit.test_reserve_publish import _Conn as _PublishConn
from tests.unit.test_reserve_publish import _lease

EPOCH = "e1"
SMALL = PROMPT_NOTICE_BYTES - 1


class _Conn(_PublishConn):
    """The Reserve/Publish tests' connection, with the epoch a Release checks."""

    daemon_epoch = EPOCH


class Client:
    def __init__(self) -> None:
        lock = threading.RLock()
        self.channel = SessionChannel(lambda f: None, lambda: None, lock)
        self.frames: list[pb.SessionFrame] = []
        self.channel._write = self.frames.append  # type: ignore[method-assign]
        self.channel.reserve_publishes = True
        self.channel.reserve_over_read = False  # an older daemon, unless a test says
        # The daemon's end of the session's Release ring, and the client's.
        self.daemon_ring, fd = IdRing.create("relayd-release")
        self.channel.release_ring = IdRing.map(fd)
        os.close(fd)
        self.notices = Notices(_Conn(self.channel), lock, "thinker", ReadChecks(lock, False))  # type: ignore[arg-type]

    def close(self) -> None:
        assert self.channel.release_ring is not None
        self.channel.release_ring.close()
        self.daemon_ring.close()

    def releases_sent(self) -> list[int]:
        return [r.lease_id for f in self.frames for r in f.release]

    def published(self) -> list[int]:
        carried = [r.lease_id for f in self.frames for r in f.reserve if r.HasField("publish")]
        return carried + [p.lease_id for f in self.frames for p in f.publish]


@pytest.fixture
def client() -> Iterator[Client]:
    c = Client()
    yield c
    c.close()


def _read(lease_id: int, length: int) -> pb.DataRef:
    """A reader's DataRef of a lease whose generation is its id, as a ring word needs."""
    return pb.DataRef(
        origin=pb.Origin(daemon_epoch=EPOCH),
        lease=pb.LeaseRef(lease_id=lease_id, generation=lease_id, length=length),
    )


@pytest.mark.parametrize("nbytes", [PROMPT_NOTICE_BYTES, 64 << 20])
def test_a_large_leases_publish_goes_at_once(client: Client, nbytes: int) -> None:
    async def put() -> None:
        lease = _lease(0)
        client.notices.reserve(lease, "r", "talker")
        client.notices.publish(lease, nbytes, pb.TRANSPORT_SHM)
        # Written before publish returned: no turn of the loop, no linger timer.
        assert client.published() == [lease.id]

    asyncio.run(put())


def test_a_smaller_leases_publish_lingers(client: Client) -> None:
    async def put() -> None:
        lease = _lease(0)
        client.notices.reserve(lease, "r", "talker")
        client.notices.publish(lease, SMALL, pb.TRANSPORT_SHM)
        assert client.frames == []
        client.channel.flush()  # as its linger would
        assert client.published() == [lease.id]

    asyncio.run(put())


def test_a_large_leases_release_goes_in_a_frame_at_once_not_the_ring(client: Client) -> None:
    async def read() -> None:
        client.notices.release(_read(41, PROMPT_NOTICE_BYTES))
        assert client.releases_sent() == [41]
        assert client.daemon_ring.take() == []

    asyncio.run(read())


def test_a_smaller_leases_release_goes_in_the_ring_and_wakes_nobody(client: Client) -> None:
    async def read() -> None:
        client.notices.release(_read(42, SMALL))
        assert client.frames == []
        assert client.daemon_ring.take() == [42]

    asyncio.run(read())


@pytest.mark.parametrize("nbytes", [PROMPT_NOTICE_BYTES, 64 << 20])
def test_a_large_lease_lingers_to_a_daemon_that_takes_a_reserve_over_a_read_one(
    client: Client, nbytes: int
) -> None:
    """Its writer takes the run back on the reader's mark: neither notice need hurry."""
    client.channel.reserve_over_read = True

    async def transfer() -> None:
        lease = _lease(0)
        client.notices.reserve(lease, "r", "talker")
        assert client.notices.publish(lease, nbytes, pb.TRANSPORT_SHM)  # watched
        client.notices.release(_read(44, nbytes))
        assert client.frames == []
        assert client.daemon_ring.take() == [44]
        client.channel.flush()  # as its linger would
        assert client.published() == [lease.id]

    asyncio.run(transfer())


def test_an_older_daemon_gets_no_watch(client: Client) -> None:
    """A lingering Publish in its Reserve, but the daemon would refuse a Reserve
    over the lease once read: the writer waits for the Freed, not the mark."""

    async def put() -> None:
        lease = _lease(0)
        client.notices.reserve(lease, "r", "talker")
        assert not client.notices.publish(lease, SMALL, pb.TRANSPORT_SHM)
        assert client.frames == []  # it lingers all the same

    asyncio.run(put())


def test_a_large_release_after_its_claim_in_the_ring_keeps_the_claim_first(
    client: Client,
) -> None:
    """The claim before a large copy goes by the ring; the daemon takes a session's
    ring before it judges the Releases of that session's next frame."""

    async def read() -> None:
        m = _read(43, PROMPT_NOTICE_BYTES)
        client.notices.claim(m, ring=True)
        client.notices.release(m)
        assert client.releases_sent() == [43]
        (claim,) = client.daemon_ring.take()
        assert claim == 43 | CLAIM_BIT

    asyncio.run(read())


def test_a_landed_leases_release_is_in_the_frame_at_once_and_goes_after_the_turn(
    client: Client,
) -> None:
    """A lease landed from another node, read on the session's loop: not the ring
    (no writer's frame takes it on that node). The Release is in the pending frame
    before release() returns, so a close sends it, and the lease is read; arming
    its linger waits for a later turn, after the get has returned."""

    async def read() -> None:
        client.channel._loop = asyncio.get_running_loop()  # as an open session's
        m = _read(45, SMALL)
        client.notices.release(m, ring=False)
        assert [r.lease_id for r in client.channel.pending.release] == [45]
        with pytest.raises(StaleRefError):
            client.notices._checks.check_not_released(m, EPOCH)
        assert client.frames == [] and client.daemon_ring.take() == []
        for _ in range(3):  # the turn that marks it, the one that sends it
            if client.frames:
                break
            await asyncio.sleep(0)
        assert client.releases_sent() == [45]

    asyncio.run(read())
