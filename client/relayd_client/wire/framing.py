"""Session-socket framing, both ways: a 4-byte little-endian length, then one
``relayd.v1.SessionFrame`` of at most :data:`MAX_FRAME` bytes.

The client's :class:`~relayd_client._session.SessionChannel`, the daemon's
``SessionProtocol`` and the operator's blocking session all frame through
this module; each side still chooses how to react to a frame that breaks the
limit (the daemon refuses the session, a client treats the daemon as gone).
"""

from __future__ import annotations

import mmap
import struct

from .proto import relay_pb2 as pb

FRAME_LENGTH = struct.Struct("<I")
#: Bytes of the length prefix.
LENGTH_BYTES = FRAME_LENGTH.size
MAX_FRAME = 4 << 20
SESSION_SOCKET_SUFFIX = ".session"

#: How long a notice waits for company before its frame goes, on both sides of
#: the session socket (a client's Reserve, Publish, Claim and Release, the
#: daemon's Freed) and between daemons (Peer.Notify). Nothing on a put or a get
#: waits for a notice, so the linger costs no latency; long enough that a 50/s
#: stream's chunks, 20 ms apart, share frames, which takes a third off the
#: daemon's CPU per chunk.
NOTICE_LINGER_S = 0.025
#: ... unless a client's lingering notices (Publish, Claim, Release) hold back
#: this many bytes of a writer's arena. Each frame a client sends wakes the
#: daemon, at ~100 us of CPU cache-cold, against ~16 us for a transfer's
#: notices, so the fewer frames, the less daemon CPU a transfer costs. A writer
#: takes a run back when its reader marks the lease read (relayd_client._grants),
#: not on the Freed this cap delays, so the cap no longer decides how many runs
#: the writer cycles through (waiting for the Freed, a 1 MiB writer used 18,
#: cache-cold); it bounds what a writer whose readers do not mark (views, older
#: clients) holds back, and a run taken back on its mark no longer counts
#: (``SessionChannel.taken_back``). In three alternating pairs of stop-and-wait
#: runs at 1 MiB, 16 MiB (a wake-up per 16 transfers) cost the daemon 21-41 us a
#: transfer and 64 MiB (one per 40-60) 18-27 us, with latency and the 16-stream
#: workload's p50 and p99 the same within the host's noise. A writer holds the
#: grants to cover it: one short of space asks for a grant, and that sends its
#: notices at once.
NOTICE_LINGER_MAX_BYTES = 64 << 20
#: To a daemon that takes no Reserve over a lease its reader marked read (an
#: older one), a client's Publish and Release of a lease this large go at once,
#: never lingering: the daemon frees the run before the writer's next put, which
#: copies into it again while it is still in cache. A Release that reaches the
#: daemon before its lease's Publish waits for it, so both must go: while
#: either lingered, a stop-and-wait writer of 4 MiB went through 6 runs, 24 MiB
#: of cold memory (1 MiB: 18). A 4 MiB copy into a run last written six
#: transfers ago costs about 2.5 times one into the run just read (a writer
#: and reader without a daemon, measured: 370-410 against 120-160 us). With
#: both at once the writer alternates between at most two runs, and transfers
#: of 4 and 16 MiB took 10-35% less time, for two wake-ups of the daemon a
#: transfer instead of a quarter (its CPU per 4 MiB transfer 105-120 -> 135-170
#: us). At 1 and 2 MiB that tripled its CPU for no clear latency gain. Nor
#: did the Publish alone from 256 KiB, the Release left in its ring (taken at
#: the next Publish's wake-up): the writer reused 2-12 runs instead of 17-72,
#: but the daemon, woken at the end of every put, held a core as the DataRef
#: went to the reader: the blocking client's trip grew from 38-40 to 98-104 us
#: at 256 KiB and 1 MiB, the daemon's CPU from 13-28 to 77-86 us a transfer.
#: To a daemon that does, the writer takes the run back on its reader's mark
#: (relayd_client._grants) without either notice, so they linger as the rest
#: do: in two alternating pairs of stop-and-wait runs the daemon's CPU per
#: transfer went from 147-227 to 39-47 us at 4 MiB and from 299-400 to 135-169
#: us at 16 MiB (a wake-up per 16 and per 4 transfers instead of two a
#: transfer), latency the same or lower within the host's noise.
PROMPT_NOTICE_BYTES = 4 << 20
#: The daemon's Freed to a writer goes at once from this many bytes: the daemon
#: sends it in a turn it is awake for anyway, and a writer of large payloads needs
#: its space back before its grant (8 MiB by default) is all in flight.
FREED_LINGER_MAX_BYTES = 2 << 20


def encode_frame(frame: pb.SessionFrame) -> bytes:
    """``frame`` as it goes on the session socket."""
    body = frame.SerializeToString()
    return FRAME_LENGTH.pack(len(body)) + body


def frame_length(buf: bytes | bytearray | memoryview | mmap.mmap, pos: int = 0) -> int:
    """The body length announced by the prefix at ``buf[pos:pos + LENGTH_BYTES]``."""
    (n,) = FRAME_LENGTH.unpack_from(buf, pos)
    return int(n)


def decode_frame(body: bytes | bytearray | memoryview) -> pb.SessionFrame:
    """One frame's body (without its prefix); ``DecodeError`` when it is not a SessionFrame."""
    return pb.SessionFrame.FromString(bytes(body))


def session_socket_path(socket: str) -> str:
    """The session socket beside the gRPC socket ``socket``.

    A client derives it from the path it was given rather than taking the
    daemon's own: a daemon in a container reports its ``/run/relayd``, which
    the client may reach through another directory (a volume mounted elsewhere).
    """
    return socket + SESSION_SOCKET_SUFFIX
