"""Raw Mooncake Transfer Engine between two processes: what relayd-mooncake is held against.

Imported only inside benchmark processes (it imports torch; Mooncake itself when a
size starts). Each side's engine is set up as relayd's daemons set up theirs (see
``relayd.transports.mooncake``): P2PHANDSHAKE mode (no metadata server; the session
id is ``"host:rpc port"``), TCP forced, the same ``MC_*`` environment, here on
127.0.0.1, or with ``--netns`` on each side's namespace address (``ctx.hosts``).

One engine per process (the lanes of a stream-workload process share it, each with
its own buffer):

- writer: an engine and a registered, pre-faulted buffer of ``FLOOR_SLOTS``
  page-aligned slots; per transfer it copies the payload into the next slot (as the
  floor does) and notifies the slot. The setup blob carries its session id and the
  buffer's address, all the reader needs to reach it.
- reader: its own engine and registered buffer of the same shape; per transfer one
  ``transfer_sync_read`` of the whole payload from the writer's slot into its own
  slot, then the ack. The returned tensor is a view of that slot: the bytes Mooncake
  wrote, without the copy-out relayd-mooncake's ``get()`` adds.

The sync call busy-spins the reader's core until the read completes (or fails after
``MC_TRANSFER_TIMEOUT``); nothing else runs in the reader meanwhile, so the blocking
``PairMethod`` contract fits and no thread is needed. For the same reason the
stream workload gives it a process pair per stream (``shares_process=False`` in the
registry): sixteen threads spinning in one process on two cores sustained 612-628
of 800 chunks a second.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from relayd.config import Settings
from relayd.transports.mooncake import mooncake_environment
from relayd_bench import _rtt
from relayd_bench._api import LATE_HANDOFF_S, PairMethod
from relayd_bench._baselines import FLOOR_SLOTS, PAGE
from relayd_bench._lanes import shared

_NOTE = struct.Struct("<QQ48x")  # slot, transfer: 64 bytes, as the floor's notify


class _Captured:
    text = ""


@contextlib.contextmanager
def _stderr_captured() -> Iterator[_Captured]:
    """Send fd 2 to a temporary file for the block; its text is in the result afterwards.

    Mooncake logs a warning and an error at every engine start even when all is well
    ("Local segment descriptor not found" in P2PHANDSHAKE mode); on the terminal they
    would interleave with the bench's progress. They are kept for the error message
    of a start that fails.
    """
    got = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield got
            finally:
                os.dup2(saved, 2)
                tmp.seek(0)
                got.text = tmp.read().decode(errors="replace")
    finally:
        os.close(saved)


def _open_engine(host: str) -> tuple[Any, str]:
    """An engine initialised as relayd's daemons initialise theirs; (engine, session id)."""
    # Mooncake reads MC_LOG_LEVEL when it is first imported: set everything before that.
    for key, value in mooncake_environment(Settings(), os.environ).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    with _stderr_captured() as said:
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        log = " | ".join(line.strip() for line in said.text.splitlines()[-5:] if line.strip())
        raise RuntimeError(f"mooncake initialize as {host} over tcp returned {rc}: {log}")
    return engine, f"{host}:{int(engine.get_rpc_port())}"


class _Buffer:
    """Anonymous memory of FLOOR_SLOTS page-aligned slots, faulted in and registered."""

    def __init__(self, engine: Any, size: int) -> None:
        self.stride = -(-size // PAGE) * PAGE
        length = self.stride * FLOOR_SLOTS
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, length, flags=flags)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor.zero_()  # every page faulted in now, never during a transfer
        self.slots: list[torch.Tensor] = [
            self.tensor.narrow(0, k * self.stride, size) for k in range(FLOOR_SLOTS)
        ]
        self.base = int(self.tensor.data_ptr())
        self._engine: Any = None
        rc = engine.register_memory(self.base, length)
        if rc != 0:
            self.close()
            raise RuntimeError(f"mooncake register_memory of {length} B returned {rc}")
        self._engine = engine

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self.base)
        self.slots = []
        self.tensor = None  # views must be gone too, or the mmap refuses to close
        self._map.close()


class MooncakeRaw(PairMethod):
    """Mooncake TE at its simplest, one sync read per transfer: the target of relayd-mooncake."""

    engine: Any = None
    buffer: _Buffer | None = None

    def _open(self, size: int, host: str) -> _Buffer:
        self.size = size
        self.stack = contextlib.ExitStack()
        # the last user's exit drops the engine's last reference, which stops its threads
        engine = shared(("mooncake", host), lambda: _open_engine(host), lambda _: None)
        self.engine, self.session = self.stack.enter_context(engine)
        self.buffer = _Buffer(self.engine, size)
        return self.buffer

    def _close(self) -> None:
        buffer, self.buffer = self.buffer, None
        try:
            if buffer is not None:
                buffer.close()
        finally:
            # The last user's reference: the engine stops its threads then (about a second).
            self.engine = None
            self.stack.close()

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.source = source
        buf = self._open(size, self.ctx.hosts[0])
        blob = {"session": self.session, "base": buf.base, "stride": buf.stride}
        return json.dumps(blob).encode()

    def send(self, i: int) -> bytes:
        assert self.buffer is not None
        k = i % FLOOR_SLOTS
        self.buffer.slots[k].copy_(self.source)
        return _NOTE.pack(k, i)

    def teardown_writer(self) -> None:
        self._close()

    def setup_reader(self, size: int, blob: bytes) -> None:
        writer = json.loads(blob)
        self.peer, self.remote_base = str(writer["session"]), int(writer["base"])
        self.remote_stride = int(writer["stride"])
        self._open(size, self.ctx.hosts[1])
        self.reads = self.transfers = 0

    def recv(self, notify: memoryview) -> torch.Tensor:
        assert self.buffer is not None
        k = int(_NOTE.unpack_from(notify)[0])
        if k >= FLOOR_SLOTS:
            raise ValueError(f"bad notify: slot {k}")
        local = self.buffer.base + k * self.buffer.stride
        remote = self.remote_base + k * self.remote_stride
        rc = self.engine.transfer_sync_read(self.peer, local, remote, self.size)
        self.reads += 1
        self.transfers += 1
        if rc != 0:
            raise RuntimeError(
                f"mooncake transfer_sync_read of {self.size} B from {self.peer} returned {rc}"
                " (the reason is in Mooncake's log above)"
            )
        return self.buffer.slots[k]

    def teardown_reader(self) -> None:
        self._close()

    def cleanup(self) -> None:
        # each transfer's count so far, as relayd-mooncake's come from its daemon's counters
        rt = _rtt.bare_read_round_trips(self.reads, self.transfers)
        if rt is not None:
            self.extra[_rtt.EXTRA_RT] = _rtt.fmt_rt(rt)


class MooncakeRawLate(MooncakeRaw):
    """The same read, its DataRef handed over ``LATE_HANDOFF_S`` after the write."""

    handoff_delay_s = LATE_HANDOFF_S
