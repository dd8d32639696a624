"""Who may free a lease unread: a session serving the stage that writes it or the
stage it is addressed to, by the lease's own record (``CrossNodeLeases.discard``).

A DataRef is guessable (lease ids are sequential, the generation is the id, the
rest is its holder's to fill), so holding one entitles nobody. Here on a real
(small) arena: a published lease, a reserved one, one whose Reserve has not
arrived yet (waited for, or held and judged when it is published), and one
adopted from a dead writer.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from relayd_client import PermissionDeniedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.records import LeaseState
from tests._daemon import async_wait_until
from tests.unit.test_leases import (
    SLOT,
    Clock,
    _manager,
    _publish,
    _reserve,
    _seal,
    _session,
    arena,
)

__all__ = ["arena"]  # the fixture, shared with test_leases

WRITER, READER, INTRUDER = "thinker", "talker", "vocoder"


def test_a_published_lease_is_discarded_only_by_its_writers_or_readers_stage(
    arena: Arena,
) -> None:
    m = _manager(arena, Clock(), [])
    w = _session(m, WRITER, [])
    grant = asyncio.run(m.grant(w, 4 * SLOT, 1.0))
    lid = _publish(m, w, grant, 0, 1)
    with pytest.raises(PermissionDeniedError, match=f"{WRITER}.*{READER}"):
        m.crossnode.discard_now(lid, lid, [INTRUDER, "critic"])
    assert m.leases[lid].state is LeaseState.PUBLISHED
    # A wrong generation names no live lease: stale, whoever asks.
    assert not m.crossnode.discard_now(lid, lid + 1, [INTRUDER])
    for slot, stages in enumerate(([INTRUDER, WRITER], [READER]), start=1):
        lid = _publish(m, w, grant, slot, 1)
        assert m.crossnode.discard_now(lid, lid, stages)
        assert lid not in m.leases
        assert not m.crossnode.discard_now(lid, lid, stages)  # gone already
    # A reserved lease has its record too: refused at once.
    reserved = max(m.new_generation_base(grant), grant.last_lease) + 1
    _reserve(m, w, grant, 3, 1, reserved)
    _seal(arena, grant, 3, reserved, 10)
    with pytest.raises(PermissionDeniedError):
        m.crossnode.discard_now(reserved, reserved, [INTRUDER])
    m.on_publish(w, pb.Publish(lease_id=reserved, nbytes=10, transport=pb.TRANSPORT_SHM))
    assert m.leases[reserved].state is LeaseState.PUBLISHED


def test_a_discard_before_the_reserve_is_judged_when_the_lease_is_published(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    # The writer's notices linger: a DataRef can reach a discarder before its
    # Reserve reaches the daemon. Nothing says then whose lease it is.
    m = _manager(arena, Clock(), [])
    w = _session(m, WRITER, [])
    grant = asyncio.run(m.grant(w, 4 * SLOT, 1.0))
    base = m.new_generation_base(grant)
    kept, freed = base + 1, base + 2
    with caplog.at_level(logging.WARNING, logger="relayd"):
        assert m.crossnode.discard_now(kept, kept, [INTRUDER])  # held until the Publish
        assert m.crossnode.discard_now(freed, freed, [READER])
        for slot, lid in enumerate((kept, freed)):
            _seal(arena, grant, slot, lid, 10)
            _reserve(m, w, grant, slot, 1, lid)
            m.on_publish(w, pb.Publish(lease_id=lid, nbytes=10, transport=pb.TRANSPORT_SHM))
    assert m.leases[kept].state is LeaseState.PUBLISHED  # still its reader's
    assert freed not in m.leases
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and f"lease {kept}" in refused[0], refused


def test_an_adopted_lease_is_discarded_by_whoever_names_it(arena: Arena) -> None:
    # Sealed by a writer that died before announcing it: its stages are unknown,
    # and any reader naming it may read (and so free) it; a discard is no more.
    m = _manager(arena, Clock(), [])
    w = _session(m, WRITER, [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = m.new_generation_base(grant) + 1
    _seal(arena, grant, 0, lid, 10)
    m.close_session(w.id)
    assert m.leases[lid].adopted
    assert m.crossnode.discard_now(lid, lid, [INTRUDER])
    assert not m.leases and arena.used_bytes == 0


def test_a_discard_that_overtakes_the_reserve_waits_for_it_and_hears_the_verdict(
    arena: Arena,
) -> None:
    m = _manager(arena, Clock(), [])
    w = _session(m, WRITER, [])

    async def go() -> None:
        grant = await m.grant(w, SLOT, 1.0)
        lid = m.new_generation_base(grant) + 1
        intruder = asyncio.ensure_future(m.crossnode.discard(lid, lid, [INTRUDER], uid=1))
        reader = asyncio.ensure_future(m.crossnode.discard(lid, lid, [READER], uid=2))
        await async_wait_until(lambda: m.table.publish_waits.waiting == 2, 5, "both to wait")
        _seal(arena, grant, 0, lid, 10)
        _reserve(m, w, grant, 0, 1, lid)
        m.on_publish(w, pb.Publish(lease_id=lid, nbytes=10, transport=pb.TRANSPORT_SHM))
        with pytest.raises(PermissionDeniedError):
            await asyncio.wait_for(intruder, 5)
        assert await asyncio.wait_for(reader, 5)
        assert lid not in m.leases

    asyncio.run(go())
