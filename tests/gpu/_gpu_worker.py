"""A GPU stage process for tests/gpu: ``python -m tests.gpu._gpu_worker --socket S --stage NAME``.

Commands arrive as JSON lines on stdin, answers leave as JSON lines on
stdout (the tests are the "app channel"). ``--cuda-first`` initializes CUDA
before attaching, so the daemon learns this process's GPU (its edges can be
routed cuda_ipc_direct / cuda_ipc_pool); without it the process attaches as
a CPU stage and initializes CUDA only when a command needs it.

``--direct`` opts the writer into cuda_ipc_direct.

Commands: ``put`` (answers with the DataRef at once, without waiting for
the GPU: the reader must cope with a writer whose copies are still queued;
``side``: the producer and the put run on a side stream; ``keep=false``:
the writer drops its tensors right after the put, answering with their
digest first), ``digest`` (the SHA-256 of a payload put earlier, after a
device sync; the payload is then dropped), ``get``, ``get_many``,
``put_many`` (many small puts, optionally aborted unread: latency of the
first and last 200, GPU memory before and after), ``abort``, ``mem``,
``close`` (the client closes, the process stays), ``facts``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
from relayd_client import DataRef, RelayClient, _cuda_pool

from tests._workers import digest

# A matmul chain of this length keeps an H100/H200 busy for ~0.2 s (fp32,
# 4096^2): put() enqueues its copy behind it and hands the DataRef out first.
HEAVY_STEPS = 100


def devices(obj: Any) -> list[str]:
    if isinstance(obj, torch.Tensor):
        return [obj.device.type]
    if isinstance(obj, dict):
        return [d for k in sorted(obj) for d in devices(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in devices(v)]
    return []


def heavy_source(nbytes: int, seed: int) -> torch.Tensor:
    """A tensor still being computed when put() is called: a chain of big matmuls."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(4096, 4096, device="cuda", generator=g)
    b = torch.randn(4096, 4096, device="cuda", generator=g) / 64.0
    for _ in range(HEAVY_STEPS):
        a = torch.tanh(a @ b)
    flat = a.reshape(-1).view(torch.uint8)
    return (
        flat[:nbytes].clone()
        if nbytes <= flat.numel()
        else flat.repeat(nbytes // flat.numel() + 1)[:nbytes]
    )


def mem() -> dict[str, int]:
    """This process's allocated GPU bytes, and the device's free bytes (all processes)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    free, _total = torch.cuda.mem_get_info()
    return {"allocated": int(torch.cuda.memory_allocated()), "free": int(free)}


def make_payload(where: str, seed: int, nbytes: int, heavy: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    main = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    half = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    if where == "cpu":
        return {"seed": seed, "hidden": main, "extra": half}
    # .t(): a non-contiguous CUDA leaf (strides travel in direct handles).
    # Moved before the heavy source: a copy from pageable host memory waits
    # for everything queued on the stream, so after it nothing would be pending.
    extra = half.cuda().t()
    gpu_main = heavy_source(nbytes, seed) if heavy else main.cuda()
    out: dict[str, Any] = {"seed": seed, "hidden": gpu_main, "extra": extra}
    if where == "mixed":
        out["cpu"] = torch.arange(1000, dtype=torch.int64)
    return out


def expected_digest(seed: int, nbytes: int) -> str:
    """The digest of ``make_payload("cuda", seed, nbytes, heavy=False)``, computed on the CPU."""
    g = torch.Generator().manual_seed(seed)
    main = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    half = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    return digest({"seed": seed, "hidden": main, "extra": half.t()})


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--stage", required=True)
    p.add_argument("--cuda-first", action="store_true")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--direct", action="store_true")
    args = p.parse_args()
    if args.cuda_first:
        torch.cuda.set_device(args.device)
        torch.cuda.init()
    kept: dict[str, Any] = {}  # rid -> payload: the writer keeps its tensors alive
    client = RelayClient(args.stage, args.socket, timeout=30.0, cuda_ipc_direct=args.direct)
    async with client:
        print(json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                break
            cmd = json.loads(line)
            try:
                if cmd["op"] == "put":
                    side = cmd.get("side", False)
                    stream = torch.cuda.Stream() if side else None
                    with torch.cuda.stream(stream) if side else contextlib.nullcontext():
                        payload = make_payload(
                            cmd.get("where", "cuda"),
                            cmd["seed"],
                            cmd["nbytes"],
                            cmd.get("heavy", False),
                        )
                        ref = await client.put(payload, to_stage=cmd["to"], request_id=cmd["rid"])
                        # Is this GPU still busy (the source or its copy into the lease)?
                        pending = (
                            torch.cuda.is_initialized() and not torch.cuda.current_stream().query()
                        )
                    answer = {
                        "ref": ref.to_bytes().hex(),
                        "transport": ref.transport.value,
                        "pending": pending,
                    }
                    if cmd.get("keep", True):
                        kept[cmd["rid"]] = payload
                    # else: the writer lets go of its tensors right after put
                    del payload
                elif cmd["op"] == "digest":
                    if torch.cuda.is_initialized():
                        torch.cuda.synchronize()  # a side stream's producer is done too
                    answer = {"digest": digest(kept.pop(cmd["rid"]))}
                elif cmd["op"] == "get":
                    ref = DataRef.from_bytes(bytes.fromhex(cmd["ref"]))
                    obj = await client.get(ref)
                    answer = {
                        "digest": digest(obj),
                        "devices": devices(obj),
                        "transport": ref.transport.value,
                    }
                elif cmd["op"] == "get_many":
                    digests = []
                    for hexref in cmd["refs"]:
                        obj = await client.get(DataRef.from_bytes(bytes.fromhex(hexref)))
                        digests.append(digest(obj))
                        del obj
                    answer = {"digests": digests}
                elif cmd["op"] == "put_many":
                    before = mem()
                    lat, refs, transports = [], [], set()
                    for i in range(cmd["n"]):
                        payload = make_payload("cuda", i, cmd["nbytes"], False)
                        rid = f"{cmd['rid']}-{i}"
                        t0 = time.perf_counter()
                        ref = await client.put(payload, to_stage=cmd["to"], request_id=rid)
                        lat.append(time.perf_counter() - t0)
                        transports.add(ref.transport.value)
                        if cmd.get("abort"):
                            await client.abort(rid)
                        else:
                            refs.append(ref.to_bytes().hex())
                            kept[rid] = payload
                        del payload
                    answer = {
                        "first_ms": statistics.median(lat[:200]) * 1e3,
                        "last_ms": statistics.median(lat[-200:]) * 1e3,
                        "transports": sorted(transports),
                        "refs": refs,
                        "before": before,
                        "after": mem(),
                    }
                elif cmd["op"] == "drop_kept":
                    kept.clear()
                    answer = mem()
                elif cmd["op"] == "abort":
                    answer = {"freed": await client.abort(cmd["rid"])}
                elif cmd["op"] == "mem":
                    answer = mem()
                elif cmd["op"] == "status":  # waits for a re-attach in progress
                    answer = {"epoch": (await client.status()).daemon_epoch}
                elif cmd["op"] == "close":
                    await client.close()
                    answer = {"closed": True}
                elif cmd["op"] == "facts":
                    gpu = client._conn.gpu
                    answer = {
                        "pool_imports": _cuda_pool.pool_imports,
                        "pinned": bool(gpu is not None and gpu.pinned),
                        "cuda": torch.cuda.is_initialized(),
                    }
                else:
                    answer = {"error": f"unknown op {cmd['op']}"}
            except Exception as exc:  # reported to the test, which decides
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
