"""What relayd is measured against: the physical limit, the pooled floor, the patterns it replaces.

Imported only inside benchmark processes (it imports torch).

- ``memcpy``: one hot in-process copy; no hand-off can beat it.
- ``floor``: one pre-faulted /dev/shm segment of 4 page-aligned slots, mapped once
  by both processes; the writer copies into the next slot and sends a 64-byte
  notify, the reader copies out into a fresh tensor. relayd's copy-out read should
  approach this.
- ``floor-view``: the same, but the reader takes a zero-copy view (one copy in all).
- ``floor-async``: ``floor`` driven from an event loop, as relayd's async client is:
  the part of relayd's cost that is asyncio, not relayd.
- ``shm-per-transfer``: the seed pattern: a new ``multiprocessing.shared_memory``
  segment per transfer, so every transfer pays create, first-touch faults and unlink.
- ``pickle-uds``: the tensor pickled over the Unix socket, read fully and unpickled.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch
from relayd_client.wire.paths import SHM_DIR

from relayd_bench._api import AsyncPairMethod, BenchContext, LocalMethod, PairMethod

PAGE = mmap.PAGESIZE
FLOOR_SLOTS = 4  # rotate like a pool does, so the slot side is not artificially cache-hot
_FLOOR_NOTE = struct.Struct("<QQQ40x")  # offset, length, transfer: a 64-byte descriptor
_NAME_NOTE = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Segment:
    """A /dev/shm file mapped shared with MAP_POPULATE, so every page is faulted in up front."""

    def __init__(self, name: str, size: int | None) -> None:
        path = os.path.join(SHM_DIR, name)
        create = size is not None
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if size is not None:
                os.ftruncate(fd, size)
            length = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, length, flags=flags)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.name = name
        self.path = path
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None  # views must be gone too, or the mmap refuses to close
        self._map.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Floor(PairMethod):
    """Pooled shared memory at its simplest: the target relayd's shm path should approach."""

    def _slots(self, seg: _Segment, size: int) -> list[torch.Tensor]:
        assert seg.tensor is not None
        self.stride = _round_up(size, PAGE)
        return [seg.tensor.narrow(0, k * self.stride, size) for k in range(FLOOR_SLOTS)]

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.size = size
        self.source = source
        self.seg = _Segment(self.ctx.segment_name("floor"), _round_up(size, PAGE) * FLOOR_SLOTS)
        self.slot_views = self._slots(self.seg, size)
        assert self.seg.tensor is not None
        self.seg.tensor.zero_()  # fault every page in now, never during a transfer
        return self.seg.name.encode()

    def send(self, i: int) -> bytes:
        k = i % FLOOR_SLOTS
        self.slot_views[k].copy_(self.source)
        return _FLOOR_NOTE.pack(k * self.stride, self.size, i)

    def teardown_writer(self) -> None:
        self.slot_views = []
        self.seg.close()
        self.seg.unlink()

    def setup_reader(self, size: int, blob: bytes) -> None:
        self.size = size
        self.seg = _Segment(blob.decode(), None)
        self.slot_views = self._slots(self.seg, size)
        for view in self.slot_views:
            view[::PAGE].sum()  # touch each page once so the first transfers do not fault

    def _slot(self, notify: memoryview) -> torch.Tensor:
        offset, length, _ = (int(v) for v in _FLOOR_NOTE.unpack_from(notify))
        if length != self.size or offset % self.stride:
            raise ValueError(f"bad descriptor: offset {offset}, length {length}")
        return self.slot_views[offset // self.stride]

    def recv(self, notify: memoryview) -> torch.Tensor:
        out = torch.empty(self.size, dtype=torch.uint8)
        out.copy_(self._slot(notify))
        return out

    def teardown_reader(self) -> None:
        self.slot_views = []
        self.seg.close()


class FloorView(Floor):
    """The floor with a zero-copy read: one copy per hand-off, the writer's."""

    def recv(self, notify: memoryview) -> torch.Tensor:
        return self._slot(notify)


class FloorAsync(AsyncPairMethod):
    """The floor with coroutine hooks: compare relayd's async client with this, not only floor."""

    def __init__(self, ctx: BenchContext) -> None:
        super().__init__(ctx)
        self._floor = Floor(ctx)

    async def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        return self._floor.setup_writer(size, source)

    async def send(self, i: int) -> bytes:
        return self._floor.send(i)

    async def teardown_writer(self) -> None:
        self._floor.teardown_writer()

    async def setup_reader(self, size: int, blob: bytes) -> None:
        self._floor.setup_reader(size, blob)

    async def recv(self, notify: memoryview) -> torch.Tensor:
        return self._floor.recv(notify)

    async def teardown_reader(self) -> None:
        self._floor.teardown_reader()


def _untrack(shm: SharedMemory) -> None:
    # The writer hands the segment over: its reader unlinks it. Left registered, the
    # resource tracker would unlink it again (and warn) when the benchmark exits.
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")


class ShmPerTransfer(PairMethod):
    """The seed pattern: a new segment per transfer, made by the writer, unlinked by the reader."""

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.size = size
        self.source = source
        return b""

    def send(self, i: int) -> bytes:
        name = self.ctx.segment_name("spt")
        shm = SharedMemory(name=name, create=True, size=self.size)
        try:
            _untrack(shm)
            dst = torch.frombuffer(shm.buf, dtype=torch.uint8)[: self.size]
            dst.copy_(self.source)
            del dst  # release the buffer export, or close() refuses
        finally:
            shm.close()
        return name.encode().ljust(_NAME_NOTE, b"\0")

    def setup_reader(self, size: int, blob: bytes) -> None:
        self.size = size
        self.shm: SharedMemory | None = None

    def recv(self, notify: memoryview) -> torch.Tensor:
        name = bytes(notify).rstrip(b"\0").decode()
        self.shm = SharedMemory(name=name)  # attach registers it; unlink() unregisters
        src = torch.frombuffer(self.shm.buf, dtype=torch.uint8)[: self.size]
        out = torch.empty(self.size, dtype=torch.uint8)
        out.copy_(src)
        del src
        return out

    def cleanup(self) -> None:
        shm, self.shm = self.shm, None
        if shm is not None:
            shm.close()
            shm.unlink()


class PickleUds(PairMethod):
    """The tensor itself, pickled, over the socket; the reader reads it all and unpickles."""

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.source = source
        return b""

    def send(self, i: int) -> bytes:
        return pickle.dumps(self.source)  # as the reference: default protocol

    def recv(self, notify: memoryview) -> torch.Tensor:
        t = pickle.loads(notify)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"unpickled {type(t).__name__}, not a tensor")
        return t


class Memcpy(LocalMethod):
    """One hot in-process copy between preallocated tensors: the physical limit."""

    def setup(self, size: int, source: torch.Tensor) -> None:
        self.source = source
        self.dst = torch.empty(size, dtype=torch.uint8)
        self.dst.copy_(source)  # fault the destination in

    def transfer(self, i: int) -> torch.Tensor:
        self.dst.copy_(self.source)
        return self.dst
