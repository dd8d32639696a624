"""``relayd demo``: a thinker process streams hidden states to a talker process.

Starts a daemon on the embedded default unless one already answers on the
socket, then runs two stage processes: the thinker puts one chunk per step
(plus a small control chunk that rides inline), sends each DataRef over a
pipe - standing in for the application's own control channel - and the talker
gets and verifies every chunk. Prints what went through which transport and
the daemon's view at the end.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import multiprocessing as mp
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

from relayd_client.wire.paths import default_socket_path

from . import launch
from .launch import DaemonProcess

DAEMON_READY_S, DAEMON_STOP_S = 60.0, 30.0


def _digest(t: Any) -> str:
    # The bytes where they lie: bfloat16, the hidden states' dtype, has no numpy twin.
    t = t.contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest()[
        :16
    ]


def _thinker(socket: str, chunks: int, chunk_bytes: int, conn: Connection) -> None:
    import torch
    from relayd_client import RelayClient

    async def run() -> None:
        async with RelayClient("thinker", socket) as client:
            hidden = chunk_bytes // 2  # bf16
            for k in range(chunks):
                h = torch.randn(hidden // 1024, 1024).to(torch.bfloat16)
                ref = await client.put(
                    {"hidden": h, "step": k},
                    to_stage="talker",
                    request_id="demo-request",
                    chunk_id=k,
                )
                conn.send((ref.to_bytes(), _digest(h)))
                ctrl = await client.put(
                    {"step": k, "tokens": [k, k + 1]},
                    to_stage="talker",
                    request_id="demo-request-ctrl",
                )
                conn.send((ctrl.to_bytes(), ""))
            conn.send(None)

    asyncio.run(run())


def _talker(socket: str, conn: Connection, result: Connection) -> None:
    from relayd_client import DataRef, RelayClient

    async def run() -> None:
        seen: Counter[str] = Counter()
        ok = bad = 0
        nbytes = 0
        t0 = time.perf_counter()
        async with RelayClient("talker", socket) as client:
            loop = asyncio.get_running_loop()
            while True:
                item = await loop.run_in_executor(None, conn.recv)
                if item is None:
                    break
                wire, want = item
                if not seen:  # time the stream, not the processes starting up
                    t0 = time.perf_counter()
                ref = DataRef.from_bytes(wire)
                obj = await client.get(ref)
                seen[ref.transport.value] += 1
                if want:
                    nbytes += ref.nbytes
                    if _digest(obj["hidden"]) == want:
                        ok += 1
                    else:
                        bad += 1
        result.send((dict(seen), ok, bad, nbytes, time.perf_counter() - t0))

    asyncio.run(run())


def run_demo(*, socket: str | None, chunks: int, chunk_bytes: int) -> int:
    socket = socket or default_socket_path()
    daemon: DaemonProcess | None = None
    if launch.health(socket):
        print(f"starting relayd on {socket} (embedded default)", flush=True)
        daemon = DaemonProcess.serve(socket)  # its log goes to this terminal
        try:
            daemon.start(DAEMON_READY_S)
        except launch.DaemonStartError as exc:
            print(f"relayd did not start ({exc}); see its log above", file=sys.stderr)
            return 1
    else:
        print(f"using the relayd already serving on {socket}", flush=True)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_thinker, args=(socket, chunks, chunk_bytes, a), name="thinker"),
        ctx.Process(target=_talker, args=(socket, b, res_send), name="talker"),
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        while not res_recv.poll(0.5):
            failed = [p.name for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"{', '.join(failed)} failed" if failed else "timed out"
                print(f"demo {why}; see the traceback above", file=sys.stderr)
                return 1
        seen, ok, bad, nbytes, seconds = res_recv.recv()
        for p in procs:
            p.join(30)
        print(
            f"thinker -> talker: {chunks} hidden-state chunks of {chunk_bytes} bytes, "
            f"{ok} verified, {bad} corrupted, {nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"
        )
        for transport, n in sorted(seen.items()):
            print(f"  {transport:<14} {n:>6} transfers")
        from relayd.status_tables import render_status
        from relayd.status_view import fetch_status, status_dict

        print(render_status(status_dict(fetch_status(socket))))
        return 0 if bad == 0 and ok == chunks else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if daemon is not None:
            print(f"relayd stopped (exit {daemon.stop(timeout_s=DAEMON_STOP_S)})")
