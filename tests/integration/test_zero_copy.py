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


def test_a_large_view_stays_on_the_loop_and_in_the_arena(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above OFFLOAD_BYTES a copying get runs on a worker thread; a view must not.

    A view copies nothing, so the thread hand-off would be all it costs (it
    was ~250 us of a 16 MiB view's ~480 us, measured).
    """
    from relayd_client import _client

    threaded: list[str] = []
    real_to_thread = asyncio.to_thread

    async def spy(func: object, /, *args: object, **kwargs: object) -> object:
        threaded.append(getattr(func, "__name__", "?"))
        return await real_to_thread(func, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_client.asyncio, "to_thread", spy)
    n = _client.OFFLOAD_BYTES // 4 + 1024
    payload = torch.arange(n, dtype=torch.int32)

    async def write(w: RelayClient, request_id: str) -> DataRef:
        # buffer(), as a put between two stages of one process goes by reference
        like = {"x": torch.empty(n, dtype=torch.int32, device="meta")}
        async with w.buffer(to_stage="talker", request_id=request_id, like=like) as out:
            out.payload["x"].copy_(payload)
        assert out.ref is not None
        return out.ref

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            ref = await write(w, "v")
            threaded.clear()
            async with r.view(DataRef.from_bytes(ref.to_bytes())) as obj:
                x = obj["x"]
                seg = r._views[ref.proto.lease.segment]
                start = seg.data_ptr()
                assert start <= x.data_ptr() < start + seg.numel()  # in place, not a copy
                assert torch.equal(x, payload)
                del x, obj
            assert threaded == []
            ref = await write(w, "c")
            threaded.clear()
            got = await r.get(ref)
            assert torch.equal(got["x"], payload)
            assert threaded == ["unpack"]  # the copying read still leaves the loop

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: d.pool()["used_bytes"] == 0, 10, "both leases released")
