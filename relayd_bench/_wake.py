"""How long a process on another core takes to wake here: the machine's wake probe.

A relayd transfer is a chain of processes waking one another: a writer wakes
its daemon, which wakes the reader (and, across nodes, the reader's daemon in
between). Each link costs what the machine charges for waking a process on
another core, and on a VM that charge grows with how long the woken core has
been idle: a halted virtual CPU is woken through the host. Measured on a
2-core VM: 10-34 us to a process that had just gone to sleep, 70-76 us after
1 ms idle, ~91 us after 2 ms. A stop-and-wait transfer's daemons sit idle for most
of each round, so every hop pays the idle price.

The waker pays too: a send that wakes a halted virtual CPU exits to the host to
interrupt it, inside the send call. Measured on the same VM: 1.4 us to a core
that had just gone to sleep, 14-19 us once it had idled 0.1-1 ms; 1.5-2 us with
the guest polling before it halts. A daemon that wakes a reader or a peer pays
it as CPU on every such send.

The idle price starts well short of 1 ms. On the same VM a wake-up took
17-26 us up to 30 us idle and 35-49 us from 50 us on; and the floor's own
4 KiB trip, 14 us while its writer sends 3 us after the reader's ack, was
45-47 us once its writer spent 15 us before sending (a put's work; relayd's
4 KiB put takes ~20). So the probe times a third point, after
:data:`SHORT_PAUSE_S` idle: where it is near the 1 ms figure, a reader whose
writer works a few tens of microseconds pays the whole price, and a small
transfer's trip says more about the machine than about relayd.

The bench measures all of it once per run, as it does the cold-call probe, and
prints it under the machine line: two runs on two machines compare knowing it,
and a cross-node run's hops read against it. The probe pins a sender and a
receiver process to two different cores; a single-core process skips it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from relayd_bench._coldcall import COLD_PAUSE_S

SAMPLES = 200
# The short idle the probe also times: a put's work plus the DataRef's trip.
SHORT_PAUSE_S = 50e-6
# How long the whole probe may take before it is given up (its samples take
# about SAMPLES x COLD_PAUSE_S).
PROBE_TIMEOUT_S = 30.0
_STAMP = struct.Struct("<q")

# The receiver: its own process, pinned to one core, answering each stamp with
# how long after it the stamp was read (CLOCK_MONOTONIC is one clock for all
# processes). Nothing to import but the standard library: it starts in ~30 ms.
_RECEIVER = """
import os, socket, struct, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
s = socket.socket(fileno=int(sys.argv[1]))
stamp = struct.Struct("<q")
while True:
    data = s.recv(stamp.size)
    now = time.monotonic_ns()
    if len(data) < stamp.size:
        break
    s.sendall(stamp.pack(now - stamp.unpack(data)[0]))
"""


@dataclasses.dataclass(frozen=True)
class Wake:
    pause_s: float
    busy_us: float  # median, to a receiver that had just gone to sleep
    idle_us: float  # median, to a receiver idle for pause_s
    send_busy_us: float = 0.0  # median time in the sender's send call, the same ways
    send_idle_us: float = 0.0
    # The same after short_pause_s idle (0: not timed, as in older results).
    short_pause_s: float = 0.0
    short_us: float = 0.0
    send_short_us: float = 0.0

    def line(self) -> str:
        short = f"{self.short_pause_s * 1e6:g} µs idle"
        long = f"{self.pause_s * 1e3:g} ms idle"
        wake, send = f"{self.busy_us:.1f} µs", f"{self.send_busy_us:.1f} µs"
        if self.short_pause_s:
            wake += f", {self.short_us:.1f} µs after {short}"
            send += f", {self.send_short_us:.1f} µs after {short}"
        return (
            f"wake-up on another core: {wake}, {self.idle_us:.1f} µs after {long} "
            "(a message's send to its read)\n"
            f"the send that wakes it: {send}, {self.send_idle_us:.1f} µs after {long} "
            "(the waker's CPU)"
        )


def two_cores() -> tuple[int, int] | None:
    """Two cores this process may run on (its own, then its helper's); None: one only."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def _one_way_us(sock: socket.socket, samples: int, pause: float) -> tuple[float, float]:
    """The median µs from a send to the receiver's read, and in the send call
    itself, the receiver idle ``pause`` seconds before each. This process spins
    meanwhile, so that it, not the receiver, holds its core and the receiver's
    core alone goes idle."""
    clock = time.monotonic_ns
    took, sends = [], []
    for _ in range(samples):
        until = clock() + int(pause * 1e9)
        while clock() < until:
            pass
        sent = clock()
        sock.sendall(_STAMP.pack(sent))
        sends.append(clock() - sent)
        answer = sock.recv(_STAMP.size, socket.MSG_WAITALL)
        if len(answer) != _STAMP.size:
            raise ConnectionError("the wake probe's receiver is gone")
        took.append(_STAMP.unpack(answer)[0])
    return float(statistics.median(took)) / 1000, float(statistics.median(sends)) / 1000


def probe(
    samples: int = SAMPLES, pause: float = COLD_PAUSE_S, short: float = SHORT_PAUSE_S
) -> Wake | None:
    """Time a wake-up of a process on another core, just asleep, ``short`` s and
    ``pause`` s idle;
    None where this process may run on one core only, or may not pin itself, or
    the receiver did not answer: the run goes on without the line."""
    cores = two_cores()
    if cores is None:
        return None
    try:
        with helper(_RECEIVER, cores) as sock:
            return _measure(sock, samples, pause, short)
    except OSError:  # socket.timeout included
        return None


@contextlib.contextmanager
def helper(
    script: str, cores: tuple[int, int], args: Sequence[str] = (), fds: Sequence[int] = ()
) -> Iterator[socket.socket]:
    """A probe's other process: Python running ``script`` with its end of a
    socket pair (in its argv: the descriptor's number, the core to pin itself
    to, ``cores[1]``, then ``args``) and ``fds``; this end is yielded, with
    :data:`PROBE_TIMEOUT_S` on its calls, and this process is pinned to
    ``cores[0]`` meanwhile. Closing it ends the helper, which is waited for
    (killed past :data:`PROBE_TIMEOUT_S`)."""
    mine, theirs = socket.socketpair()
    with mine:
        with theirs:
            child = subprocess.Popen(
                [sys.executable, "-c", script, str(theirs.fileno()), str(cores[1]), *args],
                pass_fds=(theirs.fileno(), *fds),
                stderr=subprocess.DEVNULL,  # a helper that fails is told by its silence
            )
        restore = os.sched_getaffinity(0)
        try:
            mine.settimeout(PROBE_TIMEOUT_S)
            os.sched_setaffinity(0, {cores[0]})
            try:
                yield mine
            finally:
                os.sched_setaffinity(0, restore)
        finally:
            mine.close()  # the helper reads end-of-file and exits
            try:
                child.wait(PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _measure(sock: socket.socket, samples: int, pause: float, short: float) -> Wake:
    """The probe's samples, on the receiver's socket."""
    _one_way_us(sock, 5, 0.0)  # the receiver is up and pinned once it answers
    busy, send_busy = _one_way_us(sock, samples, 0.0)
    shorter, send_shorter = _one_way_us(sock, samples, short)
    idle, send_idle = _one_way_us(sock, samples, pause)
    return Wake(pause, busy, idle, send_busy, send_idle, short, shorter, send_shorter)
