"""The cross-node pull, on the reader's node.

:meth:`Puller.fetch`: check the DataRef against the writer's arena geometry
learned at handshake, reserve a local run, take a credit of that peer, pull
through the transport, then pull the writer's 16-byte slot header (into the
spare bytes past the local data): the generation check. Generations are never
reused and the writer's daemon zeroes a header before the slots can be reused,
so a header still holding the DataRef's generation after the copy means the
bytes were never overwritten during it. Only then is the local lease published
to the reader; a batched Release notice then frees the writer's lease in the
background, off the reader's path: a Peer round trip costs about four times
the 16-byte header pull.

A pull that fails with bytes still in flight keeps its local run and its
credit until the transport says nothing more can land (the in-flight rule of
:mod:`relayd.transports.base`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import (
    AbortedError,
    CorruptRefError,
    InvalidArgumentError,
    PeerUnavailableError,
    PermissionDeniedError,
    SessionClosedError,
    StaleRefError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import HEADER_STRIDE, SLOT_HEADER
from relayd_client.wire.transport import Transport

from .peer_context import PeerParts
from .peer_links import PeerState
from .pools.records import Lease
from .pools.sessions import Session, SessionState
from .push_landing import PushLanding
from .rpc.frames import lease_ref
from .transports.base import PullError, PullOp, PullTimeoutError, split_ops

log = logging.getLogger(__name__)


class Puller:
    """Foreign DataRefs into this arena; a landed push when there is one."""

    def __init__(
        self, parts: PeerParts, landing: PushLanding, note_origin: Callable[[str, str], None]
    ) -> None:
        self.settings = parts.settings
        self.arena = parts.arena
        self.leases = parts.leases
        self.hooks = parts.hooks
        self.transport = parts.transport
        self.credits = parts.credits
        self.links = parts.links
        self.notifier = parts.notifier
        self.local_bases = parts.local_bases
        self.landing = landing
        # (request id, peer address): so that an abort reaches the peers it pulled from.
        self.note_origin = note_origin

    async def fetch(self, session: Session, data: bytes, timeout: float) -> pb.LeaseRef:
        """Pull a foreign DataRef into this arena; returns the local lease."""
        got = self.start(session, data, timeout)
        return got if isinstance(got, pb.LeaseRef) else await got

    def start(
        self, session: Session, data: bytes, timeout: float
    ) -> pb.LeaseRef | Coroutine[Any, Any, pb.LeaseRef]:
        """A read of a foreign DataRef: the local lease now when its push has
        landed, else the work that waits for the push or pulls. A bad DataRef
        raises here, before anything waits."""
        m = self._checked(session, data)
        pushed = self.landing.take_now(m)
        if pushed is not None:
            return self._lease_ref(pushed, pushed.nbytes)
        return self._fetch(session, m, timeout)

    def _checked(self, session: Session, data: bytes) -> pb.DataRef:
        ref = DataRef.from_bytes(data)
        m = ref.proto
        if m.to_stage not in session.stages:
            raise PermissionDeniedError(
                f"DataRef is addressed to stage {m.to_stage!r}; the session serves {session.stages}"
            )
        if ref.transport is not Transport.SHM:
            raise InvalidArgumentError(f"{ref.transport.value} DataRefs cannot be fetched")
        if m.origin.node_id == self.settings.node_id:
            raise InvalidArgumentError("the DataRef is from this node; read it directly")
        req = self.leases.requests.get(m.request_id)
        if req is not None and req.stops(m.origin.stage, m.to_stage):
            raise AbortedError(f"request {m.request_id!r} was aborted")
        return m

    async def _fetch(self, session: Session, m: pb.DataRef, timeout: float) -> pb.LeaseRef:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pushed = await self.landing.take(m, deadline)
        if pushed is not None:
            return self._lease_ref(pushed, pushed.nbytes)
        peer = self.links.peer_for(m)
        remote = m.lease
        # 16 bytes past the data hold the writer's slot header, read back after the copy.
        local = await self.leases.crossnode.reserve_for_pull(
            session,
            remote.length + HEADER_STRIDE,
            max(deadline - loop.time(), 0.0),
            request_id=m.request_id,
            from_stage=m.origin.stage,
            to_stage=m.to_stage,
        )
        ops: list[PullOp] = []
        try:
            self._still(peer, m)
            ops = self._ops(peer, remote, local)
            body, check = ops[:-1], ops[-1:]
            self.note_origin(m.request_id, peer.address)
            await self._pull(peer, m, body, check, deadline)
            if self._scratch(local, remote.length) != (remote.generation, remote.length):
                raise StaleRefError(
                    f"the lease was read, reclaimed or aborted on node {peer.node_id!r} while "
                    "it was pulled; data discarded"
                )
            if session.state is SessionState.CLOSED:
                # The reader died during the pull: nobody would ever release the lease.
                raise SessionClosedError("the reader's session closed during the pull")
            self.leases.crossnode.publish_pull(local, remote.length)
            self.landing.pulled(peer.address, phases=len([p for p in (body, check) if p]))
        except BaseException:
            # The run is ours alone, so whatever Mooncake still has in flight into
            # it is this pull's: free it only once that has stopped.
            quarantine = asyncio.ensure_future(self.transport.wait_settled(ops)) if ops else None
            self._drop_after(local, quarantine)
            raise
        # The copy is verified: the writer's lease can go, off the reader's path,
        # batched with the other notices to that peer.
        # It frees the lease only for a reader of the stage it is addressed to.
        self.notifier.box(peer.address).released.add(
            lease_id=remote.lease_id, generation=remote.generation, reader_stages=session.stages
        )
        self.notifier.send(peer.address, urgent=False)
        return self._lease_ref(local, remote.length)

    def _lease_ref(self, local: Lease, length: int) -> pb.LeaseRef:
        return lease_ref(self.leases.crossnode.where(local, length))

    def _still(self, peer: PeerState, m: pb.DataRef) -> None:
        """After a wait: ``peer`` is still the daemon that wrote ``m``. One restarted
        meanwhile keeps its node id and address, not its epoch, and may hold a lease
        of the same id and generation at the same place: its bytes are not ``m``'s."""
        if self.links.peer_for(m) is not peer:
            raise PeerUnavailableError(
                f"peer node {peer.node_id!r} moved to another address during the read"
            )

    async def _pull(
        self,
        peer: PeerState,
        m: pb.DataRef,
        body: list[PullOp],
        check: list[PullOp],
        deadline: float,
    ) -> None:
        """``check`` starts once ``body`` has landed, all under one credit."""
        loop = asyncio.get_running_loop()
        async with self.credits.acquire(peer.address, max(deadline - loop.time(), 0.0)) as credit:
            self._still(peer, m)
            peer.in_flight += 1
            peer.in_flight_max = max(peer.in_flight_max, peer.in_flight)
            start = time.perf_counter()
            settle: asyncio.Future[Any] | None = None
            try:
                budget = min(max(deadline - loop.time(), 0.0), self.settings.peer_timeout)
                await self.transport.pull(peer.mooncake_session, body, timeout=budget, then=check)
            except PullError as err:
                if err.in_flight:
                    settle = err.settled
                if isinstance(err, PullTimeoutError) and budget >= self.settings.peer_timeout:
                    # peer_timeout, not the reader's own deadline, ran out: the peer
                    # stopped answering, which is what a dead peer is to the reader.
                    raise PeerUnavailableError(
                        f"peer {peer.address} did not answer within peer_timeout "
                        f"({self.settings.peer_timeout:g}s): {err}"
                    ) from err
                raise
            except asyncio.CancelledError:
                # Bytes may still land: keep the run and the credit until they stop.
                settle = asyncio.ensure_future(self.transport.wait_settled(body + check))
                raise
            finally:
                peer.in_flight -= 1
                if settle is not None:
                    credit.release_when(settle)
            self.hooks.pull_seconds(time.perf_counter() - start)

    def _drop_after(self, lease: Lease, quarantine: asyncio.Future[Any] | None) -> None:
        leases = self.leases

        def drop(_: Any = None) -> None:
            leases.crossnode.drop_pull(lease)
            leases.flush()

        if quarantine is None or quarantine.done():
            drop()
        else:
            log.warning("pull into lease %d still in flight; its run stays quarantined", lease.id)
            quarantine.add_done_callback(drop)

    def _ops(self, peer: PeerState, remote: pb.LeaseRef, local: Lease) -> list[PullOp]:
        seg = peer.segments.get(remote.segment)
        if seg is None:
            raise CorruptRefError(
                f"DataRef names segment {remote.segment} the writer does not have"
            )
        if (
            remote.nslots == 0
            or remote.slot + remote.nslots > seg.nslots
            or remote.length > remote.nslots * peer.slot_size
            or remote.offset != seg.data_offset + remote.slot * peer.slot_size
        ):
            raise CorruptRefError("DataRef lease lies outside the writer's arena")
        lseg = self.arena.segments[local.run.segment]
        local_addr = self.local_bases[local.run.segment] + lseg.slot_offset(local.run.slot)
        remote_addr = seg.base + remote.offset
        ops = split_ops(local_addr, remote_addr, remote.length)
        # Last: the writer's slot header, into the 16 bytes past the local data.
        header = seg.base + remote.slot * HEADER_STRIDE
        ops.append(PullOp(local_addr + remote.length, header, HEADER_STRIDE))
        return ops

    def _scratch(self, local: Lease, length: int) -> tuple[int, int]:
        seg = self.arena.segments[local.run.segment]
        gen, nbytes = SLOT_HEADER.unpack_from(seg.mm, seg.slot_offset(local.run.slot) + length)
        return int(gen), int(nbytes)


__all__ = ["Puller"]
