"""Zero-copy put (buffer) and get (view / copy=False) against the real daemon."""

from __future__ import annotations

import asyncio

import pytest
import torch
from relayd_client import DataRef, RelayClient, StaleRefError

from tests._daemon import running_daemon, wait_until

pytestmark = pytest.mark.timeout(120)


def test_buffer_writes_in_place_and_view_reads_in_place(tmp_path: object) -> None:
    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            like = {
                "h": torch.empty(512, 1024, dtype=torch.bfloat16, device="meta"),
                "ids": torch.empty(7, dtype=torch.int64, device="meta"),
                "step": 4,
            }
            async with w.buffer(to_stage="talker", request_id="b", like=like) as out:
                h = out.payload["h"]
                torch.mul(torch.ones(512, 1024, dtype=torch.bfloat16), 3, out=h)
                out.payload["ids"].copy_(torch.arange(7))
            assert out.ref is not None and out.payload is None
            wire = out.ref.to_bytes()
            async with r.view(DataRef.from_bytes(wire)) as obj:
                assert obj["step"] == 4
                assert torch.equal(obj["ids"], torch.arange(7))
                assert torch.equal(obj["h"], torch.full((512, 1024), 3, dtype=torch.bfloat16))
            with pytest.raises(StaleRefError):
                r.release(DataRef.from_bytes(wire))  # released by the view already

            with pytest.raises(RuntimeError, match="producer failed"):
                async with w.buffer(to_stage="talker", request_id="c", like=like):
                    raise RuntimeError("producer failed")

            # buffer() always uses the arena (a put between two stages of one
            # process would be handed over by reference instead).
            x_like = {"x": torch.empty(1 << 18, dtype=torch.int64, device="meta")}
            async with w.buffer(to_stage="talker", request_id="d", like=x_like) as out:
                out.payload["x"].copy_(torch.arange(1 << 18))
            assert out.ref is not None
            ref = out.ref
            views = await r.get(ref, copy=False)
            assert torch.equal(views["x"], torch.arange(1 << 18))
            r.release(ref)
            with pytest.raises(StaleRefError):
                r.release(ref)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(
            lambda: d.pool()["used_bytes"] == 0 and not d.status().get("leases"),
            10,
            "cancelled and released leases freed",
        )


def test_large_copies_leave_the_loop_by_address_and_views_stay_on_it(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above OFFLOAD_BYTES a put's and a copying get's bytes move on a worker thread.

    The worker gets addresses only: a tensor handed to it stays referenced
    until it runs again, and a reader's previous output kept alive that way
    made each ~40th 16 MiB get fault its output in anew (measured). A view
    copies nothing, so it must not leave the loop at all: the hand-off was
    all it cost (~250 us of a 16 MiB view's ~480 us, measured).
    """
    from relayd_client import _local, _reader, _writer

    threaded: list[tuple[object, ...]] = []
    real_to_thread = asyncio.to_thread

    async def spy(func: object, /, *args: object, **kwargs: object) -> object:
        threaded.append(args)
        return await real_to_thread(func, *args, **kwargs)  # type: ignore[arg-type]

    def tensors_in(args: object) -> int:
        if isinstance(args, torch.Tensor):
            return 1
        if isinstance(args, (list, tuple)):
            return sum(tensors_in(a) for a in args)
        return 0

    monkeypatch.setattr(_reader.asyncio, "to_thread", spy)
    # Two stages of one process would hand puts over by reference.
    monkeypatch.setattr(_local, "serves", lambda stage: False)
    n = _writer.OFFLOAD_BYTES // 4 + 1024
    payload = torch.arange(n, dtype=torch.int32)

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            like = {"x": torch.empty(n, dtype=torch.int32, device="meta")}
            refs = []
            for rid in ("v", "c"):
                async with w.buffer(to_stage="talker", request_id=rid, like=like) as out:
                    out.payload["x"].copy_(payload)
                assert out.ref is not None
                refs.append(out.ref)
            threaded.clear()
            async with r.view(DataRef.from_bytes(refs[0].to_bytes())) as obj:
                x = obj["x"]
                seg = r._conn.views[refs[0].proto.lease.segment]
                start = seg.data_ptr()
                assert start <= x.data_ptr() < start + seg.numel()  # in place, not a copy
                assert torch.equal(x, payload)
                del x, obj
            assert threaded == []
            got = await r.get(refs[1])
            assert torch.equal(got["x"], payload)
            assert len(threaded) == 1 and tensors_in(threaded) == 0
            # A put: plain tensors go by address; one that torch must copy goes as is.
            threaded.clear()
            ref = await w.put({"x": payload}, to_stage="talker", request_id="p")
            assert len(threaded) == 1 and tensors_in(threaded) == 0
            assert torch.equal((await r.get(ref))["x"], payload)
            strided = torch.arange(2 * n, dtype=torch.int32)[::2]
            threaded.clear()
            ref = await w.put({"x": strided}, to_stage="talker", request_id="s")
            assert len(threaded) == 1 and tensors_in(threaded) == 2  # segment and source
            assert torch.equal((await r.get(ref))["x"], strided)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: d.pool()["used_bytes"] == 0, 10, "every lease released")
