"""The contract between the harness and a benchmarked method.

A method is one class. The harness builds an instance in each process that runs
it (with the :class:`BenchContext`; one per lane where a process carries several
streams, see :class:`JobSpec`) and drives it through the hooks below over the
planned sizes; which hooks run depends on the base class:

``PairMethod`` / ``AsyncPairMethod`` (a writer process and a reader process)
    writer: ``setup_writer(size, source) -> blob`` once per size; the harness hands
            ``blob`` to the reader. ``start_writer()`` once the reader is set up,
            before the first transfer (untimed: wait there for what a steady state
            has, such as a route). Then per transfer ``send(i) -> notify`` inside the
            timed region: copy ``source`` wherever the method moves data and return
            the small message the reader needs (for relayd: the DataRef bytes). The
            harness frames it over the Unix socketpair and waits for the ack before
            the next transfer. ``teardown_writer()`` after the last ack of a size.
    reader: ``setup_reader(size, blob)`` once per size, before the first transfer.
            Per transfer ``recv(notify) -> tensor``: the timed region ends when it
            returns, so return once the payload is usable as a tensor in this
            process. ``notify`` is only valid during the call. Then ``cleanup()``
            (release a view, unlink a segment: untimed, but before the ack, so a
            writer waiting on free space sees it), then the ack.
            ``teardown_reader()`` after the last transfer of a size.

``LocalMethod`` / ``AsyncLocalMethod`` (one process: memcpy, same-process relayd)
    ``setup(size, source)``, per transfer ``transfer(i) -> tensor`` (timed),
    ``cleanup()``, and ``teardown()``.

Returned tensors must be contiguous ``torch.uint8`` of exactly ``size`` elements:
the harness checks their first 8 bytes carry the transfer number it stamped into
``source`` (so a stale slot or a skipped copy fails loudly) and the last byte the
payload pattern. Async hooks run on an event loop that the harness keeps running
while it waits on the socket, so a client's background tasks (notices, releases)
progress as they would in an application. If a transfer fails, the teardown hook
still runs (its own errors are ignored) before the process reports the failure.

Put a method's own state on ``self`` (lanes of one process may share what a
real process would share, such as one client per stage); use ``self.ctx.segment_name()`` for any
/dev/shm name so the harness can sweep leftovers; put what the method observed
(e.g. the transport relayd picked) in ``self.extra``, it ends up in the results.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import os
from typing import TYPE_CHECKING

from relayd_bench._procstat import ProcSample

if TYPE_CHECKING:
    import torch

_SEGMENT_COUNTER = itertools.count()
LOOPBACK = "127.0.0.1"
LATE_HANDOFF_S = 0.005
"""How long after its put a ``-late`` method hands the DataRef over: a hop through a
scheduler or a queue, long enough for a push to land first."""


@dataclasses.dataclass(frozen=True)
class BenchContext:
    """What every method instance may need; picklable, crosses the spawn boundary."""

    run_id: str
    shm_prefix: str
    socket: str | None = None
    reader_socket: str | None = None
    daemon_pid: int | None = None
    reader_daemon_pid: int | None = None  # the reader's own daemon (relayd-mooncake), if known
    stream_index: int = 0  # which process pair of the stream workload: its stages
    lane: int = 0  # which of that pair's streams (see JobSpec.lanes)
    # --netns, for a cross-node method: the writer's and the reader's network namespace
    # and address; the harness joins them by TCP across the veth link instead of a
    # socketpair. Mooncake engines of the methods bind these addresses.
    netns: tuple[str, str] | None = None
    hosts: tuple[str, str] = (LOOPBACK, LOOPBACK)
    # --timeline, for a cross-node method: the directory its writer and reader stamp
    # their steps into (see relayd_bench._timeline).
    timeline: str | None = None

    def segment_name(self, tag: str) -> str:
        """A /dev/shm name unique to this run, process and call; swept by the harness."""
        return f"{self.shm_prefix}{tag}-{os.getpid()}-{next(_SEGMENT_COUNTER)}"

    def request_id(self, size: int, i: int) -> str:
        return f"bench-{self.run_id}-{self.stream_index}-{self.lane}-{size}-{i}"


class _Base:
    handoff_delay_s = 0.0
    """A pair method's writer hands each DataRef over this long after ``send``
    returned, and the sample starts at the hand-off: what a read costs when its
    DataRef comes after its bytes (0: at once, the sample starts before ``send``)."""

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx
        self.extra: dict[str, str] = {}

    def daemon_pids(self) -> tuple[int, int] | None:
        """The writer's side's and the reader's side's processes that a pair method
        runs in place of relayd's daemons (asked of the writer once it started):
        the table counts their CPU and wake-ups as the daemons'. None: the
        daemons the bench talks to, if any."""
        return None


class PairMethod(_Base, abc.ABC):
    """Writer and reader in two processes, blocking hooks."""

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        return b""

    def start_writer(self) -> None:
        """After the reader's setup, before the first transfer (untimed)."""
        return None

    @abc.abstractmethod
    def send(self, i: int) -> bytes | bytearray | memoryview: ...

    def finish_writer(self) -> None:
        """After the last transfer's ack, before the report (untimed): fill ``extra``."""
        return None

    def teardown_writer(self) -> None:
        return None

    def setup_reader(self, size: int, blob: bytes) -> None:
        return None

    @abc.abstractmethod
    def recv(self, notify: memoryview) -> torch.Tensor: ...

    def cleanup(self) -> None:
        return None

    def teardown_reader(self) -> None:
        return None


class AsyncPairMethod(_Base, abc.ABC):
    """Writer and reader in two processes, coroutine hooks on one loop per process."""

    async def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        return b""

    async def start_writer(self) -> None:
        """After the reader's setup, before the first transfer (untimed)."""
        return None

    @abc.abstractmethod
    async def send(self, i: int) -> bytes | bytearray | memoryview: ...

    async def finish_writer(self) -> None:
        """After the last transfer's ack, before the report (untimed): fill ``extra``."""
        return None

    async def teardown_writer(self) -> None:
        return None

    async def setup_reader(self, size: int, blob: bytes) -> None:
        return None

    @abc.abstractmethod
    async def recv(self, notify: memoryview) -> torch.Tensor: ...

    async def cleanup(self) -> None:
        return None

    async def teardown_reader(self) -> None:
        return None


class LocalMethod(_Base, abc.ABC):
    """Both halves in one process, blocking hooks."""

    def setup(self, size: int, source: torch.Tensor) -> None:
        return None

    @abc.abstractmethod
    def transfer(self, i: int) -> torch.Tensor: ...

    def cleanup(self) -> None:
        return None

    def teardown(self) -> None:
        return None


class AsyncLocalMethod(_Base, abc.ABC):
    """Both halves in one process, coroutine hooks."""

    async def setup(self, size: int, source: torch.Tensor) -> None:
        return None

    @abc.abstractmethod
    async def transfer(self, i: int) -> torch.Tensor: ...

    async def cleanup(self) -> None:
        return None

    async def teardown(self) -> None:
        return None


AnyMethod = PairMethod | AsyncPairMethod | LocalMethod | AsyncLocalMethod
METHOD_BASES = (PairMethod, AsyncPairMethod, LocalMethod, AsyncLocalMethod)


@dataclasses.dataclass(frozen=True)
class SizePlan:
    size: int
    warmup: int
    iterations: int


@dataclasses.dataclass(frozen=True)
class Pace:
    """Open-loop schedule for the stream workload: lane j's transfer i is due at
    start + offset + j * lane_step + i * period."""

    period_ns: int
    offset_ns: int
    lane_step_ns: int = 0

    def due_offset_ns(self, lane: int) -> int:
        return self.offset_ns + lane * self.lane_step_ns


@dataclasses.dataclass(frozen=True)
class Step:
    """One method over some sizes, in order."""

    method: str
    target: str  # "module:Class", imported in the child only (it imports torch)
    sizes: tuple[SizePlan, ...]
    reader_daemon: bool = False  # the reader uses ctx.reader_socket: count that daemon too


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One process pair (or one process) running its steps in order.

    A full run gives every (method, size) its own job; ``--quick`` puts many steps
    in one job, because each fresh process pays seconds of imports.

    ``lanes`` > 1 (the stream workload): the pair carries that many streams at once,
    as a thinker and a talker process carry many requests. Each lane has its own
    method instance, channel and paced loop (tasks on the process's one event loop,
    or threads for blocking methods); a process sends one report per size with every
    lane's samples.
    """

    steps: tuple[Step, ...]
    ctx: BenchContext
    pace: Pace | None = None
    measure_daemon: bool = True
    lanes: int = 1


@dataclasses.dataclass(frozen=True)
class Usage:
    """CPU and minor faults of one process over the measured transfers of one size."""

    cpu_ns: int
    minflt: int


@dataclasses.dataclass(frozen=True)
class WriterReport:
    method: str
    size: int
    usage: Usage
    cycles_ns: tuple[int, ...]  # t0 -> ack, measured transfers
    daemon: ProcSample | None  # what the daemon spent over the measured transfers
    reader_daemon: ProcSample | None  # the reader's own daemon, for a step with reader_daemon
    start_ns: int  # first measured transfer's t0 (scheduled time when paced)
    end_ns: int  # after the last measured ack
    extra: dict[str, str]


Parts = tuple[int, int, int]
"""Where one transfer's one-way time went, in ns, adding up to its sample: the writer's
``send`` hook (for relayd the put and the DataRef's bytes), the notify's way to the
reader until the reader has read its frame, and the reader's ``recv`` hook (the
DataRef's parse and the get). A ``-late`` method's clock starts when it hands the
DataRef over, after its send, so its send part is zero."""


@dataclasses.dataclass(frozen=True)
class ReaderReport:
    method: str
    size: int
    usage: Usage
    samples_ns: tuple[int, ...]  # one-way t1 - t0 of each measured transfer
    extra: dict[str, str] = dataclasses.field(default_factory=dict)  # what the reader observed
    parts_ns: tuple[Parts, ...] = ()  # each sample's three parts, in the same order


@dataclasses.dataclass(frozen=True)
class ChildError:
    role: str
    method: str | None
    size: int | None
    message: str
    traceback: str


ChildMessage = WriterReport | ReaderReport | ChildError
