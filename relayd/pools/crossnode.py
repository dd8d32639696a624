"""Leases of cross-node transfers: pulled here for a reader, pushed from or to a peer,
released by a peer.

A pull lands in a run the daemon itself owns: an orphan grant holding exactly
one lease, so the normal rules free it (the reader's Release, TTL, abort,
drain) and the slots go straight back to the arena. The lease stays RESERVED
(invisible to readers, untouched by TTL and abort) while bytes may still land.
A landed push is a PUBLISHED lease over part of a peer's standing push grant,
whose run goes back to that grant. On the writer's side a peer's release
frees a lease as its reader would, if it is addressed to the pulling reader;
a discard, local or a peer's, frees it unread if the discarding session serves
its writer's or its reader's stage.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from relayd_client.wire.errors import (
    AbortedError,
    DrainingError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from relayd_client.wire.transport import Transport

from .arena import Run
from .early import MAX_EARLY_PER_UID, Early, EarlyKind
from .events import LocalLease
from .lease_table import LeaseTable
from .records import NAME_KEEP, Grant, Lease, LeaseState, ReclaimReason, may_discard, slots_for
from .sessions import Session


class CrossNodeLeases:
    def __init__(self, table: LeaseTable, quota_slots: int) -> None:
        self.table = table
        self.quota_slots = quota_slots

    def _daemon_lease(
        self,
        grant: Grant,
        run: Run,
        state: LeaseState,
        *,
        request_id: str,
        from_stage: str,
        to_stage: str,
        uids: Collection[int],
    ) -> Lease:
        """The one lease of a grant the daemon owns, recorded in the table and its request
        as the ``uids``' (of the sessions it is read for: see ``RequestInfo.uids``)."""
        t = self.table
        lease_id = grant.first_lease_id()
        now = t.clock()
        lease = Lease(
            id=lease_id,
            generation=lease_id,
            grant=grant,
            run=run,
            state=state,
            request_id=request_id[:NAME_KEEP],
            from_stage=from_stage[:NAME_KEEP],
            to_stage=to_stage[:NAME_KEEP],
            writer="",
            created=now,
        )
        t.add(lease)
        req = t.requests.add(lease, now)
        for uid in uids:
            req.add_uid(uid)
        return lease

    # -- the reader's side of a pull ---------------------------------------------------

    async def reserve_for_pull(
        self,
        session: Session,
        nbytes: int,
        timeout: float,
        *,
        request_id: str,
        from_stage: str,
        to_stage: str,
    ) -> Lease:
        """A RESERVED lease of ``nbytes`` for ``session`` to read once the pull is in."""
        t = self.table
        if t.queue.draining:
            raise DrainingError("daemon is draining; no new reservations")
        need = slots_for(nbytes, t.slot_size)
        if need > t.arena.max_run_slots() or need > self.quota_slots:
            raise ResourceExhaustedError(
                f"{nbytes} bytes exceed the largest run this daemon can hold for one reader; "
                "raise --shm-pool-size (and --max-stage-bytes)"
            )
        # Waits fairly with the writers, counted against the reader's quota while
        # it waits; once granted the daemon owns the run, not the session.
        grant = await t.queue.wait(session, need, timeout, t.arena.name)
        session.let_go(grant)
        grant.session_id = ""
        grant.orphan = True
        return self._daemon_lease(
            grant,
            grant.run,
            LeaseState.RESERVED,
            request_id=request_id,
            from_stage=from_stage,
            to_stage=to_stage,
            uids=(session.uid,),
        )

    def publish_pull(self, lease: Lease, nbytes: int) -> None:
        """The pulled bytes are in and verified: stamp the header, let the reader read."""
        t = self.table
        if t.leases.get(lease.id) is not lease:
            raise DrainingError("the pulled lease was reclaimed (drain) before it was published")
        req = t.requests.get(lease.request_id)
        if req is not None and req.stops(lease.from_stage, lease.to_stage):
            t.free(lease, ReclaimReason.ABORT)
            t.queue.wake()
            raise AbortedError(f"request {lease.request_id!r} was aborted")
        t.arena.segments[lease.run.segment].write_header(lease.run.slot, lease.generation, nbytes)
        lease.state = LeaseState.PUBLISHED
        lease.published_at = t.clock()
        lease.nbytes = nbytes
        t.hooks.transfer(Transport.MOONCAKE.value, 1, nbytes, lease.from_stage, lease.to_stage)

    def drop_pull(self, lease: Lease) -> None:
        """Give back a pull's run (failed, or settled after a failure). Idempotent."""
        if self.table.leases.get(lease.id) is lease:
            self.table.forget(lease)

    # -- pushes -------------------------------------------------------------------------

    def free_pushed(self, lease: Lease) -> bool:
        """The push of ``lease`` landed at the consumer's node: free it here, as its
        reader would. False when it had been freed meanwhile (abort, TTL)."""
        t = self.table
        live = t.still_published(lease)
        if live:
            t.free(lease, None)
        if t.unhold(lease) or live:  # the writer hears of its slots as after a release
            t.flush()
        return live

    def where(self, lease: Lease, length: int) -> LocalLease:
        """Where a daemon's lease of ``length`` bytes lies, as its reader maps it."""
        run = lease.run
        offset = self.table.arena.segments[run.segment].slot_offset(run.slot)
        return LocalLease(lease.id, run.segment, run.slot, run.nslots, offset, length)

    def adopt_push(
        self,
        run: Run,
        nbytes: int,
        *,
        request_id: str,
        from_stage: str,
        to_stage: str,
        returns: Callable[[Lease], None],
        uids: Collection[int],
    ) -> Lease:
        """A PUBLISHED lease over ``run``, a part of a push grant whose bytes a peer
        has written: read, expired and aborted like any lease; its run then goes
        to ``returns``, not to the pool. ``uids``: of the sessions serving
        ``to_stage``, whose copy it is."""
        t = self.table
        if t.queue.draining:
            raise DrainingError("daemon is draining; no new leases")
        grant = Grant(t.queue.new_id(), "", run, orphan=True, returns=returns)
        t.grants[grant.id] = grant
        lease = self._daemon_lease(
            grant,
            run,
            LeaseState.PUBLISHED,
            request_id=request_id,
            from_stage=from_stage,
            to_stage=to_stage,
            uids=uids,
        )
        lease.published_at = lease.created
        lease.nbytes = nbytes
        t.arena.segments[run.segment].write_header(run.slot, lease.generation, nbytes)
        t.hooks.transfer(Transport.MOONCAKE.value, 1, nbytes, lease.from_stage, lease.to_stage)
        return lease

    # -- the writer's side of a pull, and discards ----------------------------------------

    def release_from_peer(
        self, lease_id: int, generation: int, reader_stages: Collection[str] | None = None
    ) -> bool:
        """A peer pulled this lease: free it as its reader would. False: it was gone
        (read, expired, aborted) or never published, so the peer's copy is void.

        ``reader_stages``: the stages of the session the peer pulled for. As for
        a local reader, the lease must be addressed to one of them - its
        recorded to_stage, whatever the DataRef the peer was handed says - or
        nothing is freed (PermissionDeniedError). None: the daemon frees a
        lease of its own accord (a put whose writer will never hand it on);
        a session's discard is :meth:`discard`.
        """
        stages = tuple(reader_stages) if reader_stages is not None else None
        kind = EarlyKind.OWN if stages is None else EarlyKind.PEER
        lease = self._published(lease_id, generation, kind, stages or ())
        if not isinstance(lease, Lease):
            return lease
        if stages is not None and not (lease.adopted or lease.to_stage in stages):
            raise PermissionDeniedError(
                f"lease {lease_id} is addressed to stage {lease.to_stage[:64]!r}, not to the "
                "pulling reader's"
            )
        self._free(lease)
        return True

    async def discard(
        self, lease_id: int, generation: int, stages: Collection[str], uid: int = -1
    ) -> bool:
        """A session serving ``stages`` (of ``uid``; -1: on a peer's node) frees this
        lease unread; False: it was gone. See :meth:`discard_now`.

        A lease its writer may still publish (its Reserve or Publish lingers on the
        writer's side) waits for that Publish, briefly (as a socket fallback read
        does, see ``publish_waits``), so that its caller hears the verdict, and
        that the lease is freed, not a promise."""
        if self.table.publish_may_come(lease_id, generation):
            await self.table.publish_waits.wait(lease_id, uid)
        return self.discard_now(lease_id, generation, stages, uid)

    def discard_now(
        self, lease_id: int, generation: int, stages: Collection[str], uid: int = -1
    ) -> bool:
        """A session serving ``stages`` frees this lease unread; False: it was gone.

        Only a lease its record says one of them writes or reads (see
        ``records.may_discard``); any other is PermissionDeniedError, and left
        as it is. A lease with no record yet (its Reserve not arrived) is held
        for its Publish and judged then: True now, a refusal then only logged.
        """
        stages = tuple(stages)
        known = self.table.leases.get(lease_id)
        if known is not None and known.generation == generation:
            check_discard(known, stages)
        lease = self._published(lease_id, generation, EarlyKind.DISCARD, stages, uid)
        if not isinstance(lease, Lease):
            return lease
        self._free(lease)
        return True

    def _published(
        self,
        lease_id: int,
        generation: int,
        kind: EarlyKind,
        stages: tuple[str, ...],
        uid: int = -1,
    ) -> Lease | bool:
        """The published lease a release or discard of ``kind`` names, to free now;
        else whether it holds: parked (True) until the lease is published, or
        void (False)."""
        t = self.table
        lease = t.leases.get(lease_id)
        if lease is None or lease.state is LeaseState.RESERVED:
            # The writer's notices linger: the peer may have read a lease whose
            # Reserve and Publish are still on the way (its copy checked the
            # sealed header). The release waits for them, like a local one.
            if lease is None and t.unannounced_in(lease_id) is None:
                return False  # no such grant, or announced and already freed
            if lease_id != generation:
                return False
            if lease is not None and t.sealed_length(lease) is None:
                return False
            if uid >= 0 and t.early.from_uid(uid) >= MAX_EARLY_PER_UID:
                # A discard may name any id of a live grant not announced yet:
                # one uid's must not fill the table every reader parks in.
                raise ResourceExhaustedError(
                    f"more than {MAX_EARLY_PER_UID} discards, claims and releases of leases "
                    f"not yet published from the sessions of uid {uid}"
                )
            # Under the discarding session's uid, in that uid's share.
            return t.early.park(lease_id, Early(kind, "", generation, t.clock(), stages, uid))
        if lease.generation != generation:
            return False
        if lease.state is not LeaseState.PUBLISHED:
            return False
        return lease

    def _free(self, lease: Lease) -> None:
        self.table.free(lease, None)
        self.table.flush()


def check_discard(lease: Lease, stages: Collection[str]) -> None:
    """PermissionDeniedError unless a session serving ``stages`` may discard ``lease``."""
    if not may_discard(lease, stages):
        raise PermissionDeniedError(
            f"lease {lease.id} is written by stage {lease.from_stage[:64]!r} for stage "
            f"{lease.to_stage[:64]!r}; a discard frees only a lease of a stage the "
            f"session serves ({', '.join(stages)[:256]})"
        )
