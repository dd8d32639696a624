"""One sglang-omni stage process: its CommEngine and stage I/O over a relay.

``python -m tests.frameworks._sglang_stage ROLE --socket S --me EP --peer EP``

The stages talk over sglang-omni's own ZMQ control plane (DataReady and
DataAck messages); the data goes through the relay the stage is given
(``--relay relayd``, or sglang-omni's ``shm`` for comparison). Each process
prints JSON lines on stdout and, where the test must look at the daemon while
it is still attached, waits for a line on stdin.

Roles and scenarios:

* ``thinker --scenario pipeline``: a nested payload and a stream (chunks with
  metadata tensors, then done) of request r1 to the talker, then reads the
  payload the talker sends back for r1; and a payload of r3.
* ``talker --scenario pipeline``: reads them, prints what it read, and sends a
  payload of the same request back - after sglang-omni's read already called
  ``relay.cleanup(r1)``. A payload of r3 it frees unread (``discard``), twice.
* ``thinker/talker --scenario abort``: the thinker publishes r2; the talker
  aborts r2 as ``Stage.on_abort`` does (``CommEngine.cleanup``) before reading,
  then drains as a stage does, and both wait for stdin.
* ``thinker/talker --scenario latency``: for each of ``--sizes``, one payload
  of that many bytes per round, ``--rounds`` times, one at a time; the talker
  prints the median time
  from the thinker starting its send to the talker holding the data (both
  read CLOCK_MONOTONIC, which all processes share).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import torch
from sglang_omni.comm.data_ref import DataKind, DataRef, TransportKind
from sglang_omni.comm.engine import CommEngine
from sglang_omni.comm.router import CommRouter
from sglang_omni.pipeline.control_plane import PullSocket, PushSocket, send_to_endpoint
from sglang_omni.proto import DataAckMessage, DataReadyMessage, StagePayload
from sglang_omni.proto.request import OmniRequest
from sglang_omni.relay.base import Relay, create_relay

from tests._workers import digest, make_payload
from tests.frameworks._procs import REPORT

THINKER, TALKER = "thinker", "talker"
WAIT_S = 60.0
CHUNKS = 12
CHUNK_ELEMS = 16 * 1024  # 64 KiB of float32: above sglang-omni's inline limit


def emit(**kw: Any) -> None:
    print(REPORT, json.dumps(kw), flush=True)


def make_relay(kind: str, stage: str, socket: str) -> Relay:
    if kind == "relayd":
        # Looking the relay up registers it with sglang-omni's factory.
        from relayd_client.integrations.sglang_omni import RelaydRelay  # noqa: F401

        return create_relay("relayd", stage=stage, socket=socket)
    return create_relay("shm", engine_id=f"{stage}_shm", device="cpu", credits=64)


class ControlPlane:
    """What the engine publishes DataReady and DataAck messages through."""

    def __init__(self) -> None:
        self.sockets: dict[str, PushSocket] = {}

    async def send_to_stage(self, next_stage: str, endpoint: str, msg: Any, /) -> None:
        await send_to_endpoint(self.sockets, endpoint, msg)

    def close(self) -> None:
        for s in self.sockets.values():
            s.close()


class StageProc:
    def __init__(self, name: str, peer: str, args: argparse.Namespace) -> None:
        self.name, self.peer, self.args = name, peer, args
        self.relay = make_relay(args.relay, name, args.socket)
        self.engine = CommEngine(
            CommRouter(
                stage_name=name,
                gpu_id=None,
                same_process_targets=set(),
                gpu_stage_names=set(),
                injected_relay=self.relay,
                comm_config={"ack_timeout_s": WAIT_S},
            )
        )
        self.cp = ControlPlane()
        self.pull = PullSocket(args.me, bind=True)
        self.inbox: asyncio.Queue[DataReadyMessage] = asyncio.Queue()
        self.ready_done: set[str] = set()

    async def start(self) -> None:
        await self.pull.start()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            msg = await self.pull.recv()
            if isinstance(msg, DataAckMessage):
                self.engine.ack_transfer(msg)
            elif isinstance(msg, DataReadyMessage):
                await self.inbox.put(msg)

    async def next_ready(self) -> DataReadyMessage:
        return await asyncio.wait_for(self.inbox.get(), WAIT_S)

    async def ack(self, msg: DataReadyMessage, ref: DataRef, error: str | None = None) -> None:
        await self.cp.send_to_stage(
            self.peer,
            self.args.peer,
            DataAckMessage(
                request_id=msg.request_id,
                from_stage=self.name,
                to_stage=msg.from_stage,
                object_id=ref.object_id,
                success=error is None,
                error=error,
            ),
        )

    async def send_payload(self, request_id: str, data: Any) -> None:
        await self.engine.send_payload(
            relay=self.engine.relay(TransportKind.SHM),
            control_plane=self.cp,
            request_id=request_id,
            payload=StagePayload(
                request_id=request_id, request=OmniRequest(inputs="hi"), data=data
            ),
            transport=TransportKind.SHM,
            from_stage=self.name,
            to_stage=self.peer,
            target_endpoint=self.args.peer,
        )

    async def send_chunk(self, request_id: str, k: int, data: torch.Tensor, meta: Any) -> None:
        await self.engine.send_stream_chunk(
            relay=self.engine.relay(TransportKind.SHM),
            control_plane=self.cp,
            request_id=request_id,
            data=data,
            target_stage=self.peer,
            target_endpoint=self.args.peer,
            from_stage=self.name,
            chunk_id=k,
            metadata=meta,
            transport=TransportKind.SHM,
        )

    async def send_done(self, request_id: str) -> None:
        await self.cp.send_to_stage(
            self.peer,
            self.args.peer,
            DataReadyMessage(
                request_id=request_id,
                from_stage=self.name,
                to_stage=self.peer,
                data_ref=None,
                is_done=True,
            ),
        )

    async def read(self, msg: DataReadyMessage) -> tuple[DataRef, Any]:
        ref = DataRef.from_dict(msg.data_ref)
        relay = self.engine.inbound_relay(msg.from_stage)
        if ref.kind is DataKind.STAGE_PAYLOAD:
            payload = await self.engine.read_payload(
                relay=relay, request_id=msg.request_id, data_ref=ref
            )
            return ref, payload.data
        data, meta = await self.engine.read_stream_chunk(relay=relay, data_ref=ref)
        return ref, (data, meta)

    async def settle(self) -> None:
        """Every published object acknowledged and its put completed."""
        deadline = time.monotonic() + WAIT_S
        while self.engine.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.engine.pending)} transfers never acknowledged")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.pump.cancel()
        await self.engine.close()
        self.cp.close()
        self.pull.close()
        aclose = getattr(self.relay, "aclose", None)
        if aclose is not None:
            await aclose()


def chunk(k: int) -> tuple[torch.Tensor, dict[str, Any]]:
    g = torch.Generator().manual_seed(1000 + k)
    data = torch.randn(CHUNK_ELEMS, generator=g)
    return data, {"pos": k, "scale": torch.full((4096,), float(k)), "tag": f"c{k}"}


async def wait_stdin() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def thinker(p: StageProc) -> None:
    a = p.args
    if a.scenario == "pipeline":
        payload = make_payload(7, 300_000)
        await p.send_payload("r1", payload)
        sent_chunks = []
        for k in range(CHUNKS):
            data, meta = chunk(k)
            await p.send_chunk("r1", k, data, meta)
            sent_chunks.append(digest([data, meta]))
        await p.send_done("r1")
        await p.send_payload("r3", make_payload(8, 500_000))  # the talker drops it unread
        emit(sent_payload=digest(payload), sent_chunks=sent_chunks)
        msg = await p.next_ready()
        ref, back = await p.read(msg)
        await p.ack(msg, ref)
        emit(echo=back["echo"], echo_tensor=digest(back["t"]))
        await p.settle()
        emit(settled=True)
    elif a.scenario == "abort":
        await p.send_payload("r2", make_payload(9, 2_000_000))
        for k in range(CHUNKS):
            data, meta = chunk(k)
            await p.send_chunk("r2", k, data, meta)
        emit(published=True)
        await p.settle()  # the talker's negative acks end every transfer
        emit(settled=True)
        await wait_stdin()
    elif a.scenario == "latency":
        for size in a.sizes:
            for i in range(a.rounds):
                t = torch.randint(0, 255, (size,), dtype=torch.uint8)
                await p.send_payload(f"lat{size}-{i}", {"x": t, "t0": time.monotonic()})
                msg = await p.next_ready()  # the talker's go-ahead: it holds our data
                ref, _back = await p.read(msg)
                await p.ack(msg, ref)
        await p.settle()
        emit(settled=True)


async def talker(p: StageProc) -> None:
    a = p.args
    if a.scenario == "pipeline":
        got_payload: dict[str, Any] = {}
        order: list[int] = []
        sums: list[str] = []
        done = False
        dropped: list[str] = []
        while not (done and got_payload and dropped):
            msg = await p.next_ready()
            if msg.is_done:
                done = True
                continue
            if msg.request_id == "r3":  # forwarded past this stage: free it unread
                ref = DataRef.from_dict(msg.data_ref)
                info = ref.buffer.info
                await p.relay.discard(info)
                try:
                    await p.relay.discard(info)
                except Exception as exc:
                    dropped.append(type(exc).__name__)
                await p.ack(msg, ref)
                continue
            ref, obj = await p.read(msg)
            await p.ack(msg, ref)
            if ref.kind is DataKind.STAGE_PAYLOAD:
                got_payload = {"digest": digest(obj)}
                # Same request, after the read's cleanup(r1): must still go through.
                await p.send_payload("r1", {"echo": digest(obj), "t": torch.arange(70_000)})
            else:
                order.append(msg.chunk_id)
                sums.append(digest([obj[0], obj[1]]))
        emit(payload=got_payload["digest"], order=order, chunks=sums, second_discard=dropped)
        await p.settle()
        emit(settled=True)
    elif a.scenario == "abort":
        held = [await p.next_ready() for _ in range(1 + CHUNKS)]
        p.engine.cleanup("r2")  # what Stage.on_abort does
        failed = 0
        for msg in held:  # a stage drains what was published for an aborted request
            ref = DataRef.from_dict(msg.data_ref)
            try:
                await p.read(msg)
            except Exception as exc:
                failed += 1
                await p.ack(msg, ref, error=f"{type(exc).__name__}: {exc}")
            else:
                await p.ack(msg, ref)
        emit(aborted=True, drained=len(held), failed=failed)
        await wait_stdin()
    elif a.scenario == "latency":
        medians = {}
        for size in a.sizes:
            times = []
            for _ in range(a.rounds):
                msg = await p.next_ready()
                ref, obj = await p.read(msg)
                times.append(time.monotonic() - obj["t0"])
                assert obj["x"].numel() == size
                await p.ack(msg, ref)
                await p.send_payload(msg.request_id, {"ok": True})
            warm = times[len(times) // 5 :]  # the first rounds open sessions, map memory
            medians[str(size)] = statistics.median(warm)
        await p.settle()
        emit(median_s=medians)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=[THINKER, TALKER])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--me", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--scenario", choices=["pipeline", "abort", "latency"], required=True)
    ap.add_argument("--relay", choices=["relayd", "shm"], default="relayd")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256 * 1024, 4 << 20])
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()
    p = StageProc(a.role, TALKER if a.role == THINKER else THINKER, a)
    await p.start()
    try:
        await (thinker(p) if a.role == THINKER else talker(p))
    finally:
        await p.close()


if __name__ == "__main__":
    asyncio.run(main())
