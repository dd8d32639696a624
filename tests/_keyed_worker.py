"""A stage process driven line by line: ``python -m tests._keyed_worker --socket S --stage X``.

Keyed delivery and discard need a conversation (put, then get in another
process, then get again), so this worker reads one command per stdin line
and answers one line on stdout: ``OK ...``, ``NONE`` or ``ERR <class> <message>``.

    put KEY SEED SIZE RID TO      -> OK <hex DataRef> <digest> <transport>  (KEY "-": no key)
    put-cancelled KEY SEED SIZE RID TO -> OK  (the keyed put's task cancelled once its
                                    KeyedPut is out; answered once its withdrawal ended)
    get KEY FROM TIMEOUT          -> OK <digest>
    poll KEY FROM                 -> OK <digest> | NONE
    take KEY FROM TIMEOUT [TO]    -> OK <hex DataRef> | NONE
    read HEX                      -> OK <digest>
    discard HEX                   -> OK
    discard-refs HEX              -> OK <n>     (get the payload, discard its TensorRefs)
    ref SEED SIZE CONSUMER RID TO -> OK <hex DataRef>  (a payload forwarding a TensorRef)
    abort RID                     -> OK <leases freed>
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import torch
from relayd_client import DataRef, RelayClient, RelayError, SyncRelayClient, TensorRef, _keyed

from tests import _zygote
from tests._daemon import _SPAWNED, REPO, read_line, send_line
from tests._workers import digest, make_payload, out

ANSWER_TIMEOUT = 30.0


class Stage:
    """The test's handle on one worker process serving ``stage`` on a daemon's socket."""

    def __init__(self, socket: str, stage: str, *, blocking: bool = False) -> None:
        args = ["--socket", socket, "--stage", stage] + (["--blocking"] if blocking else [])
        self.proc = _zygote.popen("tests._keyed_worker", args, cwd=REPO, stderr=False)
        _SPAWNED.append(self.proc)  # reaped after the test, whatever happens
        assert self._line(ANSWER_TIMEOUT) == "READY"

    def ask(self, *words: object, timeout: float = ANSWER_TIMEOUT) -> str:
        """Send one command; its one-line answer."""
        self.send(*words)
        return self._line(timeout)

    def send(self, *words: object) -> None:
        """Send a command whose answer :meth:`answer` collects later."""
        send_line(self.proc, " ".join(map(str, words)))

    def answer(self, timeout: float = ANSWER_TIMEOUT) -> str:
        return self._line(timeout)

    def _line(self, timeout: float) -> str:
        return read_line(self.proc, timeout)


class _Blocking:
    """A SyncRelayClient behind the awaitable calls the commands make: each runs on a
    worker thread, as vllm-omni's connectors call it."""

    def __init__(self, client: SyncRelayClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._client, name)

        async def call(*args: Any, **kw: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kw)

        return call


async def _run(c: Any, words: list[str]) -> str:
    cmd, args = words[0], words[1:]
    if cmd == "put":
        key, seed, size, rid, to = args
        payload = make_payload(int(seed), int(size))
        ref = await c.put(payload, to_stage=to, request_id=rid, key=None if key == "-" else key)
        return f"OK {ref.to_bytes().hex()} {digest(payload)} {ref.transport.value}"
    if cmd == "put-cancelled":
        return await _put_cancelled(c, *args)
    if cmd == "get":
        key, source, timeout = args
        return f"OK {digest(await c.get_key(key, from_stage=source, timeout=float(timeout)))}"
    if cmd == "poll":
        key, source = args
        missing = object()
        obj = await c.poll_key(key, from_stage=source, default=missing)
        return "NONE" if obj is missing else f"OK {digest(obj)}"
    if cmd == "take":
        key, source, timeout, *to = args
        ref = await c.take_key(
            key, from_stage=source, to_stage=to[0] if to else None, timeout=float(timeout)
        )
        return "NONE" if ref is None else f"OK {ref.to_bytes().hex()}"
    if cmd == "read":
        return f"OK {digest(await c.get(DataRef.from_bytes(bytes.fromhex(args[0]))))}"
    if cmd == "discard":
        await c.discard(DataRef.from_bytes(bytes.fromhex(args[0])))
        return "OK"
    if cmd == "discard-refs":
        obj = await c.get(DataRef.from_bytes(bytes.fromhex(args[0])))
        refs = [v for v in obj.values() if isinstance(v, TensorRef)]
        for r in refs:
            await c.discard(r)
        return f"OK {len(refs)}"
    if cmd == "ref":
        seed, size, consumer, rid, to = args
        g = torch.Generator().manual_seed(int(seed))
        big = torch.randint(0, 256, (int(size),), dtype=torch.uint8, generator=g)
        tref = await c.ref(big, consumer_stage=consumer, request_id=rid)
        ref = await c.put({"step": 1, "big": tref}, to_stage=to, request_id=rid)
        return f"OK {ref.to_bytes().hex()}"
    if cmd == "abort":
        return f"OK {await c.abort(args[0])}"
    return f"ERR ValueError unknown command {cmd!r}"


async def _put_cancelled(c: RelayClient, key: str, seed: str, size: str, rid: str, to: str) -> str:
    """A keyed put whose task is cancelled while it waits for the daemon's answer."""
    payload = make_payload(int(seed), int(size))
    session = c._conn.session
    put = asyncio.ensure_future(c.put(payload, to_stage=to, request_id=rid, key=key))
    deadline = time.monotonic() + ANSWER_TIMEOUT
    while not session._keyed:  # its KeyedPut is out once its answer is awaited
        if put.done() or time.monotonic() > deadline:
            return "ERR RuntimeError the put ended before its KeyedPut was awaited"
        await asyncio.sleep(0)  # no timer: the put's own steps run between
    put.cancel()
    try:
        await put
    except asyncio.CancelledError:
        pass
    else:
        return "ERR RuntimeError the put was answered before the cancel"
    # The withdrawal, answered (or failed, logged): its task exists once the put raised.
    withdrawals = set(_keyed._giving_back)
    if withdrawals:
        _, pending = await asyncio.wait(withdrawals, timeout=max(deadline - time.monotonic(), 0))
        if pending:
            return "ERR RuntimeError the withdrawal did not end"
    return "OK"


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--stage", required=True)
    p.add_argument("--blocking", action="store_true", help="use SyncRelayClient")
    a = p.parse_args()
    if a.blocking:
        sync = SyncRelayClient(a.stage, a.socket)
        await asyncio.to_thread(sync.open)
        try:
            await _serve(_Blocking(sync))
        finally:
            await asyncio.to_thread(sync.close)
    else:
        async with RelayClient(a.stage, a.socket) as c:
            await _serve(c)


async def _serve(c: Any) -> None:
    loop = asyncio.get_running_loop()
    out("READY")
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            return
        try:
            answer = await _run(c, line.split())
        except RelayError as exc:
            answer = f"ERR {type(exc).__name__} {exc}"
        out(answer)


if __name__ == "__main__":
    asyncio.run(main())
