"""A push whose Landed notice is late, lost, or read twice at the reader's node:
two nodes in one process on real parts (see ``test_peer_manager``), the
Mooncake WRITE a loopback transfer, small pushes riding the notice channel."""

from __future__ import annotations

import os
import pathlib
import socket
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.metrics import Metrics
from relayd.peer_channel import frame
from relayd.pools.sessions import Session
from tests._daemon import listener_reading
from tests.unit.test_peer_manager import (
    BOUND,
    SLOT,
    WRITER,
    Node,
    _sha,
    pushing_nodes,
    run,
    until,
)

pytestmark = pytest.mark.timeout(60)


def _held(node: Node) -> int:
    """``node``'s arena in use, but for the push grants it gave peers: a peer asks
    for one once it hears of a stage served here (the writer's too), whenever
    that heartbeat comes."""
    given = node.peers.push.landing.given.values()
    return node.arena.used_bytes - sum(g.run.nslots for g in given) * node.arena.slot_size


def _close(node: Node, session: Session, used: int) -> None:
    """Close ``session``: ``node``'s arena holds what it held before it (``_held``), no more."""
    node.leases.close_session(session.id)
    assert _held(node) == used


def test_an_attached_landed_that_comes_after_the_reader_pulled_is_not_published(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's attached push is held on the way; B's reader stops waiting at the peer
    timeout and pulls the writer's lease. When the Landed notice then arrives, B
    must not publish a second copy of a DataRef already read, nor tell A it
    received it: the run goes back to A's grant and nothing stays held."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            a_used, b_used = _held(a), _held(b)
            notifier = a.peers.notifier
            real = notifier.send_attached
            held: list[tuple[str, pb.PushLanded, bytes]] = []

            def hold(address: str, landed: pb.PushLanded, data: Any, sent: Any) -> bool:
                held.append((address, landed, bytes(data)))
                sent()  # copied: the writer's run may change
                return True

            monkeypatch.setattr(notifier, "send_attached", hold)
            data = os.urandom(SLOT + 7)
            writer = a.session(WRITER)
            ref = await a.put(writer, data, push=True)
            assert len(held) == 1
            got = await b.peers.fetch(reader, ref, BOUND)  # waits, then pulls
            assert _sha(b.read(got)) == _sha(data)
            counts = b.peers.push.counts[a.address]
            assert counts.reads_pulled == 1
            await until(lambda: not a.leases.leases, "the pull to free the writer's lease")

            received: list[pb.LeaseKey] = []
            push_a = a.peers.push
            real_received = push_a._received
            monkeypatch.setattr(
                push_a,
                "_received",
                lambda address, keys: (received.extend(keys), real_received(address, keys)),
            )
            address, landed, attached = held[0]
            assert real(address, landed, attached, lambda: None)
            grant = push_a.out[b.address]
            await until(
                lambda: counts.into == 1 or grant.alloc.free_runs() == [(0, grant.nslots)],
                "B to handle the late Landed notice",
            )
            assert counts.into == 0
            assert not b.peers.push.landing._landed
            b.release(reader, got)
            assert not b.leases.leases
            assert not received
            _close(a, writer, a_used)
            _close(b, reader, b_used)

    run(main())


def test_a_claimed_attached_push_is_not_pulled_a_second_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's receipt for an attached push has not reached A (W's lease is still
    published there). A second fetch of the same DataRef, while the landed lease
    is claimed and after it was released, must fail with StaleRefError, not
    pull a second copy of it."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            a_used, b_used = _held(a), _held(b)
            held: list[pb.PushLanded] = []
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            data = os.urandom(2 * SLOT + 5)
            writer = a.session(WRITER)
            ref = await a.put(writer, data, push=True)
            got = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(got)) == _sha(data)
            assert len(held) == 1
            pushed = DataRef.from_bytes(ref).proto.lease
            assert pushed.lease_id in a.leases.leases  # published at A until the receipt
            b.leases.on_claim(reader, pb.Claim(lease_id=got.lease_id, generation=got.generation))

            with pytest.raises(StaleRefError):
                await b.peers.fetch(reader, ref, BOUND)
            b.release(reader, got)
            assert not b.leases.leases
            with pytest.raises(StaleRefError):
                await b.peers.fetch(reader, ref, BOUND)
            assert b.transport.transfers == 0  # no pull
            assert b.peers.push.counts[a.address].reads_pulled == 0

            monkeypatch.undo()
            b.peers.push._receipt(a.address, held[0])
            await until(lambda: not a.leases.leases, "the receipt to free the writer's lease")
            grant = a.peers.push.out[b.address]
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "freed runs")
            assert not b.leases.leases
            _close(a, writer, a_used)
            _close(b, reader, b_used)

    run(main())


def test_a_landed_notice_lost_on_a_broken_notice_channel_loses_no_data(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's WRITE lands at B; the notice channel breaks in the middle of the batch
    carrying its Landed notice (half a frame reaches B), while heartbeats go on.
    B's reader waits for the push, then reads the bytes by pull, not StaleRefError;
    and the run of A's grant at B comes back."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            a_used, b_used = _held(a), _held(b)
            notifier = a.peers.notifier
            link = notifier._channels[b.address]
            real_send = link.send
            broken: list[pb.PeerNotices] = []

            def send(batch: pb.PeerNotices, attached: Any = (), sent: Any = None) -> bool:
                if not batch.landed or broken:
                    return bool(real_send(batch, attached, sent))
                broken.append(batch)
                body = batch.SerializeToString()
                half = len(body) // 2
                os.write(link._fd, frame(body)[: 4 + half])
                link.close()  # the connection breaks before the rest of the frame
                return True

            monkeypatch.setattr(link, "send", send)
            data = os.urandom(2 * SLOT + 5)
            writer = a.session(WRITER)
            ref = await a.put(writer, data, push=True)
            await until(lambda: broken, "the Landed notice on the breaking channel")
            got = await b.peers.fetch(reader, ref, BOUND)
            assert b.peers.links.peers[a.address].up  # B never took A for lost
            assert _sha(b.read(got)) == _sha(data)
            b.release(reader, got)
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")
            # The run A cut for it in B's grant stays out until that grant is
            # renewed: B never took it, and A cannot tell a lost Landed from a
            # late one, whose refusal gives the run back.
            _close(a, writer, a_used)
            _close(b, reader, b_used)

    run(main())


def _queued_gauge(a: Node, b: Node) -> float | None:
    """``relayd_peer_notice_channel_queued_bytes`` for B, as A's metrics show it."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.attach_state(
        lambda: {"pools": [], "leases": {}, "sessions": 0, "serving": 1, **a.peers.snapshot()}
    )
    return registry.get_sample_value("relayd_peer_notice_channel_queued_bytes", {"peer": b.address})


def test_an_attached_push_holds_the_writers_run_until_its_bytes_went(
    tmp_path: pathlib.Path,
) -> None:
    """The bytes of an attached push that the kernel did not take at once wait in
    the notice channel's queue as a view of W's run, uncopied: an abort meanwhile
    frees W's lease at once, but its run stays held (no Freed for the writer to
    refill it under the send) until they went. B then reads what was put."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=16 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            await until(lambda: b.peers._notices_in.conns, "B's end of the channel")
            a_used, b_used = _held(a), _held(b)
            link = a.peers.notifier._channels[b.address]
            # A slow peer: the kernel takes little at a time, and B takes nothing yet.
            sock = link._writer.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            listener_reading(b.peers._notices_in, False)
            writer = a.session(WRITER)
            data = os.urandom(16 * SLOT)
            ref = await a.put(writer, data, push=True)
            assert a.peers.push.counts[b.address].attached == 1
            assert link.backlog > 0
            assert _queued_gauge(a, b) == link.backlog  # what an operator sees
            lease_id = DataRef.from_bytes(ref).proto.lease.lease_id
            table = a.leases.table
            assert a.leases.abort(writer, "r1")[0] == 1
            assert not a.leases.leases
            assert lease_id in table.held  # freed, but its run is still being sent
            listener_reading(b.peers._notices_in, True)
            await until(lambda: lease_id not in table.held, "the bytes to go, then the run")
            assert link.backlog == 0
            assert _queued_gauge(a, b) == 0
            got = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(got)) == _sha(data)
            b.release(reader, got)
            await until(lambda: not b.leases.leases, "B's lease freed")
            _close(a, writer, a_used)
            _close(b, reader, b_used)

    run(main())
