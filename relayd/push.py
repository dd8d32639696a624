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
    A       no longer holds W's lease, but keeps it published
    A -> B  Notify{landed: (lease id, generation, run, request, stages)}
    B       validates it and publishes a local lease over the run, keyed by
            (origin node, lease id, generation)
    B -> A  Notify{received: the key} (lingering, off every path): A frees
            W's lease; until then a Landed lost on the way (the notice
            channel broke) leaves B's reader a lease to pull
    A -> B  after a broken link is back, Notify{unreceived: keys} on each
            beat while A holds leases B has not said it received (its
            receipts may have been lost with the link); B answers received
            for those it published
    B -> R  LandedPush(key, local lease) on the session socket (a blocking
            client's on its announcement socket), when R's session alone
            serves the stage and no fetch of it waits: R's get reads the
            lease with no call (the slot header decides, as for any lease)
    R -> B  otherwise FetchCall(DataRef) on the session socket: the landed lease,
            at once; not landed yet: waits for the Landed (or Declined) notice
    R -> B  Release (session socket), as for any local lease
    B -> A  Notify{freed: the run} (lingering): A may write that run again

A push of at most ``--push-attach-max`` bytes skips the WRITE and its
acknowledgement: on the peer's notice channel its bytes follow its Landed
notice (``attached``), sent straight from W's run, and B reads them straight
into the run the notice names once the checks that need no bytes passed
(:meth:`PushManager._attach`, :meth:`PushLanding.place`). Here too W's lease
stays published until B's ``received``, so bytes lost on the way (B's daemon
dies, the channel breaks) are pulled from it, as after a failed WRITE.

Nothing on the reader's path waits for a network round trip it started: the
one wait (for the Landed notice) overlaps the DataRef's own trip. After a WRITE
that notice leaves one acknowledgement late; with attached bytes it leaves with
the put, as the DataRef does. The DataRef says ``push`` so that B knows to wait
rather than pull; a writer's daemon that cannot push (no grant, no room, no
credit, peer down, abort) says Declined and the reader pulls as before. A push is never started twice and a pull is never
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
from collections.abc import Sequence
from typing import Any

from relayd_client.wire.errors import (
    PermissionDeniedError,
    RelayError,
)
from relayd_client.wire.framing import FREED_LINGER_MAX_BYTES
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL
from relayd_client.wire.slots import SlotAllocator

from .peer_context import PeerParts
from .peer_links import PeerState
from .pools.records import Lease
from .push_landing import PushCounts, PushLanding, forget_oldest
from .transports.base import PullError, split_ops

log = logging.getLogger(__name__)

# Receipts for attached pushes linger (nothing waits for them) until those
# pending for a peer free this many of its writers' bytes: a writer that gets
# its space back late copies into cold memory, or asks for a grant.
RECEIPT_LINGER_MAX_BYTES = FREED_LINGER_MAX_BYTES


Unreceived = collections.OrderedDict[tuple[int, int], Lease]


@dataclasses.dataclass(eq=False)
class GrantOut:
    """Our standing push grant at one peer (the writer's side)."""

    grant_id: int
    epoch: str
    segment: int
    slot: int
    nslots: int
    alloc: SlotAllocator


class PushManager:
    """Pushes for one daemon: the writer's side here, the reader's in ``landing``;
    owned by the PeerManager."""

    def __init__(self, parts: PeerParts) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.out: dict[str, GrantOut] = {}  # by peer address
        self.counts: dict[str, PushCounts] = collections.defaultdict(PushCounts)
        self.landing = PushLanding(parts, self.counts)
        # Leases whose push landed (and so were freed here), by id.
        self._pushed: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Pushes sent but not yet received, by peer: (lease id, generation) -> lease.
        self._unreceived: dict[str, Unreceived] = {}
        # Those of a peer whose link broke before it said: its epoch then, and
        # them, to ask it about once it is up again (:meth:`ask_unreceived`).
        self._unasked: dict[str, tuple[str, Unreceived]] = {}
        # The attached bytes of the receipts lingering for each peer.
        self._receipt_bytes: collections.Counter[str] = collections.Counter()
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
        ask = pb.PushGrantRequest(
            node_id=self.settings.node_id,
            daemon_epoch=self.parts.epoch,
            nbytes=self.settings.push_grant_size,
        )
        try:
            resp = await self.parts.links.call(peer, "PushGrant", ask)
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
        in flight into it decline, and the next heartbeat asks for a new one.
        Pushes it has not said it received stay published here for its pulls,
        and the next heartbeat asks it about them (it forgot its receipts for us).

        It dropped the grant we gave it too, and asks anew with a free allocator of
        its own: that grant is void here as well, or its next WRITE could land on a
        push we hold unread, or meet one of its writes still in flight."""
        self._unasked_from(peer)
        self.landing.void_given(peer.node_id)
        if self.out.pop(peer.address, None) is not None:
            log.info("peer %s voided its push grant; asking again", peer.address)

    def peer_down(self, peer: PeerState) -> None:
        """Its grant and whatever it gave us are void; readers waiting on it stop.
        Pushes it has not said it received wait to be asked about (its receipts
        sent meanwhile are refused here)."""
        self.out.pop(peer.address, None)
        self._unasked_from(peer)
        self._receipt_bytes.pop(peer.address, None)
        self.landing.peer_lost(peer.node_id)

    def _unasked_from(self, peer: PeerState) -> None:
        unreceived = self._unreceived.pop(peer.address, None)
        if unreceived:
            asked = self._unasked.get(peer.address)
            if asked is not None and asked[0] == peer.epoch:  # a second outage, unasked
                asked[1].update(unreceived)
                unreceived = asked[1]
                forget_oldest(unreceived)
            self._unasked[peer.address] = (peer.epoch, unreceived)

    def ask_unreceived(self, peer: PeerState) -> None:
        """On each beat while the link is up again: ask ``peer`` about the pushes
        it had not said it received when the link broke and that are still
        published here. Its ``received`` answers free them as receipts do (the
        first ask may reach it before it takes us for up again, and is refused:
        hence each beat). The others stay for their readers' pulls, or their TTL.
        A peer that restarted since holds none of them."""
        asked = self._still_unasked(peer.address)
        if asked is None:
            return
        epoch, leases = asked
        if epoch != peer.epoch:
            del self._unasked[peer.address]
            return
        box = self.parts.notifier.box(peer.address)
        for lease_id, generation in leases:
            box.unreceived.add(lease_id=lease_id, generation=generation)
        self.parts.notifier.send(peer.address, added=len(leases))

    def _still_unasked(self, address: str) -> tuple[str, Unreceived] | None:
        """What there is to ask ``address`` about: its pushes still published here
        (an abort, the TTL or a pull frees the others, asked or not)."""
        asked = self._unasked.get(address)
        if asked is None:
            return None
        leases = asked[1]
        table = self.parts.leases.crossnode.table
        for key in [k for k, lease in leases.items() if not table.still_published(lease)]:
            del leases[key]
        if not leases:
            del self._unasked[address]
            return None
        return asked

    def on_publish(self, lease: Lease) -> None:
        """LeaseManager hook: ``lease`` was published with Publish.push set."""
        peer = self._target(lease.to_stage)
        if peer is None or not self.enabled or lease.nbytes == 0 or lease.run.pool != SHM_POOL:
            # Nobody to push to (the consumer moved, its node is down, or several
            # serve it): every up peer hears Declined, so the reader's daemon,
            # wherever it is, pulls.
            for p in self.parts.links.peers.values():
                if p.up:
                    self._decline(p.address, lease, meant=False)
            return
        out = self.out.get(peer.address)
        slots = lease.run.nslots
        start = out.alloc.allocate(slots) if out is not None else None
        credit = self.parts.credits.try_acquire(peer.address) if start is not None else None
        if out is None or start is None or credit is None:
            if out is not None and start is not None:
                out.alloc.free(start, slots)
            self._decline(peer.address, lease)
            return
        self.parts.leases.hold(lease)
        if self._attach(peer, out, lease, start):
            credit.release()
            return
        task = asyncio.get_running_loop().create_task(
            self._push(peer, out, lease, start, credit), name=f"relayd-push {lease.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _target(self, stage: str) -> PeerState | None:
        """The one up peer serving ``stage``; None when none or several do: the DataRef
        may reach a reader on any of them, and one on a node the push did not go to
        would find W's lease freed by the push, with nothing left to pull."""
        found = None
        for p in self.parts.links.peers.values():
            if p.up and stage in p.stages:
                if found is not None:
                    return None
                found = p
        return found

    def _decline(self, address: str, lease: Lease, *, meant: bool = True) -> None:
        """Tell the peer at ``address`` that ``lease`` will not be pushed there.

        ``meant``: the push was for that peer, whose reader may be waiting for its
        announcement, so the decline names the stage and that reader is told.
        Not so when several nodes serve the stage: each would tell its reader of
        every put, a wake-up per put for readers that never get its DataRef.
        """
        self.counts[address].declined += 1
        self.parts.notifier.box(address).declined.add(
            lease_id=lease.id, generation=lease.generation, to_stage=lease.to_stage if meant else ""
        )
        self.parts.notifier.send(address)

    async def _push(
        self, peer: PeerState, out: GrantOut, lease: Lease, start: int, credit: Any
    ) -> None:
        if self.out.get(peer.address) is not out:
            # The peer was lost before this task ran, its geometry forgotten with it:
            # nothing was written, so the push fails as a refused one does.
            credit.release()
            self._push_failed(peer.address, out, lease, start)
            return
        manager = self.parts.leases
        arena = self.parts.arena
        nbytes = lease.nbytes
        src = self.parts.local_bases[lease.run.segment] + arena.segments[
            lease.run.segment
        ].slot_offset(lease.run.slot)
        seg = peer.segments[out.segment]
        dst = seg.base + seg.data_offset + (out.slot + start) * peer.slot_size
        ops = split_ops(src, dst, nbytes)
        settle: asyncio.Future[Any] | None = None
        landed = False
        try:
            await self.parts.transport.push(
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
            settle = asyncio.ensure_future(self.parts.transport.wait_settled(ops))
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
        # Landed: the bytes are at the peer, and nothing reads W's run any more.
        # The peer is told (unless an abort or TTL freed the lease meanwhile), and
        # W's lease stays published until it says it published the bytes, as
        # after an attached push: a Landed notice lost with a broken channel
        # then leaves the reader's daemon a lease to pull, not a stale ref.
        live = manager.crossnode.table.still_published(lease)
        manager.unhold(lease)
        if not live:
            manager.flush()
            out.alloc.free(start, lease.run.nslots)
            self._decline(peer.address, lease)
            return
        self._await_receipt(peer.address, lease)
        self.parts.notifier.box(peer.address).landed.append(self._notice(out, lease, start))
        self.parts.notifier.send(peer.address)

    def _attach(self, peer: PeerState, out: GrantOut, lease: Lease, start: int) -> bool:
        """Push a small lease with no Mooncake WRITE: its bytes follow its Landed
        notice on the peer's notice channel, so they arrive with it, one one-way
        trip after the publish. False: not this way (too big, no channel up, or
        a backlog on it); the caller pushes by Mooncake.

        W's lease stays published until the peer's receipt (:meth:`_received`):
        if the channel breaks or the peer's daemon dies before the bytes are
        published there, its reader pulls them from W's lease after the peer
        timeout, as after a failed WRITE. W's run stays held until the kernel
        has taken the bytes from it (what it cannot take at once waits in the
        channel's queue, uncopied), so an abort or the TTL meanwhile frees the
        lease but not the slots under the send.
        """
        nbytes, address = lease.nbytes, peer.address
        if nbytes > self.settings.push_attach_max:
            return False
        data = self.parts.arena.view(lease.run, nbytes)
        try:
            notice = self._notice(out, lease, start, nbytes)
            sent = self.parts.notifier.send_attached(
                address, notice, data, functools.partial(self.parts.leases.unhold, lease)
            )
        finally:
            data.release()  # the channel's queue keeps views of its own
        if not sent:
            return False
        self._await_receipt(address, lease)
        self.counts[address].attached += 1
        return True

    def _await_receipt(self, address: str, lease: Lease) -> None:
        """W's pushed ``lease`` stays published until ``address`` says it has it."""
        unreceived = self._unreceived.setdefault(address, collections.OrderedDict())
        unreceived[lease.id, lease.generation] = lease
        forget_oldest(unreceived)  # a peer that never answers: those wait for a pull

    def _received(self, address: str, keys: Sequence[pb.LeaseKey]) -> None:
        """``address`` published the bytes of these pushes: W's leases go, unless an
        abort, the TTL or a pull freed them meanwhile. Keys of leases not pushed
        to that peer, or already received, change nothing."""
        unreceived = self._unreceived.get(address)
        asked = self._unasked.get(address)
        for k in keys:
            key = k.lease_id, k.generation
            lease = unreceived.pop(key, None) if unreceived is not None else None
            if lease is None and asked is not None:
                lease = asked[1].pop(key, None)
            if lease is not None and self.parts.leases.crossnode.free_pushed(lease):
                self._landed(address, lease)

    @staticmethod
    def _notice(out: GrantOut, lease: Lease, start: int, attached: int = 0) -> pb.PushLanded:
        return pb.PushLanded(
            lease_id=lease.id,
            generation=lease.generation,
            grant_id=out.grant_id,
            slot=start,
            nslots=lease.run.nslots,
            length=lease.nbytes,
            request_id=lease.request_id,
            from_stage=lease.from_stage,
            to_stage=lease.to_stage,
            attached=attached,
        )

    def _landed(self, address: str, lease: Lease) -> None:
        """W's pushed lease was freed here: counted, and remembered for :meth:`landed`."""
        self.counts[address].out += 1
        self._pushed[lease.id] = lease.generation
        forget_oldest(self._pushed)

    def landed(self, lease_id: int, generation: int) -> bool:
        """Whether this writer's lease was freed here because its push landed.

        Such a put lives on in the consumer's node: a keyed put whose Publish
        pushed it before the key arrived still names a readable payload.
        """
        return self._pushed.get(lease_id) == generation

    def _push_failed(self, address: str, out: GrantOut, lease: Lease, start: int) -> None:
        """Nothing of the push writes any more: W's lease and the run are free to go."""
        self.parts.leases.unhold(lease)
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
            try:
                out.alloc.free(f.slot, f.nslots)
            except ValueError as err:  # not out: the rest of its batch still counts
                log.warning("peer %s freed a run of our push grant twice: %s", address, err)

    # -- notices from peers -------------------------------------------------------------

    def place(self, n: pb.PeerNotices) -> list[memoryview]:
        """Where the notice channel reads the bytes attached to ``n``'s Landed
        notices, in their order (see :meth:`PushLanding.place`)."""
        peer = self._sender(n)
        return [self.landing.place(peer, m) for m in n.landed if m.attached]

    def unplace(self, views: Sequence[memoryview]) -> None:
        self.landing.unplace(views)

    def _sender(self, n: pb.PeerNotices) -> PeerState | None:
        peer = self.parts.links.by_node.get(n.node_id)
        if peer is None or not peer.up or peer.epoch != n.daemon_epoch:
            return None
        return peer

    def on_notices(self, n: pb.PeerNotices, attached: Sequence[memoryview] = ()) -> int:
        """A batch from a peer, with the bytes attached to its Landed notices in their
        order (only on the notice channel): validated piece by piece; returns how
        many pulled leases it released here."""
        peer = self._sender(n)
        if peer is None:
            raise PermissionDeniedError(
                f"notices from node {n.node_id!r} epoch {n.daemon_epoch!r}, not a connected peer"
            )
        manager = self.parts.leases
        released = 0
        for r in n.released:
            try:
                released += manager.crossnode.release_from_peer(
                    r.lease_id, r.generation, r.reader_stages[:64]
                )
            except RelayError as err:  # that lease stays for its reader; the rest go on
                log.warning("peer %s: %s", peer.address, err)
        if n.freed:
            self.on_freed(peer.address, n.freed)
        self.landing.on_declined(n)
        self._received(peer.address, n.received)
        self._answer_unreceived(peer, n.unreceived)
        data = iter(attached)
        for landed in n.landed:
            got = next(data, None) if landed.attached else None
            if self.landing.on_landed(peer, landed, got):
                self._receipt(peer.address, landed)
        return released

    def _answer_unreceived(self, peer: PeerState, keys: Sequence[pb.LeaseKey]) -> None:
        """``peer`` asks which of these pushes of its own were published here."""
        box = self.parts.notifier.box(peer.address)
        answered = 0
        for k in keys:
            if self.landing.published((peer.node_id, peer.epoch, k.lease_id, k.generation)):
                box.received.add(lease_id=k.lease_id, generation=k.generation)
                answered += 1
        if answered:
            self.parts.notifier.send(peer.address, urgent=False, added=answered)

    def _receipt(self, address: str, landed: pb.PushLanded) -> None:
        """Tell the writer's daemon a push is published here: lingering, riding
        the next batch to that peer, unless the receipts pending for it give back
        :data:`RECEIPT_LINGER_MAX_BYTES` (at most one frame of its own per that
        many bytes pushed)."""
        self.parts.notifier.box(address).received.add(
            lease_id=landed.lease_id, generation=landed.generation
        )
        self._receipt_bytes[address] += int(landed.length)
        notifier = self.parts.notifier
        notifier.send(address, urgent=False)
        if self._receipt_bytes[address] >= RECEIPT_LINGER_MAX_BYTES:
            del self._receipt_bytes[address]
            # After the readers this landing woke: they wait, the writer's daemon
            # only wants its space back before its next push.
            flush = functools.partial(notifier.send, address, urgent=True, added=0)
            asyncio.get_running_loop().call_soon(flush)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.landing.close()

    def status(self, address: str) -> dict[str, int]:
        c = self.counts.get(address, PushCounts())
        out = self.out.get(address)
        asked = self._still_unasked(address)
        size = out.nslots * self.parts.arena.slot_size if out is not None else 0
        return {
            "pushes_out": c.out,
            "pushes_declined": c.declined,
            "pushes_in": c.into,
            "push_grant_bytes": size,
            "reads_landed": c.reads_landed,
            "reads_awaited": c.reads_awaited,
            "reads_pulled": c.reads_pulled,
            "pull_phases": c.pull_phases,
            "pushes_attached": c.attached,
            "reads_attached": c.reads_attached,
            "pushes_unreceived": len(self._unreceived.get(address, ()))
            + (len(asked[1]) if asked is not None else 0),
            "pushes_announced": c.announced,
            "reads_announced": c.reads_announced,
        }


__all__ = ["GrantOut", "PushManager"]
