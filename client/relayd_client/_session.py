"""The client's end of the session socket: batched notices out, events in.

Notices (reserve, publish, claim, release, …) are appended to one pending
``SessionFrame`` and written together: at once (``flush=True``, for a claim
before a long copy), at the end of the current event-loop turn (a cancel, a
report), or, for notices nothing waits on (a publish, a view's claim, a
release), up to ``linger`` seconds later with whatever else has gathered by
then. A publish may linger because the slot header, not the notice, says a
lease was sealed: the daemon reads it if the writer dies first. Writing never
waits: it is a non-blocking send into the socket buffer.

Frames in are handled in the protocol's ``data_received``, in the loop turn
that reads them: an answer wakes its caller one turn sooner than through a
reader task (a daemon's frame to a waiting get, measured: ~8 us of ~45).

Threads other than the loop's may append notices and mark too (the blocking
client's callers), holding :attr:`SessionChannel.lock` for both. A frame due
now is written by that thread itself, straight into the socket when nothing
the loop queued is still unsent (else behind it, through the loop): handing
every send to the loop thread made it contend for the GIL with the caller's
next copy (the blocking client's 1 MiB put+get took ~70 us longer, measured).

While a call waits for its answer here, :class:`~relayd_client._liveness.Liveness`
probes a daemon that has gone silent, and one that does not answer is taken
for gone (:meth:`SessionChannel._unanswered`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ._apart import AnnouncementSocket
from ._bind import bind_session, map_rings
from ._liveness import Liveness
from .wire import peercred
from .wire.errors import DaemonUnavailableError, RelayError, RelayTimeoutError, error_from_code
from .wire.framing import (
    LENGTH_BYTES,
    MAX_FRAME,
    NOTICE_LINGER_MAX_BYTES,
    NOTICE_LINGER_S,
    decode_frame,
    encode_frame,
    frame_length,
)
from .wire.proto import relay_pb2 as pb
from .wire.rings import IdRing

T = TypeVar("T")
log = logging.getLogger(__name__)

# A lingering frame goes out early once it holds this many notices, so that
# frames stay far below MAX_FRAME at any rate.
LINGER_MAX_NOTICES = 512
# A fetch's answer may trail its own deadline by the daemon's clean-up.
_ANSWER_GRACE = 1.0
# How long close() waits for the daemon to read the last frame and hang up.
_CLOSE_GRACE = 1.0


KeyedCall = pb.KeyedPut | pb.KeyedTake | pb.DiscardCall


class SessionChannel:
    def __init__(
        self,
        on_frame: Callable[[pb.SessionFrame], None],
        on_lost: Callable[[], None],
        lock: threading.RLock | None = None,
    ) -> None:
        # Guards the pending frame against callers on other threads; the
        # frame handler runs under it too (it frees leases those callers cut).
        self.lock = lock if lock is not None else threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arming = False  # a caller thread asked the loop for a linger timer
        self._raw: socket.socket | None = None  # the session socket, for sends off the loop
        self._queued = 0  # sends handed to the loop and not yet written
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._ended: asyncio.Future[None] | None = None  # done once the connection is gone
        self._pending = pb.SessionFrame()
        self._dirty = False
        self._scheduled = False  # a flush at the end of this loop turn
        self._lingering: asyncio.TimerHandle | None = None  # a later flush
        self._linger_s = 0.0  # what it was armed for
        self._sent_at = -math.inf  # loop time of the last frame out
        self._lingered = self._lingered_bytes = 0
        # See connect(): the daemon's Freed to this session, this session's Releases.
        self.freed_ring: IdRing | None = None
        self.release_ring: IdRing | None = None
        # See connect(): where the daemon tells this session's pushes, if apart.
        self.apart: AnnouncementSocket | None = None
        # The daemon takes a Publish inside its lease's Reserve (its
        # AttachResponse.reserve_publishes): see Notices.publish.
        self.reserve_publishes = False
        # It takes a Reserve over a lease its reader marked read (its
        # AttachResponse.reserve_over_read): large leases' notices linger too.
        self.reserve_over_read = False
        self._calls: dict[int, asyncio.Future[pb.FetchResponse]] = {}
        self._keyed: dict[int, asyncio.Future[bytes]] = {}
        # Calls whose caller gave up before the answer came. The daemon does not
        # know: a fetch's answer is a lease landed for this session, a take's a
        # key it consumed; unread, each stays held until its TTL, so a late
        # answer is given back (a fetch's lease released, a take's to ``late``).
        self._given_up: set[int] = set()
        self._late_keyed: dict[int, Callable[[bytes], None]] = {}
        self._call_ids = itertools.count(1)
        self.closed = False
        self.liveness = Liveness(
            lambda: bool(self._calls or self._keyed), self._send_probe, self._unanswered
        )

    async def connect(
        self,
        path: str,
        session_id: str,
        token: bytes,
        timeout: float,
        shm_nonce: bytes = b"",
        *,
        trusted: frozenset[int] | None = None,
        rings: bool = False,
        announcements: bool = False,
    ) -> None:
        """Connect and bind; with ``trusted``, only to a daemon running as one of those uids.

        With ``rings``, ask for the daemon's Freed and Release rings
        (:mod:`relayd_client.wire.rings`); :attr:`freed_ring` and
        :attr:`release_ring` are then the rings, or None where the daemon sent none.
        With ``announcements`` too, for its announcement socket (:mod:`._apart`):
        :attr:`apart`, or None where the daemon sent none.
        """
        loop = self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            try:
                await asyncio.wait_for(loop.sock_connect(sock, path), timeout)
            except PermissionError as exc:
                raise peercred.permission_problem(path, exc) from None
            except (OSError, TimeoutError) as exc:
                raise DaemonUnavailableError(f"cannot open session socket {path}: {exc}") from None
            if trusted is not None:
                peercred.check_peer(sock, path, trusted)
            bind = pb.Bind(
                session_id=session_id,
                session_token=token,
                shm_nonce=shm_nonce,
                freed_ring=rings,
                release_ring=rings,
                announcements=rings and announcements,
            )
            try:
                frame, fds = await asyncio.wait_for(bind_session(loop, sock, bind), timeout)
            except TimeoutError:
                raise DaemonUnavailableError("daemon did not confirm the session in time") from None
            except (ConnectionError, OSError) as exc:
                raise DaemonUnavailableError(f"daemon closed the session: {exc}") from None
            if rings and announcements and len(fds) == 3:
                self.apart = AnnouncementSocket.adopt(fds.pop())
            self.freed_ring, self.release_ring = map_rings(fds)
            self._ended = loop.create_future()
            transport, _ = await loop.create_unix_connection(lambda: _Frames(self), sock=sock)
            self._transport = transport
            if any(ev.answers_probes for ev in frame.event if ev.kind == pb.EVENT_KIND_BOUND):
                self.liveness.enable(loop)
        except BaseException:
            sock.close()
            self._drop_ring()
            raise
        with self.lock:
            self._on_frame(frame)

    # -- out ------------------------------------------------------------------------

    @property
    def pending(self) -> pb.SessionFrame:
        """The frame being collected; callers append notices, then call :meth:`mark`."""
        return self._pending

    def on_loop(self) -> bool:
        """Whether the caller runs on this session's loop (not a blocking client's caller)."""
        return self._loop is not None and asyncio._get_running_loop() is self._loop

    def mark(self, *, flush: bool = False, linger: float = 0.0, holds: int = 0) -> None:
        """Send the pending frame: now, at the end of this turn, or within ``linger`` s.

        Lingering batches notices nobody waits for: on two busy cores every
        frame wakes the daemon onto a core a writer or reader needs, and a
        copying reader's release cost it ~40 us of one-way latency (measured).
        Only a busy channel lingers: a notice that comes ``linger`` s or more
        after the last frame goes at the end of this turn, since nothing would
        join it and the timer itself is one more wakeup (paced streams got a
        ~20% higher p50 from it, measured). A sooner mark takes the lingering
        notices along.
        """
        if self._loop is not None and asyncio._get_running_loop() is not self._loop:
            self._mark_from_thread(flush, linger, holds)
            return
        self._dirty = True
        if flush:
            self.flush()
        elif self._scheduled:
            pass
        elif linger > 0.0:
            loop = asyncio.get_running_loop()
            if self._linger_ends(loop, linger, holds):
                self._soon()
            elif self._lingering is None:
                self._arm_linger(loop, linger)
        else:
            self._soon()

    def _linger_ends(self, loop: asyncio.AbstractEventLoop, linger: float, holds: int) -> bool:
        """Count one more lingering notice holding ``holds`` bytes; whether the
        frame must go now instead of lingering on. (Nor does a notice of a lease
        of ``PROMPT_NOTICE_BYTES`` or more, to an older daemon: see ``Notices``.)"""
        self._lingered += 1
        self._lingered_bytes += holds
        return (
            self._lingered >= LINGER_MAX_NOTICES
            or self._lingered_bytes >= NOTICE_LINGER_MAX_BYTES
            or loop.time() - self._sent_at >= linger
        )

    def taken_back(self, frame: pb.SessionFrame, nbytes: int) -> None:
        """A writer took back, on its reader's read mark, the ``nbytes`` a
        lingering notice in ``frame`` counted as held: they are no longer held
        back, so they no longer count toward ``NOTICE_LINGER_MAX_BYTES`` (if the
        frame still waits). That cap bounds what readers that do not mark hold
        back; counting marked leases too, a stop-and-wait writer's frame went
        every 16 transfers at 4 MiB and every 4 at 16 MiB, each a daemon
        wake-up of ~400 us cache-cold, where the linger alone sends it every
        25 ms."""
        with self.lock:
            if frame is self._pending:
                self._lingered_bytes = max(self._lingered_bytes - nbytes, 0)

    def _mark_from_thread(self, flush: bool, linger: float, holds: int) -> None:
        """:meth:`mark` for a caller off the loop (it holds :attr:`lock`).

        Same batching. A frame due now is written by the caller itself
        (:meth:`_send_from_thread`): handed to the loop instead, its send
        contended for the GIL with the caller's next copy. A lingering one
        costs the caller nothing once the loop has armed its timer.
        """
        loop = self._loop
        with self.lock:
            self._dirty = True
            if loop is None or self._scheduled or self.closed:
                return  # not connected yet, or a flush is on its way
            now = flush or linger <= 0.0 or self._linger_ends(loop, linger, holds)
            try:
                if now:
                    self._send_from_thread(loop)
                elif self._lingering is None and not self._arming:
                    self._arming = True
                    loop.call_soon_threadsafe(self._arm, linger)
            except RuntimeError:  # the loop is closed: so is the session
                pass

    def _send_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write the pending frame from a caller thread (it holds :attr:`lock`)."""
        self._lingered = self._lingered_bytes = 0
        frame, self._pending, self._dirty = self._pending, pb.SessionFrame(), False
        self._sent_at = loop.time()
        data = encode_frame(frame)
        transport = self._transport
        if transport is None:
            return
        if self._queued == 0 and transport.get_write_buffer_size() == 0:
            raw = self._raw
            if raw is None:
                # A second descriptor of the same socket (non-blocking, like the
                # loop's): the loop's transport object is not for other threads.
                raw = self._raw = socket.socket(
                    fileno=os.dup(transport.get_extra_info("socket").fileno())
                )
                raw.setblocking(False)
            try:
                sent = raw.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:  # the reader sees the session end
                log.debug("session write failed: %s", exc)
                return
            if sent == len(data):
                return
            data = data[sent:]
        # Behind what is queued: the rest goes out in order, through the loop.
        self._queued += 1
        loop.call_soon_threadsafe(self._write_queued, data)

    def _write_queued(self, data: bytes) -> None:
        with self.lock:
            self._queued -= 1
            self._write_bytes(data)

    def _arm(self, linger: float) -> None:
        with self.lock:
            self._arming = False
            if self._dirty and not self._scheduled and self._lingering is None:
                self._arm_linger(asyncio.get_running_loop(), linger)

    def _arm_linger(self, loop: asyncio.AbstractEventLoop, linger: float) -> None:
        self._linger_s = linger
        self._lingering = loop.call_later(linger, self._linger_due)

    def _linger_due(self) -> None:
        """The linger timer. If a caller thread sent the frame meanwhile
        (:meth:`_send_from_thread`, which cannot cancel the loop's timer), what
        came since lingers from that send: this timer sent it within a few ms
        of it, a frame of its own and one more wake-up of the daemon."""
        with self.lock:
            self._lingering = None
            loop = asyncio.get_running_loop()
            left = self._sent_at + self._linger_s - loop.time()
            if left > 0.0 and self._dirty and not self._scheduled:
                self._lingering = loop.call_later(left, self._linger_due)
                return
        self.flush()

    def _soon(self) -> None:
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        with self.lock:
            self._scheduled = False
            self._lingered = self._lingered_bytes = 0
            if self._lingering is not None:
                self._lingering.cancel()
                self._lingering = None
            if not self._dirty:
                return
            frame, self._pending, self._dirty = self._pending, pb.SessionFrame(), False
            self._sent_at = asyncio.get_running_loop().time()
            self._write(frame)  # under the lock: no caller thread's frame overtakes it

    def _write(self, frame: pb.SessionFrame) -> None:
        data = encode_frame(frame)
        with self.lock:
            if self._queued:  # a caller thread's frame waits on the loop: after it
                self._queued += 1
                asyncio.get_running_loop().call_soon(self._write_queued, data)
            else:
                self._write_bytes(data)

    def _write_bytes(self, data: bytes) -> None:
        if self._transport is None or self.closed:
            return
        try:
            self._transport.write(data)
        except (ConnectionError, RuntimeError) as exc:
            log.debug("session write failed: %s", exc)

    async def fetch(
        self,
        data_ref: bytes,
        timeout: float,
        answer: asyncio.Future[pb.FetchResponse] | None = None,
    ) -> pb.FetchResponse:
        """``Relay.Fetch`` on this socket: the daemon pulls a foreign DataRef.

        ``answer``: the caller's future for the answer, which it may resolve
        itself with what the daemon would answer, if it learns that first; the
        daemon's answer then finds no call and is dropped.
        """
        if self.closed or self._transport is None:
            raise DaemonUnavailableError("the session with the daemon is closed")
        call_id = next(self._call_ids)
        if answer is None:
            answer = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        self.liveness.call_out()
        # Under the lock, as every notice: a blocking client's caller may be
        # swapping out the pending frame to send it from its own thread.
        with self.lock:
            self._pending.fetch.append(
                pb.FetchCall(call_id=call_id, data_ref=data_ref, timeout_seconds=timeout)
            )
            self.mark(flush=True)
        try:
            return await _answered(answer, timeout, "a cross-node read")
        except BaseException:
            got = _outcome(answer)
            if got is None:
                self._given_up.add(call_id)
            elif not isinstance(got, BaseException):  # answered, but nobody resumed to read it
                self._release_fetched(got)
            raise
        finally:
            self._calls.pop(call_id, None)

    async def keyed(
        self, call: KeyedCall, timeout: float, late: Callable[[bytes], None] | None = None
    ) -> bytes:
        """A keyed put, take or discard: its answer's DataRef bytes (often empty).

        The call goes at once with whatever notices are pending: a keyed put's
        Publish must reach the daemon with it, or before. ``late`` gets a
        non-empty answer that comes after the caller gave up (timed out, or
        was cancelled), on the loop.
        """
        if self.closed or self._transport is None:
            raise DaemonUnavailableError("the session with the daemon is closed")
        call.call_id = call_id = next(self._call_ids)
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._keyed[call_id] = answer
        self.liveness.call_out()
        with self.lock:
            if isinstance(call, pb.KeyedPut):
                self._pending.keyed_put.append(call)
            elif isinstance(call, pb.KeyedTake):
                self._pending.keyed_take.append(call)
            else:
                self._pending.discard.append(call)
            self.mark(flush=True)
        try:
            return await _answered(answer, timeout, "")
        except BaseException:
            got = _outcome(answer)
            if late is not None and got is None:
                self._late_keyed[call_id] = late
            elif late is not None and isinstance(got, bytes) and got:  # nobody resumed to read it
                late(got)
            raise
        finally:
            self._keyed.pop(call_id, None)

    def _answer_keyed(self, frame: pb.SessionFrame) -> None:
        for result in frame.keyed_result:
            answer = self._keyed.get(result.call_id)
            if answer is None or answer.done():
                late = self._late_keyed.pop(result.call_id, None)  # its caller gave up
                if (
                    late is not None
                    and result.code == pb.ERROR_CODE_UNSPECIFIED
                    and result.data_ref
                ):
                    late(result.data_ref)
                continue
            if result.code == pb.ERROR_CODE_UNSPECIFIED:
                answer.set_result(result.data_ref)
            else:
                answer.set_exception(error_from_code(result.code, result.message))

    def _answer(self, frame: pb.SessionFrame) -> None:
        for result in frame.fetched:
            answer = self._calls.get(result.call_id)
            if answer is None or answer.done():
                # Its caller gave up, or an announcement answered it first: that
                # get reads (and releases) the same lease, so only the former's goes.
                if result.call_id in self._given_up:
                    self._given_up.discard(result.call_id)
                    if result.HasField("response"):
                        self._release_fetched(result.response)
                continue
            if result.HasField("response"):
                answer.set_result(result.response)
            else:
                answer.set_exception(error_from_code(result.code, result.message))

    def _release_fetched(self, resp: pb.FetchResponse) -> None:
        """Release a fetched lease nobody will read, as a read of it would (a
        lingering frame, not the ring: see Notices.release)."""
        lease = resp.lease
        with self.lock:
            self._pending.release.add(lease_id=lease.lease_id, generation=lease.generation)
            self.mark(linger=NOTICE_LINGER_S, holds=lease.length)

    # -- in -------------------------------------------------------------------------

    def _got(self, frame: pb.SessionFrame) -> None:
        """One frame from the daemon (see :class:`_Frames`)."""
        self.liveness.heard()
        if frame.fetched:
            self._answer(frame)
        if frame.keyed_result:
            self._answer_keyed(frame)
        with self.lock:
            self._on_frame(frame)

    def _send_probe(self) -> None:
        with self.lock:
            self._pending.probe = True
            self.mark(flush=True)

    def _unanswered(self, why: str) -> None:
        """The daemon answered no probe: fail the waiting calls with ``why`` and end
        the connection, as if the daemon had hung up (the client re-attaches).

        Kept open instead, the connection would make every later call wait for
        the same silence, and the answers of the calls failed here could still
        come, unheard of, after the daemon resumes; ended, the daemon closes the
        session when it resumes, as after any lost connection.
        """
        log.warning("%s; dropping the session", why)
        self._fail_calls(why)
        if self._transport is not None:
            self._transport.abort()  # not close(): it would wait to send what the daemon won't read

    def _fail_calls(self, why: str) -> None:
        answers: list[asyncio.Future[Any]] = [*self._calls.values(), *self._keyed.values()]
        # No answer comes now to give back.
        self._given_up.clear()
        self._late_keyed.clear()
        for answer in answers:
            if not answer.done():
                answer.set_exception(DaemonUnavailableError(why))

    def _lost(self) -> None:
        """The connection is gone: calls in flight fail, and the client hears of it once."""
        self.liveness.stop()
        self._fail_calls("the session closed before the daemon answered")
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        if not self.closed:
            self.closed = True
            self._on_lost()

    async def close(self) -> None:
        transport = self._transport
        hang_up = transport is not None and not self.closed
        if hang_up:
            self.flush()
        self.closed = True
        self.liveness.stop()
        if hang_up:
            await self._hang_up()
        with self.lock:
            raw, self._raw = self._raw, None
            self._drop_ring()
        if raw is not None:
            raw.close()
        if transport is not None:
            transport.close()
            if self._ended is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._ended), _CLOSE_GRACE)
        self._transport = None

    def _drop_ring(self) -> None:
        rings = (self.freed_ring, self.release_ring)
        self.freed_ring = self.release_ring = None
        for ring in rings:
            if ring is not None:
                ring.close()
        apart, self.apart = self.apart, None
        if apart is not None:
            apart.close()

    async def _hang_up(self) -> None:
        """Half-close, then wait (bounded) until the daemon has read all and hung up.

        Closing outright races the daemon's own writes to this session (a
        Freed, a registry event): a write that meets a closed socket makes it
        drop the frames it has not read yet, such as the last reports.
        """
        assert self._transport is not None and self._ended is not None
        try:
            self._transport.write_eof()
        except (OSError, RuntimeError):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._ended), _CLOSE_GRACE)


class _Frames(asyncio.Protocol):
    """The session socket's reading side: each whole frame goes to the channel as
    it is read. A frame too large, one that does not parse, or a handler that
    raises ends the session; the channel hears of the end in :meth:`connection_lost`.
    """

    def __init__(self, channel: SessionChannel) -> None:
        self.channel = channel
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # ended by an earlier frame of this read
        buf = self.buf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= LENGTH_BYTES:
                n = frame_length(buf, pos)
                if n > MAX_FRAME:
                    raise DaemonUnavailableError(f"daemon sent a {n}-byte frame")
                start = pos + LENGTH_BYTES
                if len(buf) - start < n:
                    break
                frame = decode_frame(buf[start : start + n])
                pos = start + n
                self.channel._got(frame)
        except RelayError as exc:
            log.warning("session protocol error: %s", exc)
            self._end()
        except Exception:
            log.exception("session reader failed")
            self._end()
        else:
            del buf[:pos]

    def _end(self) -> None:
        transport, self.transport = self.transport, None
        self.buf = bytearray()
        if transport is not None:
            transport.close()

    def eof_received(self) -> bool:
        return False  # the daemon hung up: close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.channel._lost()


def _outcome(answer: asyncio.Future[T]) -> T | BaseException | None:
    """What ``answer`` was resolved with (a result or an error); None: nothing
    (its caller stopped waiting first, which cancels it)."""
    if not answer.done() or answer.cancelled():
        return None
    return answer.exception() or answer.result()


async def _answered(answer: asyncio.Future[T], timeout: float, what: str) -> T:
    """The daemon's answer to a call, within the call's timeout and a grace."""
    budget = timeout + _ANSWER_GRACE
    try:
        # Not wait_for: its own waiter costs the answer one more loop turn.
        async with asyncio.timeout(budget):
            return await answer
    except TimeoutError:
        about = f" {what}" if what else ""
        raise RelayTimeoutError(f"the daemon did not answer{about} within {budget:.3g}s") from None
