"""What a process of another local user tries against a daemon; run by _users.run_as.

Prints one JSON object: what worked, or the error type and message.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import sys
from typing import Any


async def attach(socket: str, stage: str) -> dict[str, Any]:
    import torch
    from relayd_client import RelayClient

    async with RelayClient(stage, socket, timeout=5) as c:
        data = torch.arange(1 << 18, dtype=torch.int32)
        ref = await c.put({"x": data}, to_stage=stage, request_id="as-user")
        back = await c.get(ref)
        same = (
            hashlib.sha256(back["x"].numpy().tobytes()).hexdigest()
            == hashlib.sha256(data.numpy().tobytes()).hexdigest()
        )
        return {"ok": same, "socket_fallback": c.socket_fallback, "session": c.session_id}


async def discard(socket: str, stage: str, *refs: str) -> dict[str, Any]:
    """Discard each hex DataRef in ``refs`` as a session of ``stage``: what each got."""
    from relayd_client import DataRef, RelayClient, RelayError

    got = []
    async with RelayClient(stage, socket, timeout=5) as c:
        for ref in refs:
            try:
                await c.discard(DataRef.from_bytes(bytes.fromhex(ref)))
                got.append("OK")
            except RelayError as exc:
                got.append(type(exc).__name__)
    return {"discards": got}


async def hijack(socket: str, stage: str, request_id: str) -> dict[str, Any]:
    """Write one lease of our own (for a stage nobody serves) under another stage's
    ``request_id``, which makes ``stage`` one of the request's writers, then abort
    the request."""
    import torch
    from relayd_client import RelayClient, RelayError

    async with RelayClient(stage, socket, timeout=5) as c:
        await c.put({"x": torch.arange(1 << 17, dtype=torch.int32)}, to_stage="critic",
                    request_id=request_id)  # fmt: skip
        try:
            await c.abort(request_id)
        except RelayError as exc:
            return {"abort": type(exc).__name__}
    return {"abort": "OK"}


def map_segments(prefix: str) -> dict[str, Any]:
    """Open and map, read-write, every /dev/shm file whose name starts with ``prefix``."""
    mapped, denied = 0, 0
    for name in sorted(os.listdir("/dev/shm")):
        if not name.startswith(prefix) or name.endswith(".lock"):
            continue
        try:
            fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        except PermissionError:
            denied += 1
            continue
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
            mm.close()
            mapped += 1
        finally:
            os.close(fd)
    return {"mapped": mapped, "denied": denied}


def operate(socket: str, other_stage: str) -> dict[str, Any]:
    """Status and Drain through an operator session, while a stage session is attached."""
    import grpc
    from relayd_client import RelayClient

    from relayd.operator import operator_session

    async def hold() -> dict[str, Any]:
        async with RelayClient(other_stage, socket, timeout=5):
            with operator_session(socket) as op:
                resp = op.status(5)
                try:
                    op.drain(0.5, 5)
                    drain = "OK"
                except grpc.RpcError as err:
                    drain = err.code().name
        return {
            "sessions": len(resp.sessions),
            "pools": len(resp.pools),
            "stages": len(resp.stages),
            "drain": drain,
        }

    return asyncio.run(asyncio.wait_for(hold(), 60))


def main(argv: list[str]) -> int:
    action, *args = argv
    try:
        if action == "attach":
            out = asyncio.run(asyncio.wait_for(attach(*args), 60))
        elif action == "discard":
            out = asyncio.run(asyncio.wait_for(discard(*args), 60))
        elif action == "hijack":
            out = asyncio.run(asyncio.wait_for(hijack(*args), 60))
        elif action == "operate":
            out = operate(*args)
        elif action == "map":
            out = map_segments(*args)
        else:
            raise SystemExit(f"unknown action {action}")
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
