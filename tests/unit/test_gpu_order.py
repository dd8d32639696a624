"""The GPU paths' ordering and lifetime decisions, with fake streams and events (no GPU).

What runs on a GPU is in tests/gpu; here: which stream and which thread a
copy goes to, deadlines on event waits, the writer's fences before slots
go back, read-once accounting of direct refs, the counts given back after a
partial export, and the mapping cache per (handle, offset).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from relayd_client import _cuda_copy, _cuda_direct, _gpu_order
from relayd_client.wire.errors import RelayTimeoutError, StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import async_wait_until


class FakeEvent:
    """Completes after ``after`` queries (never when None); ``fire()`` completes it."""

    def __init__(self, after: int | None = 0) -> None:
        self.after = after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after

    def fire(self) -> None:
        self.after = 0


class FakeClock:
    """A clock that advances only when the code under test sleeps; a turn of
    the loop (``sleep(0)``) costs ``YIELD_S``."""

    YIELD_S = 20e-6

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleep_sync(seconds)

    def sleep_sync(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds or self.YIELD_S


# -- which stream, which thread ----------------------------------------------------------


def test_caller_streams_are_the_callers_current_stream_per_cuda_device_once() -> None:
    asked: list[int] = []

    def current(d: int) -> str:
        asked.append(d)
        return f"s{d}"

    # CPU tensors (None) ask nothing; each device once, in order.
    assert _gpu_order.caller_streams([None, 1, 0, 1, None], current) == ("s0", "s1")
    assert asked == [0, 1]
    assert _gpu_order.caller_streams([None, None], current) == ()


def test_run_on_streams_runs_inside_every_stream_and_leaves_them() -> None:
    log: list[str] = []

    @contextlib.contextmanager
    def enter(s: str) -> Iterator[None]:
        log.append(f"enter {s}")
        try:
            yield
        finally:
            log.append(f"exit {s}")

    def copy(x: int) -> int:
        log.append("copy")
        return x * 2

    assert _gpu_order.run_on_streams(["a", "b"], enter, copy, 21) == 42
    assert log == ["enter a", "enter b", "copy", "exit b", "exit a"]
    log.clear()

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _gpu_order.run_on_streams(["a"], enter, fail)
    assert log == ["enter a", "exit a"]


class _FakeTorchCuda:
    """The few ``torch.cuda`` calls the shm worker path makes, per thread as CUDA does."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.made: list[int] = []

    def current(self) -> str:
        return getattr(self._local, "stream", "legacy-default")

    def current_stream(self, device: int) -> str:
        return f"caller-side-stream-{device}" if self.current() == "caller" else self.current()

    @contextlib.contextmanager
    def stream(self, s: str) -> Iterator[None]:
        before = self.current()
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = before

    def Stream(self, device: int) -> str:
        self.made.append(device)
        return f"copy-{device}-{len(self.made)}"


class _FakeTensor:
    def __init__(self, device: int | None) -> None:
        self.is_cuda = device is not None
        self.device = type("D", (), {"index": device})()


def test_shm_copy_on_a_worker_runs_on_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: a worker thread starts on the legacy default stream, which a
    producer on a side stream does not order; the copy must see the caller's."""
    fake = _FakeTorchCuda()
    monkeypatch.setattr(_cuda_copy, "torch_cuda", lambda: fake)
    monkeypatch.setattr(_cuda_copy, "uses_cuda", lambda: True)
    fake._local.stream = "caller"  # the producer's side stream on this thread
    streams = _cuda_copy.worker_streams([_FakeTensor(None), _FakeTensor(0), _FakeTensor(2)])
    assert streams == ("caller-side-stream-0", "caller-side-stream-2")

    seen: list[str] = []

    async def offload() -> None:
        await asyncio.to_thread(
            _cuda_copy.run_on_worker, streams, lambda: seen.append(fake.current())
        )
        # Without the streams a worker copies on its own default stream: the bug.
        await asyncio.to_thread(_cuda_copy.run_on_worker, (), lambda: seen.append(fake.current()))

    asyncio.run(offload())
    assert seen == ["caller-side-stream-2", "legacy-default"]


def test_worker_streams_of_a_cpu_only_process_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_copy, "uses_cuda", lambda: False)
    assert _cuda_copy.worker_streams([_FakeTensor(None)]) == ()


def test_dedicated_streams_one_per_device_until_discarded() -> None:
    made: list[int] = []

    def make(i: int) -> str:
        made.append(i)
        return f"copy-{i}-{len(made)}"

    streams = _gpu_order.DedicatedStreams(make)
    assert streams.get(0) == "copy-0-1" and streams.get(0) == "copy-0-1"
    assert streams.get(1) == "copy-1-2" and made == [0, 1] and len(streams) == 2
    streams.discard(0)  # stuck behind a dead writer's event: later reads get a new one
    assert streams.get(0) == "copy-0-3"


@pytest.mark.parametrize(
    ("dst_is_cuda", "same_or_peer", "worker"),
    [(True, True, False), (True, False, True), (False, False, True), (False, True, True)],
)
def test_which_reads_leave_the_event_loop(
    dst_is_cuda: bool, same_or_peer: bool, worker: bool
) -> None:
    assert _gpu_order.copy_in_worker(dst_is_cuda, same_or_peer) is worker


# -- waiting ------------------------------------------------------------------------------


def test_wait_event_returns_once_complete_without_a_thread_or_a_timer() -> None:
    # A copy done within the spin window costs turns of the loop, no timer:
    # a loop's timer sleeps at least a millisecond, however short it is asked.
    clock, event = FakeClock(), FakeEvent(after=5)
    asyncio.run(_gpu_order.wait_event(event, clock() + 1.0, "x", clock=clock, sleep=clock.sleep))
    assert event.queries == 6 and clock.slept == [0] * 5


def test_a_long_wait_polls_on_the_loops_tick_and_backs_off() -> None:
    clock, event = FakeClock(), FakeEvent(after=80)
    asyncio.run(_gpu_order.wait_event(event, clock() + 1.0, "x", clock=clock, sleep=clock.sleep))
    timed = [s for s in clock.slept if s]
    spins = len(clock.slept) - len(timed)
    assert spins == pytest.approx(_gpu_order.POLL_SPIN_S / FakeClock.YIELD_S, abs=1)
    assert clock.slept[:spins] == [0] * spins  # the spin comes first
    assert timed[0] == _gpu_order.POLL_FIRST_S >= 1e-3  # never under the loop's tick
    assert timed == sorted(timed) and max(timed) == _gpu_order.POLL_MAX_S


def test_wait_event_on_an_event_that_never_fires_ends_at_the_deadline() -> None:
    clock, event = FakeClock(), FakeEvent(after=None)
    deadline = clock() + 0.25
    with pytest.raises(RelayTimeoutError, match="the writer's copy did not complete"):
        asyncio.run(
            _gpu_order.wait_event(
                event, deadline, "the writer's copy", clock=clock, sleep=clock.sleep
            )
        )
    assert clock.now == pytest.approx(deadline)  # never sleeps past it


def test_quarantine_holds_buffers_until_their_copy_is_done() -> None:
    q = _gpu_order.Quarantine()
    late, done = FakeEvent(after=None), FakeEvent()
    q.hold(late, "dst-tensors")
    q.hold(done, "other")
    assert q.prune() == 1 and len(q) == 1
    late.fire()
    assert q.prune() == 0


# -- the writer's fences --------------------------------------------------------------------


def test_slots_go_back_at_once_when_the_writers_copy_is_done() -> None:
    fences, back = _gpu_order.WriterFences(), []

    async def scenario() -> None:
        fences.add(7, FakeEvent())
        assert fences.free(7, lambda: back.append(7)) is True
        assert fences.free(8, lambda: back.append(8)) is True  # no event recorded: nothing queued

    asyncio.run(scenario())
    assert back == [7, 8] and fences.events == {} and fences.deferred == 0


def test_slots_of_a_lease_whose_copy_is_queued_wait_for_it() -> None:
    """Defect: abort, TTL or a release freed a lease whose copy was still queued,
    and the next lease in those slots was then overwritten."""
    fences, back = _gpu_order.WriterFences(), []
    queued = FakeEvent(after=None)

    async def scenario() -> None:
        fences.add(7, queued)
        assert fences.free(7, lambda: back.append(7)) is False
        for _ in range(20):
            await asyncio.sleep(0)
        assert back == [] and fences.deferred == 1  # still queued: not back
        queued.fire()
        await async_wait_until(lambda: back, 5, "the fence's lease back", interval=0.001)

    asyncio.run(scenario())
    assert back == [7] and fences.deferred == 0 and fences.events == {}


def test_a_lease_freed_twice_while_queued_is_released_once() -> None:
    fences, back = _gpu_order.WriterFences(), []
    queued = FakeEvent(after=None)

    async def scenario() -> None:
        fences.add(5, queued)
        assert fences.free(5, lambda: back.append("cancel")) is False
        assert fences.free(5, lambda: back.append("freed")) is False and fences.deferred == 1
        queued.fire()
        await async_wait_until(lambda: back, 5, "the fence's lease back", interval=0.001)

    asyncio.run(scenario())
    assert back == ["cancel"]


def test_off_a_loop_the_caller_waits_for_the_copy_then_frees() -> None:
    fences, back = _gpu_order.WriterFences(), []
    fences.add(9, FakeEvent(after=3))
    assert fences.free(9, lambda: back.append(9)) is True and back == [9]
    clock = FakeClock()
    never = FakeEvent(after=None)
    assert not _gpu_order.wait_event_blocking(
        never, clock() + 0.1, clock=clock, sleep=clock.sleep_sync
    )
    assert clock.now == pytest.approx(100.1)


def test_settle_waits_for_every_queued_copy_and_counts_the_late() -> None:
    fences = _gpu_order.WriterFences()
    fences.add(1, FakeEvent(after=3))
    fences.add(2, FakeEvent(after=None))

    async def scenario() -> int:
        return await fences.settle(asyncio.get_running_loop().time() + 0.05)

    assert asyncio.run(scenario()) == 1


def test_cancel_drops_deferred_releases() -> None:
    fences, back = _gpu_order.WriterFences(), []

    async def scenario() -> None:
        event = FakeEvent(after=None)
        fences.add(3, event)
        fences.free(3, lambda: back.append(3))
        deferred = asyncio.all_tasks() - {asyncio.current_task()}
        assert deferred and fences.deferred == 1
        fences.cancel()
        event.fire()  # a release still deferred would now run at its next poll
        # Until the deferred work has ended, not for a fixed time.
        await asyncio.wait_for(asyncio.gather(*deferred, return_exceptions=True), 5)

    asyncio.run(scenario())
    assert back == [] and fences.deferred == 0


# -- direct refs ------------------------------------------------------------------------------


def test_a_direct_ref_is_read_once() -> None:
    reads = _gpu_order.ReadOnce(memory=2)
    reads.claim(("e", "obj-1"), "this ref")
    with pytest.raises(StaleRefError, match="already read by this process"):
        reads.claim(("e", "obj-1"), "this ref")
    reads.forget(("e", "obj-1"))
    reads.claim(("e", "obj-1"), "this ref")
    reads.claim(("e", "obj-2"), "this ref")
    reads.claim(("e", "obj-3"), "this ref")  # memory bounded: the oldest is forgotten
    reads.claim(("e", "obj-1"), "this ref")


class _Spec:
    def __init__(self, index: int, nbytes: int) -> None:
        self.index, self.nbytes = index, nbytes


def test_a_partial_export_gives_back_the_counts_it_took() -> None:
    """Defect: the fallback to the pool after a partial export leaked the counts."""
    released: list[bytes] = []

    def export(t: str) -> pb.CudaIpcHandle:
        if t == "imported":
            raise RuntimeError("cannot re-export an IPC-imported storage")
        return pb.CudaIpcHandle(handle=t.encode(), ref_counter_handle=b"rc-" + t.encode())

    tensors = ["a", "empty", "b", "imported"]
    specs = [_Spec(0, 8), _Spec(1, 0), _Spec(2, 8), _Spec(3, 8)]
    got = _cuda_direct.export_all_direct(
        tensors, specs, export, lambda h: released.append(h.ref_counter_handle)
    )
    assert got is None and released == [b"rc-a", b"rc-b"]
    released.clear()
    ok = _cuda_direct.export_all_direct(
        tensors[:3], specs[:3], export, lambda h: released.append(h.ref_counter_handle)
    )
    assert ok is not None and ok[1] is None and [h.handle for h in ok if h] == [b"a", b"b"]
    assert released == []


def test_direct_mappings_are_cached_per_handle_and_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage this process still holds is reused, and the new share's count
    released, as torch.multiprocessing does; another offset is another mapping."""
    torch = pytest.importorskip("torch")
    from torch.multiprocessing import reductions

    opened: list[tuple[bytes, int]] = []
    released: list[tuple[bytes, int]] = []

    def new_shared_cuda(ordinal: int, handle: bytes, size: int, offset: int, *rest: Any) -> Any:
        opened.append((handle, offset))
        return torch.UntypedStorage(size)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    monkeypatch.setattr(
        torch.UntypedStorage,
        "_release_ipc_counter_cuda",
        lambda h, off: released.append((h, off)),
        raising=False,
    )
    monkeypatch.setattr(reductions, "shared_cache", reductions.SharedCache())

    def handle(offset: int, rc: int) -> pb.CudaIpcHandle:
        return pb.CudaIpcHandle(
            handle=b"H" * 64, storage_bytes=64, storage_offset_bytes=offset,
            ref_counter_handle=b"/rc", ref_counter_offset=rc,
        )  # fmt: skip

    first = _cuda_direct._open_direct(0, handle(0, 1))
    again = _cuda_direct._open_direct(0, handle(0, 2))  # while `first` is held: the same mapping
    assert opened == [(b"H" * 64, 0)] and released == [(b"/rc", 2)]
    assert again.data_ptr() == first.data_ptr()
    _cuda_direct._open_direct(0, handle(64, 3))  # another block of the same segment
    assert opened == [(b"H" * 64, 0), (b"H" * 64, 64)]
    del first, again
    _cuda_direct._open_direct(0, handle(0, 4))  # nobody holds it any more: opened anew
    assert opened[-1] == (b"H" * 64, 0) and released == [(b"/rc", 2)]
