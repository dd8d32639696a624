"""Stage processes for integration tests: ``python -m tests._workers CMD ...``.

Writers print one hex DataRef per line on stdout (the "app channel"); readers
take them on stdin and print one payload digest per line. Payloads are made
deterministically from (seed, size), so both sides agree on the digest
without sharing anything but the DataRef.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from typing import Any

import torch
from relayd_client import DataRef, RelayClient, RelayError


def make_payload(seed: int, nbytes: int) -> dict[str, Any]:
    """A nested payload with about ``nbytes`` tensor bytes and several dtypes/shapes."""
    g = torch.Generator().manual_seed(seed)
    main = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return {
        "seed": seed,
        "hidden": main,
        "meta": {"shape": (2, 3), "name": f"p{seed}", "scale": 0.5},
        "extras": [
            torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            torch.tensor(seed % 2 == 0),
            torch.empty(0, 4, dtype=torch.float32),
            torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
        ],
    }


def digest(obj: Any) -> str:
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, dict):
            h.update(b"{")
            for k, v in o.items():
                h.update(repr(k).encode())
                walk(v)
            h.update(b"}")
        elif isinstance(o, (list, tuple)):
            h.update(b"[" if isinstance(o, list) else b"(")
            for v in o:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def cmd_write(a: argparse.Namespace) -> None:
    sizes = [a.sizes[i % len(a.sizes)] for i in range(max(a.count, len(a.sizes)))]
    async with RelayClient(a.stage, a.socket) as c:
        if a.go:  # attached; write once told to
            out("ATTACHED")
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

        async def one(i: int, size: int) -> None:
            payload = make_payload(a.seed + i, size)
            rid = f"{a.request}-{i}" if a.split else a.request
            try:
                ref = await c.put(
                    payload, to_stage=a.to, request_id=rid, timeout=a.timeout, trace_id=a.trace_id
                )
            except RelayError as exc:
                out(f"ERR {type(exc).__name__} {exc}")
                return
            out(f"{ref.to_bytes().hex()} {digest(payload)} {ref.transport.value}")

        if a.concurrent:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(sizes)))
        else:
            for i, s in enumerate(sizes):
                await one(i, s)
        if a.hold:
            out("HOLDING")
            await asyncio.sleep(3600)


async def cmd_read(a: argparse.Namespace) -> None:
    async with RelayClient(a.stage, a.socket) as c:
        out("READY")
        loop = asyncio.get_running_loop()

        async def one(line: str) -> None:
            try:
                obj = await c.get(DataRef.from_bytes(bytes.fromhex(line.split()[0])))
            except RelayError as exc:
                out(f"ERR {type(exc).__name__} {exc}")
                return
            out(digest(obj))

        tasks = []
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                break
            if a.concurrent:
                tasks.append(asyncio.ensure_future(one(line)))
            else:
                await one(line)
        await asyncio.gather(*tasks)


async def cmd_read_exit(a: argparse.Namespace) -> None:
    """Read each DataRef on stdin, then end the process at once: no close, nothing flushed."""
    c = RelayClient(a.stage, a.socket)
    await c.open()
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        out(digest(await c.get(DataRef.from_bytes(bytes.fromhex(line.split()[0])))))
    os._exit(0)


async def cmd_local(a: argparse.Namespace) -> None:
    """Writer ``--stage`` and reader ``--to`` in this one process: put and get each size."""
    async with RelayClient(a.stage, a.socket) as w, RelayClient(a.to, a.socket) as r:
        for i, size in enumerate(a.sizes):
            payload = make_payload(a.seed + i, size)
            ref = await w.put(payload, to_stage=a.to, request_id=f"{a.request}-{i}")
            out(f"{ref.transport.value} {digest(await r.get(ref)) == digest(payload)}")


async def cmd_hold_reserved(a: argparse.Namespace) -> None:
    """Reserve a lease and never publish it (killed by the test)."""
    async with RelayClient(a.stage, a.socket) as c:
        lease = await c._grants.reserve(a.sizes[0], time.monotonic() + 10)
        c._notices.reserve(lease, a.request, a.to)
        c._conn.session.mark(flush=True)
        out("RESERVED")
        await asyncio.sleep(3600)


async def cmd_hold_claimed(a: argparse.Namespace) -> None:
    """Claim a DataRef with a zero-copy get and never release it (killed by the test)."""
    async with RelayClient(a.stage, a.socket) as c:
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        obj = await c.get(DataRef.from_bytes(bytes.fromhex(line.split()[0])), copy=False)
        out(f"CLAIMED {digest(obj)}")
        await asyncio.sleep(3600)


def make_chunk(seed: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"i": seed, "x": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)}


async def _lines_in() -> Any:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            return
        yield line


async def cmd_stream_write(a: argparse.Namespace) -> None:
    """Put --count chunks of --sizes[0] bytes, then the done (or, with --error-at, error) signal."""
    async with RelayClient(a.stage, a.socket) as c:
        for i in range(a.count):
            if a.error_at is not None and i == a.error_at:
                out(c.put_error(a.to, a.request, "writer failed").to_bytes().hex() + " ERROR")
                return
            chunk = make_chunk(a.seed + i, a.sizes[0])
            try:
                ref = await c.put(
                    chunk, to_stage=a.to, request_id=a.request, chunk_id=i, timeout=a.timeout
                )
            except RelayError as exc:
                out(f"ERR {type(exc).__name__} {exc}")
                return
            out(f"{ref.to_bytes().hex()} {digest(chunk)} {ref.transport.value}")
        out(c.put_done(a.to, a.request).to_bytes().hex() + " DONE")
        if a.hold:
            out("HOLDING")
            await asyncio.sleep(3600)


async def cmd_stream_read(a: argparse.Namespace) -> None:
    """Feed DataRefs from stdin in any order; print each chunk's digest in stream order."""
    async with RelayClient(a.stage, a.socket) as c:
        out("READY")

        async def feed() -> None:
            async for line in _lines_in():
                c.feed(DataRef.from_bytes(bytes.fromhex(line.split()[0])))

        feeder = asyncio.ensure_future(feed())
        try:
            async for chunk in c.stream(a.request, from_stage=a.source, timeout=a.timeout):
                out(digest(chunk))
            out("END")
        except RelayError as exc:
            out(f"ERR {type(exc).__name__} {exc}")
        feeder.cancel()


async def cmd_ref_write(a: argparse.Namespace) -> None:
    """Stage A: publish a tensor for stage --consumer once, send it to --to inside a payload."""
    async with RelayClient(a.stage, a.socket) as c:
        g = torch.Generator().manual_seed(a.seed)
        big = torch.randint(0, 256, (a.sizes[0],), dtype=torch.uint8, generator=g)
        tref = await c.ref(big, consumer_stage=a.consumer, request_id=a.request)
        ref = await c.put({"step": 1, "big": tref}, to_stage=a.to, request_id=a.request)
        out(f"{ref.to_bytes().hex()} {digest(big)} {ref.transport.value}")


async def cmd_forward(a: argparse.Namespace) -> None:
    """Stage B: get a payload, pass its TensorRef on to --to without reading it."""
    from relayd_client._refs import TensorRef

    async with RelayClient(a.stage, a.socket) as c:
        async for line in _lines_in():
            obj = await c.get(DataRef.from_bytes(bytes.fromhex(line.split()[0])))
            big = obj["big"]
            assert isinstance(big, TensorRef), type(big)
            ref = await c.put({"step": 2, "big": big}, to_stage=a.to, request_id=a.request)
            out(f"{ref.to_bytes().hex()} {type(big).__name__} {ref.transport.value}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "cmd",
        choices=[
            "write", "read", "hold-reserved", "hold-claimed", "stream-write", "stream-read",
            "ref-write", "forward", "local", "read-exit",
        ],
    )  # fmt: skip
    p.add_argument("--socket", required=True)
    p.add_argument("--stage", default=None, help="default: thinker for writers, talker for readers")
    p.add_argument("--to", default="talker")
    p.add_argument("--request", default="r")
    p.add_argument("--split", action="store_true", help="one request id per payload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--count", type=int, default=0, help="payloads to write (sizes cycle)")
    p.add_argument("--concurrent", action="store_true")
    p.add_argument("--hold", action="store_true", help="stay alive after writing")
    p.add_argument("--go", action="store_true", help="write: attach, then wait for a line")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1 << 20])
    p.add_argument("--error-at", type=int, default=None, help="stream-write: fail at chunk N")
    p.add_argument("--source", default="thinker", help="stream-read: the writer stage")
    p.add_argument("--consumer", default="C", help="ref-write: the stage the tensor is for")
    p.add_argument("--trace-id", default=None, help="write: the trace id each put carries")
    a = p.parse_args()
    if a.stage is None:
        readers = ("read", "hold-claimed", "stream-read", "read-exit")
        a.stage = "talker" if a.cmd in readers else "thinker"
    fn = {
        "write": cmd_write,
        "read": cmd_read,
        "hold-reserved": cmd_hold_reserved,
        "hold-claimed": cmd_hold_claimed,
        "stream-write": cmd_stream_write,
        "stream-read": cmd_stream_read,
        "ref-write": cmd_ref_write,
        "forward": cmd_forward,
        "local": cmd_local,
        "read-exit": cmd_read_exit,
    }[a.cmd]
    asyncio.run(fn(a))


if __name__ == "__main__":
    main()
