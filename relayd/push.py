"""Push to the consumer's node: the bytes travel while the DataRef does.

A pull starts when the DataRef reaches the reader: the reader's daemon then
waits for Mooncake (one network round trip plus the bytes) and checks the
writer's slot header (another one). A push starts when the writer publishes,
so the bytes cross the network while the DataRef crosses the application's
channel, and the reader's get finds a local lease.

The message flow (writer W on node A, reader R on node B)::

    B -> A  PushGrant (once per peer, after the handshake; off every path):
            a standing run of B's arena that A may write into, "the push grant"
    W -> A  Publish(push) on the session socket, sent at once, not lingering
    A       cuts a run from its push grant at B (local bookkeeping only), takes
            a credit of B (none free: fall back), holds W's lease
    A -> B  Mooncake WRITE of the bytes into that run (B's engine applies it;
            TCP protocol v2 acks only then)
    A       frees W's lease (the bytes are safe at B)
    A -> B  Notify{landed: (lease id, generation, run, request, stages)}
    B       validates it and publishes a local lease over the run, keyed by
            (origin node, lease id, generation)
    R -> B  FetchCall(DataRef) on the session socket: the landed lease, at once;
            not landed yet: waits for the Landed (or Declined) notice
    R -> B  Release (session socket), as for any local lease
    B -> A  Notify{freed: the run} (lingering): A may write that run again

Nothing on the reader's path waits for a network round trip it started: the
one wait (for the Landed notice) overlaps the DataRef's own trip. The DataRef
says ``push`` so that B knows to wait rather than pull; a writer's daemon that
cannot push (no grant, no room, no credit, peer down, abort) says Declined and
the reader pulls as before. A push is never started twice and a pull is never
started while a push of the same lease may land: B pulls only after Declined,
after the peer's loss, or when the peer timeout passed with no word at all.

Trust: everything in a PushGrant or a notice comes from a peer and is checked
here - the sender must be a connected peer with the epoch it claims, a landed
run must lie inside the grant given to *that* peer and overlap no live landed
lease, its length must fit the run, and its addressee stage must be served on
this node (a peer cannot make this daemon hold leases for nobody).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from relayd_client.wire.errors import (
    AbortedError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL
from relayd_client.wire.slots import SlotAllocator

from .pools.arena import Run
from .pools.freed import FREED_LINGER_MAX_BYTES
from .pools.records import Lease, LeaseState
from .transports.base import PullError, split_ops

if TYPE_CHECKING:
    from .peers import PeerManager, PeerState

log = logging.getLogger(__name__)

# Keys of leases landed and already read, and of pushes declined, remembered so
# a second fetch of the same DataRef does not wait for a push that will not come.
_REMEMBER = 1 << 14
# Peer timeouts the free part of a grant given to a lost peer stays out of use.
QUARANTINE_TIMEOUTS = 4
_NAME_MAX = 256

Key = tuple[str, str, int, int]  # (origin node, its epoch, lease id, generation)


@dataclasses.dataclass(eq=False)
class GrantOut:
    """Our standing push grant at one peer (the writer's side)."""

    grant_id: int
    epoch: str
    segment: int
    slot: int
    nslots: int
    alloc: SlotAllocator


@dataclasses.dataclass(eq=False)
class GrantIn:
    """A push grant this daemon gave a peer (the reader's side)."""

    node_id: str
    epoch: str
    grant_id: int
    run: Run
    used: SlotAllocator  # which runs of it hold live landed leases
    retired: bool = False


@dataclasses.dataclass
class PushCounts:
    out: int = 0
    declined: int = 0
    into: int = 0
    reads_landed: int = 0
    reads_awaited: int = 0
    reads_pulled: int = 0
    pull_phases: int = 0


class PushManager:
    """Both sides of pushes for one daemon; owned by the PeerManager."""

    def __init__(self, peers: PeerManager) -> None:
        self.peers = peers
        self.settings = peers.settings
        self.out: dict[str, GrantOut] = {}  # by peer address
        self.given: dict[str, GrantIn] = {}  # by node id
        self.counts: dict[str, PushCounts] = collections.defaultdict(PushCounts)
        self._next_grant = 1
        self._landed: dict[Key, Lease] = {}
        self._declined: collections.OrderedDict[Key, None] = collections.OrderedDict()
        # Writer's side: leases whose push landed (and so were freed here), by id.
        self._pushed: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._waiters: dict[Key, list[asyncio.Future[None]]] = {}
        self._waiting_for: dict[Key, str] = {}  # request id of each awaited push
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def enabled(self) -> bool:
        return self.settings.push_grant_size > 0

    # -- writer's side: grants held at peers ------------------------------------------

    async def ask_grant(self, peer: PeerState) -> None:
        """After a handshake: ask ``peer`` for a push grant (errors only logged)."""
        if not self.enabled or peer.stub is None:
            return
        self.out.pop(peer.address, None)
        try:
            resp = await peer.stub.PushGrant(
                pb.PushGrantRequest(
                    node_id=self.settings.node_id,
                    daemon_epoch=self.peers.epoch,
                    nbytes=self.settings.push_grant_size,
                ),
                timeout=self.settings.peer_timeout,
                metadata=self.peers.metadata(),
            )
        except Exception as exc:  # grpc.RpcError, or the peer lacks the call
            log.info("no push grant from peer %s: %s", peer.address, exc)
            return
        seg = peer.segments.get(resp.segment)
        if (
            not resp.grant_id
            or resp.daemon_epoch != peer.epoch
            or seg is None
            or resp.nslots == 0
            or resp.slot + resp.nslots > seg.nslots
        ):
            log.info("peer %s gave no usable push grant", peer.address)
            return
        self.out[peer.address] = GrantOut(
            resp.grant_id,
            peer.epoch,
            resp.segment,
            resp.slot,
            resp.nslots,
            SlotAllocator(resp.nslots),
        )

    def grant_void(self, peer: PeerState) -> None:
        """``peer`` retired the grant it gave us (it took us for lost): pushes still
        in flight into it decline, and the next heartbeat asks for a new one."""
        if self.out.pop(peer.address, None) is not None:
            log.info("peer %s voided its push grant; asking again", peer.address)

    def peer_down(self, peer: PeerState) -> None:
        """Its grant and whatever it gave us are void; readers waiting on it stop."""
        self.out.pop(peer.address, None)
        node = peer.node_id
        given = self.given.pop(node, None) if node else None
        if given is not None:
            # It may be alive behind a broken link, its writes into the grant still
            # in flight or retried when the link heals: nothing may reuse that space
            # until they have surely ended (each is bounded by the peer timeout, and
            # it stops pushing once it takes us for lost or hears the grant is void).
            self._retire(given, quarantine=QUARANTINE_TIMEOUTS * self.settings.peer_timeout)
        for key in [k for k in self._waiters if k[0] == node]:
            self._wake(key)

    def on_publish(self, lease: Lease) -> None:
        """LeaseManager hook: ``lease`` was published with Publish.push set."""
        peer = self._target(lease.to_stage)
        if peer is None or not self.enabled or lease.nbytes == 0 or lease.run.pool != SHM_POOL:
            # Nobody to push to (the consumer moved, or its node is down): every up
            # peer hears Declined, so the reader's daemon, wherever it is, pulls.
            for p in self.peers.peers.values():
                if p.up:
                    self._decline(p.address, lease)
            return
        out = self.out.get(peer.address)
        slots = lease.run.nslots
        start = out.alloc.allocate(slots) if out is not None else None
        credit = self.peers.credits.try_acquire(peer.address) if start is not None else None
        if out is None or start is None or credit is None:
            if out is not None and start is not None:
                out.alloc.free(start, slots)
            self._decline(peer.address, lease)
            return
        self.peers.leases.hold(lease)
        task = asyncio.get_running_loop().create_task(
            self._push(peer, out, lease, start, credit), name=f"relayd-push {lease.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _target(self, stage: str) -> PeerState | None:
        for p in self.peers.peers.values():
            if p.up and stage in p.stages:
                return p
        return None

    def _decline(self, address: str, lease: Lease) -> None:
        self.counts[address].declined += 1
        self.peers.notifier.box(address).declined.add(
            lease_id=lease.id, generation=lease.generation
        )
        self.peers.notifier.send(address)

    async def _push(
        self, peer: PeerState, out: GrantOut, lease: Lease, start: int, credit: Any
    ) -> None:
        manager = self.peers.leases
        arena = self.peers.arena
        nbytes = lease.nbytes
        src = self.peers.local_bases[lease.run.segment] + arena.segments[
            lease.run.segment
        ].slot_offset(lease.run.slot)
        seg = peer.segments[out.segment]
        dst = seg.base + seg.data_offset + (out.slot + start) * peer.slot_size
        ops = split_ops(src, dst, nbytes)
        settle: asyncio.Future[Any] | None = None
        landed = False
        try:
            await self.peers.transport.push(
                peer.mooncake_session, ops, timeout=self.settings.peer_timeout
            )
            landed = True
        except PullError as err:
            log.warning("push of lease %d to %s failed: %s", lease.id, peer.address, err)
            if err.in_flight:
                settle = err.settled
        except RelayError as err:
            log.warning("push of lease %d to %s failed: %s", lease.id, peer.address, err)
        except asyncio.CancelledError:
            settle = asyncio.ensure_future(self.peers.transport.wait_settled(ops))
            raise
        finally:
            if settle is not None:
                credit.release_when(settle)
            else:
                credit.release()
            if not landed:
                self._after(settle, lambda: self._push_failed(peer.address, out, lease, start))
        if not landed:
            return
        if self.out.get(peer.address) is not out:
            # The grant went void while the write was in flight: the peer was lost
            # (and may be back, with a new grant or none). It retired that grant, so
            # these bytes landed in nothing it will publish, and W's lease is still
            # the only copy: keep it for the reader's pull, and decline.
            manager.unhold(lease)
            self._decline(peer.address, lease)
            return
        # Landed: the bytes are safe at the peer, W's lease goes now, and the peer
        # is told (unless an abort or TTL freed the lease meanwhile).
        if not manager.free_pushed(lease):
            out.alloc.free(start, lease.run.nslots)
            self._decline(peer.address, lease)
            return
        self.counts[peer.address].out += 1
        self._pushed[lease.id] = lease.generation
        while len(self._pushed) > _REMEMBER:
            self._pushed.popitem(last=False)
        self.peers.notifier.box(peer.address).landed.add(
            lease_id=lease.id,
            generation=lease.generation,
            grant_id=out.grant_id,
            slot=start,
            nslots=lease.run.nslots,
            length=nbytes,
            request_id=lease.request_id,
            from_stage=lease.from_stage,
            to_stage=lease.to_stage,
        )
        self.peers.notifier.send(peer.address)

    def landed(self, lease_id: int, generation: int) -> bool:
        """Whether this writer's lease was freed here because its push landed.

        Such a put lives on in the consumer's node: a keyed put whose Publish
        pushed it before the key arrived still names a readable payload.
        """
        return self._pushed.get(lease_id) == generation

    def _push_failed(self, address: str, out: GrantOut, lease: Lease, start: int) -> None:
        """Nothing of the push writes any more: W's lease and the run are free to go."""
        self.peers.leases.unhold(lease)
        if self.out.get(address) is out:
            out.alloc.free(start, lease.run.nslots)
        self._decline(address, lease)

    @staticmethod
    def _after(settle: asyncio.Future[Any] | None, fn: Any) -> None:
        if settle is None or settle.done():
            fn()
        else:
            settle.add_done_callback(lambda _: fn())

    def on_freed(self, address: str, freed: Any) -> None:
        """The peer's readers are done with runs of our grant there."""
        out = self.out.get(address)
        if out is None:
            return
        for f in freed:
            if f.grant_id != out.grant_id or f.nslots == 0 or f.slot + f.nslots > out.nslots:
                log.warning("peer %s freed a run outside our push grant; ignored", address)
                continue
            out.alloc.free(f.slot, f.nslots)

    # -- reader's side: grants given, landed leases -------------------------------------

    def grant_to(self, req: pb.PushGrantRequest) -> pb.PushGrantResponse:
        none = pb.PushGrantResponse(daemon_epoch=self.peers.epoch)
        peer = self.peers.by_node.get(req.node_id)
        if not self.enabled or peer is None or not peer.up or peer.epoch != req.daemon_epoch:
            return none  # it asks again after its next handshake
        old = self.given.get(req.node_id)
        if old is not None and old.epoch == req.daemon_epoch:
            return self._grant_response(old)
        if old is not None:
            self._retire(old)
            del self.given[req.node_id]
        arena = self.peers.arena
        want = min(int(req.nbytes), self.settings.push_grant_size, arena.capacity_bytes // 4)
        nslots = min(want // arena.slot_size, arena.max_run_slots())
        run = arena.allocate(nslots) if nslots > 0 else None
        if run is None:
            return none
        gin = GrantIn(req.node_id, req.daemon_epoch, self._next_grant, run, SlotAllocator(nslots))
        self._next_grant += 1
        self.given[req.node_id] = gin
        return self._grant_response(gin)

    def _grant_response(self, gin: GrantIn) -> pb.PushGrantResponse:
        return pb.PushGrantResponse(
            grant_id=gin.grant_id,
            segment=gin.run.segment,
            slot=gin.run.slot,
            nslots=gin.run.nslots,
            daemon_epoch=self.peers.epoch,
        )

    def _retire(self, gin: GrantIn, *, quarantine: float = 0.0) -> None:
        """The grant is void: its free parts go back to the arena (after
        ``quarantine`` s), each landed lease's run when that lease is freed."""
        gin.retired = True
        runs = [
            Run(gin.run.segment, gin.run.slot + start, n, gin.run.pool)
            for start, n in gin.used.free_runs()
        ]
        if quarantine > 0:
            asyncio.get_running_loop().call_later(quarantine, self._to_arena, runs)
        else:
            self._to_arena(runs)

    def _to_arena(self, runs: list[Run]) -> None:
        for run in runs:
            self.peers.arena.free(run)
        self.peers.leases.wake()

    def on_notices(self, n: pb.PeerNotices) -> int:
        """A batch from a peer: validated piece by piece; returns how many pulled
        leases it released here."""
        peer = self.peers.by_node.get(n.node_id)
        if peer is None or not peer.up or peer.epoch != n.daemon_epoch:
            raise PermissionDeniedError(
                f"notices from node {n.node_id!r} epoch {n.daemon_epoch!r}, not a connected peer"
            )
        manager = self.peers.leases
        released = 0
        for r in n.released:
            try:
                released += manager.release_from_peer(
                    r.lease_id, r.generation, r.reader_stages[:64]
                )
            except RelayError as err:  # that lease stays for its reader; the rest go on
                log.warning("peer %s: %s", peer.address, err)
        if n.freed:
            self.on_freed(peer.address, n.freed)
        for d in n.declined:
            key = (n.node_id, n.daemon_epoch, int(d.lease_id), int(d.generation))
            self._remember(key)
            self._wake(key)
        for landed in n.landed:
            self._on_landed(peer, landed)
        return released

    def _on_landed(self, peer: PeerState, m: pb.PushLanded) -> None:
        key = (peer.node_id, peer.epoch, int(m.lease_id), int(m.generation))
        gin = self.given.get(peer.node_id)
        slot_size = self.peers.arena.slot_size
        why = ""
        if gin is None or gin.retired or m.grant_id != gin.grant_id:
            why = "names no push grant of ours"
        elif m.nslots == 0 or m.slot + m.nslots > gin.run.nslots:
            why = "lies outside the push grant"
        elif m.length == 0 or m.length > m.nslots * slot_size:
            why = f"length {m.length} does not fit {m.nslots} slots"
        elif not gin.used.allocate_at(int(m.slot), int(m.nslots)):
            why = "overlaps a landed lease not yet read"
        if why:
            log.warning(
                "peer %s: landed push of lease %d %s; ignored", peer.address, m.lease_id, why
            )
            self._remember(key)
            self._wake(key)
            return
        assert gin is not None
        run = Run(gin.run.segment, gin.run.slot + int(m.slot), int(m.nslots), gin.run.pool)
        refuse = ""
        req = self.peers.leases.requests.get(m.request_id)
        if key in self._landed or key in self._declined:
            refuse = "landed twice"
        elif len(m.request_id) > _NAME_MAX or len(m.to_stage) > _NAME_MAX:
            refuse = "names too long"
        elif m.to_stage not in self.peers.local_stages():
            refuse = f"stage {m.to_stage!r} is not served on this node"
        elif req is not None and req.aborted:
            refuse = f"request {m.request_id!r} was aborted"
        if refuse:
            log.info("push of lease %d from %s refused: %s", m.lease_id, peer.address, refuse)
            self._give_back(gin, run)
            self._remember(key)
            self._wake(key)
            return
        try:
            lease = self.peers.leases.adopt_push(
                run,
                int(m.length),
                request_id=m.request_id,
                from_stage=m.from_stage[:_NAME_MAX],
                to_stage=m.to_stage,
                returns=functools.partial(self._returned, gin, key),
            )
        except RelayError as exc:  # draining
            log.info("push of lease %d from %s refused: %s", m.lease_id, peer.address, exc)
            self._give_back(gin, run)
            self._remember(key)
            self._wake(key)
            return
        self.counts[peer.address].into += 1
        self._landed[key] = lease
        self._wake(key)

    def _returned(self, gin: GrantIn, key: Key, run: Run) -> None:
        """A landed lease was freed (read, TTL, abort, drain)."""
        self._landed.pop(key, None)
        self._remember(key)
        self._give_back(gin, run)

    def _give_back(self, gin: GrantIn, run: Run) -> None:
        start = run.slot - gin.run.slot
        if gin.retired:
            self.peers.arena.free(run)
            self.peers.leases.wake()
            return
        gin.used.free(start, run.nslots)
        peer = self.peers.by_node.get(gin.node_id)
        if peer is not None and peer.up:
            self.peers.notifier.box(peer.address).freed.add(
                grant_id=gin.grant_id, slot=start, nslots=run.nslots
            )
            # A big run goes back at once, as a local Freed does: the writer's
            # daemon cannot push the next big lease until it has it.
            big = run.nslots * self.peers.arena.slot_size >= FREED_LINGER_MAX_BYTES
            self.peers.notifier.send(peer.address, urgent=big)

    def _remember(self, key: Key) -> None:
        self._declined[key] = None
        self._declined.move_to_end(key)
        while len(self._declined) > _REMEMBER:
            self._declined.popitem(last=False)

    def _wake(self, key: Key) -> None:
        self._waiting_for.pop(key, None)
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def take(self, m: pb.DataRef, deadline: float) -> Lease | None:
        """The landed lease for DataRef ``m``, waiting for its push when the writer
        asked for one; None: read it by pull."""
        key = (
            m.origin.node_id,
            m.origin.daemon_epoch,
            int(m.lease.lease_id),
            int(m.lease.generation),
        )
        lease = self._landed.get(key)
        waited = False
        # Only a peer holding a grant here can push here: from any other, nothing
        # will come (its pushes are off, or it pushes to another node), so pull.
        given = self.given.get(key[0])
        pushable = given is not None and not given.retired and given.epoch == key[1]
        if lease is None and m.push and pushable and key not in self._declined:
            peer = self.peers.by_node.get(key[0])
            if peer is None or not peer.up:
                return None  # the pull says what is wrong with the peer
            loop = asyncio.get_running_loop()
            waited = True
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(key, []).append(fut)
            self._waiting_for[key] = m.request_id
            wait = min(deadline - loop.time(), self.settings.peer_timeout)
            try:
                await asyncio.wait_for(fut, max(wait, 0.0))
            except TimeoutError:
                log.warning("push of lease %d from %s did not arrive; pulling", key[2], key[0])
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self._waiters[key]
                        self._waiting_for.pop(key, None)
            req = self.peers.leases.requests.get(m.request_id)
            if req is not None and req.aborted:
                raise AbortedError(f"request {m.request_id!r} was aborted")
            lease = self._landed.get(key)
            if lease is None and not (peer.up and self.peers.by_node.get(key[0]) is peer):
                raise PeerUnavailableError(
                    f"peer node {key[0]!r} went down while its push of lease {key[2]} "
                    f"was awaited: {peer.last_error or 'unreachable'}"
                )
        if lease is None:
            return None
        if self.peers.leases.leases.get(lease.id) is not lease:
            return None
        if lease.to_stage != m.to_stage or lease.request_id != m.request_id:
            raise PermissionDeniedError(
                "the DataRef does not match the lease its writer's daemon pushed here"
            )
        if lease.state is not LeaseState.PUBLISHED:
            return None
        peer = self.peers.by_node.get(key[0])
        if peer is not None:
            counts = self.counts[peer.address]
            if waited:
                counts.reads_awaited += 1
            else:
                counts.reads_landed += 1
        return lease

    def pulled(self, address: str, phases: int) -> None:
        """A read of that peer's DataRef was served by a pull that waited for
        ``phases`` Mooncake phases (round trips), one after the other."""
        counts = self.counts[address]
        counts.reads_pulled += 1
        counts.pull_phases += phases

    def discard(self, m: pb.DataRef) -> bool:
        """Free the landed copy of DataRef ``m`` unread; False when none is here."""
        key = (
            m.origin.node_id,
            m.origin.daemon_epoch,
            int(m.lease.lease_id),
            int(m.lease.generation),
        )
        lease = self._landed.get(key)
        manager = self.peers.leases
        if lease is None or manager.leases.get(lease.id) is not lease:
            return False
        manager.drop_pull(lease)
        manager.flush()
        return True

    def abort(self, request_id: str) -> None:
        """Readers waiting for pushes of ``request_id`` stop with AbortedError (the
        abort itself freed the landed leases; the writer's side declines the rest)."""
        for key in [k for k, rid in self._waiting_for.items() if rid == request_id]:
            self._wake(key)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for key in list(self._waiters):
            self._wake(key)

    def status(self, address: str) -> dict[str, int]:
        c = self.counts.get(address, PushCounts())
        out = self.out.get(address)
        size = out.nslots * self.peers.arena.slot_size if out is not None else 0
        return {
            "pushes_out": c.out,
            "pushes_declined": c.declined,
            "pushes_in": c.into,
            "push_grant_bytes": size,
            "reads_landed": c.reads_landed,
            "reads_awaited": c.reads_awaited,
            "reads_pulled": c.reads_pulled,
            "pull_phases": c.pull_phases,
        }


__all__ = ["GrantIn", "GrantOut", "PushManager"]
