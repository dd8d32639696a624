"""Grants whose writer is gone: what survives it, and what it sealed but never announced.

When the writer's session ends its grants become *orphans*: unpublished leases
are dropped, the unused parts go back to the pool at once, and each published
lease returns its own run to the pool when it is read, expires or is aborted.
Arena leases the writer sealed but never announced (its notices linger) are
published from their slot headers. Published GPU leases go with their writer.
The socket fallback hands a grant to the daemon the same way
(:meth:`Orphans.orphan` with no writer).
"""

from __future__ import annotations

import logging

from relayd_client.wire.transport import Transport

from .arena import Run
from .lease_table import LeaseTable
from .records import Grant, Lease, LeaseState, ReclaimReason, is_id_of, slots_for
from .sessions import Session

log = logging.getLogger(__name__)


class Orphans:
    def __init__(self, table: LeaseTable) -> None:
        self.table = table

    def orphan(self, grant: Grant, writer: Session | None = None) -> None:
        t = self.table
        if writer is not None:
            self.adopt_sealed(grant, writer)
        dropped = 0
        # A GPU pool lease is read by waiting on its writer's CUDA event, which
        # dies with the writer (using it after that is undefined), and a writer
        # killed with its copy queued may leave the event looking complete:
        # published GPU leases go with their writer, unread, never served.
        gpu = grant.run.pool != t.arena.name
        # A writer killed mid-copy (still exiting): a reader copying out of one
        # of its leases may have seen the event complete too early; clearing
        # the header makes that reader's check after its copy fail (its slots
        # are held until the writer has exited, see RunReturns.from_orphan).
        killed = gpu and writer is not None and t.returns.may_run(writer.pid)
        for lease in list(grant.leases.values()):
            state = lease.state
            if (
                state is LeaseState.RESERVED
                or (gpu and state is LeaseState.PUBLISHED)
                or (killed and state is LeaseState.CLAIMED)
            ):
                t.forget(lease)
                dropped += 1
        if dropped:
            t.hooks.reclaimed(ReclaimReason.WRITER_DIED, dropped)
        grant.orphan = True
        if writer is not None:
            grant.writer_pid = writer.pid
        # Give back every part of the run no published lease sits on (and no
        # freed lease a push is still reading: see LeaseTable.hold).
        live = [*grant.leases.values(), *t.held_in(grant)]
        kept = sorted((lease.run.slot, lease.run.nslots) for lease in live)
        cursor = grant.run.slot
        end = grant.run.slot + grant.run.nslots
        for slot, n in [*kept, (end, 0)]:
            if slot > cursor:
                t.returns.from_orphan(
                    Run(grant.run.segment, cursor, slot - cursor, grant.run.pool), grant.writer_pid
                )
            cursor = max(cursor, slot + n)
        if not grant.leases:
            t.grants.pop(grant.id, None)

    def adopt_sealed(self, grant: Grant, writer: Session) -> None:
        """Publish what a dead writer sealed but never announced.

        A writer's Publish notices linger (up to the client's NOTICE_LINGER_S),
        so it can die after handing out a DataRef the daemon has not heard of. Its slot
        headers say what it sealed: a RESERVED lease whose header carries its
        generation is published, and a header of this grant's generation over
        slots no known lease covers is a lease whose Reserve never came.
        """
        t = self.table
        if grant.run.pool != t.arena.name:
            return
        adopted = 0
        start, end = grant.run.slot, grant.run.slot + grant.run.nslots
        busy = bytearray(grant.run.nslots)
        # A lease freed while a push reads it keeps its slots, and its header,
        # until the push stops (LeaseTable.hold): that header is no unannounced lease.
        for lease in [*grant.leases.values(), *t.held_in(grant)]:
            first = lease.run.slot - start
            busy[first : first + lease.run.nslots] = b"\x01" * lease.run.nslots
        for lease in list(grant.leases.values()):
            if lease.state is LeaseState.RESERVED:
                length = t.sealed_length(lease)
                if length is not None:
                    t.published(lease, length, Transport.SHM.value)
                    adopted += 1
        slot = start
        while slot < end:
            gen, length = t.arena.header(grant.run.segment, slot)
            nslots = slots_for(length, t.slot_size)
            if (
                busy[slot - start]
                or not is_id_of(gen, grant.id)
                or gen in t.leases
                or slot + nslots > end
                or any(busy[slot - start : slot - start + nslots])
            ):
                slot += 1
                continue
            lease = Lease(
                id=gen,
                generation=gen,
                grant=grant,
                run=Run(grant.run.segment, slot, nslots, grant.run.pool),
                state=LeaseState.RESERVED,
                request_id="",
                from_stage=writer.stages[0] if writer.stages else "",
                to_stage="",
                writer=writer.id,
                created=t.clock(),
                adopted=True,
            )
            t.add(lease)
            t.published(lease, length, Transport.SHM.value)
            adopted += 1
            slot += nslots
        if adopted:
            log.info(
                "published %d sealed leases of a writer that died before announcing them",
                adopted,
                extra={"session_id": writer.id},
            )
