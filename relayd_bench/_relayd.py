"""relayd itself, through its client, in the same harness as the baselines.

Imported only inside benchmark processes. If ``relayd_client`` does not import,
the registry reports these methods as skipped before any process starts.

Every method attaches one client per process and stage at setup (not timed; the
lanes of a stream-workload process share it, as a stage worker's requests share
its one client) and, per transfer, does exactly what an application does: the
writer ``put``s and sends ``ref.to_bytes()`` as its notify; the reader rebuilds the
``DataRef`` and ``get``s (a copy) or enters ``view`` (zero-copy, released in
``cleanup`` before the ack). The transport relayd picked is recorded in the
results (``extra``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from relayd_client import (  # type: ignore[import-not-found, unused-ignore]
    DataRef,
    RelayClient,
    SyncRelayClient,
)
from relayd_client.wire.proto import relay_pb2 as pb

from relayd_bench import _daemon, _rtt
from relayd_bench._api import LATE_HANDOFF_S, AsyncLocalMethod, AsyncPairMethod, PairMethod
from relayd_bench._lanes import shared

WRITER_STAGE = "bench-writer"
READER_STAGE = "bench-reader"
ROUTE_WAIT_S = 10.0
# How long the writer's report waits for the reader's daemon to count the last
# reads: an announced read is counted when its lingering Release arrives.
COUNTED_WAIT_S = 2.0


@dataclasses.dataclass
class _Shared:
    opened: asyncio.Future[RelayClient]
    users: int = 0


# per event loop, stage and daemon socket: the lanes of one process share one client
_CLIENTS: dict[tuple[asyncio.AbstractEventLoop, str, str | None], _Shared] = {}


async def _opened(stage: str, socket: str | None) -> RelayClient:
    client = RelayClient(stage=stage, socket=socket)
    await client.open()
    return client


@contextlib.asynccontextmanager
async def shared_client(stage: str, socket: str | None) -> AsyncIterator[RelayClient]:
    """This process's ``RelayClient`` of ``stage``; closed when its last user leaves."""
    key = (asyncio.get_running_loop(), stage, socket)
    shared = _CLIENTS.get(key)
    if shared is None:
        shared = _CLIENTS[key] = _Shared(asyncio.ensure_future(_opened(stage, socket)))
    shared.users += 1
    try:
        yield await asyncio.shield(shared.opened)
    finally:
        shared.users -= 1
        if not shared.users:
            del _CLIENTS[key]
            if not shared.opened.done():
                shared.opened.cancel()
            elif not shared.opened.cancelled() and shared.opened.exception() is None:
                await shared.opened.result().close()


def _open_sync(stage: str, socket: str | None) -> SyncRelayClient:
    client = SyncRelayClient(stage=stage, socket=socket)
    client.open()
    return client


def shared_sync_client(
    stage: str, socket: str | None
) -> contextlib.AbstractContextManager[SyncRelayClient]:
    """This process's ``SyncRelayClient`` of ``stage`` (it is thread-safe)."""
    return shared(
        ("sync-client", stage, socket), lambda: _open_sync(stage, socket), SyncRelayClient.close
    )


def transport_name(ref: Any) -> str:
    t = getattr(ref, "transport", None)  # relayd_client.Transport; its values are lower-case names
    value = getattr(t, "value", t)
    return str(value) if value is not None else "unknown"


class RelaydShm(AsyncPairMethod):
    """put() into the daemon's arena; the reader get()s a private copy (the default read)."""

    reader_copy = True
    expect_transport: str | None = None

    def _stages(self) -> tuple[str, str]:
        # one stage pair per stream, so concurrent streams never read each other's data
        k = self.ctx.stream_index
        return f"{WRITER_STAGE}-{k}", f"{READER_STAGE}-{k}"

    def _reader_socket(self) -> str | None:
        return self.ctx.socket

    async def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.size = size
        self.source = source
        self.stack = contextlib.AsyncExitStack()
        self.client = await self.stack.enter_async_context(
            shared_client(self._stages()[0], self.ctx.socket)
        )
        return b""

    async def send(self, i: int) -> bytes:
        ref = await self.client.put(
            {"t": self.source},
            to_stage=self._stages()[1],
            request_id=self.ctx.request_id(self.size, i),
        )
        if i == 0:
            self.extra["transport"] = transport_name(ref)
            if self.expect_transport and self.extra["transport"] != self.expect_transport:
                raise RuntimeError(
                    f"relayd moved a {self.size}-byte put over {self.extra['transport']},"
                    f" not {self.expect_transport}"
                )
        wire: bytes = ref.to_bytes()
        return wire

    async def teardown_writer(self) -> None:
        await self.stack.aclose()

    async def setup_reader(self, size: int, blob: bytes) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.client = await self.stack.enter_async_context(
            shared_client(self._stages()[1], self._reader_socket())
        )
        self.view: Any = None

    async def recv(self, notify: memoryview) -> torch.Tensor:
        ref = DataRef.from_bytes(bytes(notify))
        if self.reader_copy:
            obj = await self.client.get(ref)
        else:
            self.view = self.client.view(ref)
            obj = await self.view.__aenter__()
        tensor: torch.Tensor = obj["t"]
        return tensor

    async def cleanup(self) -> None:
        view, self.view = self.view, None
        if view is not None:
            await view.__aexit__(None, None, None)

    async def teardown_reader(self) -> None:
        await self.stack.aclose()


class RelaydShmView(RelaydShm):
    """put() as above; the reader holds a zero-copy view until cleanup (one copy in all)."""

    reader_copy = False


class RelaydInline(RelaydShm):
    """Small puts travel inside the DataRef itself; fails if relayd picks anything else."""

    expect_transport = "inline"


def _reads(sock: str | None) -> _rtt.ReadCounts | None:
    """The reads the daemon at ``sock`` counted, by how each found its bytes."""
    return None if sock is None else _rtt.read_counts(_daemon.status(sock))


def _counted_reads(sock: str | None, before: _rtt.ReadCounts, sent: int) -> dict[str, str]:
    """How the reads since ``before`` found their bytes, and the round trips they
    waited for (``extra``: see ``_rtt``), once the daemon at ``sock`` has counted
    ``sent`` of them or ``COUNTED_WAIT_S`` has passed; blocking."""
    deadline = time.monotonic() + COUNTED_WAIT_S
    after = _reads(sock)
    while after is not None and (after - before).total < sent and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the daemon's counters, bounded above
        after = _reads(sock)
    if after is None:
        return {}
    d = after - before
    extras = {"reads": f"{d.landed}/{d.awaited}/{d.pulled}/{d.attached}/{d.announced}"}
    rt = _rtt.relayd_round_trips(d)
    bound = _rtt.relayd_round_trips(d, landed_as_awaited=True)
    if rt is not None and bound is not None:
        extras[_rtt.EXTRA_RT] = _rtt.fmt_rt(rt)
        extras[_rtt.EXTRA_RT_BOUND] = _rtt.fmt_rt(bound)
    return extras


def _note_sent(method: Any, i: int, wire: bytes) -> None:
    """A cross-node writer sent put ``i`` as ``wire``: counted for the read counts
    its report waits for; the first says whether the put asked for a push."""
    method.sent = i + 1
    if i == 0:
        method.extra["push"] = "yes" if DataRef.from_bytes(wire).proto.push else "no"


async def _until_routed_across(client: RelayClient, to_stage: str) -> None:
    """The writer's daemon learns which node serves the reader's stage at its next
    heartbeat after the reader attached; a put before that is pulled, not pushed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ROUTE_WAIT_S
    while loop.time() < deadline:
        client._routes.forget()
        key = (to_stage, True, (), False)  # a CPU payload too large for inline
        if await client._routes.ask(key, 1 << 20, False, False) == pb.TRANSPORT_MOONCAKE:
            return
        await asyncio.sleep(0.05)  # polling the daemon's registry, bounded above


class RelaydMooncake(RelaydShm):
    """Reader attached to another node's daemon: the writer's daemon pushes the bytes
    there over Mooncake TE as soon as they are published (or the reader's pulls them).

    The round trips each read waited for come from the reader's daemon's counters,
    read before the first transfer of a size and after its last ack (see ``_rtt``).
    """

    def _reader_socket(self) -> str | None:
        return self.ctx.reader_socket

    async def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        blob = await super().setup_writer(size, source)
        self.reads_before = await asyncio.to_thread(_reads, self.ctx.reader_socket)
        self.sent = 0
        return blob

    async def finish_writer(self) -> None:
        if self.reads_before is not None:
            sock, sent = self.ctx.reader_socket, self.sent
            self.extra.update(
                await asyncio.to_thread(_counted_reads, sock, self.reads_before, sent)
            )

    async def start_writer(self) -> None:
        await _until_routed_across(self.client, self._stages()[1])

    async def send(self, i: int) -> bytes:
        wire = await super().send(i)
        _note_sent(self, i, wire)
        return wire


class RelaydMooncakeView(RelaydMooncake):
    """relayd-mooncake with the reader in a zero-copy view of the landed bytes, as
    mooncake-raw's reader uses its registered buffer in place (one copy in all)."""

    reader_copy = False


class RelaydMooncakeLate(RelaydMooncake):
    """relayd-mooncake with the DataRef handed over ``LATE_HANDOFF_S`` after the put,
    as through a scheduler: the push has landed, and the get reads it where its
    daemon announced it landed."""

    handoff_delay_s = LATE_HANDOFF_S


class RelaydSync(PairMethod):
    """The blocking client: put and get on the caller's thread, no event loop in the hooks."""

    def _stages(self) -> tuple[str, str]:
        k = self.ctx.stream_index
        return f"{WRITER_STAGE}-{k}", f"{READER_STAGE}-{k}"

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.size = size
        self.source = source
        self.stack = contextlib.ExitStack()
        self.client = self.stack.enter_context(
            shared_sync_client(self._stages()[0], self.ctx.socket)
        )
        return b""

    def send(self, i: int) -> bytes:
        ref = self.client.put(
            {"t": self.source},
            to_stage=self._stages()[1],
            request_id=self.ctx.request_id(self.size, i),
        )
        if i == 0:
            self.extra["transport"] = transport_name(ref)
        wire: bytes = ref.to_bytes()
        return wire

    def teardown_writer(self) -> None:
        self.stack.close()

    def setup_reader(self, size: int, blob: bytes) -> None:
        self.stack = contextlib.ExitStack()
        self.client = self.stack.enter_context(
            shared_sync_client(self._stages()[1], self.ctx.socket)
        )

    def recv(self, notify: memoryview) -> torch.Tensor:
        obj = self.client.get(DataRef.from_bytes(bytes(notify)))
        tensor: torch.Tensor = obj["t"]
        return tensor

    def teardown_reader(self) -> None:
        self.stack.close()


class RelaydMooncakeSync(RelaydSync):
    """relayd-mooncake with the blocking client on both sides (the vLLM connector's)."""

    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        blob = super().setup_writer(size, source)
        self.reads_before = _reads(self.ctx.reader_socket)
        self.sent = 0
        return blob

    def start_writer(self) -> None:
        self.client._run(_until_routed_across(self.client._client, self._stages()[1]))

    def send(self, i: int) -> bytes:
        wire = super().send(i)
        _note_sent(self, i, wire)
        return wire

    def finish_writer(self) -> None:
        if self.reads_before is not None:
            sock, sent = self.ctx.reader_socket, self.sent
            self.extra.update(_counted_reads(sock, self.reads_before, sent))

    def setup_reader(self, size: int, blob: bytes) -> None:
        self.stack = contextlib.ExitStack()
        self.client = self.stack.enter_context(
            shared_sync_client(self._stages()[1], self.ctx.reader_socket)
        )


class RelaydLocal(AsyncLocalMethod):
    """Both stages in one process: relayd hands over a reference (local_object), no bytes move."""

    async def setup(self, size: int, source: torch.Tensor) -> None:
        self.size = size
        self.source = source
        self.stack = contextlib.AsyncExitStack()
        self.writer = await self.stack.enter_async_context(
            RelayClient(stage=WRITER_STAGE, socket=self.ctx.socket)
        )
        self.reader = await self.stack.enter_async_context(
            RelayClient(stage=READER_STAGE, socket=self.ctx.socket)
        )

    async def transfer(self, i: int) -> torch.Tensor:
        ref = await self.writer.put(
            {"t": self.source}, to_stage=READER_STAGE, request_id=self.ctx.request_id(self.size, i)
        )
        if i == 0:
            self.extra["transport"] = transport_name(ref)
        obj = await self.reader.get(DataRef.from_bytes(ref.to_bytes()))
        tensor: torch.Tensor = obj["t"]
        return tensor

    async def teardown(self) -> None:
        await self.stack.aclose()
