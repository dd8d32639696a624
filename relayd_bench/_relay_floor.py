"""``floor-relay``: relayd-mooncake's path with nothing on it but the bytes.

A relayd-mooncake transfer crosses four processes: the writer, its daemon, the
reader's daemon and the reader. This baseline runs the same four, joined the
same way, each doing only what moves the bytes:

- the writer copies the payload into the next of ``FLOOR_SLOTS`` slots of a
  pre-faulted /dev/shm segment, and sends the slot and transfer number to its
  forwarder over a Unix socket (a put's Publish) and to the reader over the
  bench's channel (the DataRef);
- the writer's forwarder (``_forwarder``), an asyncio loop as relayd's daemon is,
  sends a 16-byte header and the slot's bytes in one ``writev`` on a TCP
  connection to the reader's forwarder (as a push's bytes ride its Landed notice);
- the reader's forwarder, an asyncio loop, reads them straight into a slot of its
  own segment, woken once they are in (``SO_RCVLOWAT``, as relayd's daemon is),
  and tells the reader over a Unix socket (the announcement);
- the reader waits for that word in a blocking ``recv`` and copies the slot out.

No leases, checks, notices or protobuf: relayd-mooncake / floor-relay is what
relayd's own work costs on that path, beyond the wake-ups and the kernel's TCP
that both pay alike. With ``--netns`` each forwarder runs in its side's
namespace (it inherits it) and the TCP connection crosses the link, as the
daemons' does.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
from typing import IO, cast

import torch

from relayd.peer_channel import ATTACHED_READ_MIN
from relayd_bench import _rtt
from relayd_bench._api import PairMethod
from relayd_bench._baselines import FLOOR_SLOTS, PAGE, _round_up, _Segment
from relayd_bench._forwarder import IN, OUT, WORD, recv_exactly

START_TIMEOUT_S = 10.0  # a forwarder's start: its port, its connection
WAIT_TIMEOUT_S = 10.0  # a transfer's bytes, a forwarder's exit
# What a wake-up of the reader's forwarder waits for at the most (SO_RCVLOWAT):
# half relayd's, whose first read of a push takes the start of its bytes along
# with the notice. A mark the size of the window the kernel opens never comes.
READ_MIN = ATTACHED_READ_MIN // 2


class _Forwarder:
    """One forwarder process and this process's end of its Unix socket."""

    def __init__(self, role: str, segment: str, size: int, host: str, port: int = 0) -> None:
        ours, theirs = socket.socketpair()
        layout = (size, _round_up(size, PAGE), FLOOR_SLOTS, READ_MIN)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relayd_bench._forwarder", role, str(theirs.fileno()),
                 segment, *map(str, layout), host, str(port)],
                pass_fds=(theirs.fileno(),),
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        finally:
            theirs.close()
        self.sock = ours
        self.sock.settimeout(WAIT_TIMEOUT_S)
        self.line = self.next_line()

    def next_line(self) -> str:
        """What the forwarder prints next (its port, its peer's pid, that it connected)."""
        out = cast(IO[str], self.proc.stdout)
        ready, _, _ = select.select([out], [], [], START_TIMEOUT_S)
        line = out.readline().strip() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(
                f"floor-relay forwarder said nothing within {START_TIMEOUT_S:g}s (it did not "
                "start, or the other side's never dialled in)"
            )
        return line

    def close(self) -> None:
        self.sock.close()  # its end: the forwarder's loop ends, and so does its peer's
        try:
            self.proc.wait(WAIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class FloorRelay(PairMethod):
    """relayd-mooncake's four processes and hops with only the bytes on them."""

    def _segment(self, size: int, tag: str) -> None:
        self.size = size
        self.stride = _round_up(size, PAGE)
        self.seg = _Segment(self.ctx.segment_name(tag), self.stride * FLOOR_SLOTS)
        assert self.seg.tensor is not None
        self.seg.tensor.zero_()  # every page faulted in now, never during a transfer
        self.slots = [self.seg.tensor.narrow(0, k * self.stride, size) for k in range(FLOOR_SLOTS)]

    def _close(self) -> None:
        self.fwd.close()
        self.slots = []
        self.seg.close()
        self.seg.unlink()

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.source = source
        self._segment(size, "relay-out")
        host = self.ctx.hosts[0]
        self.fwd = _Forwarder(OUT, self.seg.name, size, host)
        return json.dumps({"host": host, "port": int(self.fwd.line)}).encode()

    def start_writer(self) -> None:
        self.peer_pid = int(self.fwd.next_line())  # the reader's forwarder has dialled in

    def daemon_pids(self) -> tuple[int, int]:
        return self.fwd.proc.pid, self.peer_pid

    def send(self, i: int) -> bytes:
        k = i % FLOOR_SLOTS
        self.slots[k].copy_(self.source)
        word = WORD.pack(k, i)
        self.fwd.sock.sendall(word)
        return word

    def teardown_writer(self) -> None:
        self._close()

    def setup_reader(self, size: int, blob: bytes) -> None:
        out = json.loads(blob)
        self._segment(size, "relay-in")
        self.fwd = _Forwarder(IN, self.seg.name, size, str(out["host"]), int(out["port"]))

    def recv(self, notify: memoryview) -> torch.Tensor:
        want = WORD.unpack_from(notify)
        said = recv_exactly(self.fwd.sock, WORD.size, "the floor-relay forwarder went away")
        got = WORD.unpack(said)
        if got != want:
            raise ValueError(f"announced slot/transfer {got}, the DataRef says {want}")
        out = torch.empty(self.size, dtype=torch.uint8)
        out.copy_(self.slots[got[0]])
        return out

    def cleanup(self) -> None:
        # The bytes travel beside the DataRef: its one-way trip is all a read waits for.
        self.extra[_rtt.EXTRA_RT] = _rtt.fmt_rt(_rtt.DATAREF_TRIP)

    def teardown_reader(self) -> None:
        self._close()
