"""Every DataRef is read once, whatever its transport.

shm leases are freed by the daemon when read; inline DataRefs carry their bytes
and never reach the daemon, so the reading client itself refuses a second read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from relayd_client import (
    CorruptRefError,
    DataRef,
    RelayClient,
    StaleRefError,
    SyncRelayClient,
    Transport,
)

from tests._daemon import drained, run_worker, running_daemon, wait_until
from tests._daemon import lines as _lines

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT = 30
SIZES = {Transport.INLINE: 1000, Transport.SHM: 1 << 20}


@pytest.mark.parametrize("transport", [Transport.INLINE, Transport.SHM])
def test_second_read_in_another_process_call_is_stale(tmp_path: Path, transport: Transport) -> None:
    with running_daemon(str(tmp_path)) as d:
        w = run_worker(["write", "--socket", d.socket, "--sizes", str(SIZES[transport])])
        (line,) = _lines(w)
        ref_hex, digest, shown = line.split()
        assert shown == transport.value
        r = run_worker(["read", "--socket", d.socket], input=f"{ref_hex}\n{ref_hex}\n\n".encode())
        got = _lines(r)
        assert got[:2] == ["READY", digest]
        assert got[2].startswith("ERR StaleRefError "), got
        wait_until(lambda: drained(d), 10, "the arena back to zero")


def test_inline_ref_is_read_once_by_get_view_and_the_blocking_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayd_client._local

    # Writer and reader share this process: hide the local stage table, so
    # that small puts travel inline as between two processes.
    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    with running_daemon(str(tmp_path)) as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as w, RelayClient("r", d.socket) as r:
                payload = {"t": torch.arange(10), "step": 3}
                wire = (await w.put(payload, to_stage="r", request_id="q")).to_bytes()
                assert DataRef.from_bytes(wire).transport is Transport.INLINE
                first = await r.get(wire)
                assert torch.equal(first["t"], payload["t"]) and first["step"] == 3
                with pytest.raises(StaleRefError) as err:
                    await r.get(wire)
                assert type(err.value) is StaleRefError
                assert str(err.value) == (
                    "this inline DataRef was already read by this process; it is read once"
                )
                with pytest.raises(StaleRefError):
                    async with r.view(wire):
                        pass
                # A damaged copy consumes nothing: the real one is still readable.
                other = await w.put(payload, to_stage="r", request_id="q")
                broken = bytearray(other.to_bytes())
                broken[-1] ^= 0xFF
                with pytest.raises(CorruptRefError):
                    await r.get(bytes(broken))
                assert (await r.get(other))["step"] == 3

        asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT))

        with SyncRelayClient("w", d.socket) as w, SyncRelayClient("r", d.socket) as r:
            ref = w.put({"x": 1}, to_stage="r", request_id="s")
            assert ref.transport is Transport.INLINE
            assert r.get(ref) == {"x": 1}
            with pytest.raises(StaleRefError):
                r.get(ref)
