"""Releases that overtake their lease's Publish are parked in one table for
all sessions: one uid, however many sessions it opens, gets a share of it, so
the early Releases of every other reader are still heard."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client import InvalidArgumentError, ResourceExhaustedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.early import (
    MAX_EARLY,
    MAX_EARLY_PER_LEASE,
    MAX_EARLY_PER_SESSION,
    MAX_EARLY_PER_UID,
)
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Grant, Hooks, LeaseState
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _bound(m: LeaseManager, stage: str, uid: int) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(lambda f: None), pid=1, uid=uid, gid=uid)


def _manager(arena: Arena) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, clock=lambda: 0.0, hooks=Hooks(),
    )  # fmt: skip


def _reserve(m: LeaseManager, writer: Session, grant: Grant, lease_id: int) -> None:
    """The writer's Reserve of ``lease_id``, the grant's first slot, for the talker."""
    m.on_reserve(writer, pb.Reserve(
        lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot, nslots=1,
        generation=lease_id, request_id="r", to_stage="talker", from_stage="thinker",
    ))  # fmt: skip


def _publish(m: LeaseManager, writer: Session, lease_id: int) -> None:
    m.on_publish(writer, pb.Publish(lease_id=lease_id, nbytes=SLOT, transport=pb.TRANSPORT_SHM))


def test_one_uid_cannot_fill_the_early_table_and_silence_other_readers(arena: Arena) -> None:
    m = _manager(arena)
    writer = _bound(m, "thinker", uid=0)
    grant = asyncio.run(m.grant(writer, SLOT, 1.0))
    base = m.new_generation_base(grant)
    honest_id = base + 1
    # A hostile uid's sessions release ids of the writer's grant it has not
    # announced yet, as many as the table would take.
    hostile = [_bound(m, "talker", uid=1000) for _ in range(2)]
    refused = parked = 0
    lease_id = honest_id
    for s in hostile:
        try:
            while parked < MAX_EARLY:
                lease_id += 1
                for _ in range(MAX_EARLY_PER_SESSION):
                    m.on_release(s, pb.Release(lease_id=lease_id, generation=lease_id))
                    parked += 1
        except InvalidArgumentError:  # the daemon closes that session
            refused += 1
    assert refused == len(hostile)
    assert m.table.early.from_uid(1000) == MAX_EARLY_PER_UID
    # An honest reader of another uid releases the writer's next lease before
    # its Publish lands: heard, and the lease is freed as it is published.
    reader = _bound(m, "talker", uid=2000)
    m.on_release(reader, pb.Release(lease_id=honest_id, generation=honest_id))
    _reserve(m, writer, grant, honest_id)
    assert m.leases[honest_id].state is LeaseState.RESERVED
    _publish(m, writer, honest_id)
    assert honest_id not in m.leases  # not left published for the TTL
    # Expired, the hostile notices stop counting against their uid.
    m.table.early.expire(1e9)
    assert m.table.early.from_uid(1000) == 0 and not m.table.early


def test_another_uid_cannot_crowd_out_a_leases_early_release(arena: Arena) -> None:
    # A lease's next id is easy to guess (ids go up by one in a grant): sessions of
    # a hostile uid park what one lease would take before its Publish lands.
    m = _manager(arena)
    writer = _bound(m, "thinker", uid=0)
    grant = asyncio.run(m.grant(writer, SLOT, 1.0))
    lease_id = m.new_generation_base(grant) + 1
    for s in [_bound(m, "vocoder", uid=1000) for _ in range(2)]:
        for _ in range(MAX_EARLY_PER_LEASE // 2):
            m.on_claim(s, pb.Claim(lease_id=lease_id, generation=lease_id))
    # The reader the lease is addressed to releases it before its Publish lands:
    # still heard, and the lease is freed as it is published, not at its TTL.
    reader = _bound(m, "talker", uid=2000)
    m.on_release(reader, pb.Release(lease_id=lease_id, generation=lease_id))
    _reserve(m, writer, grant, lease_id)
    _publish(m, writer, lease_id)
    assert lease_id not in m.leases, "the addressed reader's early Release went unheard"


def test_one_uids_early_discards_cannot_fill_the_early_table(arena: Arena) -> None:
    # A discard of an id its writer has not announced yet is parked like a
    # Release; one uid's, however many, take that uid's share only.
    m = _manager(arena)
    writer = _bound(m, "thinker", uid=0)
    grant = asyncio.run(m.grant(writer, SLOT, 1.0))
    honest_id = m.new_generation_base(grant) + 1
    lease_id = honest_id
    with pytest.raises(ResourceExhaustedError):
        for _ in range(MAX_EARLY):
            lease_id += 1
            m.crossnode.discard_now(lease_id, lease_id, ("vocoder",), 1000)
    assert m.table.early.from_uid(1000) == MAX_EARLY_PER_UID
    reader = _bound(m, "talker", uid=2000)
    m.on_release(reader, pb.Release(lease_id=honest_id, generation=honest_id))
    _reserve(m, writer, grant, honest_id)
    _publish(m, writer, honest_id)
    assert honest_id not in m.leases, "the reader's early Release went unheard"
