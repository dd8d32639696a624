"""A discard of another node's DataRef: the writer's daemon judges it by its own record.

The reader's daemon cannot see the lease, so it sends the discarding session's
stages with ``Peer.ReleaseRemote``; the writer's daemon frees the lease only if
its recorded writer or addressee is one of them, whatever the DataRef says. A
push that landed on the reader's node is judged there by the landed record.
Two real peer layers in one process (``test_peer_manager``), with the daemon's
real keyed calls on the reader's node.
"""

from __future__ import annotations

import os
import pathlib

import grpc
import pytest
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import PermissionDeniedError, StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from tests.unit.test_keyed_put_answer_too_late import _keyed
from tests.unit.test_peer_manager import (
    BOUND,
    READER,
    SLOT,
    WRITER,
    _sha,
    pushing_nodes,
    run,
    two_nodes,
    until,
)

pytestmark = pytest.mark.timeout(60)

INTRUDER = "vocoder"


def _discard(ref: bytes) -> pb.DiscardCall:
    return pb.DiscardCall(call_id=1, data_ref=ref)


def _claiming(ref: bytes, stage: str) -> bytes:
    """``ref`` as its holder may fill it: written by and addressed to ``stage``."""
    m = pb.DataRef()
    m.CopyFrom(DataRef.from_bytes(ref).proto)
    m.to_stage = m.origin.stage = stage
    return DataRef(m).to_bytes()


def test_a_stage_that_neither_writes_nor_reads_a_pulled_ref_cannot_discard_it(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader, intruder = a.session(WRITER), b.session(READER), b.session(INTRUDER)
            on_b = _keyed(b)
            data = os.urandom(2 * SLOT + 7)
            ref = await a.put(writer, data)
            for forged in (ref, _claiming(ref, INTRUDER)):
                with pytest.raises(PermissionDeniedError):
                    await on_b.discard(intruder, _discard(forged))
            assert len(a.leases.leases) == 1
            # Its reader still reads it, byte for byte.
            local = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(local)) == _sha(data)
            b.release(reader, local)
            await until(lambda: not a.leases.leases and not b.leases.leases, "both leases freed")

    run(main())


def test_the_writers_and_the_readers_stage_may_discard_a_ref_of_another_node(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            writer_on_b = b.session(WRITER)  # another process of the writer's stage
            on_b = _keyed(b)
            for who in (reader, writer_on_b):
                ref = await a.put(writer, os.urandom(SLOT))
                await on_b.discard(who, _discard(ref))
                assert not a.leases.leases
                with pytest.raises(StaleRefError):
                    await on_b.discard(who, _discard(ref))
            a.leases.close_session(writer.id)
            assert a.arena.used_bytes == 0 and b.arena.used_bytes == 0

    run(main())


def test_a_discard_from_a_peer_that_names_no_stages_frees_nothing(
    tmp_path: pathlib.Path,
) -> None:
    """A reader's daemon that predates the check sends no stages: only a lease that
    anyone may read (adopted) could go; this one stays for its reader."""

    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer = a.session(WRITER)
            m = DataRef.from_bytes(await a.put(writer, os.urandom(SLOT))).proto
            old = pb.ReleaseRemoteRequest(
                lease_id=m.lease.lease_id,
                generation=m.lease.generation,
                node_id=b.settings.node_id,
                discard=True,
            )
            with pytest.raises(grpc.RpcError) as refused:
                await b.peers.links.call(b.peers.links.peers[a.address], "ReleaseRemote", old)
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert len(a.leases.leases) == 1

    run(main())


def test_a_landed_push_is_discarded_only_by_its_writers_or_readers_stage(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer, intruder = a.session(WRITER), b.session(INTRUDER)
            on_b = _keyed(b)
            data = os.urandom(2 * SLOT + 5)
            ref = await a.put(writer, data, push=True)
            await until(lambda: b.peers.push.counts[a.address].into == 1, "the push to land")
            await until(lambda: not a.leases.leases, "the writer's lease freed on landing")
            for forged in (ref, _claiming(ref, INTRUDER)):
                with pytest.raises(PermissionDeniedError):
                    await on_b.discard(intruder, _discard(forged))
            assert len(b.leases.leases) == 1
            local = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(local)) == _sha(data)
            b.release(reader, local)
            # The reader's stage may free a landed push unread.
            ref = await a.put(writer, data, push=True, request_id="r2")
            await until(lambda: b.peers.push.counts[a.address].into == 2, "the second push")
            await on_b.discard(reader, _discard(ref))
            assert not b.leases.leases

    run(main())
