"""The reading side of a client: check a DataRef, read its bytes, release its lease.

Every get is checked whole before anything is claimed, released, fetched or
copied (:meth:`Reader.checked_ref`), so a forged DataRef consumes nothing.
Then by transport: a same-process object (:mod:`_local`), inline bytes read
once, a same-node lease (the slot header checked before and after the copy:
the seqlock), a lease pulled from another node first (:mod:`_remote`), the
GPU paths (:mod:`_gpu_paths`), or the socket fallback. The blocking client
runs the inline and same-node steps on its caller's thread with the same
methods (:meth:`Reader.read_here`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import _apart, _copies, _cuda_facts, _cuda_staging, _flatten, _local, _packing, _remote
from ._aborts import AbortedRequests
from ._checks import ReadChecks
from ._notices import Notices
from ._refs import TensorRef, substitute
from ._steady import NO_LANE, ReadLanes
from ._writer import OFFLOAD_BYTES
from .wire.compact import RefFields
from .wire.dataref import KIND_DATA, DataRef
from .wire.errors import (
    CorruptRefError,
    DaemonUnavailableError,
    InvalidArgumentError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    StaleEpochError,
    StaleRefError,
)
from .wire.proto import relay_pb2 as pb
from .wire.shm import MappedSegment, read_mark
from .wire.transport import Transport

if TYPE_CHECKING:
    from ._connection import Connection
    from ._gpu_paths import GpuPaths
    from ._session import SessionChannel


class Reader:
    """Gets of one client; collaborators are the connection's parts, not the client."""

    def __init__(
        self,
        conn: Connection,
        checks: ReadChecks,
        notices: Notices,
        aborts: AbortedRequests,
        gpu: GpuPaths,
    ) -> None:
        self._conn = conn
        self._stages = conn.stages
        self.checks = checks
        self._notices = notices
        self._aborts = aborts
        self._gpu = gpu
        self.held: set[int] = set()  # lease ids of zero-copy gets not released yet
        # cross-node: object id -> the local DataRef a zero-copy get fetched it into
        self._fetched: dict[str, pb.DataRef] = {}
        self.announced = _remote.Announced()  # cross-node pushes landed for this client
        self.lanes = ReadLanes(conn, checks, aborts, conn.stages, self.end_read, self._read_inline)

    # -- checks before anything is read ------------------------------------------------

    def check_addressed(self, m: RefFields) -> None:
        if m.to_stage not in self._stages:
            raise PermissionDeniedError(
                f"DataRef is addressed to stage {m.to_stage!r}; this client serves {self._stages}"
            )

    def check_readable(self, m: RefFields) -> None:
        self.check_addressed(m)
        if m.kind != KIND_DATA:
            raise InvalidArgumentError(
                "a done/error signal carries no payload; hand it to feed() and read stream()"
            )
        # Whether or not the daemon has freed it yet (the writer's notices may
        # still be on the way), an aborted request's data is not read here.
        self._aborts.check(m.request_id)

    def checked_ref(self, m: RefFields) -> Any:
        """``m``'s decoded header, once it names only tensors and refs ``m`` carries,
        and the forwarded refs addressed to this client are sound too.

        The layout is checked against the lease where the lease is read
        (:meth:`lease_region`, :meth:`_get_socket`, the GPU paths), before
        any claim; a foreign lease is pulled first, so its layout is checked here.
        """
        checks = self.checks
        tree = checks.decode_header(m)
        need_tensors, need_refs = checks.slot_bounds(m, tree)
        if need_tensors > len(m.tensors) or need_refs > len(m.refs):
            raise CorruptRefError(
                f"payload header refers to {need_tensors} tensors and {need_refs} forwarded "
                f"refs, but the DataRef has {len(m.tensors)} and {len(m.refs)}"
            )
        if m.transport == pb.TRANSPORT_SHM and _remote.is_foreign(m, self._conn.node_id):
            checks.checked_specs(m, m.lease.length)
        for r in m.refs:
            if r.to_stage in self._stages and r.kind == KIND_DATA:
                self.checked_ref(r)
        return tree

    def lease_region(
        self, m: RefFields
    ) -> tuple[MappedSegment, Any, int, list[_packing.TensorSpec]]:
        """The lease's segment and its view (held: keeps the mapping through the
        copy), where its data starts there, and its validated layout."""
        conn = self._conn
        a = conn.require_open()
        origin = m.origin
        self.checks.check_not_released(m, a.daemon_epoch)
        if origin.daemon_epoch != a.daemon_epoch:
            if origin.node_id == a.node_id:
                raise StaleEpochError(
                    f"DataRef comes from daemon epoch {origin.daemon_epoch!r}; the daemon restarted "
                    f"(now {a.daemon_epoch!r}) and its data is gone"
                )
            raise PeerUnavailableError(
                f"DataRef comes from node {origin.node_id!r}; cross-node "
                "reads need the Mooncake transport"
            )
        lease = m.lease
        with conn.lock:  # the blocking client's teardown unmaps under it
            if not conn.attached(a):
                # The daemon went away since the gate: its arena is gone or
                # is the next daemon's, whose leases may bear the same ids.
                raise DaemonUnavailableError("relayd went away during the get; nothing was read")
            segments = conn.segments
            if lease.segment >= len(segments):
                raise CorruptRefError(f"DataRef names segment {lease.segment} of {len(segments)}")
            seg, view = segments[lease.segment], conn.views[lease.segment]
            wrong = seg.misplaced(lease.slot, lease.nslots, lease.offset, lease.length)
            if wrong is not None:
                raise CorruptRefError(f"DataRef lease {wrong}")
            gen, length = seg.read_header(lease.slot)
        specs = self.checks.checked_specs(m, lease.length)
        if gen != lease.generation or length != lease.length:
            self._aborts.check(m.request_id)
            raise StaleRefError(
                "DataRef's lease was already read, reclaimed (TTL) or aborted; it cannot be read again"
            )
        return seg, view, lease.offset, specs

    # -- get --------------------------------------------------------------------------

    async def get(self, ref: DataRef, copy: bool) -> Any:
        if copy:
            got = self.lanes.read(ref)
            if got is not NO_LANE:
                return got
        m = ref.fields
        self.check_readable(m)
        if ref.transport is Transport.LOCAL_OBJECT:
            return self.take_local(m)
        tree = self.checked_ref(m)
        if m.refs:
            return await self._get_forwarded(ref.proto, tree, copy)
        return await self._read(ref, tree, copy)

    def take_local(self, m: RefFields) -> Any:
        try:  # a try, not contextlib.suppress: a context manager per get costs ~1.5 us
            return _local.take(m.object_id)
        except KeyError:
            pass
        self._aborts.check(m.request_id)
        raise StaleRefError(
            "local_object DataRef is not held in this process (read already, or it comes "
            "from another process)"
        )

    def here(self, ref: DataRef) -> bool:
        """Whether :meth:`read_here` can read ``ref`` on the calling thread (no await)."""
        transport = ref.transport
        if ref.fields.refs or self._conn.socket_fallback:
            return False
        return transport is Transport.INLINE or (
            transport is Transport.SHM and not _remote.is_foreign(ref, self._conn.node_id)
        )

    def read_here(self, m: RefFields, tree: Any, copy: bool, *, landed: bool = False) -> Any:
        """An inline or same-node lease's payload, read on this thread.

        Returns None when a lease's tensors go to a GPU (the caller awaits
        :meth:`get` instead), and an :class:`InlineOnGpu` for inline tensors
        still to be moved to their GPU.
        """
        if m.transport == pb.TRANSPORT_INLINE:
            specs, tensors = self._read_inline(m)
            if _cuda_facts.restores_on_gpu(specs):  # small CUDA leaves travel inline too
                return InlineOnGpu(tree, specs, tensors)
            self.lanes.learn(m, tree, specs)  # inline bytes are copied, view or not
            return _flatten.rebuild(tree, tensors)
        seg, view, start, specs = self.lease_region(m)
        if _cuda_facts.restores_on_gpu(specs):
            return None
        if copy and m.lease.length >= OFFLOAD_BYTES:
            # A long copy: the daemon learns who reads the lease first.
            session = self._conn.session
            self._notices.claim(m, ring=not landed)
            try:
                tensors = self.read_region(m, view, start, specs, copy)
            except BaseException:
                self._unclaim(m, session, landed)
                raise
        else:
            tensors = self.read_region(m, view, start, specs, copy)
        self.end_read(m, seg, copy, landed=landed)
        if copy:
            self.lanes.learn(m, tree, specs)
        return _flatten.rebuild(tree, tensors)

    def _unclaim(self, m: RefFields, session: SessionChannel, landed: bool) -> None:
        """A claimed copy gave up (cancelled, out of memory): the TTL never frees
        a claimed lease, so release it, unless the session that claimed it is
        gone and took the claim along. The DataRef is read then."""
        if self._conn.session is session and not session.closed:
            self._notices.release(m, ring=not landed)

    async def _read(self, ref: DataRef, tree: Any, copy: bool) -> Any:
        """The payload of a DataRef without forwarded refs, checked by :meth:`checked_ref`."""
        m: RefFields = ref.fields
        transport = ref.transport
        conn = self._conn
        if transport is Transport.INLINE:
            got = self.read_here(m, tree, copy)
            if isinstance(got, InlineOnGpu):
                return await got.restore()
            return got
        # Cross-node: where the push landed, or the local daemon fetches it first.
        landed = transport is Transport.SHM and _remote.is_foreign(ref, conn.node_id)
        if landed:
            local = self._announced(ref) or await self._fetch(ref)
            if not copy:
                self._fetched[local.object_id] = local
            m = local
        if transport in (Transport.CUDA_IPC_POOL, Transport.CUDA_IPC_DIRECT):
            return _flatten.rebuild(tree, await self._gpu.get(ref.proto, transport, copy))
        if transport not in (Transport.SHM, Transport.SOCKET):
            raise PeerUnavailableError(
                f"{transport.value} DataRefs are not served by this client yet"
            )
        if conn.socket_fallback:
            return _flatten.rebuild(tree, await self._get_socket(m))
        seg, view, start, specs = self.lease_region(m)
        lease = m.lease
        # CUDA leaves go straight from the (pinned) arena to this process's GPU.
        on_gpu = _cuda_facts.restores_on_gpu(specs)
        host_copy = copy and not on_gpu
        if host_copy and lease.length >= OFFLOAD_BYTES:
            # Only a copy is worth a thread: a view is the same few
            # microseconds at any size, and the hand-off alone costs ~100.
            session = conn.session
            self._notices.claim(m, ring=not landed)
            try:
                # Allocated on this thread (see _copies.allocate), copied on a
                # worker that is given addresses only (see _packing.Copy).
                tensors = _copies.allocate(specs)
                plan = _copies.copy_plan(view.data_ptr() + start, specs, tensors)
                await asyncio.to_thread(_copies.run_copies, plan)
            except BaseException:
                self._unclaim(m, session, landed)
                raise
        else:
            tensors = self.read_region(m, view, start, specs, host_copy)
        if on_gpu:
            tensors = await _cuda_staging.restore_on_device(tensors, specs, copy)
        self.end_read(m, seg, copy, landed=landed)
        if host_copy:
            self.lanes.learn(m, tree, specs)
        return _flatten.rebuild(tree, tensors)

    async def _fetch(self, ref: DataRef) -> pb.DataRef:
        """The local DataRef of a cross-node ``ref``, from this node's daemon; or
        from its announcement of the same push, if that comes first. A pushed
        DataRef for a stage the daemon announces to this session waits for the
        announcement before asking (see :mod:`._remote`)."""
        conn = self._conn
        m = ref.proto
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[pb.FetchResponse] = loop.create_future()
        heard: asyncio.Future[None] = loop.create_future()

        def heard_of() -> None:
            self._answer_from_announcement(ref, answer)
            if not heard.done():
                heard.set_result(None)

        told = _remote.on_loop(loop, heard_of)
        key = self.announced.when_added(m, told)
        try:
            if self.announced.expects(m):
                try:
                    async with asyncio.timeout(min(_remote.ANNOUNCE_WAIT_S, conn.timeout)):
                        await heard
                except TimeoutError:
                    self.announced.unheard(m.to_stage)
            local = await _remote.fetch(conn.session, ref, conn.timeout, answer)
        finally:
            self.announced.stop_waiting(key, told)
        self.announced.forget(m)
        return local

    def _answer_from_announcement(
        self, ref: DataRef, answer: asyncio.Future[pb.FetchResponse]
    ) -> None:
        """Answer a fetch from the announcement that just came, as the daemon
        would (its own answer follows, if a FetchCall went): the announced
        lease, while its slot header says so; else leave it to the daemon."""
        if answer.done():
            return
        try:
            landed = self._landed_lease(ref)
        except RelayError:  # the daemon's answer says what is wrong
            return
        if landed is not None:
            lease, a = landed
            answer.set_result(
                pb.FetchResponse(lease=lease, node_id=a.node_id, daemon_epoch=a.daemon_epoch)
            )

    def landed_ref(self, ref: DataRef, *, wait: bool = False) -> pb.DataRef | None:
        """The local DataRef of a cross-node ``ref`` whose push the daemon announced
        here, for :meth:`read_landed` on the calling thread; None: :meth:`get` it.

        ``wait``: a push whose announcement is expected (:meth:`Announced.expects`)
        and not here yet is waited for on this thread, as :meth:`_fetch` waits for
        it on the loop: the blocking client then reads it on its caller's thread,
        not through the loop thread and back; with the session's announcement
        socket (:mod:`._apart`), it hears the announcement itself as well.
        """
        if ref.transport is not Transport.SHM or ref.fields.refs or self._conn.socket_fallback:
            return None
        if not _remote.is_foreign(ref, self._conn.node_id):
            return None
        apart = self._conn.session.apart
        if wait and apart is not None:
            apart.drain(self.hear)  # what came before this get
        local = self._announced(ref)
        if local is not None or not wait or not self.announced.expects(ref.proto):
            return local
        return self._await_announced(ref)

    def _await_announced(self, ref: DataRef) -> pb.DataRef | None:
        """:meth:`_announced` once the daemon has said what became of ``ref``'s push,
        waiting on this thread up to ``ANNOUNCE_WAIT_S``, and reading the session's
        announcement socket meanwhile if it has one (:mod:`._apart`)."""
        m = ref.proto
        waiter = _apart.Waiter()
        told = waiter.tell  # one bound method: stop_waiting compares it
        key = self.announced.when_added(m, told)
        try:
            local = self._announced(ref)  # announced before the wait was set up
            if local is None:
                timeout = min(_remote.ANNOUNCE_WAIT_S, self._conn.timeout)
                apart = self._conn.session.apart
                if apart is None:
                    told_in_time = waiter.wait(timeout)
                else:
                    told_in_time = apart.wait(waiter, timeout, self.hear)
                # Told or not, look: a frame the announcement socket had no room
                # for went on the session socket, and the loop heard it.
                local = self._announced(ref)
                if local is None and told_in_time:
                    self.announced.fetch_now(m)  # declined, or announced and gone since
                elif local is None:
                    self.announced.unheard(m.to_stage)
        finally:
            self.announced.stop_waiting(key, told)
        return local

    def hear(self, frames: Iterable[pb.SessionFrame]) -> None:
        """The announcements in ``frames``, from the session socket (the loop
        thread) or the announcement socket (a blocking get's thread)."""
        a = self._conn.attach
        for frame in frames:
            self.announced.hear(frame, None if a is None else a.daemon_epoch)

    def _announced(self, ref: DataRef) -> pb.DataRef | None:
        """The local DataRef of ``ref``'s push as the daemon announced it, while its
        slot header still says so; None: fetch, and the daemon says what became of
        it (read, reclaimed, aborted) or pulls it."""
        landed = self._landed_lease(ref)
        if landed is None:
            return None
        lease, a = landed
        return _remote.local_ref(ref.proto, lease, a.node_id, a.daemon_epoch)

    def _landed_lease(self, ref: DataRef) -> tuple[pb.LeaseRef, pb.AttachResponse] | None:
        """Where ``ref``'s announced push landed, and the attach whose arena holds
        it, while the lease's slot header says so; None: not announced, or no
        longer there."""
        conn = self._conn
        a = conn.require_open()
        lease = self.announced.take(ref.proto, a.daemon_epoch)
        if lease is None:
            return None
        with conn.lock:  # as in lease_region: this attach's arena, or none
            segments = conn.segments
            if not conn.attached(a) or lease.segment >= len(segments):
                return None
            seg = segments[lease.segment]
            if lease.slot >= seg.nslots:
                return None
            if seg.read_header(lease.slot) != (lease.generation, lease.length):
                return None
        return lease, a

    def read_landed(self, local: pb.DataRef, tree: Any, copy: bool) -> Any:
        """:meth:`read_here` of an announced push's local DataRef (:meth:`landed_ref`)."""
        got = self.read_here(local, tree, copy, landed=True)
        if not copy:
            self._fetched[local.object_id] = local
        return got

    def _read_inline(self, m: RefFields) -> tuple[list[_packing.TensorSpec], list[Any]]:
        """An inline DataRef's tensors, once: the same rule as a lease's, kept by the
        reader because inline bytes never reach the daemon."""
        key = self.checks.claim_inline(m, "this inline DataRef")
        try:
            data = m.inline_data
            # One allocation and a memcpy per tensor, straight from the bytes.
            specs = self.checks.checked_specs(m, len(data))
            return specs, _copies.unpack_bytes(data, specs)
        except BaseException:
            self.checks.forget_inline(key)
            raise

    def read_region(
        self,
        m: RefFields,
        view: Any,
        start: int,
        specs: list[_packing.TensorSpec],
        host_copy: bool,
    ) -> list[Any]:
        """Copies (or views) of a validated lease's tensors, on the calling thread."""
        if host_copy:
            # By address: no slice of the segment to build (see _copies.pack_at).
            return _copies.unpack_from(view.data_ptr() + start, specs)
        # A view (or a GPU restore) outlives this turn: the daemon must
        # know who holds the lease before its TTL could reclaim it
        # (seconds), so the claim may linger like a release and often
        # shares its frame. A short copy is released in this same turn,
        # and the release alone says all the claim would.
        self._notices.claim(m, flush=False)
        region = view[start : start + m.lease.length]
        return _copies.unpack(region, specs, copy=False, validated=True)

    def end_read(
        self, m: RefFields, seg: MappedSegment, copy: bool, *, landed: bool = False
    ) -> None:
        """The seqlock's second check, then release a copy or hold a view's lease
        (``landed``: a lease landed from another node, see :meth:`Notices.release`)."""
        lease = m.lease
        if seg.read_header(lease.slot)[0] != lease.generation:
            raise StaleRefError("the lease was reclaimed while it was being read; data discarded")
        if copy:
            if not landed:  # a landed lease's writer is this node's daemon: no mark for it
                # Before the Release: the writer may cut from the run once it sees this.
                seg.mark_read(lease.slot, read_mark(m.object_id, lease.lease_id))
            self._notices.release(m, ring=not landed)
        else:
            self.held.add(lease.lease_id)

    def release(self, ref: DataRef) -> None:
        fetched = self._fetched.pop(ref.fields.object_id, None)  # cross-node: the local lease
        m = fetched if fetched is not None else ref.fields
        if m.lease.lease_id not in self.held:
            raise StaleRefError("this DataRef is not held by a zero-copy get (released twice?)")
        self.held.discard(m.lease.lease_id)
        if ref.transport is Transport.SHM:
            self._mark_read(m)
        self._notices.release(m, ring=fetched is None)

    def _mark_read(self, m: RefFields) -> None:
        """Mark a view's lease read in its slot header (see :mod:`.wire.shm`), while
        the header still names it: an abort may have freed it, and its run may
        hold the writer's next lease by now."""
        conn = self._conn
        lease = m.lease
        with conn.lock:  # as in lease_region: this attach's arena, or none
            segments = conn.segments
            if m.origin.daemon_epoch != conn.daemon_epoch or lease.segment >= len(segments):
                return
            seg = segments[lease.segment]
            if lease.slot < seg.nslots and seg.read_header(lease.slot)[0] == lease.generation:
                seg.mark_read(lease.slot, read_mark(m.object_id, lease.lease_id))

    def holds_views(self, ref: DataRef) -> bool:
        """Whether a zero-copy get of ``ref`` holds a lease that view() must release."""
        return ref.transport in (Transport.SHM, Transport.SOCKET) and not self._conn.socket_fallback

    async def _get_forwarded(self, m: pb.DataRef, tree: Any, copy: bool) -> Any:
        """A payload with forwarded refs: ours are materialized, the rest pass through."""
        plain = pb.DataRef()
        plain.CopyFrom(m)
        del plain.refs[:]
        obj = await self._read(DataRef(plain), tree, copy)
        values: list[object] = []
        for r in m.refs:
            if r.to_stage in self._stages:
                values.append(await self.get(DataRef(r), True))
            else:
                values.append(TensorRef(r))
        return substitute(obj, values)

    async def _get_socket(self, m: RefFields) -> list[Any]:
        """Socket fallback: the daemon copies the lease out to us and frees it."""
        import torch

        conn = self._conn
        a = conn.require_open()
        if m.origin.daemon_epoch != a.daemon_epoch:
            raise StaleEpochError(
                f"DataRef comes from daemon epoch {m.origin.daemon_epoch!r}, not {a.daemon_epoch!r}"
            )
        specs = self.checks.checked_specs(m, m.lease.length)
        try:
            resp = await conn.call(
                "GetBytes",
                pb.GetBytesRequest(
                    lease=m.lease if isinstance(m, pb.DataRef) else m.lease.to_proto(),
                    request_id=m.request_id,
                ),
                conn.timeout,
            )
        except StaleRefError:
            self._aborts.check(m.request_id)  # freed by an abort: say so
            raise
        data = bytearray(resp.data)
        if len(data) != m.lease.length:
            raise CorruptRefError(
                f"daemon sent {len(data)} bytes for a {m.lease.length}-byte lease"
            )
        src = (
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
        return _copies.unpack(src, specs, copy=False)  # the views own `data`


class InlineOnGpu:
    """Inline tensors read on this thread that still have to be moved to their GPU."""

    __slots__ = ("specs", "tensors", "tree")

    def __init__(self, tree: Any, specs: list[_packing.TensorSpec], tensors: list[Any]) -> None:
        self.tree = tree
        self.specs = specs
        self.tensors = tensors

    async def restore(self) -> Any:
        tensors = await _cuda_staging.restore_on_device(self.tensors, self.specs, copy=False)
        return _flatten.rebuild(self.tree, tensors)
