"""Ordering and lifetime of the client's GPU work, with no torch in sight.

The ``_cuda*`` modules do the CUDA calls; the decisions they need are here, over
"stream-like" and "event-like" objects, so they are tested with fakes on
machines without a GPU. What each piece answers:

* :func:`caller_streams` / :func:`run_on_streams`: which stream a copy that
  runs on a worker thread goes to. PyTorch's current stream is per thread,
  and a worker starts on the legacy default stream, which is *not* ordered
  after work on the caller's (non-blocking) side streams: the caller's
  current streams are captured on the caller's thread and entered in the
  worker, so the copy runs after the producer.
* :class:`DedicatedStreams`: one copy stream per device for reads, made on
  first use. A reader's copy out of a pool waits on the writer's event; on
  the reader's compute stream that wait would stall the model's own work
  behind the writer's queue.
* :func:`copy_in_worker`: whether a read's copies leave the event loop. A
  copy between two GPUs without peer access, or into pageable host memory,
  blocks the calling thread.
* :func:`wait_event`: a host wait for a CUDA event with a deadline; CUDA's
  ``synchronize`` cannot be given one (a dead writer's event may never fire).
* :class:`Quarantine`: buffers a copy may still write into after its wait
  was abandoned at the deadline stay referenced until that copy is done,
  so the caching allocator cannot hand them to anyone else meanwhile.
* :class:`WriterFences`: the writer's event per pool lease. A lease's slots
  go back to the grant only once the copy into them is known complete
  (abort, TTL or a reader's release can free a lease whose copy is still
  queued, and a later lease in those slots would be overwritten).
* :class:`ReadOnce`: DataRefs this process has already read (a direct ref
  read twice would release PyTorch's IPC reference count twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ._recent import Recent
from .wire.errors import RelayTimeoutError, StaleRefError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Host polling of an event. Most copies take microseconds to a few ms. An
# event loop's timers tick in whole milliseconds (epoll's and libuv's
# timeouts), so from a loop a timed poll under that sleeps a full millisecond:
# measured on an H200, a 1 MiB pool read that copies in ~15 µs returned after
# ~1.7 ms. So a loop first only yields between checks for POLL_SPIN_S (its
# other tasks run; it does not block), then polls on its own tick, backing off
# to bound its cost. A thread's sleep is precise: it starts at THREAD_POLL_FIRST_S.
POLL_SPIN_S = 1e-3
POLL_FIRST_S = 1e-3
THREAD_POLL_FIRST_S = 50e-6
POLL_MAX_S = 2e-3
# How long a writer's copy into its own pool may stay queued before its
# slots are given up on (kept out of use for the life of the client).
FENCE_LIMIT_S = 120.0
READ_ONCE_MEMORY = 65536


class EventLike(Protocol):
    def query(self) -> bool: ...


# -- which stream, which thread ----------------------------------------------------------


def caller_streams(
    devices: Iterable[int | None], current_stream: Callable[[int], T]
) -> tuple[T, ...]:
    """The calling thread's current stream on each CUDA device in ``devices``
    (``None`` is a CPU tensor), in device order, each once."""
    return tuple(current_stream(d) for d in sorted({d for d in devices if d is not None}))


def run_on_streams(
    streams: Sequence[Any],
    enter: Callable[[Any], contextlib.AbstractContextManager[Any]],
    fn: Callable[..., T],
    *args: Any,
) -> T:
    """``fn(*args)`` with each of ``streams`` made current in this thread."""
    if len(streams) == 1:  # the usual read (one GPU): no ExitStack on its path
        with enter(streams[0]):
            return fn(*args)
    with contextlib.ExitStack() as stack:
        for s in streams:
            stack.enter_context(enter(s))
        return fn(*args)


class DedicatedStreams:
    """One stream per device index, made by ``make(index)`` on first use."""

    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = make
        self._streams: dict[int, Any] = {}

    def get(self, index: int) -> Any:
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = self._make(index)
        return s

    def discard(self, index: int) -> None:
        """Stop using ``index``'s stream (work on it may never finish); the next get makes one."""
        self._streams.pop(index, None)

    def __len__(self) -> int:
        return len(self._streams)


def copy_in_worker(dst_is_cuda: bool, same_or_peer: bool) -> bool:
    """A read's copies go to a worker thread when they would block the caller:
    into host memory, or between GPUs without peer access (staged through
    host memory); a same-GPU or peer copy is only enqueued."""
    return not dst_is_cuda or not same_or_peer


# -- waiting ------------------------------------------------------------------------------


async def wait_event(
    event: EventLike,
    deadline: float,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return once ``event`` has completed; :class:`RelayTimeoutError` at ``deadline``.

    Polled from the event loop (``cudaEventQuery`` does not block): no
    thread is left behind in a ``synchronize`` that never returns.
    """
    spin_until = clock() + POLL_SPIN_S
    delay = POLL_FIRST_S
    while not event.query():
        now = clock()
        if now >= deadline:
            raise RelayTimeoutError(f"{what} did not complete before the deadline")
        if now < spin_until:
            await sleep(0)  # a turn of the loop, not a timer (see POLL_SPIN_S)
            continue
        await sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, POLL_MAX_S)


def wait_event_blocking(
    event: EventLike,
    deadline: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """:func:`wait_event` for a thread that may block; False at ``deadline``."""
    delay = THREAD_POLL_FIRST_S
    while not event.query():
        now = clock()
        if now >= deadline:
            return False
        sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, POLL_MAX_S)
    return True


class Quarantine:
    """Objects held until an event says the GPU work using them is done."""

    def __init__(self) -> None:
        self._held: list[tuple[EventLike, tuple[Any, ...]]] = []

    def hold(self, event: EventLike, *objs: Any) -> None:
        self.prune()
        self._held.append((event, objs))

    def prune(self) -> int:
        """Let go of what is done; returns how many entries are still held."""
        self._held = [(e, o) for e, o in self._held if not e.query()]
        return len(self._held)

    def __len__(self) -> int:
        return len(self._held)


# -- the writer's side of a pool lease -------------------------------------------------


class WriterFences:
    """The event recorded after the writer's copy into each of its pool leases.

    ``free`` hands a lease's slots back through ``release`` at once when its
    copy is known complete, otherwise once it is (a task on the running
    loop). :meth:`settle` waits, bounded, for every copy still queued: what
    a writer does before it lets its grants go.
    """

    def __init__(self) -> None:
        self.events: dict[int, EventLike] = {}
        self._deferred: dict[int, asyncio.Task[None]] = {}

    def add(self, lease_id: int, event: EventLike) -> None:
        self.events[lease_id] = event

    def complete(self, lease_id: int) -> bool:
        event = self.events.get(lease_id)
        return event is None or bool(event.query())

    def free(self, lease_id: int, release: Callable[[], None]) -> bool:
        """Release the slots of ``lease_id`` now or once its copy is done; True if now."""
        event = self.events.get(lease_id)
        if event is None or event.query():
            self.events.pop(lease_id, None)
            release()
            return True
        if lease_id in self._deferred:
            return False  # freed twice (a cancel, then the daemon's Freed): once is enough
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Not on a loop (a blocking caller's thread): that thread may wait.
            if wait_event_blocking(event, time.monotonic() + FENCE_LIMIT_S):
                self.events.pop(lease_id, None)
                release()
                return True
            log.error(
                "the copy into GPU lease %d is still queued; its slots stay out of use", lease_id
            )
            return False
        self._deferred[lease_id] = loop.create_task(self._later(lease_id, event, release))
        return False

    async def _later(self, lease_id: int, event: EventLike, release: Callable[[], None]) -> None:
        try:
            await wait_event(event, time.monotonic() + FENCE_LIMIT_S, "the writer's copy")
        except RelayTimeoutError:
            log.error(
                "the copy into GPU lease %d is still queued after %.0f s; its slots stay "
                "out of use for the life of this client",
                lease_id,
                FENCE_LIMIT_S,
            )
            return
        finally:
            self._deferred.pop(lease_id, None)
        self.events.pop(lease_id, None)
        release()

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    async def settle(self, deadline: float) -> int:
        """Wait until every recorded copy is done or ``deadline``; returns how many are not."""
        late = 0
        for lease_id, event in list(self.events.items()):
            try:
                await wait_event(event, deadline, f"the copy into GPU lease {lease_id}")
            except RelayTimeoutError:
                late += 1
        return late

    def cancel(self) -> None:
        """Drop the deferred releases (the session that owned the slots is gone)."""
        for task in self._deferred.values():
            task.cancel()
        self._deferred.clear()


# -- readers ------------------------------------------------------------------------------


class ReadOnce:
    """Keys of what this process has read, refused a second time (bounded memory)."""

    def __init__(self, memory: int = READ_ONCE_MEMORY) -> None:
        self._seen: Recent[Hashable] = Recent(memory)

    def claim(self, key: Hashable, what: str) -> None:
        if key in self._seen:
            raise StaleRefError(f"{what} was already read by this process; it is read once")
        self._seen.add(key)

    def forget(self, key: Hashable) -> None:
        """A read that failed before it took anything may be tried again."""
        self._seen.pop(key, None)
