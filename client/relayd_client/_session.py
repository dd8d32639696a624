"""The client's end of the session socket: batched notices out, events in.

Notices (reserve, publish, claim, release, …) are appended to one pending
``SessionFrame`` and written together: at once (``flush=True``, for a claim
before a long copy), at the end of the current event-loop turn (a cancel, a
report), or, for notices nothing waits on (a publish, a view's claim, a
release), up to ``linger`` seconds later with whatever else has gathered by
then. A publish may linger because the slot header, not the notice, says a
lease was sealed: the daemon reads it if the writer dies first. Writing never
waits: it is a non-blocking send into the socket buffer.

Threads other than the loop's may append notices and mark too (the blocking
client's callers), holding :attr:`SessionChannel.lock` for both. A frame due
now is written by that thread itself, straight into the socket when nothing
the loop queued is still unsent (else behind it, through the loop): handing
every send to the loop thread made it contend for the GIL with the caller's
next copy (the blocking client's 1 MiB put+get took ~70 us longer, measured).
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
from typing import Any, TypeVar

from ._bind import bind_session, map_rings
from .wire import peercred
from .wire.errors import DaemonUnavailableError, RelayError, RelayTimeoutError, error_from_code
from .wire.framing import (
    LENGTH_BYTES,
    MAX_FRAME,
    NOTICE_LINGER_MAX_BYTES,
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
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending = pb.SessionFrame()
        self._dirty = False
        self._scheduled = False  # a flush at the end of this loop turn
        self._lingering: asyncio.TimerHandle | None = None  # a later flush
        self._sent_at = -math.inf  # loop time of the last frame out
        self._lingered = self._lingered_bytes = 0
        self._task: asyncio.Task[None] | None = None
        # See connect(): the daemon's Freed to this session, this session's Releases.
        self.freed_ring: IdRing | None = None
        self.release_ring: IdRing | None = None
        # The daemon takes a Publish inside its lease's Reserve (its
        # AttachResponse.reserve_publishes): see Notices.publish.
        self.reserve_publishes = False
        self._calls: dict[int, asyncio.Future[pb.FetchResponse]] = {}
        self._keyed: dict[int, asyncio.Future[bytes]] = {}
        self._call_ids = itertools.count(1)
        self.closed = False

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
    ) -> None:
        """Connect and bind; with ``trusted``, only to a daemon running as one of those uids.

        With ``rings``, ask for the daemon's Freed and Release rings
        (:mod:`relayd_client.wire.rings`); :attr:`freed_ring` and
        :attr:`release_ring` are then the rings, or None where the daemon sent none.
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
            )
            try:
                frame, fds = await asyncio.wait_for(bind_session(loop, sock, bind), timeout)
            except TimeoutError:
                raise DaemonUnavailableError("daemon did not confirm the session in time") from None
            except (ConnectionError, OSError) as exc:
                raise DaemonUnavailableError(f"daemon closed the session: {exc}") from None
            self.freed_ring, self.release_ring = map_rings(fds)
            self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            self._drop_ring()
            raise
        with self.lock:
            self._on_frame(frame)
        self._task = loop.create_task(self._read_loop(), name="relayd-session-reader")

    # -- out ------------------------------------------------------------------------

    @property
    def pending(self) -> pb.SessionFrame:
        """The frame being collected; callers append notices, then call :meth:`mark`."""
        return self._pending

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
            self._lingered += 1
            self._lingered_bytes += holds
            if (
                self._lingered >= LINGER_MAX_NOTICES
                or self._lingered_bytes >= NOTICE_LINGER_MAX_BYTES
                or loop.time() - self._sent_at >= linger
            ):
                self._soon()
            elif self._lingering is None:
                self._lingering = loop.call_later(linger, self.flush)
        else:
            self._soon()

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
            now = flush or linger <= 0.0
            if not now:
                self._lingered += 1
                self._lingered_bytes += holds
                now = (
                    self._lingered >= LINGER_MAX_NOTICES
                    or self._lingered_bytes >= NOTICE_LINGER_MAX_BYTES
                    or loop.time() - self._sent_at >= linger
                )
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
        writer = self._writer
        if writer is None:
            return
        if self._queued == 0 and writer.transport.get_write_buffer_size() == 0:
            raw = self._raw
            if raw is None:
                # A second descriptor of the same socket (non-blocking, like the
                # loop's): the loop's transport object is not for other threads.
                raw = self._raw = socket.socket(
                    fileno=os.dup(writer.get_extra_info("socket").fileno())
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
                self._lingering = asyncio.get_running_loop().call_later(linger, self.flush)

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
        if self._writer is None or self.closed:
            return
        try:
            self._writer.write(data)
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
        if self.closed or self._writer is None:
            raise DaemonUnavailableError("the session with the daemon is closed")
        call_id = next(self._call_ids)
        if answer is None:
            answer = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        self._pending.fetch.append(
            pb.FetchCall(call_id=call_id, data_ref=data_ref, timeout_seconds=timeout)
        )
        self.mark(flush=True)
        try:
            return await _answered(answer, timeout, "a cross-node read")
        finally:
            self._calls.pop(call_id, None)

    async def keyed(self, call: KeyedCall, timeout: float) -> bytes:
        """A keyed put, take or discard: its answer's DataRef bytes (often empty).

        The call goes at once with whatever notices are pending: a keyed put's
        Publish must reach the daemon with it, or before.
        """
        if self.closed or self._writer is None:
            raise DaemonUnavailableError("the session with the daemon is closed")
        call.call_id = call_id = next(self._call_ids)
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._keyed[call_id] = answer
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
        finally:
            self._keyed.pop(call_id, None)

    def _answer_keyed(self, frame: pb.SessionFrame) -> None:
        for result in frame.keyed_result:
            answer = self._keyed.get(result.call_id)
            if answer is None or answer.done():
                continue  # its caller gave up
            if result.code == pb.ERROR_CODE_UNSPECIFIED:
                answer.set_result(result.data_ref)
            else:
                answer.set_exception(error_from_code(result.code, result.message))

    def _answer(self, frame: pb.SessionFrame) -> None:
        for result in frame.fetched:
            answer = self._calls.get(result.call_id)
            if answer is None or answer.done():
                continue  # its caller gave up
            if result.HasField("response"):
                answer.set_result(result.response)
            else:
                answer.set_exception(error_from_code(result.code, result.message))

    # -- in -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                n = frame_length(await self._reader.readexactly(LENGTH_BYTES))
                if n > MAX_FRAME:
                    raise DaemonUnavailableError(f"daemon sent a {n}-byte frame")
                frame = decode_frame(await self._reader.readexactly(n))
                if frame.fetched:
                    self._answer(frame)
                if frame.keyed_result:
                    self._answer_keyed(frame)
                with self.lock:
                    self._on_frame(frame)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            raise
        except RelayError as exc:
            log.warning("session protocol error: %s", exc)
        except Exception:
            log.exception("session reader failed")
        finally:
            answers: list[asyncio.Future[Any]] = [*self._calls.values(), *self._keyed.values()]
            for answer in answers:
                if not answer.done():
                    answer.set_exception(
                        DaemonUnavailableError("the session closed before the daemon answered")
                    )
            if not self.closed:
                self.closed = True
                self._on_lost()

    async def close(self) -> None:
        hang_up = self._writer is not None and not self.closed
        if hang_up:
            self.flush()
        self.closed = True
        if hang_up and self._task is not None:
            await self._hang_up()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with self.lock:
            raw, self._raw = self._raw, None
            self._drop_ring()
        if raw is not None:
            raw.close()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer.wait_closed(), 2)
        self._writer = None

    def _drop_ring(self) -> None:
        rings = (self.freed_ring, self.release_ring)
        self.freed_ring = self.release_ring = None
        for ring in rings:
            if ring is not None:
                ring.close()

    async def _hang_up(self) -> None:
        """Half-close, then wait (bounded) until the daemon has read all and hung up.

        Closing outright races the daemon's own writes to this session (a
        Freed, a registry event): a write that meets a closed socket makes it
        drop the frames it has not read yet, such as the last reports.
        """
        assert self._writer is not None and self._task is not None
        try:
            self._writer.write_eof()
        except (OSError, RuntimeError):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_GRACE)


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
