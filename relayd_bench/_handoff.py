"""What a copy into memory another core just read costs here: the hand-off probe.

A writer in steady state copies into a run its reader on another core read a
moment ago. That core's cache still holds the run, and a store to a line
another core holds first takes the line back from it; a run read one copy
earlier has moved on to the shared cache by then. On a 2-core VM a 256 KiB
copy took x1.5-x3.1 as long into the run just read in 8 probes of 10 (x0.6 and
x1.0 in the other two; x0.8-x0.9 at 1 and 4 MiB), which is why a writer
cuts a lease of up to ``relayd_client._grants.BEHIND_NEWEST_MAX`` from the run
freed before the last rather than the last (``Grants._cut``). The bench times
both once per run and prints them with the machine, as it does the wake and
cold-call probes: where the ratio is near 1, the two runs cost the same.

The probe pins itself and a reader process to two different cores, shares two
buffers with it (a memfd) and, for each sample, has the reader copy one out,
then times its own copy into either that buffer or the other one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import socket
import statistics
import time

from relayd_bench._wake import helper, two_cores

# The copy timed: a hidden-state chunk's size, below BEHIND_NEWEST_MAX.
NBYTES = 256 << 10
SAMPLES = 200

# The reader: its own process, pinned to one core, copying buffer k out of the
# shared memory each time it is sent k, then answering. Standard library only.
_READER = """
import ctypes, mmap, os, socket, sys
os.sched_setaffinity(0, {int(sys.argv[2])})
n = int(sys.argv[4])
s = socket.socket(fileno=int(sys.argv[1]))
shared = mmap.mmap(int(sys.argv[3]), 2 * n)
base = ctypes.addressof(ctypes.c_char.from_buffer(shared))
out = bytearray(n)
dst = ctypes.addressof(ctypes.c_char.from_buffer(out))
while True:
    k = s.recv(1)
    if not k:
        break
    ctypes.memmove(dst, base + k[0] * n, n)
    s.sendall(k)
"""


@dataclasses.dataclass(frozen=True)
class Handoff:
    nbytes: int
    just_read_us: float  # median copy into the buffer the other core read last
    read_before_us: float  # median copy into the one it read the time before

    @property
    def ratio(self) -> float:
        return self.just_read_us / max(self.read_before_us, 1e-9)

    def line(self) -> str:
        return (
            f"a {self.nbytes >> 10} KiB copy into memory another core read last: "
            f"{self.just_read_us:.1f} µs, into memory it read the time before: "
            f"{self.read_before_us:.1f} µs (x{self.ratio:.1f})"
        )


def probe(samples: int = SAMPLES, nbytes: int = NBYTES) -> Handoff | None:
    """Time both copies; None where this process may run on one core only, or
    may not pin itself, or the reader did not answer: the run goes on without."""
    cores = two_cores()
    if cores is None:
        return None
    try:
        fd = os.memfd_create("relayd-bench-handoff")
        try:
            os.ftruncate(fd, 2 * nbytes)
            with (
                mmap.mmap(fd, 2 * nbytes) as shared,
                helper(_READER, cores, [str(fd), str(nbytes)], (fd,)) as sock,
            ):
                return _measure(sock, shared, samples, nbytes)
        finally:
            os.close(fd)
    except (OSError, BufferError):  # socket.timeout included
        return None


def _measure(sock: socket.socket, shared: mmap.mmap, samples: int, nbytes: int) -> Handoff:
    """The probe's samples, on the reader's socket."""
    source = bytearray(os.urandom(nbytes))
    src = ctypes.addressof(ctypes.c_char.from_buffer(source))
    base = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    _copies(sock, src, base, 5, nbytes, alternate=True)  # faulted in, reader up
    just_read = _copies(sock, src, base, samples, nbytes, alternate=False)
    read_before = _copies(sock, src, base, samples, nbytes, alternate=True)
    return Handoff(nbytes, just_read, read_before)


def _copies(
    sock: socket.socket, src: int, base: int, samples: int, nbytes: int, *, alternate: bool
) -> float:
    """The median µs of a copy into the buffer the reader read last (or, with
    ``alternate``, the one it read before that), the reader then reading it."""
    memmove, now = ctypes.memmove, time.perf_counter_ns
    took = []
    for i in range(samples):
        k = i % 2 if alternate else 0
        t0 = now()
        memmove(base + k * nbytes, src, nbytes)
        took.append(now() - t0)
        sock.sendall(bytes((k,)))
        if sock.recv(1) != bytes((k,)):
            raise ConnectionError("the hand-off probe's reader is gone")
    return float(statistics.median(took)) / 1000
