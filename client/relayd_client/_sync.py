"""SyncRelayClient: the blocking client, for callers on threads with no event loop.

Puts and gets on the shared arena (and inline ones) run entirely on the
caller's thread: cut a lease from a held grant, copy, stamp the slot header,
build the DataRef; check, copy out, release. Their notices join the session's
pending frame, and a private event loop on one background thread sends them
in batches and reads the daemon's frames (Freed, registry, reclaim, aborts).
That loop also runs what is slow and rare - attach, grant requests, route
look-ups, abort, re-attach, GPU and cross-node paths - through the async
client's own code, so both clients share one implementation and raise the
same errors.

Threads share one lock around the lease bookkeeping and the pending frame;
nobody holds it during a copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar, cast

from . import _cuda_copy, _keyed
from ._client import RelayClient
from ._connection import ClientState, check_timeout
from ._reader import InlineOnGpu
from ._refs import TensorRef
from ._steady import NO_LANE
from ._writer import PutPlan, check_trace_id, leased
from .wire.dataref import DataRef
from .wire.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    RelayTimeoutError,
    SessionClosedError,
)
from .wire.names import check_key
from .wire.proto import relay_pb2 as pb
from .wire.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a blocking call waits for the loop beyond its own deadline (the
# async machinery enforces that deadline; this only guards a stuck loop).
LOOP_GRACE_S = 5.0
# How long close() waits for the loop thread to finish.
CLOSE_JOIN_S = 10.0
# What a hot-path step raises when a concurrent close() took its mapping away.
# Caught with try/except, not a context manager: entering one costs about a
# microsecond, on every put and get.
LOST_MAPPING = (ValueError, IndexError, KeyError)


class _LoopThread:
    """A private event loop on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="relayd-sync-loop", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def run(self, coro: Coroutine[Any, Any, T], wait: float | None) -> T:
        """Run ``coro`` on the loop and block for its result, up to ``wait`` seconds."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise InvalidArgumentError("a SyncRelayClient cannot be called from its own loop")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise SessionClosedError("SyncRelayClient is closed") from None
        try:
            return fut.result(wait)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RelayTimeoutError(f"relayd call did not finish within {wait:.3g}s") from None
        except concurrent.futures.CancelledError:
            raise SessionClosedError("SyncRelayClient was closed during the call") from None

    def call_soon(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # closed: nothing left to wake
            self.loop.call_soon_threadsafe(callback)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(CLOSE_JOIN_S)


def _bind_to_loop(c: RelayClient, lt: _LoopThread) -> None:
    """Make the client's loop-bound wake-ups safe to call from the caller's threads.

    A put or get on a caller's thread may free space a waiting put needs, or
    be the first to need a report flush; both must then reach the loop.
    """
    space, on_loop = c._grants.space, asyncio.get_running_loop
    thread_loop = lt.loop

    def off_loop() -> bool:
        return asyncio._get_running_loop() is not thread_loop

    def wake() -> None:
        if off_loop():
            lt.call_soon(space.set)
        else:
            space.set()

    def later(delay: float, callback: Callable[[], None]) -> None:
        if off_loop():
            lt.call_soon(lambda: on_loop().call_later(delay, callback))
        else:
            on_loop().call_later(delay, callback)

    c._grants.wake = wake
    c._reports.later = later


class SyncRelayClient:
    """Blocking client of the node's relayd, safe to share between threads.

    The same operations, arguments and errors as :class:`RelayClient`, without
    ``await``: ``with SyncRelayClient(stage="talker") as c: obj = c.get(ref)``.
    A closed client cannot be reopened.
    """

    def __init__(
        self,
        stage: str | Sequence[str],
        socket: str | None = None,
        *,
        timeout: float = 10.0,
        allow_pickle: bool = False,
    ) -> None:
        self._client = RelayClient(stage, socket, timeout=timeout, allow_pickle=allow_pickle)
        # Its gets wait for pushes' announcements on their own threads: so they hear them.
        self._client._conn.announcements = True
        self._loop: _LoopThread | None = None
        self._state_lock = threading.Lock()

    # -- facts ----------------------------------------------------------------------

    @property
    def stages(self) -> tuple[str, ...]:
        return self._client.stages

    @property
    def socket(self) -> str:
        return self._client.socket

    @property
    def timeout(self) -> float:
        return self._client.timeout

    @property
    def state(self) -> ClientState:
        return self._client.state

    @property
    def node_id(self) -> str:
        return self._client.node_id

    @property
    def daemon_epoch(self) -> str:
        return self._client.daemon_epoch

    @property
    def session_id(self) -> str:
        return self._client.session_id

    @property
    def socket_fallback(self) -> bool:
        return self._client.socket_fallback

    # -- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> SyncRelayClient:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        with self._state_lock:
            c = self._client
            if c.state is ClientState.OPENED:
                return
            if c.state is ClientState.CLOSED:
                raise SessionClosedError(
                    "a closed SyncRelayClient cannot be reopened; make a new one"
                )
            lt = self._loop = _LoopThread()
            _bind_to_loop(c, lt)
            try:
                lt.run(c.open(), c.timeout * 2 + LOOP_GRACE_S)
            except BaseException:
                c.state = ClientState.CLOSED
                lt.stop()
                raise

    def close(self) -> None:
        """Close the session; safe from any thread, and more than once."""
        c = self._client
        if c._conn.forked:  # the loop thread (and maybe the lock) is the parent's
            c._conn.forget()
            return
        with self._state_lock:
            lt = self._loop
            if c.state is ClientState.CLOSED:
                return
            if lt is None:
                c.state = ClientState.CLOSED
                return
            try:
                lt.run(c.close(), c.timeout + LOOP_GRACE_S)
            except Exception as exc:  # closing anyway
                log.debug("closing the relayd session: %s", exc)
            finally:
                c.state = ClientState.CLOSED
                lt.stop()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        lt = self._loop
        # A forked child has no loop thread: what it hands the loop waits unanswered.
        if lt is None or self._client._conn.forked:
            coro.close()
            self._client._conn.require_open()  # raises the async client's error
            raise SessionClosedError("SyncRelayClient is not open")
        try:
            check_timeout(timeout)
        except InvalidArgumentError:
            coro.close()  # it never runs
            raise
        wait = self._client.timeout if timeout is None else timeout
        return lt.run(coro, 2 * max(wait, 0.0) + LOOP_GRACE_S)

    def _raise_if_closed(self) -> None:
        """In ``except LOST_MAPPING``: a hot-path step that lost its mapping to a
        concurrent close() or re-attach says so (else the caller re-raises what
        it caught)."""
        if self._client.state is ClientState.CLOSED:
            raise SessionClosedError("SyncRelayClient was closed during the call") from None
        if self._client._conn.lost:
            raise DaemonUnavailableError("relayd went away during the call") from None

    # -- put ------------------------------------------------------------------------

    def put(
        self,
        obj: Any,
        *,
        to_stage: str,
        request_id: str,
        chunk_id: int | None = None,
        timeout: float | None = None,
        pickle: bool = False,
        key: str | None = None,
        trace_id: str | None = None,
    ) -> DataRef:
        """Publish ``obj`` for ``to_stage``; see :meth:`RelayClient.put` (``key`` included)."""
        if key is not None:
            check_key(key)
        check_timeout(timeout)
        started = time.perf_counter_ns()
        trace = check_trace_id(trace_id)
        ref = self._put(obj, to_stage, request_id, chunk_id, timeout, pickle, trace)
        if key is not None:
            wait = self._client._conn.rpc_timeout(timeout)
            self._run(_keyed.index(self._client._conn, ref, key, wait), wait)
        return self._client._put_finished(ref, started)

    def _put(
        self,
        obj: Any,
        to_stage: str,
        request_id: str,
        chunk_id: int | None,
        timeout: float | None,
        pickle: bool,
        trace_id: str = "",
    ) -> DataRef:
        c = self._client
        a = c._conn.usable()
        if a is None:  # re-attach first, on the loop
            return self._run(
                c._put(obj, to_stage, request_id, chunk_id, timeout, pickle, trace_id), timeout
            )
        try:
            laned = c._put_lanes.put(a, obj, to_stage, request_id, chunk_id, pickle, trace_id)
            if laned is not None:
                return laned
            plan = c._writer.plan(a, obj, to_stage, request_id, chunk_id, pickle)
            route = c._routes.cached(plan.route_key)
            if route is None:
                route = self._run(c._routes.ask(*plan.route_facts))
            here = c._writer.put_here(plan, route)
            if here is not None:
                c._put_lanes.learn(plan, here)
                return here
            if c._gpu_paths.may_take(plan):
                # The copies are enqueued on the loop thread: after this thread's producer.
                streams = _cuda_copy.worker_streams(plan.tensors)
                gpu_ref = self._run(c._gpu_paths.put(plan, timeout, route, streams), timeout)
                if gpu_ref is not None:
                    return gpu_ref
            plan.transport, plan.trace_id = leased(route), trace_id
            ref = self._publish(plan, timeout)
            c._put_lanes.learn(plan, ref)
            return ref
        except LOST_MAPPING:
            self._raise_if_closed()
            raise

    def _publish(self, plan: PutPlan, timeout: float | None) -> DataRef:
        """The writer's publish with the copy on this thread; only a grant wait goes to the loop."""
        w = self._client._writer
        w.check_publishable(plan.request_id)
        if self._client.socket_fallback:
            return self._run(w.publish_socket(plan, timeout))
        cut = w.lease_now(plan)
        if cut is None:  # no room in the grants held: ask the daemon, on the loop
            cut = self._run(w.open_lease(plan, timeout), timeout)
        lease, start = cut
        return w.fill_and_seal(plan, lease, start)

    def ref(
        self,
        tensor: Any,
        *,
        consumer_stage: str,
        request_id: str,
        timeout: float | None = None,
    ) -> TensorRef:
        """Publish ``tensor`` once for ``consumer_stage``; see :meth:`RelayClient.ref`."""
        c = self._client
        a = c._conn.usable()
        if a is None:
            return self._run(
                c.ref(
                    tensor, consumer_stage=consumer_stage, request_id=request_id, timeout=timeout
                ),
                timeout,
            )
        try:
            plan = c._writer.plan_ref(a, tensor, consumer_stage, request_id)
            self._publish(plan, timeout)
        except LOST_MAPPING:
            self._raise_if_closed()
            raise
        return TensorRef(plan.msg)

    def put_done(self, to_stage: str, request_id: str, *, chunks: int | None = None) -> DataRef:
        """The end-of-stream signal; see :meth:`RelayClient.put_done`."""
        with self._client._table.lock:
            return self._client.put_done(to_stage, request_id, chunks=chunks)

    def put_error(self, to_stage: str, request_id: str, message: str) -> DataRef:
        """The stream-failed signal; see :meth:`RelayClient.put_error`."""
        with self._client._table.lock:
            return self._client.put_error(to_stage, request_id, message)

    # -- get ------------------------------------------------------------------------

    def get(self, ref: DataRef | bytes, *, copy: bool = True) -> Any:
        """The payload ``ref`` stands for; see :meth:`RelayClient.get`."""
        started = time.perf_counter_ns()
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        return self._client._get_finished(ref, self._get(ref, copy), started)

    def _get(self, ref: DataRef, copy: bool) -> Any:
        c = self._client
        if c._conn.lost:
            return self._run(c._get(ref, copy))
        r = c._reader
        try:
            if copy:
                got = r.lanes.read(ref)
                if got is not NO_LANE:
                    return got
        except LOST_MAPPING:
            self._raise_if_closed()
            raise
        m = ref.fields
        r.check_readable(m)
        if ref.transport is Transport.LOCAL_OBJECT:
            return r.take_local(m)
        try:
            if r.here(ref):
                got = r.read_here(m, r.checked_ref(m), copy)  # checked before any claim
            else:
                local = r.landed_ref(ref, wait=True)  # a cross-node push: no loop hop
                if local is None:
                    return self._run(c._get(ref, copy))
                got = r.read_landed(local, r.checked_ref(m), copy)
            if got is None:  # CUDA leaves: restored on the loop
                return self._run(c._get(ref, copy))
            if isinstance(got, InlineOnGpu):
                return self._run(got.restore())
            return got
        except LOST_MAPPING:
            self._raise_if_closed()
            raise

    def release(self, ref: DataRef) -> None:
        """Release a ``get(copy=False)``; see :meth:`RelayClient.release`."""
        with self._client._table.lock:
            self._client.release(ref)

    @contextlib.contextmanager
    def view(self, ref: DataRef | bytes) -> Iterator[Any]:
        """``with client.view(ref) as obj``: zero-copy tensors valid inside the block."""
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        obj = self.get(ref, copy=False)
        try:
            yield obj
        finally:
            if self._client._reader.holds_views(ref):
                self.release(ref)

    # -- keyed delivery and discard: one call on the session socket, on the loop ----------

    def take_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        timeout: float | None = None,
    ) -> DataRef | None:
        """The DataRef put under ``key``, consumed; see :meth:`RelayClient.take_key`."""
        c = self._client
        wait = c.timeout if timeout is None else timeout
        return self._run(
            c.take_key(key, from_stage=from_stage, to_stage=to_stage, timeout=wait), wait
        )

    def get_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """The payload put under ``key``, waiting for it; see :meth:`RelayClient.get_key`."""
        started = time.perf_counter_ns()
        ref = self.take_key(key, from_stage=from_stage, to_stage=to_stage, timeout=timeout)
        if ref is None:
            raise RelayTimeoutError(f"no put of key {key!r} from {from_stage!r} yet")
        return self._client._get_finished(ref, self._get(ref, True), started)

    def poll_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        default: Any = None,
    ) -> Any:
        """The payload under ``key`` if there, else ``default``; see :meth:`RelayClient.poll_key`."""
        started = time.perf_counter_ns()
        ref = self.take_key(key, from_stage=from_stage, to_stage=to_stage, timeout=0)
        if ref is None:
            return default
        return self._client._get_finished(ref, self._get(ref, True), started)

    def discard(self, ref: DataRef | TensorRef | bytes) -> None:
        """Free what ``ref`` holds without reading it; see :meth:`RelayClient.discard`."""
        self._run(self._client.discard(ref))

    # -- slow, rare: on the loop -----------------------------------------------------

    def abort(self, request_id: str) -> int:
        """Free every lease of ``request_id`` on this node; see :meth:`RelayClient.abort`."""
        return self._run(self._client.abort(request_id))

    def status(self) -> pb.StatusResponse:
        """The daemon's status; see :meth:`RelayClient.status`."""
        return self._run(self._client.status())

    def feed(self, ref: DataRef | bytes) -> None:
        """Hand the client a stream DataRef the app received; see :meth:`RelayClient.feed`."""
        c = self._client

        async def feed() -> None:
            c.feed(ref)

        self._run(feed())

    def stream(
        self, request_id: str, *, from_stage: str, timeout: float | None = None
    ) -> Iterator[Any]:
        """``for chunk in client.stream(rid, from_stage=...)``; see :meth:`RelayClient.stream`."""
        agen = cast(
            "AsyncGenerator[Any, None]",
            self._client.stream(request_id, from_stage=from_stage, timeout=timeout),
        )

        async def step() -> Any:
            return await agen.__anext__()

        lt = self._loop
        if lt is None or self._client._conn.forked:
            self._client._conn.require_open()
            raise SessionClosedError("SyncRelayClient is not open")
        # Each step waits up to the stream's own per-chunk timeout (None: as
        # long as the stream takes, like the async client).
        wait = None if timeout is None else 2 * timeout + LOOP_GRACE_S
        try:
            while True:
                try:
                    item = lt.run(step(), wait)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            with contextlib.suppress(Exception):
                lt.run(agen.aclose(), LOOP_GRACE_S)
