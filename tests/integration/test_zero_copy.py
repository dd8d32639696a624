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
