"""Victim stage processes for the fault tests, forked from one pre-imported zygote.

``python -m tests.faults._chaos --socket PATH`` reads one JSON command per line
on stdin, forks a child that plays the role, and answers with the child's pid.
Forking skips the ~2 s torch import per victim, so a bounded test can kill
dozens of real processes. The zygote itself never touches torch, gRPC or an
event loop before forking, so nothing inherited is half-initialised.

Each child appends one line per step to its ``out`` file (flushed at once):
the test polls it to kill the child at a chosen point, then SIGKILLs it.

Roles:

* ``writer``: puts payloads (sizes from ``sizes``) to ``to`` forever, printing
  ``REF <hex> <digest>`` after each publish.
* ``stream``: the same, as chunks of one request (``chunk_id`` 0, 1, ...).
* ``hold-grant``: takes a grant and reserves a lease it never publishes.
* ``view``: zero-copy get of ``ref`` and holds the views (CLAIMED).
* ``read``: copies out each ref of ``refs`` in turn, printing ``OK <digest>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

import torch  # noqa: F401  (imported before fork: the point of the zygote)
from relayd_client import DataRef, RelayClient, RelayError
from relayd_client.wire.proto import relay_pb2 as pb

from tests._workers import digest, make_payload

HOLD_SECONDS = 300.0


def _emit(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()


async def _writer(c: RelayClient, cmd: dict[str, Any], out: TextIO, stream: bool) -> None:
    sizes: list[int] = cmd["sizes"]
    seed: int = cmd["seed"]
    for i in range(1 << 30):
        size = sizes[(seed + i) % len(sizes)]
        payload = make_payload(seed * 1000 + i, size)
        rid = f"{cmd['tag']}" if stream else f"{cmd['tag']}-{i}"
        ref = await c.put(
            payload,
            to_stage=cmd["to"],
            request_id=rid,
            chunk_id=i if stream else None,
            timeout=cmd.get("timeout", 5.0),
        )
        _emit(out, f"REF {ref.to_bytes().hex()} {digest(payload)}")


async def _hold_grant(c: RelayClient, cmd: dict[str, Any], out: TextIO) -> None:
    lease = await c._grants.reserve(cmd["sizes"][0], time.monotonic() + 5)
    c._conn.session.pending.reserve.append(
        pb.Reserve(
            lease_id=lease.id,
            grant_id=lease.grant.id,
            slot=lease.slot,
            nslots=lease.nslots,
            generation=lease.id,
            request_id=cmd["tag"],
            to_stage=cmd["to"],
            from_stage=c.stages[0],
        )
    )
    c._conn.session.mark(flush=True)
    _emit(out, "RESERVED")
    await asyncio.sleep(HOLD_SECONDS)  # held until the test kills us


async def _view(c: RelayClient, cmd: dict[str, Any], out: TextIO) -> None:
    obj = await c.get(DataRef.from_bytes(bytes.fromhex(cmd["ref"])), copy=False)
    _emit(out, f"CLAIMED {digest(obj)}")
    await asyncio.sleep(HOLD_SECONDS)  # held until the test kills us


async def _read(c: RelayClient, cmd: dict[str, Any], out: TextIO) -> None:
    for ref in cmd["refs"]:
        _emit(out, "READING")
        obj = await c.get(DataRef.from_bytes(bytes.fromhex(ref)))
        _emit(out, f"OK {digest(obj)}")
    await asyncio.sleep(HOLD_SECONDS)


async def _run(socket: str, cmd: dict[str, Any], out: TextIO) -> None:
    async with RelayClient(cmd["stage"], socket, timeout=10.0) as c:
        _emit(out, "ATTACHED")
        role = cmd["role"]
        try:
            if role in ("writer", "stream"):
                await _writer(c, cmd, out, stream=role == "stream")
            elif role == "hold-grant":
                await _hold_grant(c, cmd, out)
            elif role == "view":
                await _view(c, cmd, out)
            elif role == "read":
                await _read(c, cmd, out)
            else:
                _emit(out, f"ERR unknown role {role}")
        except RelayError as exc:
            _emit(out, f"ERR {type(exc).__name__} {exc}")


def _child(socket: str, cmd: dict[str, Any]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with open(cmd["out"], "a") as out:
        try:
            asyncio.run(_run(socket, cmd, out))
        except BaseException as exc:  # report, then exit without running the zygote's code
            _emit(out, f"ERR {type(exc).__name__} {exc}")
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    a = p.parse_args()
    # Children are killed by the test; the kernel reaps them for us.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(a.socket, cmd)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
