"""A Publish rides in its lease's Reserve while that Reserve still waits to be sent.

Client: :class:`relayd_client._notices.Notices` folds the Publish into the
pending Reserve (``Reserve.publish``) only while both are in one frame and the
daemon said it takes them (``AttachResponse.reserve_publishes``); otherwise the
Publish goes on its own, as to an older daemon. Daemon: a carried Publish is
judged by the same rules as one of its own, through the session protocol.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from relayd_client._grants import Grant as ClientGrant
from relayd_client._grants import Lease as ClientLease
from relayd_client._notices import Notices
from relayd_client._session import SessionChannel
from relayd_client.wire.framing import encode_frame
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import LeaseState
from relayd.rpc.session import SessionProtocol
from tests.unit.test_frame_counts import _protocol
from tests.unit.test_leases import SLOT, Clock, _manager, _session, arena

__all__ = ["arena"]  # the fixture, shared with test_leases

# -- the client's side ---------------------------------------------------------------


class _Conn:
    """What Notices uses of a connection: its session channel."""

    def __init__(self, session: SessionChannel) -> None:
        self.session = session

    def free_lease(self, lease: ClientLease) -> None:
        pass


@pytest.fixture
def sent() -> Iterator[tuple[Notices, SessionChannel, list[pb.SessionFrame]]]:
    """Notices on an unconnected channel that keeps the frames it would send."""
    lock = threading.RLock()
    channel = SessionChannel(lambda f: None, lambda: None, lock)
    frames: list[pb.SessionFrame] = []
    channel._write = frames.append  # type: ignore[method-assign]
    channel.reserve_publishes = True
    yield Notices(_Conn(channel), lock, "thinker", None), channel, frames  # type: ignore[arg-type]


def _lease(n: int) -> ClientLease:
    grant = ClientGrant(7, 0, 100, 16, 7 << 32, "")
    return ClientLease(grant, n, 1, 7 << 32 | (n + 1))


def _put(notices: Notices, lease: ClientLease, *, flush_between: bool = False) -> None:
    notices.reserve(lease, "r", "talker")
    if flush_between:  # another notice made the frame go during the copy
        notices._conn.session.mark(flush=True)
    notices.publish(lease, 1000 + lease.local, pb.TRANSPORT_SHM, push=True)


def test_a_publish_rides_in_its_pending_reserve(sent) -> None:  # type: ignore[no-untyped-def]
    notices, channel, frames = sent

    async def scenario() -> None:
        _put(notices, _lease(0))
        _put(notices, _lease(1))
        channel.flush()

    asyncio.run(scenario())
    (frame,) = [f for f in frames if f.reserve]
    assert len(frame.publish) == 0
    assert [(r.lease_id, r.publish.lease_id, r.publish.nbytes, r.publish.push)
            for r in frame.reserve] == [(7 << 32 | 1, 7 << 32 | 1, 1000, True),
                                        (7 << 32 | 2, 7 << 32 | 2, 1001, True)]  # fmt: skip


def test_a_reserve_sent_before_the_seal_gets_a_publish_of_its_own(sent) -> None:  # type: ignore[no-untyped-def]
    notices, channel, frames = sent

    async def scenario() -> None:
        _put(notices, _lease(0), flush_between=True)
        channel.flush()

    asyncio.run(scenario())
    reserve, publish = frames
    assert [r.HasField("publish") for r in reserve.reserve] == [False]
    assert not reserve.publish
    assert [(p.lease_id, p.nbytes) for p in publish.publish] == [(7 << 32 | 1, 1000)]
    assert not publish.reserve


def test_a_daemon_that_takes_no_carried_publish_gets_its_own(sent) -> None:  # type: ignore[no-untyped-def]
    notices, channel, frames = sent
    channel.reserve_publishes = False

    async def scenario() -> None:
        _put(notices, _lease(0))
        channel.flush()

    asyncio.run(scenario())
    (frame,) = frames
    assert [r.HasField("publish") for r in frame.reserve] == [False]
    assert [p.lease_id for p in frame.publish] == [7 << 32 | 1]


# -- the daemon's side ---------------------------------------------------------------


def _bound(m: LeaseManager, stage: str, frames: list[pb.SessionFrame]) -> SessionProtocol:
    """The daemon's side of a session of ``stage`` that keeps the frames it is sent."""
    return _protocol(m, _session(m, stage, frames))


def _sealed(grant_id: int, slot: int, lease_id: int, carried_id: int | None = None) -> pb.Reserve:
    r = pb.Reserve(lease_id=lease_id, grant_id=grant_id, slot=slot, nslots=1,
                   generation=lease_id, request_id="r", to_stage="talker",
                   from_stage="thinker")  # fmt: skip
    p = r.publish
    p.lease_id = lease_id if carried_id is None else carried_id
    p.nbytes = 100
    p.transport = pb.TRANSPORT_SHM
    return r


def _errors(frames: list[pb.SessionFrame]) -> list[str]:
    return [e.message for f in frames for e in f.event if e.kind == pb.EVENT_KIND_ERROR]


def _setup(arena: Arena) -> tuple[LeaseManager, SessionProtocol, list[pb.SessionFrame], int]:
    m = _manager(arena, Clock(), [])
    wf: list[pb.SessionFrame] = []
    w = _bound(m, "thinker", wf)
    assert w.session is not None
    grant = asyncio.run(m.grant(w.session, SLOT, 1.0))
    return m, w, wf, grant.id


def test_a_carried_publish_publishes_and_a_reader_frees_it(arena: Arena) -> None:
    m, w, wf, gid = _setup(arena)
    rf: list[pb.SessionFrame] = []
    r = _bound(m, "talker", rf)
    grant = m.grants[gid]
    lid = max(m.new_generation_base(grant), grant.last_lease) + 1
    w.data_received(encode_frame(pb.SessionFrame(reserve=[_sealed(gid, grant.run.slot, lid)])))
    lease = m.leases[lid]
    assert lease.state is LeaseState.PUBLISHED and lease.nbytes == 100
    r.data_received(encode_frame(pb.SessionFrame(release=[pb.Release(lease_id=lid,
                                                                     generation=lid)])))  # fmt: skip
    assert lid not in m.leases
    assert [list(f.freed.lease_ids) for f in wf if f.HasField("freed")] == [[lid]]
    assert _errors(wf) == [] and _errors(rf) == []


def test_a_carried_publish_of_another_lease_publishes_nothing(arena: Arena) -> None:
    m, w, wf, gid = _setup(arena)
    grant = m.grants[gid]
    lid = max(m.new_generation_base(grant), grant.last_lease) + 1
    other = lid + 1
    w.data_received(
        encode_frame(pb.SessionFrame(reserve=[_sealed(gid, grant.run.slot, lid, other)]))
    )
    assert m.leases[lid].state is LeaseState.RESERVED and other not in m.leases
    (error,) = _errors(wf)
    assert f"publish of lease {other} in the Reserve of lease {lid}" in error


def test_a_lease_published_in_its_reserve_cannot_be_published_again(arena: Arena) -> None:
    m, w, wf, gid = _setup(arena)
    grant = m.grants[gid]
    lid = max(m.new_generation_base(grant), grant.last_lease) + 1
    frame = pb.SessionFrame(reserve=[_sealed(gid, grant.run.slot, lid)])
    frame.publish.add(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM)
    w.data_received(encode_frame(frame))
    lease = m.leases[lid]
    assert lease.state is LeaseState.PUBLISHED and lease.nbytes == 100
    (error,) = _errors(wf)
    assert f"bad publish of lease {lid}" in error
