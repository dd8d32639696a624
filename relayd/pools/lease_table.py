"""The lease state machine: the notices of writers and readers, and freeing.

A lease goes ``RESERVED → PUBLISHED → CLAIMED → freed``. Only its writer
publishes or cancels it; only a session serving the stage it is addressed to
(or its claimer, or anyone for an adopted lease) claims or releases it, always
naming the right generation. Notices that break a rule of the table raise
(the session socket closes that session); notices that are merely wrong for
a lease (a stale generation, another stage's lease) are ignored or answered
with a :class:`~relayd.pools.events.SessionError`. Freeing a lease zeroes its
slot header before the slots can be reused (unless its reader marked it read
already, see :meth:`LeaseTable._read_first`), then gives the slots to whoever
owns the grant: the writer (through a Freed notice), the pool (an orphan), or
a peer's push grant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from relayd_client.wire.errors import (
    ErrorCode,
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
)
from relayd_client.wire.transport import Transport

from .arena import Arena, Run
from .early import MAX_EARLY_PER_SESSION, MAX_EARLY_PER_UID, Early, EarlyKind, EarlyNotices
from .freed import FreedBatcher
from .grant_queue import GrantQueue
from .publish_waits import PublishWaits
from .records import (
    GEN_SHIFT,
    NAME_KEEP,
    Grant,
    Hooks,
    Lease,
    LeaseState,
    Pool,
    ReclaimReason,
    is_id_of,
    may_discard,
)
from .requests import Requests
from .returns import RunReturns
from .sessions import Session, Sessions

log = logging.getLogger(__name__)


# Parked notices no live session stands behind: judged by their stages alone.
_SESSIONLESS = (EarlyKind.PEER, EarlyKind.DISCARD, EarlyKind.OWN)
# The states of a lease a reader may have read and marked (see _read_first).
_READ_STATES = (LeaseState.PUBLISHED, LeaseState.CLAIMED)


def _entitled(lease: Lease, early: Early) -> bool:
    """Whether a parked sessionless notice frees ``lease``, now that its record is known."""
    if early.kind is EarlyKind.OWN:
        return True
    if early.kind is EarlyKind.PEER:
        # A pull's release holds only for the stage the lease is addressed to.
        return lease.adopted or lease.to_stage in early.stages
    if may_discard(lease, early.stages):
        return True
    # Its discarder was answered when it parked: the refusal is only seen here.
    log.warning(
        "discard of lease %d refused as it was published: stage %r writes it for %r, "
        "the discarding session serves %s",
        lease.id,
        lease.from_stage[:64],
        lease.to_stage[:64],
        ", ".join(early.stages)[:256],
    )
    return False


class ReserveNotice(Protocol):
    """A writer cut a lease from one of its grants (``relayd.v1.Reserve``)."""

    @property
    def lease_id(self) -> int: ...
    @property
    def grant_id(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def nslots(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def request_id(self) -> str: ...
    @property
    def to_stage(self) -> str: ...
    @property
    def from_stage(self) -> str: ...


class PublishNotice(Protocol):
    """The writer sealed a lease (``relayd.v1.Publish``)."""

    @property
    def lease_id(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def transport(self) -> int: ...
    @property
    def push(self) -> bool: ...


class ReaderNotice(Protocol):
    """A reader claims or releases a lease (``relayd.v1.Claim``, ``Release``)."""

    @property
    def lease_id(self) -> int: ...
    @property
    def generation(self) -> int: ...


class CancelNotice(Protocol):
    """The writer drops a lease it reserved (``relayd.v1.Cancel``)."""

    @property
    def lease_id(self) -> int: ...


class LeaseTable:
    def __init__(
        self,
        arena: Arena,
        pools: Mapping[str, Pool],
        sessions: Sessions,
        requests: Requests,
        queue: GrantQueue,
        freed: FreedBatcher,
        returns: RunReturns,
        *,
        hooks: Hooks,
        clock: Callable[[], float],
    ) -> None:
        self.arena = arena
        self.slot_size = arena.slot_size
        self.pools = pools
        self.sessions = sessions
        self.requests = requests
        self.queue = queue
        self.grants = queue.grants
        self.freed = freed
        self.returns = returns
        self.hooks = hooks
        self.clock = clock
        self.leases: dict[int, Lease] = {}
        self.early = EarlyNotices()
        # Leases a push is reading from: freeing one (abort, TTL, drain) keeps
        # its slots until the push has stopped reading them (see hold()).
        self._holds: set[int] = set()
        self.held: dict[int, Lease] = {}
        # Called with each lease published with Publish.push set (relayd.push).
        self.on_push: Callable[[Lease], None] | None = None
        # Reads through the daemon that came before their lease's Publish.
        self.publish_waits = PublishWaits()
        # While a session's frames are handled (_later): the transfers
        # published, per (transport, from_stage, to_stage), counted at the end.
        self._later = False
        self._counts: dict[tuple[str, str, str], list[int]] = {}

    def add(self, lease: Lease) -> None:
        """Record a new lease in its grant and in the table."""
        lease.grant.leases[lease.id] = lease
        lease.grant.mark(lease.run, lease)
        self.leases[lease.id] = lease

    # -- writers' notices -------------------------------------------------------------

    def on_reserve(
        self, session: Session, r: ReserveNotice, cancelled: Collection[int] = ()
    ) -> Lease:
        """Record a lease the writer cut from one of its grants; returns its record.

        Raises (the caller closes the session) unless the lease lies inside a
        grant this session holds, overlaps no live lease of it, and carries an
        id of that grant (``grant id << GEN_SHIFT | n``, ``n`` above every id
        reserved in it before): ids are then owned by their grant, so no
        session can take another's, and none is ever recorded twice.

        ``cancelled``: the lease ids the same frame cancels. A writer reuses a
        cancelled lease's slots at once, and a frame's reserves are handled
        before its cancels, so a Reserve over a lease this session cancels in
        the same frame takes that cancel first.
        """
        # Each field read once: a upb field read costs about as much as a check.
        lease_id, slot, nslots = r.lease_id, r.slot, r.nslots
        grant = session.grants.get(r.grant_id)
        if grant is None:
            raise InvalidArgumentError(
                f"lease {lease_id} names grant {r.grant_id}, which this session does not hold"
            )
        grun = grant.run
        if not (nslots >= 1 and grun.slot <= slot and slot + nslots <= grun.slot + grun.nslots):
            raise InvalidArgumentError(
                f"lease {lease_id} (slots {slot}+{nslots}) lies outside grant {grant.id}"
            )
        if lease_id != r.generation or not is_id_of(lease_id, grant.id):
            raise InvalidArgumentError(
                f"lease id {lease_id} (generation {r.generation}) is not an id of grant {grant.id}"
            )
        if lease_id <= grant.last_lease or lease_id in self.leases:
            raise InvalidArgumentError(
                f"lease id {lease_id} was used already in grant {grant.id}; ids go upward"
            )
        if (
            not grant.is_free(slot, nslots)
            and not self._cancel_first(session, grant, r, cancelled)
            and not self._read_first(session, grant, slot, nslots)
        ):
            raise InvalidArgumentError(
                f"lease {lease_id} (slots {slot}+{nslots}) would overlap a live lease "
                f"of grant {grant.id}"
            )
        from_stage = r.from_stage[:NAME_KEEP]
        if from_stage not in session.stages:
            # A writer names itself; claiming another stage's name would let it
            # pass that stage's abort check.
            raise PermissionDeniedError(
                f"lease {lease_id} names from_stage {r.from_stage[:64]!r}, not this session's"
            )
        lease = Lease(
            id=lease_id,
            generation=lease_id,
            grant=grant,
            run=Run(grun.segment, slot, nslots, grun.pool),
            state=LeaseState.RESERVED,
            request_id=r.request_id[:NAME_KEEP],
            from_stage=from_stage,
            to_stage=r.to_stage[:NAME_KEEP],
            writer=session.id,
            created=self.clock(),
        )
        self.add(lease)
        grant.last_lease = lease_id  # above the last one, checked
        req = self.requests.add(lease, lease.created, session.uid)
        if req.aborted and not req.stops(lease.from_stage, lease.to_stage):
            # A stage with no part in this lease cannot abort it ahead of time.
            req.aborted = False
            req.aborters = ()
        return lease

    def _cancel_first(
        self, session: Session, grant: Grant, r: ReserveNotice, cancelled: Collection[int]
    ) -> bool:
        """Forget the leases ``r`` overlaps if the same frame cancels every one of them."""
        if not cancelled:
            return False
        # Found by slot, not by looking at every lease of the grant: a frame can
        # carry tens of thousands of such Reserves. A freed lease whose slots a
        # push still reads (see hold()) covers its slots too, and is no cancel.
        clash = grant.overlapping(r.slot, r.nslots)
        if not all(
            lease.id in cancelled
            and self.leases.get(lease.id) is lease
            and lease.writer == session.id
            and lease.state is LeaseState.RESERVED
            for lease in clash
        ):
            return False
        for lease in clash:
            self.forget(lease)
        return grant.is_free(r.slot, r.nslots)  # none of them kept its slots (hold())

    def _read_first(self, session: Session, grant: Grant, slot: int, nslots: int) -> bool:
        """Free the leases a Reserve at ``slot`` overlaps if their reader is done with each.

        A reader marks a lease's slot header read (:meth:`MappedSegment.mark_read
        <relayd_client.wire.shm.MappedSegment.mark_read>`) before its Release, and
        the writer cuts its next lease from the run as soon as it sees the mark:
        in the cache still, and without waiting for this daemon to wake, take the
        Release and send a Freed. Its Reserve may then come before that Release.
        The header no longer naming the lease is what frees it here: the writer
        overwrites only its own published leases, which it could scribble over
        anyway, and a DataRef of a lease whose header names another fails its
        reader's check, so no reader gets the new bytes for the old lease. Not a
        lease a push or pull reads (:meth:`hold`): those slots are the daemon's
        until it stops, and the writer's session is closed. No neighbour can
        lead an honest writer there: the mark it takes is one only a holder of
        the DataRef can write (:func:`~relayd_client.wire.shm.read_mark`). The
        Release that comes later finds no lease and is dropped
        (:meth:`_reader_lease`).
        """
        clash = grant.overlapping(slot, nslots)
        pool = self.pools[grant.run.pool]
        if not all(
            self.leases.get(lease.id) is lease
            and lease.writer == session.id
            and lease.state in _READ_STATES
            and lease.id not in self._holds
            and pool.header(lease.run.segment, lease.run.slot)[0] != lease.generation
            for lease in clash
        ):
            return False
        for lease in clash:
            self.free(lease, None)
        return grant.is_free(slot, nslots)

    def on_publish(self, session: Session, p: PublishNotice) -> None:
        """The writer sealed a lease; with ``push`` set, the push starts if it is still live."""
        lease = self.leases.get(p.lease_id)
        if lease is None or lease.writer != session.id or lease.state is not LeaseState.RESERVED:
            session.refuse(ErrorCode.INVALID_ARGUMENT, f"bad publish of lease {p.lease_id}")
            return
        self._publish(session, lease, p)

    def on_sealed(self, session: Session, lease: Lease, p: PublishNotice) -> None:
        """The Publish a Reserve carried (``Reserve.publish``), for the lease
        :meth:`on_reserve` just recorded: the same rules as a Publish of its own,
        with the lookup already done."""
        if p.lease_id != lease.id:
            session.refuse(
                ErrorCode.INVALID_ARGUMENT,
                f"bad publish of lease {p.lease_id} in the Reserve of lease {lease.id}",
            )
            return
        self._publish(session, lease, p)

    def _publish(self, session: Session, lease: Lease, p: PublishNotice) -> None:
        try:
            transport = Transport.from_proto(p.transport)
        except ValueError:
            session.refuse(
                ErrorCode.INVALID_ARGUMENT,
                f"bad publish of lease {p.lease_id}: unknown transport {p.transport}",
            )
            return
        self.published(lease, p.nbytes, transport.value)
        if p.push and self.on_push is not None and self.leases.get(lease.id) is lease:
            self.on_push(lease)

    def published(self, lease: Lease, nbytes: int, transport: str) -> None:
        """``lease`` is sealed: readable, on the TTL clock, and owed what came early."""
        lease.state = LeaseState.PUBLISHED
        lease.published_at = self.clock()
        lease.nbytes = min(nbytes, lease.run.nslots * self.slot_size)
        if self.publish_waits:  # rare: only a reader on the socket fallback waits
            self.publish_waits.published(lease.id)  # they look again when they run
        if self._later:
            key = (transport, lease.from_stage, lease.to_stage)
            tally = self._counts.get(key)
            if tally is None:
                self._counts[key] = [1, lease.nbytes]
            else:
                tally[0] += 1
                tally[1] += lease.nbytes
        else:
            self.hooks.transfer(transport, 1, lease.nbytes, lease.from_stage, lease.to_stage)
        if self.requests.stops(lease.request_id, lease.from_stage, lease.to_stage):
            self.free(lease, ReclaimReason.ABORT)
            return
        if not self.early:  # nothing came ahead of its Publish (the usual case)
            return
        for early in self.early.pop(lease.id):
            if self.leases.get(lease.id) is not lease:
                return  # an earlier notice freed it
            self._settle(lease, early)

    def _settle(self, lease: Lease, early: Early) -> None:
        """Judge a parked notice now that ``lease`` is published."""
        gen = early.generation
        if early.kind in _SESSIONLESS:
            if gen == lease.generation and _entitled(lease, early):
                self.free(lease, None)
            return
        reader = self.sessions.get(early.session_id)
        if reader is None:
            # The reader read and went before the Publish landed (the
            # writer's notices linger): what it said still holds. A claim
            # it can no longer release ends as its death would have.
            if gen == lease.generation and (lease.to_stage in early.stages or lease.adopted):
                release = early.kind is EarlyKind.RELEASE
                self.free(lease, None if release else ReclaimReason.READER_DIED)
            return
        # What the reader said is judged now, against the reader alone:
        # nothing it sent may fail the writer's frame being handled.
        try:
            if early.kind is EarlyKind.CLAIM:
                self.claim(reader, lease.id, gen)
            else:
                self.release(reader, lease.id, gen)
        except RelayError as err:
            reader.refuse(ErrorCode.INVALID_ARGUMENT, str(err))

    def count_later(self) -> None:
        """Count what is published from now on at :meth:`count_now`, per edge at once.

        A frame carries a few transfers on one edge: one metrics update for
        them all instead of one each (about 1.8 us a transfer, measured).
        """
        self._later = True

    def count_now(self) -> None:
        """Count what was published since :meth:`count_later`; count at once from now on."""
        self._later = False
        counts = self._counts
        if counts:
            for (transport, from_stage, to_stage), (n, nbytes) in counts.items():
                self.hooks.transfer(transport, n, nbytes, from_stage, to_stage)
            counts.clear()

    def sealed_length(self, lease: Lease) -> int | None:
        """The length the writer sealed ``lease`` with, per its slot header; None if unsealed.

        The header is written only once the bytes are in, so it is the truth
        about a lease whose Publish notice has not arrived (it lingers; see
        the client's SessionChannel.mark) or never will (the writer died).
        """
        if lease.run.pool != self.arena.name:
            return None
        gen, length = self.arena.header(lease.run.segment, lease.run.slot)
        if gen != lease.generation or length > lease.run.nslots * self.slot_size:
            return None
        return length

    def on_cancel(self, session: Session, c: CancelNotice) -> None:
        lease = self.leases.get(c.lease_id)
        if lease is not None and lease.writer == session.id and lease.state is LeaseState.RESERVED:
            self.forget(lease)

    # -- readers' notices -------------------------------------------------------------

    def unannounced_in(self, lease_id: int) -> Grant | None:
        """The live grant ``lease_id`` is numbered in, if its writer has not announced
        it yet: writers announce their leases in order, so an id at or below the
        grant's last one is gone."""
        grant = self.grants.get(lease_id >> GEN_SHIFT)
        return grant if grant is not None and lease_id > grant.last_lease else None

    def publish_may_come(self, lease_id: int, generation: int) -> bool:
        """Whether a writer may still publish ``lease_id`` at ``generation``: it is
        reserved, or not announced yet in a live writer's grant (not a peer's push
        grant, whose leases the daemon publishes itself)."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            return lease.state is LeaseState.RESERVED and lease.generation == generation
        grant = self.unannounced_in(lease_id)
        return (
            grant is not None
            and lease_id == generation
            and is_id_of(lease_id, grant.id)
            and not grant.orphan
            and grant.returns is None
        )

    def _reader_lease(
        self, session: Session, lease_id: int, generation: int, kind: EarlyKind
    ) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is LeaseState.RESERVED:
            if lease is None and (generation != lease_id or self.unannounced_in(lease_id) is None):
                # Not an id of a live grant, or one its writer announced and that
                # is gone (read, superseded, reclaimed): nothing will settle it.
                return None
            if self.early.from_session(lease_id, session.id) >= MAX_EARLY_PER_SESSION:
                raise InvalidArgumentError(
                    f"more than {MAX_EARLY_PER_SESSION} claims/releases of lease {lease_id} "
                    "before it was published"
                )
            if self.early.from_uid(session.uid) >= MAX_EARLY_PER_UID:
                raise InvalidArgumentError(
                    f"more than {MAX_EARLY_PER_UID} claims/releases of leases not yet "
                    f"published from the sessions of uid {session.uid}"
                )
            self.early.park(
                lease_id,
                Early(kind, session.id, generation, self.clock(), session.stages, session.uid),
            )
            return None
        if lease.generation != generation:
            return None  # stale: the reader already saw that in the slot header
        if (
            lease.to_stage not in session.stages
            and lease.claimer != session.id
            and not lease.adopted
        ):
            session.refuse(
                ErrorCode.PERMISSION_DENIED,
                f"lease {lease_id} is addressed to stage {lease.to_stage!r}",
            )
            return None
        return lease

    def on_claim(self, session: Session, c: ReaderNotice) -> None:
        self.claim(session, c.lease_id, c.generation)

    def on_release(self, session: Session, r: ReaderNotice) -> None:
        self.release(session, r.lease_id, r.generation)

    def claim(self, session: Session, lease_id: int, generation: int) -> Lease | None:
        """``session`` reads the lease until it releases it: the lease, if claimed now."""
        lease = self._reader_lease(session, lease_id, generation, EarlyKind.CLAIM)
        if lease is None or lease.state is not LeaseState.PUBLISHED:
            return None
        lease.state = LeaseState.CLAIMED
        lease.claimer = session.id
        session.claimed.add(lease.id)
        return lease

    def release(self, session: Session, lease_id: int, generation: int) -> None:
        lease = self._reader_lease(session, lease_id, generation, EarlyKind.RELEASE)
        if lease is None:
            return
        if lease.state is LeaseState.CLAIMED and lease.claimer != session.id:
            session.refuse(
                ErrorCode.PERMISSION_DENIED, f"lease {lease_id} is claimed by another session"
            )
            return
        self.free(lease, None)

    # -- freeing ----------------------------------------------------------------------

    def forget(self, lease: Lease) -> None:
        """Drop a lease record; the slots go back to whoever owns the grant."""
        self.leases.pop(lease.id, None)
        lease.grant.leases.pop(lease.id, None)
        self.requests.remove(lease)
        if lease.claimer:
            claimer = self.sessions.get(lease.claimer)
            if claimer is not None:
                claimer.claimed.discard(lease.id)
        if lease.id in self._holds:
            self.held[lease.id] = lease  # the slots wait for unhold()
            return
        self.return_slots(lease)

    def return_slots(self, lease: Lease) -> None:
        # Only a header that still names the lease. What else is there stays: its
        # reader's read mark, or the next lease its writer cut from the run
        # without waiting for the daemon (on that mark, see _read_first, or
        # over a lease it cancelled, see _cancel_first), sealed already.
        pool, run = self.pools[lease.run.pool], lease.run
        if pool.header(run.segment, run.slot)[0] == lease.generation:
            pool.clear_header(run.segment, run.slot)
        grant = lease.grant
        grant.mark(lease.run, None)
        if grant.returns is not None:
            self.grants.pop(grant.id, None)
            grant.returns(lease)
        elif grant.orphan:
            self.returns.from_orphan(lease.run, grant.writer_pid)
            if not grant.leases:
                self.grants.pop(grant.id, None)
            self.queue.wake()
        else:
            self.freed.add(
                grant.session_id,
                lease.id,
                lease.run.nslots * self.slot_size,
                arena=lease.run.pool == self.arena.name,
            )

    def free(self, lease: Lease, reason: ReclaimReason | None) -> None:
        """Free ``lease``; with a ``reason``, it was reclaimed (counted and logged)."""
        lease.released = reason is None
        self.forget(lease)
        if reason is not None:
            self.hooks.reclaimed(reason, 1)
            log.info(
                "reclaimed lease",
                extra={
                    "lease_id": lease.id,
                    "request_id": lease.request_id,
                    "reason": reason.value,
                    "session_id": lease.writer,
                },
            )

    def flush(self) -> None:
        """Send the Freed notices that are due (all of them while a grant waits)."""
        self.freed.flush(space_short=self.queue.space_short)

    def still_published(self, lease: Lease) -> bool:
        """``lease`` is still this table's, published: nothing (abort, TTL, drain, a
        reader) freed it, and no newer lease took its id."""
        return self.leases.get(lease.id) is lease and lease.state is LeaseState.PUBLISHED

    def hold(self, lease: Lease) -> None:
        """A push reads ``lease``'s slots: whatever frees the lease meanwhile (abort,
        TTL, drain, a reader) frees the record at once but the slots only at
        :meth:`unhold`, so the writer cannot refill them under the push."""
        self._holds.add(lease.id)

    def held_in(self, grant: Grant) -> list[Lease]:
        """The freed leases of ``grant`` whose slots a push still reads."""
        return [h for h in self.held.values() if h.grant is grant]

    def unhold(self, lease: Lease) -> bool:
        """The push stopped reading: True if this gave the slots back."""
        self._holds.discard(lease.id)
        held = self.held.pop(lease.id, None)
        if held is None:
            return False
        self.return_slots(held)
        return True
