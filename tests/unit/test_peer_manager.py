"""PeerManager between two nodes in one process, on real parts but the wire.

Each node is what a daemon gives its peer layer: an arena in /dev/shm, a
LeaseManager, the Peer gRPC service on 127.0.0.1 (real handshakes, heartbeats
and notices), and a loopback transport in place of Mooncake, whose knobs make
a transfer fail or wait at a gate. Node A writes ("thinker"), node B reads
("talker"); B lists A in its peers and A dials back.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import CorruptRefError, PeerUnavailableError, StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL

from relayd.config import Settings
from relayd.peer_context import PeerHooks
from relayd.peers import PeerManager
from relayd.pools.arena import Arena, Run
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.push_landing import QUARANTINE_TIMEOUTS
from relayd.routing.topology import Topology
from relayd.rpc.frames import frame_sink
from relayd.transports.base import PullTimeoutError
from relayd.transports.loopback import Loopback, LoopbackTransport
from tests._daemon import async_wait_until, free_port

pytestmark = pytest.mark.timeout(60)

SLOT = 64 << 10
PEER_TIMEOUT = 1.0
BOUND = 20.0  # the longest any wait here may take before the test fails
WRITER, READER = "thinker", "talker"


class Node:
    """One daemon's peer layer; ``up``/``down`` hear the registry hook per peer node."""

    def __init__(
        self,
        name: str,
        loopback: Loopback,
        token: pathlib.Path,
        *,
        peers: tuple[str, ...] = (),
        push_grant_size: int = 0,
        push_attach_max: int = 0,
        peer_credits: int = 4,
        peer_notice_port: int = 0,
        peer_timeout: float = PEER_TIMEOUT,
    ) -> None:
        self.name = name
        self.epoch = os.urandom(4).hex()
        self.address = f"127.0.0.1:{free_port()}"
        self.settings = Settings(
            node_id=f"unit-{name}-{self.epoch}",
            peer_address=self.address,
            peers=peers,
            peer_token_file=str(token),
            peer_timeout=peer_timeout,
            peer_credits=peer_credits,
            push_grant_size=push_grant_size,
            push_attach_max=push_attach_max,
            peer_notice_port=peer_notice_port,
        )
        self.arena = Arena(
            node_id=self.settings.node_id, epoch=self.epoch, total_bytes=64 * SLOT + 8192,
            segment_bytes=1 << 30, slot_size=SLOT,
        )  # fmt: skip
        self.leases = LeaseManager(
            self.arena, grant_bytes=8 * SLOT, lease_ttl=30.0, stage_quota_bytes=48 * SLOT,
            max_sessions=8,
        )  # fmt: skip
        # Who serves what here, as the daemon keeps it: a data session is placed
        # when it binds (session()); one never bound, or an operator's, is not.
        self.topology = Topology(self.settings.node_id, self.arena, self.leases.session_table)
        self.transport: LoopbackTransport = loopback.transport()
        self.stage_events: list[tuple[str, tuple[str, ...] | None]] = []
        self.pulls: list[float] = []
        self.peers = PeerManager(
            self.settings,
            epoch=self.epoch,
            arena=self.arena,
            leases=self.leases,
            hooks=PeerHooks(
                local_stages=self.topology.registry.local_stages,
                peer_stages=self._stages,
                pull_seconds=self.pulls.append,
            ),
            transport=self.transport,
        )
        self.frames: list[pb.SessionFrame] = []

    def _stages(self, node: str, stages: Iterable[str] | None) -> None:
        self.stage_events.append((node, None if stages is None else tuple(stages)))

    def session(self, stage: str, *, placed: bool = True) -> Session:
        """A bound session of ``stage``; ``placed=False``: bound but never placed, as
        an operator's (the CLI's) is."""
        s = self.leases.open_session(pid=os.getpid(), stages=[stage])
        s = self.leases.bind(
            s.id, s.token, frame_sink(self.frames.append), pid=os.getpid(), uid=0, gid=0
        )
        if placed:
            self.topology.bound(s, self.topology.nonce, os.getpid())
        return s

    async def put(
        self,
        writer: Session,
        data: bytes,
        *,
        push: bool = False,
        request_id: str = "r1",
        to_stage: str = READER,
    ) -> bytes:
        """What a client's put does, then the DataRef it hands on."""
        grant = await self.leases.grant(writer, len(data), BOUND)
        nslots = -(-len(data) // SLOT)
        lease_id = max(self.leases.new_generation_base(grant), grant.last_lease) + 1
        seg = self.arena.segments[grant.run.segment]
        offset = seg.slot_offset(grant.run.slot)
        seg.mm[offset : offset + len(data)] = data
        seg.write_header(grant.run.slot, lease_id, len(data))
        self.leases.on_reserve(
            writer,
            pb.Reserve(
                lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot, nslots=nslots,
                generation=lease_id, request_id=request_id, to_stage=to_stage, from_stage=WRITER,
            ),
        )  # fmt: skip
        self.leases.on_publish(
            writer,
            pb.Publish(lease_id=lease_id, nbytes=len(data), transport=pb.TRANSPORT_SHM, push=push),
        )
        ref = pb.DataRef(
            version=1, request_id=request_id, chunk_id=-1, transport=pb.TRANSPORT_SHM,
            to_stage=to_stage, header_codec=pb.HEADER_CODEC_SAFE, push=push,
            origin=pb.Origin(
                node_id=self.settings.node_id, daemon_epoch=self.epoch, stage=WRITER,
                peer_address=self.address, mooncake_session=self.transport.session_id,
            ),
            lease=pb.LeaseRef(
                pool=SHM_POOL, segment=grant.run.segment, slot=grant.run.slot, nslots=nslots,
                offset=offset, length=len(data), generation=lease_id, lease_id=lease_id,
            ),
        )  # fmt: skip
        return DataRef(ref).to_bytes()

    def read(self, ref: pb.LeaseRef) -> bytes:
        seg = self.arena.segments[ref.segment]
        return bytes(seg.mm[ref.offset : ref.offset + ref.length])

    def release(self, reader: Session, ref: pb.LeaseRef) -> None:
        self.leases.on_release(reader, pb.Release(lease_id=ref.lease_id, generation=ref.generation))
        self.leases.flush()

    def credits_out(self) -> int:
        return sum(c.in_use for c in self.peers.credits.stats().values())

    async def close(self) -> None:
        await self.peers.close()

    def dispose(self) -> None:
        self.arena.close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def peer_token(tmp_path: pathlib.Path) -> pathlib.Path:
    """A peer token file, as the daemons read it: random, owner-only."""
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    return token


async def until(predicate: Callable[[], Any], what: str, timeout: float = BOUND) -> None:
    """Poll ``predicate`` on the loop until truthy; fail naming ``what`` after ``timeout``."""
    await async_wait_until(predicate, timeout, what)


@asynccontextmanager
async def two_nodes(
    tmp_path: pathlib.Path, b_notice_port: int = 0, **kw: Any
) -> AsyncIterator[tuple[Node, Node]]:
    """Node A (writer) and B (reader, which dials A), handshaken both ways."""
    token = peer_token(tmp_path)
    loopback = Loopback()
    a = Node("a", loopback, token, **kw)
    b = Node("b", loopback, token, peers=(a.address,), peer_notice_port=b_notice_port, **kw)
    try:
        await a.peers.start()
        await b.peers.start()
        await until(lambda: _up(a, b) and _up(b, a), "the handshake both ways")
        yield a, b
    finally:
        for node in (b, a):
            await node.close()
            node.dispose()


def _peer(node: Node, other: Node) -> Any:
    return node.peers.links.peers.get(other.address)


def _up(node: Node, other: Node) -> bool:
    peer = _peer(node, other)
    return peer is not None and bool(peer.up)


def run(coro: Any) -> None:
    asyncio.run(asyncio.wait_for(coro, 50))


# --- handshake ------------------------------------------------------------------------


def test_handshake_both_ways_learns_identity_geometry_and_stages(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            reader = b.session(READER)
            await until(lambda: a.peers.serving(READER) is not None, "A to hear B's stages")
            seen = b.peers.links.peers[a.address]
            assert (seen.node_id, seen.epoch) == (a.settings.node_id, a.epoch)
            assert seen.mooncake_session == a.transport.session_id
            assert seen.slot_size == SLOT and len(seen.segments) == len(a.arena.segments)
            assert a.peers.serving(READER) is a.peers.links.peers[b.address]
            assert (b.settings.node_id, (READER,)) in a.stage_events
            [status] = a.peers.status()
            assert status.up and status.node_id == b.settings.node_id
            assert list(status.stages) == [READER]
            del reader

    run(main())


def test_peers_hear_only_the_stages_of_placed_data_sessions(tmp_path: pathlib.Path) -> None:
    """A session never bound may never bind, and an operator's (the CLI's) reads
    nothing: told to peers, either drew their pushes of that stage here, to land
    for no reader."""

    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            b.leases.open_session(pid=os.getpid(), stages=["never-bound"])
            b.session("relayd-cli", placed=False)
            reader = b.session(READER)
            await until(lambda: a.peers.serving(READER) is not None, "A to hear B's stages")
            [status] = a.peers.status()
            assert list(status.stages) == [READER]
            assert a.peers.serving("never-bound") is None
            assert a.peers.serving("relayd-cli") is None
            del reader

    run(main())


def test_a_wrong_token_is_refused_and_the_peer_stays_down(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        token, other = tmp_path / "token", tmp_path / "other"
        for path in (token, other):
            path.write_bytes(os.urandom(32).hex().encode())
            path.chmod(0o600)
        loopback = Loopback()
        a = Node("a", loopback, token)
        b = Node("b", loopback, other, peers=(a.address,))
        try:
            await a.peers.start()
            await b.peers.start()
            await until(lambda: _peer(b, a) and _peer(b, a).last_error, "B's refused handshake")
            assert "token" in b.peers.links.peers[a.address].last_error
            assert not b.peers.links.peers[a.address].up and not a.peers.links.by_node
        finally:
            for node in (b, a):
                await node.close()
                node.dispose()

    run(main())


# --- the pull -------------------------------------------------------------------------


def test_a_pull_end_to_end_frees_both_sides_and_gives_credits_back(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            data = os.urandom(3 * SLOT + 123)
            ref = await a.put(writer, data)
            gate = b.transport.hold()
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            await gate.entered(BOUND)
            assert b.credits_out() == 1 and b.peers.links.peers[a.address].in_flight == 1
            gate.release()
            local = await asyncio.wait_for(fetch, BOUND)
            assert _sha(b.read(local)) == _sha(data)
            assert b.credits_out() == 0 and b.peers.links.peers[a.address].in_flight_max == 1
            assert len(b.pulls) == 1
            # The verified copy frees the writer's lease (a lingering Release notice).
            await until(lambda: not a.leases.leases, "A to free the pulled lease")
            b.release(reader, local)
            assert not b.leases.leases and b.arena.used_bytes == 0
            a.leases.close_session(writer.id)
            assert a.arena.used_bytes == 0

    run(main())


def test_a_pull_that_finds_the_writers_lease_reused_is_stale(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(SLOT))
            m = DataRef.from_bytes(ref).proto
            gate = b.transport.hold()
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            await gate.entered(BOUND)
            # The writer's daemon frees the lease (and zeroes its header) mid-copy.
            assert a.leases.release_from_peer(m.lease.lease_id, m.lease.generation, None)
            gate.release()
            with pytest.raises(StaleRefError):
                await asyncio.wait_for(fetch, BOUND)
            assert not b.leases.leases and b.arena.used_bytes == 0 and b.credits_out() == 0

    run(main())


def test_an_abort_on_the_readers_node_frees_the_writers_lease(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(SLOT), request_id="doomed")
            gate = b.transport.hold()
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            await gate.entered(BOUND)  # the pull noted A as an origin of "doomed"
            assert await b.peers.abort_remote("doomed") == 1
            assert not a.leases.leases
            gate.release()
            # The copy checks the writer's header after the bytes: the abort zeroed it.
            with pytest.raises(StaleRefError):
                await asyncio.wait_for(fetch, BOUND)
            assert not b.leases.leases and b.arena.used_bytes == 0 and b.credits_out() == 0

    run(main())


def test_a_discard_on_the_readers_node_frees_the_writers_lease_once(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer = a.session(WRITER)
            ref = await a.put(writer, os.urandom(SLOT))
            m = DataRef.from_bytes(ref).proto
            assert await b.peers.release_now(m, (READER,)) is True
            assert not a.leases.leases
            assert await b.peers.release_now(m, (READER,)) is False  # gone already

    run(main())


def test_a_pull_that_times_out_in_flight_keeps_run_and_credit_until_it_settles(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(2 * SLOT))
            gate = b.transport.hold()
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, 0.2))
            await gate.entered(BOUND)
            with pytest.raises(PullTimeoutError) as late:
                await asyncio.wait_for(fetch, BOUND)
            assert late.value.in_flight is True
            # Bytes may still land: the run and the credit stay out of use.
            assert b.leases.leases and b.arena.used_bytes > 0 and b.credits_out() == 1
            gate.release()
            await until(lambda: b.arena.used_bytes == 0, "the quarantined run to come back")
            assert not b.leases.leases and b.credits_out() == 0

    run(main())


def test_peer_loss_fails_a_pending_pull_and_leaves_nothing_held(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(SLOT))
            gate = b.transport.hold()
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            await gate.entered(BOUND)
            await a.close()  # node A's daemon goes away with the pull in flight
            with pytest.raises(PeerUnavailableError):
                await asyncio.wait_for(fetch, BOUND)
            assert not b.leases.leases and b.arena.used_bytes == 0 and b.credits_out() == 0
            # The loss itself, not any registry change: A's stages may still be
            # arriving when it goes.
            await until(lambda: (a.settings.node_id, None) in b.stage_events, "A's loss")
            assert not b.peers.links.peers[a.address].up
            with pytest.raises(PeerUnavailableError, match="down"):
                await b.peers.fetch(reader, ref, BOUND)
            assert b.credits_out() == 0

    run(main())


# --- the push -------------------------------------------------------------------------


@asynccontextmanager
async def pushing_nodes(
    tmp_path: pathlib.Path, **kw: Any
) -> AsyncIterator[tuple[Node, Node, Session]]:
    """Two nodes with pushes on; A holds B's push grant and knows B serves READER.
    Pushes are the transport's WRITEs unless ``push_attach_max`` says otherwise."""
    async with two_nodes(tmp_path, push_grant_size=16 * SLOT, **kw) as (a, b):
        reader = b.session(READER)
        await until(lambda: b.address in a.peers.push.out, "A to hold B's push grant")
        await until(lambda: a.peers.serving(READER) is not None, "A to hear B's stages")
        yield a, b, reader


def test_a_push_lands_and_the_reader_gets_a_local_lease(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            given = b.arena.used_bytes  # the push grant B gave A
            assert given == 16 * SLOT
            writer = a.session(WRITER)
            data = os.urandom(2 * SLOT + 5)
            ref = await a.put(writer, data, push=True)
            local = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(local)) == _sha(data)
            assert a.transport.transfers == 1 and b.transport.transfers == 0  # no pull
            # Freed on the writer's node once the reader's daemon says it has it.
            await until(lambda: not a.leases.leases, "the writer's lease freed")
            assert a.peers.push.counts[b.address].out == 1
            assert b.peers.push.counts[a.address].into == 1
            assert a.credits_out() == 0
            grant = a.peers.push.out[b.address]
            assert grant.alloc.free_runs() != [(0, grant.nslots)]  # the landed run is out
            b.release(reader, local)
            # The run goes back to A's grant by a (lingering) Freed notice.
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "the freed run")
            assert not b.leases.leases and b.arena.used_bytes == given

    run(main())


def test_a_read_whose_push_landed_is_answered_at_once_others_wait_or_pull(
    tmp_path: pathlib.Path,
) -> None:
    """``start_fetch`` gives the landed lease itself, with no task; a DataRef with no
    push here gives the work that pulls it; a bad DataRef fails before any wait."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            writer = a.session(WRITER)
            pushed, pulled = os.urandom(2 * SLOT + 5), os.urandom(SLOT + 3)
            ref = await a.put(writer, pushed, push=True)
            await until(lambda: b.peers.push.counts[a.address].into == 1, "the push to land")
            now = b.peers.start_fetch(reader, ref, BOUND)
            assert isinstance(now, pb.LeaseRef)
            assert _sha(b.read(now)) == _sha(pushed)
            assert b.peers.push.counts[a.address].reads_attached == 1
            later = b.peers.start_fetch(reader, await a.put(writer, pulled, request_id="p"), BOUND)
            assert not isinstance(later, pb.LeaseRef)
            local = await later
            assert _sha(b.read(local)) == _sha(pulled)
            assert b.peers.push.counts[a.address].reads_pulled == 1
            bad = bytearray(ref)
            bad[-1] ^= 0xFF  # the CRC no longer matches
            with pytest.raises(CorruptRefError):
                b.peers.start_fetch(reader, bytes(bad), BOUND)
            for got in (now, local):
                b.release(reader, got)
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")

    run(main())


def test_a_landed_push_is_announced_to_its_one_reader_who_reads_it_unasked(
    tmp_path: pathlib.Path,
) -> None:
    """B tells the one session serving the stage where the push landed (a LandedPush
    frame naming the lease a fetch would have); read and released with no fetch,
    it counts as an announced read. With two sessions on the stage, nobody is told."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer = a.session(WRITER)
            data = os.urandom(2 * SLOT + 5)
            ref = await a.put(writer, data, push=True)
            await until(lambda: b.peers.push.counts[a.address].into == 1, "the push to land")
            landed = [m for f in b.frames for m in f.landed]
            assert len(landed) == 1
            assert landed[0].request_id == "r1" and landed[0].to_stage == READER
            assert (landed[0].origin_node_id, landed[0].origin_daemon_epoch) == (
                a.settings.node_id,
                a.epoch,
            )
            lease = landed[0].lease
            assert _sha(b.read(lease)) == _sha(data)
            b.release(reader, lease)
            counts = b.peers.push.counts[a.address]
            assert (counts.announced, counts.reads_announced) == (1, 1)
            assert counts.reads_landed == counts.reads_attached == counts.reads_awaited == 0

            b.session(READER)  # a second session serving the stage
            b.frames.clear()
            ref = await a.put(writer, data, push=True, request_id="r2")
            await until(lambda: b.peers.push.counts[a.address].into == 2, "the second push")
            assert not [m for f in b.frames for m in f.landed]
            local = await b.peers.fetch(reader, ref, BOUND)  # fetched, as before
            b.release(reader, local)
            assert b.peers.push.counts[a.address].announced == 1
            assert b.peers.push.counts[a.address].reads_landed == 1
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")

    run(main())


def test_a_small_push_rides_its_landed_notice_and_no_mooncake_write(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            writer = a.session(WRITER)
            small, big = os.urandom(2 * SLOT + 5), os.urandom(4 * SLOT + 1)
            refs = [await a.put(writer, data, push=True) for data in (small, big)]
            got = [await b.peers.fetch(reader, ref, BOUND) for ref in refs]
            assert [_sha(b.read(local)) for local in got] == [_sha(small), _sha(big)]
            assert a.transport.transfers == 1  # the big one only; no pull either
            assert b.transport.transfers == 0
            assert a.peers.push.counts[b.address].attached == 1
            assert b.peers.push.counts[a.address].reads_attached == 1
            assert b.peers.push.counts[a.address].into == 2
            assert a.credits_out() == 0
            # The WRITE's lease went on its ack, the attached one on B's receipt.
            await until(lambda: not a.leases.leases, "A's leases freed")
            for local in got:
                b.release(reader, local)
            grant = a.peers.push.out[b.address]
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "freed runs")
            assert not b.leases.leases

    run(main())


def test_an_attached_push_keeps_the_writers_lease_until_the_reader_node_received_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes in flight on the notice channel may be lost with B's daemon: W's lease
    stays published for a pull until B's receipt says they are published there.
    A receipt frees only a lease A pushed to that peer by attaching it."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, reader):
            await until(lambda: a.peers.notifier.has_channel(b.address), "A's notice channel")
            held: list[pb.PushLanded] = []
            monkeypatch.setattr(b.peers.push, "_receipt", lambda address, m: held.append(m))
            writer = a.session(WRITER)
            data = os.urandom(2 * SLOT + 5)
            local_ref = DataRef.from_bytes(await a.put(writer, os.urandom(SLOT), request_id="l"))
            ref = await a.put(writer, data, push=True)
            got = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(got)) == _sha(data)
            assert len(held) == 1 and a.peers.push.counts[b.address].attached == 1
            pushed = DataRef.from_bytes(ref).proto.lease
            assert pushed.lease_id in a.leases.leases  # published, for a pull
            assert a.peers.push.status(b.address)["pushes_unreceived"] == 1

            def receipt(lease: pb.LeaseRef) -> None:
                box = b.peers.notifier.box(a.address)
                box.received.add(lease_id=lease.lease_id, generation=lease.generation)
                b.peers.notifier.send(a.address)

            # Never pushed, and pushed but of another generation: nothing changes.
            receipt(local_ref.proto.lease)
            receipt(pb.LeaseRef(lease_id=pushed.lease_id, generation=pushed.generation + 1))
            monkeypatch.undo()
            # A later push's receipt rides the same channel: handled after those.
            later = await b.peers.fetch(reader, await a.put(writer, data, push=True), BOUND)
            await until(lambda: a.peers.push.counts[b.address].out == 1, "the later receipt")
            assert set(a.leases.leases) == {local_ref.proto.lease.lease_id, pushed.lease_id}
            b.peers.push._receipt(a.address, held[0])
            await until(lambda: pushed.lease_id not in a.leases.leases, "the pushed lease freed")
            assert set(a.leases.leases) == {local_ref.proto.lease.lease_id}
            assert a.peers.push.status(b.address)["pushes_unreceived"] == 0
            # ... and the writer hears it may reuse those slots, as after a release.
            await until(
                lambda: any(pushed.lease_id in f.freed.lease_ids for f in a.frames),
                "a Freed to the writer",
            )
            assert a.peers.push.counts[b.address].out == 2
            for local in (got, later):
                b.release(reader, local)

    run(main())


def test_attached_bytes_are_placed_in_the_run_their_notice_names_and_nowhere_shared(
    tmp_path: pathlib.Path,
) -> None:
    """B reads a notice's attached bytes straight into the run of A's grant that it
    names, taken for it first; a notice that overlaps it, or names no grant of
    A's, gets memory of its own; a place the channel gives back unfilled returns
    its run to A's grant."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, _reader):
            landing = b.peers.push.landing
            peer = b.peers.links.by_node[a.settings.node_id]
            gin = landing.given[a.settings.node_id]
            length = SLOT + 7

            def landed(slot: int, grant_id: int = gin.grant_id) -> pb.PushLanded:
                return pb.PushLanded(
                    lease_id=slot + 1, generation=1, grant_id=grant_id, slot=slot, nslots=2,
                    length=length, attached=length, request_id="r", to_stage=READER,
                )  # fmt: skip

            place = landing.place(peer, landed(0))
            overlapping = landing.place(peer, landed(1))
            foreign = landing.place(peer, landed(4, grant_id=gin.grant_id + 1))
            data = os.urandom(length)
            place[:] = data
            overlapping[:] = foreign[:] = bytes(length)
            run = Run(gin.run.segment, gin.run.slot, 2, gin.run.pool)
            assert b.arena.read(run, length) == data  # the place is the run itself
            assert gin.used.free_runs() == [(2, gin.run.nslots - 2)]  # taken once
            landing.unplace([place, overlapping, foreign])
            assert gin.used.free_runs() == [(0, gin.run.nslots)]
            for view in (place, overlapping, foreign):
                view.release()

    run(main())


def test_a_taken_notice_port_leaves_that_nodes_notices_on_the_peer_service(
    tmp_path: pathlib.Path,
) -> None:
    """B cannot listen on its notice port (something else holds it): it starts all
    the same and advertises no channel, A's notices to it ride Peer.Notify, and a
    push still lands and is read; B's notices to A go on A's channel."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()

    async def main() -> None:
        async with pushing_nodes(tmp_path, b_notice_port=taken.getsockname()[1]) as (a, b, reader):
            assert b.peers.notice_port == 0 and a.peers.notice_port > 0
            await until(lambda: b.peers.notifier.has_channel(a.address), "B's channel to A")
            writer = a.session(WRITER)
            data = os.urandom(2 * SLOT + 5)
            local = await b.peers.fetch(reader, await a.put(writer, data, push=True), BOUND)
            assert _sha(b.read(local)) == _sha(data)
            assert b.peers.push.counts[a.address].into == 1  # landed: its notice came by Notify
            assert not a.peers.notifier.has_channel(b.address)
            assert a.peers.notifier.channel_batches(b.address) == 0
            b.release(reader, local)
            grant = a.peers.push.out[b.address]
            await until(lambda: grant.alloc.free_runs() == [(0, grant.nslots)], "the freed run")
            assert b.peers.notifier.channel_batches(a.address) >= 1  # that Freed, on A's channel

    try:
        run(main())
    finally:
        taken.close()


def test_a_push_that_fails_falls_back_to_the_pull(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer = a.session(WRITER)
            data = os.urandom(SLOT + 1)
            a.transport.fail_next()
            ref = await a.put(writer, data, push=True)
            local = await b.peers.fetch(reader, ref, BOUND)
            assert _sha(b.read(local)) == _sha(data)
            assert a.transport.transfers == 0 and b.transport.transfers == 1  # pulled
            assert a.peers.push.counts[b.address].declined == 1
            assert b.peers.push.counts[a.address].reads_pulled == 1
            assert a.credits_out() == 0 and b.credits_out() == 0
            b.release(reader, local)
            await until(lambda: not a.leases.leases, "A to free the pulled lease")

    run(main())


def test_a_declined_push_is_told_to_the_reader_its_landings_were_announced_to(
    tmp_path: pathlib.Path,
) -> None:
    """That reader's get may be waiting for the landing's announcement: B tells the
    one session serving the stage, once B has announced a landing for the stage
    to it, that nothing will land (a ``declined`` LandedPush with no lease), so it
    fetches now. Before any announcement, or with two sessions on the stage, nobody."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            writer = a.session(WRITER)
            data = os.urandom(SLOT + 1)

            def told() -> list[pb.LandedPush]:
                return [m for f in b.frames for m in f.declined]

            async def failed_push(request_id: str) -> bytes:
                """A push that fails, its decline heard on B before any fetch of it."""
                a.transport.fail_next()
                ref = await a.put(writer, data, push=True, request_id=request_id)
                m = DataRef.from_bytes(ref).proto
                key = (a.settings.node_id, a.epoch, m.lease.lease_id, m.lease.generation)
                await until(lambda: key in b.peers.push.landing._declined, "B to hear it")
                local = await b.peers.fetch(reader, ref, BOUND)  # pulled
                assert _sha(b.read(local)) == _sha(data)
                b.release(reader, local)
                return ref

            await failed_push("before")  # no announcement yet: its get does not wait
            assert a.peers.push.counts[b.address].declined == 1 and not told()

            ref = await a.put(writer, data, push=True)
            await until(lambda: b.peers.push.counts[a.address].announced == 1, "the landing")
            b.release(reader, await b.peers.fetch(reader, ref, BOUND))  # announced, then read

            b.frames.clear()
            ref = await failed_push("after")
            (declined,) = told()
            assert (declined.origin_node_id, declined.origin_daemon_epoch) == (
                a.settings.node_id,
                a.epoch,
            )
            m = DataRef.from_bytes(ref).proto
            assert (declined.lease_id, declined.generation) == (
                m.lease.lease_id,
                m.lease.generation,
            )
            assert declined.to_stage == READER and not declined.HasField("lease")

            b.session(READER)  # a second session serving the stage
            b.frames.clear()
            await failed_push("two")
            assert a.peers.push.counts[b.address].declined == 3 and not told()
            await until(lambda: not a.leases.leases and not b.leases.leases, "leases freed")

    run(main())


def test_a_push_with_nowhere_to_go_is_declined_naming_no_stage(tmp_path: pathlib.Path) -> None:
    """No one peer serves the stage: every peer hears the decline, and none names
    the stage, so no node wakes its reader for a DataRef it will not get."""

    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, _):
            heard: list[pb.PushDeclined] = []
            on_declined = b.peers.push.landing.on_declined

            def recorded(n: pb.PeerNotices) -> None:
                heard.extend(n.declined)
                on_declined(n)

            b.peers.push.landing.on_declined = recorded  # type: ignore[method-assign]
            await a.put(a.session(WRITER), os.urandom(SLOT), push=True, to_stage="elsewhere")
            await until(lambda: heard, "B to hear the decline")
            assert [d.to_stage for d in heard] == [""]

    run(main())


def test_a_lost_peer_fails_the_awaited_push_and_its_grant_is_quarantined(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with pushing_nodes(tmp_path) as (a, b, reader):
            given = b.arena.used_bytes
            writer = a.session(WRITER)
            gate = a.transport.hold()  # the push write waits at A
            ref = await a.put(writer, os.urandom(SLOT), push=True)
            await gate.entered(BOUND)
            fetch = asyncio.ensure_future(b.peers.fetch(reader, ref, BOUND))
            await a.close()
            with pytest.raises(PeerUnavailableError):
                await asyncio.wait_for(fetch, BOUND)
            await until(lambda: (a.settings.node_id, None) in b.stage_events, "A's loss")
            lost = time.monotonic()
            assert a.settings.node_id not in b.peers.push.landing.given
            assert not b.leases.leases and b.credits_out() == 0
            # A write of the lost peer may still land in the grant: it stays out of use
            # for QUARANTINE_TIMEOUTS peer timeouts, then goes back to the arena.
            if time.monotonic() - lost < QUARANTINE_TIMEOUTS * PEER_TIMEOUT:
                assert b.arena.used_bytes == given
            await until(lambda: b.arena.used_bytes == 0, "the quarantined grant to come back")

    run(main())
