"""Which puts write the compact DataRef (format version 2), and that both clients
read it back in another process as they read version 1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from relayd_client import DataRef, RelayClient, SyncRelayClient, Transport
from relayd_client.wire.compact import RefView
from relayd_client.wire.dataref import COMPACT_VERSION, VERSION

from tests._daemon import drained, run_worker, running_daemon, wait_until
from tests._daemon import lines as _lines

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT = 30


@pytest.mark.parametrize(("size", "transport"), [(1000, "inline"), (1 << 20, "shm")])
def test_a_plain_put_writes_a_compact_ref_another_process_reads(
    tmp_path: Path, size: int, transport: str
) -> None:
    with running_daemon(str(tmp_path)) as d:
        w = run_worker(["write", "--socket", d.socket, "--sizes", str(size)])
        (line,) = _lines(w)
        ref_hex, digest, shown = line.split()
        assert shown == transport
        wire = bytes.fromhex(ref_hex)
        assert wire[2] == COMPACT_VERSION
        assert isinstance(DataRef.from_bytes(wire).fields, RefView)
        r = run_worker(["read", "--socket", d.socket], input=f"{ref_hex}\n\n".encode())
        assert _lines(r)[:2] == ["READY", digest]
        wait_until(lambda: drained(d), 10, "the arena back to zero")


def test_which_puts_keep_version_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import relayd_client._local

    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    with running_daemon(str(tmp_path)) as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as w, RelayClient("r", d.socket) as r:
                big = torch.arange(1 << 16, dtype=torch.float32)
                chunk = await w.put(big, to_stage="r", request_id="q", chunk_id=3)
                assert chunk.to_bytes()[2] == COMPACT_VERSION
                back = DataRef.from_bytes(chunk.to_bytes())
                assert back.chunk_id == 3 and back.proto == chunk.proto
                assert torch.equal(await r.get(back), big)
                # A payload forwarding a TensorRef, a TensorRef itself and a
                # stream signal keep the message form.
                t = await w.ref(big, consumer_stage="r", request_id="q")
                assert t.data_ref().to_bytes()[2] == VERSION
                fwd = await w.put({"t": t}, to_stage="r", request_id="q")
                assert fwd.to_bytes()[2] == VERSION
                assert torch.equal((await r.get(fwd.to_bytes()))["t"], big)
                assert w.put_done("r", "q").to_bytes()[2] == VERSION
                async with w.buffer(to_stage="r", request_id="q", like=big) as out:
                    out.payload.copy_(big)
                assert out.ref is not None and out.ref.to_bytes()[2] == VERSION
                assert torch.equal(await r.get(out.ref.to_bytes()), big)

        asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT))
        wait_until(lambda: drained(d), 10, "the arena back to zero")


def test_a_client_of_a_daemon_without_compact_refs_writes_version_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayd_client._local

    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("w", d.socket) as w, SyncRelayClient("r", d.socket) as r:
            attach = w._client._conn.attach
            assert attach is not None and attach.compact_refs
            attach.compact_refs = False  # what an older daemon answers
            payload = torch.arange(1 << 16, dtype=torch.float32)
            for size in (payload, payload[:100]):
                ref = w.put(size, to_stage="r", request_id="s")
                assert ref.transport in (Transport.SHM, Transport.INLINE)
                assert ref.to_bytes()[2] == VERSION
                assert torch.equal(r.get(ref.to_bytes()), size)
        wait_until(lambda: drained(d), 10, "the arena back to zero")


def test_payloads_of_one_shape_but_other_keys_come_back_with_their_own_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer remembers a dict of tensors' header by its keys: payloads
    alike in every tensor but not in their keys, their keys' types or order,
    or in sharing a tensor, must each come back as they were put."""
    import relayd_client._local

    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    small, big = torch.arange(8.0), torch.arange(1 << 18, dtype=torch.float32)
    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("w", d.socket) as w, SyncRelayClient("r", d.socket) as r:
            for t in (small, big):
                u = t + 1
                payloads: list[dict[object, torch.Tensor]] = [
                    {"a": t}, {"b": t}, {1: t}, {True: t}, {1.0: t},
                    {"a": t, "b": u}, {"b": u, "a": t}, {"a": t, "b": t}, {"a": t, "b": u},
                ]  # fmt: skip
                for k, payload in enumerate(payloads):
                    ref = w.put(payload, to_stage="r", request_id=f"q{k}")
                    got = r.get(ref.to_bytes())
                    assert [(type(key), key) for key in got] == [
                        (type(key), key) for key in payload
                    ]
                    for key, value in payload.items():
                        assert torch.equal(got[key], value)
                    if len(payload) == 2:
                        assert (got["a"] is got["b"]) == (payload["a"] is payload["b"])
        wait_until(lambda: drained(d), 10, "the arena back to zero")
