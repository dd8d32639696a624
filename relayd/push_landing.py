"""Pushes on the reader's node: the grants this daemon gives its peers, the
leases their pushes landed, and the readers waiting for them.

A peer writes into the standing run this daemon granted it (see the flow in
:mod:`relayd.push`), then says Landed; only then does a lease exist here, and
only once it is validated: the run must lie inside the grant given to *that*
peer and overlap no live landed lease, its length must fit the run, and its
addressee stage must be served on this node. A reader whose DataRef says
``push`` waits for the Landed (or Declined) notice, never past the peer
timeout or the peer's loss, then reads the landed lease or pulls.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

from relayd_client.wire.dataref import MAX_NAME
from relayd_client.wire.errors import (
    AbortedError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    StaleRefError,
)
from relayd_client.wire.framing import FREED_LINGER_MAX_BYTES
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.slots import SlotAllocator

from .peer_context import PeerParts
from .peer_links import PeerState
from .pools.arena import Run
from .pools.crossnode import check_discard
from .pools.events import Declined, Landed
from .pools.records import Lease, LeaseState
from .pools.sessions import Session, SessionState

log = logging.getLogger(__name__)

# Keys of leases landed and already read, of pushes declined, and of pushes whose
# reader stopped waiting and pulled, remembered so a second fetch of the same
# DataRef does not wait for a push that will not come, and a Landed notice that
# comes after all is refused.
REMEMBER = 1 << 14
# Peer timeouts the free part of a grant given to a lost peer stays out of use.
QUARANTINE_TIMEOUTS = 4


def forget_oldest(remembered: collections.OrderedDict[Any, Any]) -> None:
    """Drop the oldest entries of ``remembered`` past :data:`REMEMBER`."""
    while len(remembered) > REMEMBER:
        remembered.popitem(last=False)


Key = tuple[str, str, int, int]  # (origin node, its epoch, lease id, generation)


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
    attached: int = 0  # of ``out``: bytes attached to the Landed notice
    reads_attached: int = 0  # reads of such pushes (not in landed or awaited)
    announced: int = 0  # of ``into``: leases announced to their one reader
    reads_announced: int = 0  # of those, read and released with no fetch


class PushLanding:
    """The reader's side of pushes for one daemon; owned by the PushManager."""

    def __init__(self, parts: PeerParts, counts: dict[str, PushCounts]) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.counts = counts  # shared with the writer's side, by peer address
        self.given: dict[str, GrantIn] = {}  # by node id
        self._next_grant = 1
        self._landed: dict[Key, Lease] = {}
        self._attached: set[Key] = set()  # of those, the ones whose bytes came attached
        # Of those, the ones announced to their reader and not fetched: by peer address.
        self._announced: dict[Key, str] = {}
        # The session each stage's last landing was announced to: the one whose
        # gets wait for announcements, and so the one told of a decline.
        self._announcing: dict[str, Session] = {}
        # True: landed here and read; a pull would read the DataRef a second time.
        self._declined: collections.OrderedDict[Key, bool] = collections.OrderedDict()
        self._waiters: dict[Key, list[asyncio.Future[None]]] = {}
        self._waiting_for: dict[Key, str] = {}  # request id of each awaited push
        # Runs taken for attached bytes being read straight into them, by the
        # id() of the view they are read through (held here, so ids stay unique).
        self._placed: dict[int, tuple[memoryview, GrantIn, Run]] = {}

    def peer_lost(self, node: str) -> None:
        """Whatever the lost peer ``node`` was given is void; readers waiting on it stop."""
        self.void_given(node)
        for key in [k for k in self._waiters if k[0] == node]:
            self._wake(key)

    def void_given(self, node: str) -> None:
        """The grant given to ``node`` is void: its landed leases stay until read, and
        its next request gets a grant of its own."""
        given = self.given.pop(node, None) if node else None
        if given is not None:
            # It may be alive behind a broken link, its writes into the grant still
            # in flight or retried when the link heals: nothing may reuse that space
            # until they have surely ended (each is bounded by the peer timeout, and
            # it stops pushing once it takes us for lost or hears the grant is void).
            self._retire(given, quarantine=QUARANTINE_TIMEOUTS * self.settings.peer_timeout)

    def on_declined(self, n: pb.PeerNotices) -> None:
        for d in n.declined:
            key = (n.node_id, n.daemon_epoch, int(d.lease_id), int(d.generation))
            awaited = key in self._waiters
            self._remember(key)
            self._wake(key)
            if not awaited and d.to_stage:
                # Its one reader may be waiting for the landing's announcement, if
                # it had one for this stage before: it fetches now instead.
                readers = self._readers(d.to_stage)
                if len(readers) == 1 and self._announcing.get(d.to_stage) is readers[0]:
                    readers[0].tell(Declined(key, d.to_stage))

    def grant_to(self, req: pb.PushGrantRequest) -> pb.PushGrantResponse:
        none = pb.PushGrantResponse(daemon_epoch=self.parts.epoch)
        peer = self.parts.links.by_node.get(req.node_id)
        pushes_on = self.settings.push_grant_size > 0
        if not pushes_on or peer is None or not peer.up or peer.epoch != req.daemon_epoch:
            return none  # it asks again after its next handshake
        old = self.given.get(req.node_id)
        if old is not None and old.epoch == req.daemon_epoch:
            return self._grant_response(old)
        if old is not None:
            self._retire(old)
            del self.given[req.node_id]
        arena = self.parts.arena
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
            daemon_epoch=self.parts.epoch,
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
            self.parts.arena.free(run)
        self.parts.leases.wake()

    def place(self, peer: PeerState | None, m: pb.PushLanded) -> memoryview:
        """Where the ``m.attached`` bytes following Landed notice ``m`` are read: the
        run of our grant it names, taken for it if the checks that need no bytes
        pass (those :meth:`on_landed` makes first), so they cross no buffer; else
        fresh memory, and :meth:`on_landed` refuses it and says why."""
        taken = None if peer is None else self._take_run(peer, m, int(m.attached))
        if not isinstance(taken, tuple):
            return memoryview(bytearray(m.attached))
        gin, run = taken
        view = self.parts.arena.view(run, int(m.attached))
        self._placed[id(view)] = (view, gin, run)
        return view

    def unplace(self, views: Sequence[memoryview]) -> None:
        """The channel is done with these places: runs still taken go back."""
        for view in views:
            placed = self._placed.pop(id(view), None)
            if placed is not None:
                self._give_back(placed[1], placed[2])

    def _take_run(self, peer: PeerState, m: pb.PushLanded, got: int) -> tuple[GrantIn, Run] | str:
        """The run of our grant that Landed notice ``m`` names, taken for it (``got``:
        the bytes that came with it); or why not."""
        gin = self.given.get(peer.node_id)
        if gin is None or gin.retired or m.grant_id != gin.grant_id:
            return "names no push grant of ours"
        if m.nslots == 0 or m.slot + m.nslots > gin.run.nslots:
            return "lies outside the push grant"
        if m.length == 0 or m.length > m.nslots * self.parts.arena.slot_size:
            return f"length {m.length} does not fit {m.nslots} slots"
        if m.attached and (m.attached != m.length or got != m.length):
            # Rode the Peer service, which carries no bytes, or says two lengths.
            return f"attaches {m.attached} bytes for a length of {m.length}; {got} came"
        if not gin.used.allocate_at(int(m.slot), int(m.nslots)):
            return "overlaps a landed lease not yet read"
        return gin, Run(gin.run.segment, gin.run.slot + int(m.slot), int(m.nslots), gin.run.pool)

    def on_landed(self, peer: PeerState, m: pb.PushLanded, data: memoryview | None) -> bool:
        """A push landed in our grant, or (``m.attached``) its bytes are ``data``:
        read into the run by :meth:`place`, or copied there once the notice is
        validated. True when it is published here as a local lease."""
        key = (peer.node_id, peer.epoch, int(m.lease_id), int(m.generation))
        placed = None if data is None else self._placed.pop(id(data), None)
        copy = None if placed is not None else data  # else the bytes are in the run
        taken: tuple[GrantIn, Run] | str
        if placed is None:
            taken = self._take_run(peer, m, 0 if data is None else len(data))
        elif placed[1].retired:  # the peer was lost while its bytes came
            self._give_back(placed[1], placed[2])
            taken = "names no push grant of ours"
        else:
            taken = placed[1], placed[2]
        if not isinstance(taken, tuple):
            log.warning(
                "peer %s: landed push of lease %d %s; ignored", peer.address, m.lease_id, taken
            )
            self._remember(key)
            self._wake(key)
            return False
        gin, run = taken
        refuse = ""
        req = self.parts.leases.requests.get(m.request_id)
        if key in self._landed or key in self._declined:
            refuse = "landed twice, or after its reader pulled it"
        elif len(m.request_id) > MAX_NAME or len(m.to_stage) > MAX_NAME:
            refuse = "names too long"
        elif m.to_stage not in self.parts.links.local_stages():
            refuse = f"stage {m.to_stage!r} is not served on this node"
        elif req is not None and req.stops(m.from_stage, m.to_stage):
            refuse = f"request {m.request_id!r} was aborted"
        if refuse:
            log.info("push of lease %d from %s refused: %s", m.lease_id, peer.address, refuse)
            self._give_back(gin, run)
            self._remember(key)
            self._wake(key)
            return False
        if copy is not None:
            self.parts.arena.write(run, copy)
        readers = self._readers(m.to_stage)
        try:
            lease = self.parts.leases.crossnode.adopt_push(
                run,
                int(m.length),
                request_id=m.request_id,
                from_stage=m.from_stage[:MAX_NAME],
                to_stage=m.to_stage,
                returns=functools.partial(self._returned, gin, key),
                uids={s.uid for s in readers},
            )
        except RelayError as exc:  # draining
            log.info("push of lease %d from %s refused: %s", m.lease_id, peer.address, exc)
            self._give_back(gin, run)
            self._remember(key)
            self._wake(key)
            return False
        self.counts[peer.address].into += 1
        self._landed[key] = lease
        if data is not None:
            self._attached.add(key)
        awaited = key in self._waiters
        self._wake(key)
        if not awaited:
            self._announce(peer, key, lease, m, readers)
        return True

    def _readers(self, stage: str) -> list[Session]:
        """The bound sessions serving ``stage``: whose copy a push to it is."""
        return [
            s
            for s in self.parts.leases.sessions.values()
            if s.state is SessionState.BOUND and stage in s.stages
        ]

    def _announce(
        self, peer: PeerState, key: Key, lease: Lease, m: pb.PushLanded, readers: list[Session]
    ) -> None:
        """Tell the session serving ``m``'s stage where the push landed, so that its get
        reads the lease with no FetchCall: a round trip to this daemon, after the
        bytes are here, off the reader's path. Only when exactly one session serves
        the stage: with several, any of them may hold the DataRef, and waking them
        all for one read costs more than the fetch saves. A reader already waiting
        has its fetch answered instead."""
        if len(readers) != 1:
            return
        where = self.parts.leases.crossnode.where(lease, lease.nbytes)
        readers[0].tell(Landed(key, where, m.request_id, m.to_stage))
        self._announcing[m.to_stage] = readers[0]
        self._announced[key] = peer.address
        self.counts[peer.address].announced += 1

    def _returned(self, gin: GrantIn, key: Key, lease: Lease) -> None:
        """A landed lease was freed (read, TTL, abort, drain)."""
        self._landed.pop(key, None)
        self._attached.discard(key)
        address = self._announced.pop(key, None)
        if address is not None and lease.released:
            self.counts[address].reads_announced += 1
        self._remember(key, read=lease.released or lease.state is LeaseState.CLAIMED)
        self._give_back(gin, lease.run)

    def _give_back(self, gin: GrantIn, run: Run) -> None:
        start = run.slot - gin.run.slot
        if gin.retired:
            self.parts.arena.free(run)
            self.parts.leases.wake()
            return
        gin.used.free(start, run.nslots)
        peer = self.parts.links.by_node.get(gin.node_id)
        if peer is not None and peer.up:
            self.parts.notifier.box(peer.address).freed.add(
                grant_id=gin.grant_id, slot=start, nslots=run.nslots
            )
            # A big run goes back at once, as a local Freed does: the writer's
            # daemon cannot push the next big lease until it has it.
            big = run.nslots * self.parts.arena.slot_size >= FREED_LINGER_MAX_BYTES
            self.parts.notifier.send(peer.address, urgent=big)

    def _remember(self, key: Key, *, read: bool = False) -> None:
        self._declined[key] = read or self._declined.get(key, False)
        self._declined.move_to_end(key)
        forget_oldest(self._declined)

    def published(self, key: Key) -> bool:
        """Whether the push ``key`` was published here (and may have been read since)."""
        return key in self._landed or self._declined.get(key, False)

    def _wake(self, key: Key) -> None:
        self._waiting_for.pop(key, None)
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def take(self, m: pb.DataRef, deadline: float) -> Lease | None:
        """The landed lease for DataRef ``m``, waiting for its push when the writer
        asked for one; None: read it by pull."""
        key = _key_of(m)
        # Only a peer holding a grant here can push here: from any other, nothing
        # will come (its pushes are off, or it pushes to another node), so pull.
        given = self.given.get(key[0])
        pushable = given is not None and not given.retired and given.epoch == key[1]
        if key not in self._landed and m.push and pushable and key not in self._declined:
            peer = self.parts.links.by_node.get(key[0])
            if peer is None or not peer.up:
                return None  # the pull says what is wrong with the peer
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(key, []).append(fut)
            self._waiting_for[key] = m.request_id
            wait = min(deadline - loop.time(), self.settings.peer_timeout)
            try:
                # Not wait_for, whose own waiter costs the reader one more loop turn.
                async with asyncio.timeout(max(wait, 0.0)):
                    await fut
            except TimeoutError:
                log.warning("push of lease %d from %s did not arrive; pulling", key[2], key[0])
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self._waiters[key]
                        self._waiting_for.pop(key, None)
            if key not in self._landed:
                # This reader pulls: a Landed notice coming after all would publish a
                # second copy of the DataRef, held for nobody until its TTL.
                self._remember(key)
            req = self.parts.leases.requests.get(m.request_id)
            if req is not None and req.stops(m.origin.stage, m.to_stage):
                raise AbortedError(f"request {m.request_id!r} was aborted")
            if key not in self._landed and not (
                peer.up and self.parts.links.by_node.get(key[0]) is peer
            ):
                raise PeerUnavailableError(
                    f"peer node {key[0]!r} went down while its push of lease {key[2]} "
                    f"was awaited: {peer.last_error or 'unreachable'}"
                )
            return self._taken(key, m, waited=True)
        return self._taken(key, m, waited=False)

    def take_now(self, m: pb.DataRef) -> Lease | None:
        """The landed lease for DataRef ``m`` if its push has landed; None: not
        (yet), :meth:`take` waits or says to pull. No wait, so a reader whose
        push is already here is answered without a task."""
        key = _key_of(m)
        return self._taken(key, m, waited=False) if key in self._landed else None

    def _taken(self, key: Key, m: pb.DataRef, *, waited: bool) -> Lease | None:
        """The landed lease of ``key`` for a reader of ``m``, counted as that read.
        StaleRefError when a reader has it, or had it: the writer's lease may still
        be published for a pull (an attached push not yet received), and a pull
        would read the DataRef a second time."""
        lease = self._landed.get(key)
        if lease is None:
            if self._declined.get(key, False):
                raise StaleRefError("the DataRef's push landed on this node and was read")
            return None
        if self.parts.leases.leases.get(lease.id) is not lease:
            return None
        if lease.to_stage != m.to_stage or lease.request_id != m.request_id:
            raise PermissionDeniedError(
                "the DataRef does not match the lease its writer's daemon pushed here"
            )
        if lease.state is not LeaseState.PUBLISHED:
            raise StaleRefError("the DataRef's push landed on this node and is being read")
        self._announced.pop(key, None)  # read by this fetch: counted here
        peer = self.parts.links.by_node.get(key[0])
        if peer is not None:
            counts = self.counts[peer.address]
            if key in self._attached:
                counts.reads_attached += 1
            elif waited:
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

    def discard(self, m: pb.DataRef, stages: Sequence[str]) -> bool:
        """Free the landed copy of DataRef ``m`` unread for a session serving ``stages``;
        False when none is here. PermissionDeniedError, and it stays, unless the
        stages the writer's daemon recorded for it name one of them (as there)."""
        key = _key_of(m)
        lease = self._landed.get(key)
        manager = self.parts.leases
        if lease is None or manager.leases.get(lease.id) is not lease:
            return False
        check_discard(lease, stages)
        manager.crossnode.drop_pull(lease)
        manager.flush()
        return True

    def abort(self, request_id: str) -> None:
        """Readers waiting for pushes of ``request_id`` stop with AbortedError (the
        abort itself freed the landed leases; the writer's side declines the rest)."""
        for key in [k for k, rid in self._waiting_for.items() if rid == request_id]:
            self._wake(key)

    def close(self) -> None:
        for key in list(self._waiters):
            self._wake(key)


def _key_of(m: pb.DataRef) -> Key:
    return (m.origin.node_id, m.origin.daemon_epoch, int(m.lease.lease_id), int(m.lease.generation))


__all__ = [
    "QUARANTINE_TIMEOUTS",
    "REMEMBER",
    "GrantIn",
    "PushCounts",
    "PushLanding",
    "forget_oldest",
]
