"""The session socket: one connection per client session, framed protobuf both ways.

Frame = 4-byte little-endian length + one ``relayd.v1.SessionFrame``. The
first frame must bind the connection to a session created by ``Attach``
(session id + token). The kernel tells us who is on the other end
(SO_PEERCRED), which gRPC cannot, and EOF tells us the client is gone,
however it died.

A frame with ``probe`` set is answered at once (``probe_answer``): a client
whose call waits here asks so when the daemon has been silent for a while,
and takes a daemon that does not answer for frozen
(:mod:`relayd_client.wire.keepalive`). The BOUND event says the daemon answers.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from relayd_client.wire.errors import (
    InternalError,
    InvalidArgumentError,
    RelayError,
    ResourceExhaustedError,
)
from relayd_client.wire.framing import (
    LENGTH_BYTES,
    MAX_FRAME,
    decode_frame,
    encode_frame,
    frame_length,
)
from relayd_client.wire.peercred import peer_credentials
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import IdRing
from relayd_client.wire.transport import Transport

from ..edges import log_trace
from ..pools.leases import LeaseManager
from ..pools.sessions import BIND_DEADLINE, Session
from .admission import Admission, Roles, peer_groups
from .fetch import Answer
from .frames import frame_sink
from .limits import UidLimits

if TYPE_CHECKING:
    from .keyed import KeyedCalls

log = logging.getLogger(__name__)

# Until a connection is bound, nothing but a Bind frame (~100 bytes) is due:
# a larger length prefix closes it at once instead of pinning a buffer.
UNBOUND_MAX_FRAME = 4096
# Cross-node reads one session may have waiting; more are refused. The pulls
# themselves are bounded by the peer credits; this only bounds what a session
# can make the daemon hold (a task and a DataRef each).
MAX_FETCH_CALLS = 4096
# Keyed puts, takes (a waiting get is one) and discards one session may have
# in flight; more are refused, as for fetches.
MAX_KEYED_CALLS = 4096
# Frame bytes written to one connection that its client has not read yet. Past
# this, the connection is dropped: every call and probe is answered, so a client
# that sends them and reads nothing would make the daemon hold its answers
# without end (one 4 MiB frame of fetch calls answers with ~40 MiB). A client
# that reads falls nowhere near it: what the daemon sends is small (Freed,
# events, answers naming leases), and most of it goes by the rings.
MAX_UNREAD = MAX_FRAME
# The SessionFrame fields a client sends, as keys of ``ListFields()``.
_FIELD = pb.SessionFrame.DESCRIPTOR.fields_by_name
_RESERVE, _PUBLISH, _CLAIM, _RELEASE, _CANCEL, _RETURN_GRANT = (
    _FIELD[n] for n in ("reserve", "publish", "claim", "release", "cancel", "return_grant")
)
_REPORT, _LATENCY, _FETCH, _KEYED_PUT, _KEYED_TAKE, _DISCARD = (
    _FIELD[n] for n in ("report", "latency", "fetch", "keyed_put", "keyed_take", "discard")
)
_PROBE = _FIELD["probe"]
_KEYED_CALLS = ((_KEYED_PUT, "put"), (_KEYED_TAKE, "take"), (_DISCARD, "discard"))
_REFUSAL_CODES = {
    "uid": pb.ERROR_CODE_PERMISSION_DENIED,
    "stage_owner": pb.ERROR_CODE_PERMISSION_DENIED,
    "limit": pb.ERROR_CODE_RESOURCE_EXHAUSTED,
    "bind_timeout": pb.ERROR_CODE_TIMEOUT,
}


@dataclasses.dataclass(frozen=True)
class SessionHooks:
    """What a session connection tells the rest of the daemon, and what it asks of it."""

    refused: Callable[[str], None] = lambda reason: None
    """A connection was refused, for ``reason`` (a metric label)."""
    report: Callable[[Session, pb.TransferReport], None] = lambda session, rep: None
    """A client's batch of transfers the daemon never saw; the callee validates it."""
    latency: Callable[[Session, pb.EdgeLatencyReport], None] = lambda session, rep: None
    """A client's latency counts for one edge; the callee validates them."""
    bound: Callable[[Session, bytes, int], tuple[str, int]] | None = None
    """Place a session once bound (arena nonce, pid): its data path and the registry
    version, which go back in the BOUND event."""
    closed: Callable[[str], None] = lambda session_id: None
    """Forget a session's placement when its connection ends."""
    ref: Callable[[int], None] = lambda nbytes: None
    """A forwarded tensor reference of this many bytes was published."""
    fetch: Callable[[Session, bytes, float], Answer] | None = None
    """A cross-node read (DataRef bytes, the timeout asked for): its answer now, or
    the work that waits for it; None: not served."""


class SessionProtocol(asyncio.Protocol):
    def __init__(
        self,
        manager: LeaseManager,
        admission: Admission,
        hooks: SessionHooks,
        *,
        limits: UidLimits | None = None,
        bind_deadline: float = BIND_DEADLINE,
        keyed: KeyedCalls | None = None,
        roles: Roles | None = None,
    ) -> None:
        self.manager = manager
        self.admission = admission
        self.hooks = hooks
        self._fetches: dict[int, asyncio.Task[None]] = {}
        self.keyed = keyed
        self._keyed: dict[int, asyncio.Task[None]] = {}
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.creds = (0, -1, -1)
        self._buf = bytearray()
        self.limits = limits
        self._counted_uid: int | None = None  # the uid whose share this connection holds
        self.bind_deadline = bind_deadline
        self._bind_timer: asyncio.TimerHandle | None = None
        # Shared by every connection: who may operate, who is the CLI.
        self.roles = roles if roles is not None else Roles()
        self.groups: frozenset[int] = frozenset()
        self._stopped = False
        # This end of the session's announcement socket (Bind.announcements).
        self.apart: socket.socket | None = None

    def stop(self) -> None:
        """The daemon stops: end the connection now, or as soon as it is made (the
        loop makes the protocol of an accepted connection a step before that)."""
        self._stopped = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        made = cast(asyncio.Transport, transport)
        if self._stopped:
            made.abort()
            return
        self.transport = made
        sock = transport.get_extra_info("socket")
        try:
            self.creds = peer_credentials(sock)
        except OSError:
            self._refuse("no_credentials", "cannot read peer credentials")
            return
        pid, uid, gid = self.creds
        self.groups = peer_groups(sock, pid)
        if not self.admission.admits(uid, gid, self.groups):
            self._refuse(
                "uid", f"pid {pid} uid {uid} gid {gid} is not allowed (--allow-uid/--allow-gid)"
            )
            return
        if self.limits is not None:
            if not self.limits.open(uid):
                self._refuse(
                    "limit",
                    f"uid {uid} already holds {self.limits.per_uid} session connections "
                    "(--max-uid-sessions)",
                )
                return
            self._counted_uid = uid
        # Bound or gone by the deadline: a connection that never binds holds a
        # descriptor and a place in its uid's share for nothing.
        self._bind_timer = asyncio.get_running_loop().call_later(
            self.bind_deadline, self._bind_expired
        )

    def _bind_expired(self) -> None:
        self._bind_timer = None
        if self.session is None and self.transport is not None:
            self._refuse("bind_timeout", f"no session bound within {self.bind_deadline:g}s")

    def data_received(self, data: bytes) -> None:
        self._buf += data
        buf = self._buf
        pos = 0
        self.manager.count_later()  # the transfers of these frames, counted once
        try:
            while len(buf) - pos >= LENGTH_BYTES:
                n = frame_length(buf, pos)
                limit = MAX_FRAME if self.session is not None else UNBOUND_MAX_FRAME
                if n > limit:
                    self._refuse(
                        "protocol",
                        f"frame of {n} bytes exceeds {limit}"
                        + ("" if self.session is not None else " before a session is bound"),
                    )
                    return
                start = pos + LENGTH_BYTES
                if len(buf) - start < n:
                    break
                frame = decode_frame(buf[start : start + n])
                pos = start + n
                self._handle(frame)
                if self.transport is None:
                    return
        except RelayError as err:  # a notice that would corrupt the lease table
            self._refuse("violation", str(err), int(err.code))
            return
        except Exception as exc:  # a malformed frame (or a bug) ends only this session
            log.exception("session frame failed", extra={"pid": self.creds[0]})
            self._refuse("protocol", f"bad frame: {type(exc).__name__}: {exc}")
            return
        finally:
            del buf[:pos]
            self._count()
        self._take_releases()
        self._flush()

    def _count(self) -> None:
        try:
            self.manager.count_now()
        except Exception:  # counting is the daemon's own: log, never end the loop
            log.exception("counting transfers failed")

    def _take_releases(self) -> None:
        """Readers' Release rings, now that the daemon is awake (and its frame's
        Publishes are in): what they free goes out with this turn's Freed."""
        try:
            self.manager.releases.take_all()
            self.manager.releases.schedule(restart=True)
        except Exception:  # another session's ring must not end this one: log it
            log.exception("taking Release rings failed")

    def _flush(self) -> None:
        try:
            self.manager.flush()
        except Exception:  # Freed notices are owed to others: log, never end the loop
            log.exception("sending Freed notices failed")

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._close_apart()
        self._buf = bytearray()  # an unfinished frame must not outlive its connection
        if self._bind_timer is not None:
            self._bind_timer.cancel()
            self._bind_timer = None
        if self._counted_uid is not None and self.limits is not None:
            self.limits.close(self._counted_uid)
            self._counted_uid = None
        # Nobody is left to read the answers; each pull's own clean-up frees its run.
        for task in [*self._fetches.values(), *self._keyed.values()]:
            task.cancel()
        self._fetches.clear()
        self._keyed.clear()
        if self.session is not None:
            self.roles.forget(self.session.id)
            log.info("session closed", extra={"session_id": self.session.id, "pid": self.creds[0]})
            try:
                self.manager.close_session(self.session.id)
            except Exception:  # reclaiming one session must not take the daemon down
                log.exception("reclaiming session failed", extra={"session_id": self.session.id})
            self._flush()
            self.hooks.closed(self.session.id)
            self.session = None

    # -- frames ---------------------------------------------------------------------

    def send(self, frame: pb.SessionFrame) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(encode_frame(frame))
            unread = transport.get_write_buffer_size()
            if unread > MAX_UNREAD:
                # Unsent frames and all: the client reads none (its session closes as
                # on any hang-up).
                self._refuse("unread", f"{unread} bytes of frames unread", tell=False)

    def send_apart(self, frame: pb.SessionFrame) -> bool:
        """Tell ``frame`` (a push's) on the announcement socket; False: it did not
        go (none, full, or its client closed it), so it goes on the session socket."""
        apart = self.apart
        if apart is None:
            return False
        try:
            apart.send(frame.SerializeToString())
        except BlockingIOError:  # unread for a while: its reader drains it at its next get
            return False
        except OSError:
            self._close_apart()
            return False
        return True

    def _close_apart(self) -> None:
        if self.apart is not None:
            self.apart.close()
            self.apart = None

    def _send_with_rings(
        self, frame: pb.SessionFrame, session: Session, release: bool, apart: bool
    ) -> None:
        """Send ``frame`` with new rings' descriptors (the Freed ring, and with
        ``release`` the Release ring) and, with ``apart``, the client's end of a
        new announcement socket; use them if they went.

        Straight into the socket, by ``sendmsg``, which the transport cannot
        do: only while nothing the transport holds is unsent, so frames stay
        in order (the BOUND event is the connection's first frame).
        """
        transport = self.transport
        data = encode_frame(frame)
        if transport is None or transport.is_closing():
            return
        sent = 0
        if not transport.get_write_buffer_size():
            rings: list[tuple[IdRing, int]] = []
            pair: tuple[socket.socket, socket.socket] | None = None
            try:
                for name in ("relayd-freed", "relayd-release")[: 1 + release]:
                    rings.append(IdRing.create(name))
            except OSError as exc:
                log.warning("cannot create a ring (%s); frames instead", exc)
            if apart and len(rings) == 1 + release:
                try:
                    pair = _announcement_pair()
                except OSError as exc:  # the client hears its pushes on the session socket
                    log.warning("cannot create an announcement socket (%s)", exc)
            if len(rings) == 1 + release:
                fds = [fd for _, fd in rings] + ([pair[1].fileno()] if pair is not None else [])
                try:
                    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
                    with sock:
                        sent = sock.sendmsg([data], [_rights(fds)])
                except OSError:
                    sent = 0  # the socket buffer is full: the frame goes by the transport
            for _, fd in rings:
                os.close(fd)
            if pair is not None:
                pair[1].close()  # the client's end: it has its own now, or none
            if sent:
                self.manager.freed.attach_ring(session.id, rings[0][0])
                if release:
                    self.manager.releases.attach(session.id, rings[1][0])
                if pair is not None:
                    self.apart = pair[0]
            else:
                for ring, _ in rings:
                    ring.close()
                if pair is not None:
                    pair[0].close()
        if sent < len(data):
            transport.write(data[sent:])

    def _refuse(
        self, reason: str, message: str, code: int | None = None, *, tell: bool = True
    ) -> None:
        """End the connection for ``reason`` (a metric label); ``tell``: with an ERROR
        event first, else at once (``abort``: ``close`` would wait to send frames the
        client does not read)."""
        log.warning("session connection refused: %s", message, extra={"pid": self.creds[0]})
        self.hooks.refused(reason)
        if code is None:
            code = _REFUSAL_CODES.get(reason, pb.ERROR_CODE_INVALID_ARGUMENT)
        transport = self.transport
        if transport is None:
            return
        self.transport = None  # first: nothing sent from here on comes back here
        self._buf = bytearray()
        if not tell:
            transport.abort()
            return
        if not transport.is_closing():
            error = pb.Event(
                kind=pb.EVENT_KIND_ERROR, code=cast(pb.ErrorCode, code), message=message
            )
            transport.write(encode_frame(pb.SessionFrame(event=[error])))
        transport.close()

    def _handle(self, f: pb.SessionFrame) -> None:
        m = self.manager
        session = self.session
        if session is None:
            if not f.HasField("bind"):
                self._refuse("protocol", "first frame must bind a session")
                return
            pid, uid, gid = self.creds
            try:
                session = m.bind(
                    f.bind.session_id,
                    f.bind.session_token,
                    frame_sink(self.send, self.send_apart),
                    pid=pid,
                    uid=uid,
                    gid=gid,
                )
            except RelayError as err:
                self._refuse("token", str(err))
                return
            stage = self.admission.stage_refused(session.stages, uid)
            if stage is not None:
                # Closed in this turn, before anything could place it or use it:
                # the stage's routes and keys stay with the sessions that own it.
                m.close_session(session.id)
                self._refuse(
                    "stage_owner",
                    f"uid {uid} may not serve stage {stage!r}: it is listed in --stage-owner "
                    f"without this uid (add {stage}={uid} there, or in RELAYD_STAGE_OWNER or "
                    "stage_owner of the config file, to allow it)",
                )
                return
            self.session = session
            if self._bind_timer is not None:
                self._bind_timer.cancel()
                self._bind_timer = None
            log.info(
                "session bound",
                extra={"session_id": session.id, "pid": pid, "stage": ",".join(session.stages)},
            )
            if self.admission.is_admin(uid, gid, self.groups):
                self.roles.admins.add(session.id)
            if f.bind.operator:
                self.roles.operators.add(session.id)
                path, version = "none", 0  # the CLI moves no data: not placed anywhere
            elif self.hooks.bound is not None:
                path, version = self.hooks.bound(session, f.bind.shm_nonce, pid)
            else:
                path, version = Transport.SHM.value, 0
            bound = pb.SessionFrame(
                event=[
                    pb.Event(
                        kind=pb.EVENT_KIND_BOUND,
                        message=path,
                        registry_version=version,
                        answers_probes=True,
                    )
                ]
            )
            if f.bind.freed_ring and path == Transport.SHM.value:
                self._send_with_rings(bound, session, f.bind.release_ring, f.bind.announcements)
            else:
                self.send(bound)
        # Only the fields the frame carries: reading an absent repeated field
        # of a upb message builds an empty container, and a frame carries one
        # to three of these fourteen (measured: 8.4-9.6 -> 4.6-5.7 us a frame).
        present: dict[object, Any] = dict(f.ListFields())
        if _PROBE in present:  # first: the client measures how long the answer takes
            self.send(pb.SessionFrame(probe_answer=True))
            log.debug("session probe answered", extra={"session_id": session.id})
        # Fetches first: a reader waits for its answer, which a landed push gives
        # at once, while the notices riding with it (its last Release, reports)
        # wait for nobody.
        for call in present.get(_FETCH, ()):
            self._start_fetch(session, call)
            if self.transport is None:
                return  # dropped (its answers went unread): the rest would be answered too
        cancels = present.get(_CANCEL, ())
        cancelled = {x.lease_id for x in cancels}
        for r in present.get(_RESERVE, ()):
            lease = m.on_reserve(session, r, cancelled)
            if r.trace_id:
                log_trace(r.lease_id, r.trace_id, r.request_id)
            if r.HasField("publish"):  # sealed before its Reserve went: one notice
                p = r.publish
                m.on_sealed(session, lease, p)
                if p.ref:
                    self.hooks.ref(p.nbytes)
        for p in present.get(_PUBLISH, ()):
            m.on_publish(session, p)
            if p.ref:
                self.hooks.ref(p.nbytes)
        claims, releases = present.get(_CLAIM, ()), present.get(_RELEASE, ())
        if claims or releases:  # after what the session wrote in its ring before this frame
            m.releases.take(session.id)
        for c in claims:
            m.on_claim(session, c)
        for rel in releases:
            m.on_release(session, rel)
        m.releases.by_frame += len(releases)
        for x in cancels:
            m.on_cancel(session, x)
        for g in present.get(_RETURN_GRANT, ()):
            m.return_grant(session, g.grant_id)
        for rep in present.get(_REPORT, ()):
            self.hooks.report(session, rep)
        for lat in present.get(_LATENCY, ()):
            self.hooks.latency(session, lat)
        # After the notices: a keyed put's Publish travels in the same frame.
        for field, kind in _KEYED_CALLS:
            for call in present.get(field, ()):
                self._start_keyed(session, call.call_id, kind, call)
                if self.transport is None:
                    return  # dropped, as for fetches

    # -- cross-node reads -----------------------------------------------------------

    def _start_fetch(self, session: Session, call: pb.FetchCall) -> None:
        if call.call_id in self._fetches:
            self._answer(
                call.call_id, InvalidArgumentError(f"fetch call {call.call_id} is in flight")
            )
        elif self.hooks.fetch is None:
            self._answer(call.call_id, InternalError("this daemon does not serve fetches"))
        elif len(self._fetches) >= MAX_FETCH_CALLS:
            self._answer(
                call.call_id,
                ResourceExhaustedError(f"{MAX_FETCH_CALLS} fetches already in flight"),
            )
        else:
            try:
                got = self.hooks.fetch(session, call.data_ref, call.timeout_seconds)
            except RelayError as err:
                self._answer(call.call_id, err)
                return
            except Exception as exc:  # a bug: say so to the caller, keep the session
                self._fetch_failed(session, call.call_id, exc)
                return
            if isinstance(got, pb.FetchResponse):
                self._answer(call.call_id, got)
                return
            task = asyncio.get_running_loop().create_task(self._fetch(session, call, got))
            self._fetches[call.call_id] = task

    async def _fetch(
        self, session: Session, call: pb.FetchCall, pending: Awaitable[pb.FetchResponse]
    ) -> None:
        try:
            resp = await pending
        except RelayError as err:
            self._answer(call.call_id, err)
        except Exception as exc:  # a bug: say so to the caller, keep the session
            self._fetch_failed(session, call.call_id, exc)
        else:
            self._answer(call.call_id, resp)
        finally:
            self._fetches.pop(call.call_id, None)

    def _fetch_failed(self, session: Session, call_id: int, exc: Exception) -> None:
        log.error("fetch failed", exc_info=exc, extra={"session_id": session.id})
        self._answer(call_id, InternalError(f"{type(exc).__name__}: {exc}"))

    def _answer(self, call_id: int, outcome: pb.FetchResponse | RelayError) -> None:
        if isinstance(outcome, RelayError):
            result = pb.FetchResult(
                call_id=call_id,
                code=cast(pb.ErrorCode, int(outcome.code)),
                message=outcome.message or str(outcome),
            )
        else:
            result = pb.FetchResult(call_id=call_id, response=outcome)
        self.send(pb.SessionFrame(fetched=[result]))

    # -- keyed delivery and discard (see relayd.rpc.keyed) ------------------------------

    def _start_keyed(
        self,
        session: Session,
        call_id: int,
        kind: str,
        call: pb.KeyedPut | pb.KeyedTake | pb.DiscardCall,
    ) -> None:
        if call_id in self._keyed:
            self._keyed_answer(call_id, InvalidArgumentError(f"call {call_id} is in flight"))
        elif self.keyed is None:
            self._keyed_answer(call_id, InternalError("this daemon does not serve keyed calls"))
        elif len(self._keyed) >= MAX_KEYED_CALLS:
            self._keyed_answer(
                call_id, ResourceExhaustedError(f"{MAX_KEYED_CALLS} keyed calls already in flight")
            )
        else:
            task = asyncio.get_running_loop().create_task(self._keyed_call(session, kind, call))
            self._keyed[call_id] = task

    async def _keyed_call(
        self, session: Session, kind: str, call: pb.KeyedPut | pb.KeyedTake | pb.DiscardCall
    ) -> None:
        keyed = self.keyed
        assert keyed is not None
        outcome: bytes | RelayError = b""
        try:
            if isinstance(call, pb.KeyedPut):
                await keyed.put(session, call)
            elif isinstance(call, pb.KeyedTake):
                outcome = await keyed.take(session, call)
            else:
                await keyed.discard(session, call)
        except RelayError as err:
            outcome = err
        except Exception as exc:  # a bug: say so to the caller, keep the session
            log.exception("keyed %s failed", kind, extra={"session_id": session.id})
            outcome = InternalError(f"{type(exc).__name__}: {exc}")
        finally:
            self._keyed.pop(call.call_id, None)
        self._keyed_answer(call.call_id, outcome)

    def _keyed_answer(self, call_id: int, outcome: bytes | RelayError) -> None:
        if isinstance(outcome, RelayError):
            result = pb.KeyedResult(
                call_id=call_id,
                code=cast(pb.ErrorCode, int(outcome.code)),
                message=outcome.message or str(outcome),
            )
        else:
            result = pb.KeyedResult(call_id=call_id, data_ref=outcome)
        self.send(pb.SessionFrame(keyed_result=[result]))


def _rights(fds: list[int]) -> tuple[int, int, bytes]:
    """The ancillary item that passes ``fds`` over a Unix socket, in order."""
    return socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()


def _announcement_pair() -> tuple[socket.socket, socket.socket]:
    """A session's announcement socket: (the daemon's end, the client's end).

    The daemon's end is non-blocking and reads nothing (``SHUT_RD``), so the
    client's writes fail at once and nothing piles up on the daemon's side;
    set so before the client's end goes, since a client may write the moment
    it has it.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        ours.setblocking(False)
        ours.shutdown(socket.SHUT_RD)
    except OSError:
        ours.close()
        theirs.close()
        raise
    return ours, theirs
