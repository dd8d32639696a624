"""Push grants and pushes across a link that failed on one side only, and pushes
whose peer goes in the instant they start: two nodes in one process on real
parts (see ``test_peer_manager``), the Mooncake WRITE a loopback transfer."""

from __future__ import annotations

import asyncio
import os
import pathlib
import types
from typing import Any

import grpc
import pytest
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import ResourceExhaustedError, StaleEpochError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.transports.loopback import Loopback
from tests.unit import test_peer_manager as nodes
from tests.unit.test_peer_manager import (
    BOUND,
    READER,
    SLOT,
    WRITER,
    Node,
    _sha,
    _up,
    peer_token,
    pushing_nodes,
    run,
    until,
)

pytestmark = pytest.mark.timeout(60)


def _fail_one_heartbeat(node: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``node``'s next heartbeat to any peer times out (the peer never hears of it);
    returns the list its failure is recorded in."""
    links = node.peers.links
    real = links.call
    failed: list[str] = []

    async def call(peer: Any, rpc: str, request: Any) -> Any:
        if rpc == "Heartbeat" and not failed:
            failed.append(peer.address)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="Deadline Exceeded",
            )
        return await real(peer, rpc, request)

    monkeypatch.setattr(links, "call", call)
    return failed


def test_a_writer_that_took_the_reader_for_lost_never_writes_over_a_landed_push(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's heartbeat to B times out once; B never notices. A drops B's grant,
    handshakes again and asks for one: whatever it gets, its next push must not
    land on the bytes of a push B holds for its reader, unread."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer = a.session(WRITER)
            first, second = os.urandom(2 * SLOT), os.urandom(2 * SLOT)
            ref1 = await a.put(writer, first, push=True, request_id="r1")
            await until(lambda: b.peers.push.counts[a.address].into == 1, "the first push")
            # ...and B's receipt of it at A: sent in the window where A takes B for
            # lost, it would be refused, and W's lease kept until its TTL.
            counts = a.peers.push.counts[b.address]
            await until(lambda: counts.out == 1, "the first push received at A")
            old = a.peers.push.out[b.address]
            failed = _fail_one_heartbeat(a, monkeypatch)
            await until(lambda: failed, "A's failed heartbeat")
            await until(
                lambda: a.peers.push.out.get(b.address) not in (None, old),
                "A to hold a push grant of B's again",
            )
            assert b.peers.links.peers[a.address].up  # B never took A for lost
            ref2 = await a.put(writer, second, push=True, request_id="r2")
            await until(lambda: counts.out + counts.declined == 2, "the second push to end at A")
            got1 = await b.peers.fetch(reader, ref1, BOUND)
            assert _sha(b.read(got1)) == _sha(first)
            got2 = await b.peers.fetch(reader, ref2, BOUND)
            assert _sha(b.read(got2)) == _sha(second)
            for got in (got1, got2):
                b.release(reader, got)
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")
            grant = a.peers.push.out[b.address]
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "freed runs")

    run(main())


@pytest.mark.parametrize("failing", ["writer's node", "reader's node"])
def test_a_receipt_lost_with_the_link_is_asked_for_again_once_the_peers_are_back(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """B published A's push, but its receipt is lost: one side's heartbeat times
    out, it takes the other for lost, and a receipt in flight then is refused or
    forgotten. Once they have handshaken again, A asks B which of its pushes B
    published, and frees W's lease on B's word, not at the lease's TTL."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            held: list[pb.PushLanded] = []  # B's receipts, lost
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            data = os.urandom(2 * SLOT)
            ref = await a.put(a.session(WRITER), data, push=True)
            await until(lambda: held, "B to publish the push")
            pushed = DataRef.from_bytes(ref).proto.lease
            assert pushed.lease_id in a.leases.leases  # kept for a pull until B's word
            old = a.peers.push.out[b.address]
            failed = _fail_one_heartbeat(a if failing == "writer's node" else b, monkeypatch)
            await until(lambda: failed, "the failed heartbeat")
            await until(
                lambda: a.peers.push.out.get(b.address) not in (None, old),
                "A to hold a push grant of B's again",
            )
            # B answers from what it landed, read or not: here the read comes first.
            got = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(got)) == _sha(data)
            assert b.transport.transfers == 0  # the landed copy, not a pull
            b.release(reader, got)
            await until(lambda: not a.leases.leases, "A to free the writer's lease")
            assert len(held) == 1 and a.peers.push.counts[b.address].out == 1
            assert a.peers.push.status(b.address)["pushes_unreceived"] == 0

    run(main())


def test_a_peer_that_restarted_is_not_asked_about_the_pushes_it_lost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's daemon restarted (a new epoch) after A lost its receipt: the new one
    holds none of A's pushes, so A asks it nothing and forgets them; W's lease
    stays for its readers' pulls, or its TTL."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, _reader):
            held: list[pb.PushLanded] = []
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            ref = await a.put(a.session(WRITER), os.urandom(2 * SLOT), push=True)
            await until(lambda: held, "B to publish the push")
            push, peer = a.peers.push, a.peers.links.peers[b.address]
            push.peer_down(peer)  # its receipt refused from here on
            assert push.status(b.address)["pushes_unreceived"] == 1
            restarted = types.SimpleNamespace(address=b.address, epoch="a-new-epoch")
            push.ask_unreceived(restarted)  # type: ignore[arg-type]
            assert not a.peers.notifier.box(b.address).unreceived
            assert push.status(b.address)["pushes_unreceived"] == 0
            assert DataRef.from_bytes(ref).proto.lease.lease_id in a.leases.leases

    run(main())


def test_pushes_of_a_peer_gone_for_good_are_not_counted_once_freed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's node is lost and never comes back: A's pushes B had not said it received
    wait to be asked about, and count as unreceived only while their leases are
    still published (an abort here frees one)."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, _reader):
            held: list[pb.PushLanded] = []
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            writer = a.session(WRITER)
            await a.put(writer, os.urandom(2 * SLOT), push=True, request_id="kept")
            await a.put(writer, os.urandom(2 * SLOT), push=True, request_id="doomed")
            await until(lambda: len(held) == 2, "B to publish both pushes")
            push = a.peers.push
            push.peer_down(a.peers.links.peers[b.address])
            assert push.status(b.address)["pushes_unreceived"] == 2
            assert a.leases.abort_from_peer("doomed")[0] == 1
            assert push.status(b.address)["pushes_unreceived"] == 1
            assert a.leases.abort_from_peer("kept")[0] == 1
            assert push.status(b.address)["pushes_unreceived"] == 0
            assert b.address not in push._unasked  # nothing left of them

    run(main())


def test_a_push_whose_peer_goes_before_it_starts_gives_back_its_credit_and_lease(
    tmp_path: pathlib.Path,
) -> None:
    """The publish starts a push task; in the same loop turn a heartbeat to the
    reader's node fails (A forgets B's identity, its segments among it). The push
    must end as a declined one: its credit back, W's lease no longer held, and the
    reader's pull of it must work and free it."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer = a.session(WRITER)
            data = os.urandom(2 * SLOT)
            ref = await a.put(writer, data, push=True)
            # No await since the publish: the push task has not run a step yet.
            assert a.credits_out() == 1
            a.peers.links._down(a.peers.links.peers[b.address], "Deadline Exceeded")
            counts = a.peers.push.counts[b.address]
            await until(lambda: counts.declined == 1, "the push to be declined")
            assert a.credits_out() == 0 and not a.leases.table.held
            assert not a.leases.table._holds
            got = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(got)) == _sha(data)
            b.release(reader, got)
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")
            assert a.credits_out() == 0 and b.credits_out() == 0
            assert not a.leases.table.held

    run(main())


@pytest.mark.parametrize("wait", ["room", "credit"])
def test_a_pull_that_waited_while_its_writer_restarted_reads_nothing_of_the_new_daemon(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    """B's pull of A's DataRef waits (for arena space, or for a credit of A);
    meanwhile A's daemon restarts (same node id and address, a new epoch) and its
    first put lies where the old one's did, with the same lease id and
    generation. The pull must fail with StaleEpochError, not hand the reader the
    new daemon's bytes nor free its lease."""
    token = peer_token(tmp_path)
    loopback = Loopback()

    async def main() -> None:
        a = Node("a", loopback, token)
        b = Node("b", loopback, token, peers=(a.address,), peer_credits=1)
        a2: Node | None = None
        try:
            await a.peers.start()
            await b.peers.start()
            await until(lambda: _up(a, b) and _up(b, a), "the handshake both ways")
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(2 * SLOT))
            grants = []
            credit = None
            if wait == "room":
                for filler in [b.session(stage) for stage in ("f1", "f2")]:
                    while b.arena.used_bytes < b.arena.capacity_bytes:
                        try:
                            grants.append((filler, await b.leases.grant(filler, 8 * SLOT, 0.0)))
                        except ResourceExhaustedError:
                            break
                assert b.arena.used_bytes == b.arena.capacity_bytes
            else:
                credit = b.peers.credits.try_acquire(a.address)
                assert credit is not None
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            if wait == "room":
                await until(lambda: b.leases.queue.space_short, "the pull to wait for room")
            else:
                await until(lambda: b.peers.credits.waiting(a.address) == 1, "a credit wait")
            await a.close()
            a.dispose()
            await until(lambda: not _up(b, a), "B to take A for lost")
            port = int(a.address.rpartition(":")[2])
            with monkeypatch.context() as m:
                settings = nodes.Settings
                m.setattr(nodes, "free_port", lambda: port)
                m.setattr(
                    nodes,
                    "Settings",
                    lambda **kw: settings(**{**kw, "node_id": a.settings.node_id}),
                )
                a2 = Node("a", loopback, token)
            await a2.peers.start()
            peer = b.peers.links.peers[a.address]
            await until(lambda: peer.up and peer.epoch == a2.epoch, "B to greet the new daemon")
            new = os.urandom(2 * SLOT)
            ref2 = await a2.put(a2.session(WRITER), new)
            old_lease, new_lease = (
                DataRef.from_bytes(ref).proto.lease,
                DataRef.from_bytes(ref2).proto.lease,
            )
            assert (old_lease.lease_id, old_lease.generation, old_lease.slot) == (
                new_lease.lease_id,
                new_lease.generation,
                new_lease.slot,
            )
            for filler, grant in grants:
                b.leases.return_grant(filler, grant.id)
            if credit is not None:
                credit.release()
            with pytest.raises(StaleEpochError):
                await asyncio.wait_for(fetch, BOUND)
            assert not b.leases.leases and b.credits_out() == 0
            assert new_lease.lease_id in a2.leases.leases  # the new daemon's reader keeps it
        finally:
            for node in (b, a2, a):
                if node is not None:
                    await node.close()
                    node.dispose()

    run(main())


def test_a_freed_run_that_is_not_out_spoils_nothing_else_in_its_batch(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer says it freed a run of our grant that is free already (a buggy or
    replayed notice): that entry is ignored, and the receipt in the same batch
    still frees the writer's attached push."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            held: list[pb.PushLanded] = []
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            ref = await a.put(a.session(WRITER), os.urandom(SLOT + 3), push=True)
            got = await b.peers.fetch(reader, ref, BOUND)
            pushed = DataRef.from_bytes(ref).proto.lease
            assert len(held) == 1 and pushed.lease_id in a.leases.leases
            grant = a.peers.push.out[b.address]
            free_start = grant.alloc.free_runs()[-1][0]
            batch = pb.PeerNotices(node_id=b.settings.node_id, daemon_epoch=b.epoch)
            batch.freed.add(grant_id=grant.grant_id, slot=free_start, nslots=1)
            batch.received.add(lease_id=pushed.lease_id, generation=pushed.generation)
            assert a.peers.push.on_notices(batch) == 0
            assert pushed.lease_id not in a.leases.leases
            assert a.peers.push.counts[b.address].out == 1
            b.release(reader, got)
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "the freed run")

    run(main())
