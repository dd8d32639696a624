"""The GPU paths' device-agnostic logic, on CPU: identity, routing, layout, pools, leases.

A GPU pool here is a real :class:`relayd.pools.cuda.CudaPool` (real allocator,
real SHM header segment) without device memory, so the lease rules it shares
with the arena run unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from relayd_client import (
    CorruptRefError,
    ResourceExhaustedError,
    _cuda,
    _cuda_direct,
    _cuda_facts,
    _cuda_pool,
    _cuda_staging,
)
from relayd_client._packing import TensorSpec, validate_layout
from relayd_client.wire import cuda_ipc
from relayd_client.wire.cuda_ipc import export_handle
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import HEADER_STRIDE, MappedSegment
from relayd_client.wire.transport import Transport

from relayd.pools.arena import Arena
from relayd.pools.cuda import HEADER_SEGMENT_BASE, CudaPool, pool_geometry
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Hooks, LeaseState
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena

GPU_A = "GPU-58b9e9e8-0000-0000-0000-00000000000a"
GPU_B = "GPU-58b9e9e8-0000-0000-0000-00000000000b"

# ---------------------------------------------------------------- identity


def test_uuid_of_matches_nvidia_smi_spelling() -> None:
    assert cuda_ipc.uuid_of(SimpleNamespace(uuid="58b9e9e8-aaaa")) == "GPU-58b9e9e8-aaaa"
    assert cuda_ipc.uuid_of(SimpleNamespace(uuid="GPU-58b9e9e8-aaaa")) == "GPU-58b9e9e8-aaaa"
    assert cuda_ipc.uuid_of(SimpleNamespace(uuid="MIG-1234")) == "MIG-1234"


def test_uuid_maps_to_each_process_own_ordinal() -> None:
    # Writer sees (A, B); a reader started with CUDA_VISIBLE_DEVICES=1 sees (B,).
    writer, reader = (GPU_A, GPU_B), (GPU_B,)
    assert _cuda_facts.local_ordinal(GPU_B, writer) == 1
    assert _cuda_facts.local_ordinal(GPU_B, reader) == 0
    assert _cuda_facts.local_ordinal(GPU_A, reader) is None


def test_leaf_gpu_reads_layout_devices() -> None:
    assert _cuda_facts.leaf_gpu("cpu") is None
    assert _cuda_facts.leaf_gpu(_cuda_facts.device_field(GPU_A)) == GPU_A
    assert _cuda_facts.leaf_gpu("cuda:0") == ""  # an ordinal: "some GPU", never matched by UUID
    with pytest.raises(CorruptRefError):
        _cuda_facts.leaf_gpu("mps:0")


def test_cpu_process_never_initializes_cuda() -> None:
    import torch

    assert not torch.cuda.is_initialized()
    assert not _cuda_facts.uses_cuda() and _cuda_facts.used_gpus() == ()
    assert _cuda_staging.pin_host([torch.zeros(8, dtype=torch.uint8)], "auto") == []
    assert _cuda_facts.reader_device() == torch.device("cpu")
    # A CPU reader gets CUDA leaves back on CPU, without touching CUDA.
    leaf = TensorSpec(0, (4,), "uint8", 0, 4, _cuda_facts.device_field(GPU_A))
    assert not _cuda_facts.restores_on_gpu([leaf])
    got = asyncio.run(
        _cuda_staging.restore_on_device([torch.arange(4, dtype=torch.uint8)], [leaf], True)
    )
    assert got[0].device.type == "cpu" and got[0].tolist() == [0, 1, 2, 3]
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------- route


def _facts(*devices: str) -> _cuda_facts.PayloadGpuFacts:
    return _cuda_facts.payload_facts(list(devices))


def test_payload_facts() -> None:
    f = _facts(
        _cuda_facts.device_field(GPU_B),
        _cuda_facts.device_field(GPU_A),
        _cuda_facts.device_field(GPU_A),
    )
    assert f.cuda_uuids == (GPU_A, GPU_B) and not f.has_cpu_tensors
    assert _facts("cpu", _cuda_facts.device_field(GPU_A)).has_cpu_tensors
    assert _facts("cpu").cuda_uuids == ()


@pytest.mark.parametrize(
    ("devices", "daemon", "expected"),
    [
        # the daemon knows the reader: its answer stands where this client can serve it
        ((GPU_A,), Transport.CUDA_IPC_DIRECT, Transport.CUDA_IPC_DIRECT),
        ((GPU_A,), Transport.CUDA_IPC_POOL, Transport.CUDA_IPC_POOL),
        ((GPU_A,), Transport.SHM, Transport.SHM),  # GPU -> CPU, no peer access, reader unknown
        ((GPU_B,), Transport.CUDA_IPC_POOL, Transport.SHM),  # no pool on B
        ((GPU_A, GPU_B), Transport.CUDA_IPC_POOL, Transport.SHM),  # one lease, one pool
        ((GPU_A, GPU_B), Transport.CUDA_IPC_DIRECT, Transport.CUDA_IPC_DIRECT),
        (("cpu", GPU_A), Transport.CUDA_IPC_POOL, Transport.SHM),  # mixed: CPU leaves stay CPU
        (("cpu",), Transport.CUDA_IPC_POOL, Transport.SHM),
        (("cuda:0",), Transport.CUDA_IPC_POOL, Transport.SHM),  # no UUID, no pool
    ],
)
def test_carry_out_route(devices: tuple[str, ...], daemon: Transport, expected: Transport) -> None:
    fields = [d if d.startswith(("cpu", "cuda:")) else _cuda_facts.device_field(d) for d in devices]
    got = _cuda.carry_out_route(_facts(*fields), pools={GPU_A}, daemon_route=daemon)
    assert got is expected


def test_direct_falls_back_to_the_pool_when_handles_do_not_fit() -> None:
    facts = _cuda_facts.PayloadGpuFacts(cuda_uuids=(GPU_A,), direct_meta_bytes=64 * 1024 + 1)
    chosen = _cuda.carry_out_route(facts, pools={GPU_A}, daemon_route=Transport.CUDA_IPC_DIRECT)
    assert chosen is Transport.CUDA_IPC_POOL


def test_client_facts_agree_with_the_router() -> None:
    from relayd.routing.router import DIRECT_META_LIMIT, PayloadFacts

    assert _cuda.DIRECT_META_LIMIT == DIRECT_META_LIMIT
    f = _facts(_cuda_facts.device_field(GPU_A), _cuda_facts.device_field(GPU_B))
    PayloadFacts(encoded_bytes=1 << 20, cuda_uuids=f.cuda_uuids)  # UUIDs, not ordinals


# ---------------------------------------------------------------- DataRef layout


def test_dataref_layout_for_cuda_tensors_round_trips() -> None:
    specs = [
        TensorSpec(0, (4, 256), "bfloat16", 0, 2048, _cuda_facts.device_field(GPU_A)),
        TensorSpec(1, (3,), "int64", 2048, 24, "cpu"),
    ]
    validate_layout(specs, 4096)
    handle = pb.CudaIpcHandle(
        handle=b"h" * 64, storage_bytes=4096, stride=[256, 1], storage_offset=256
    )
    msg = pb.DataRef(transport=pb.TRANSPORT_CUDA_IPC_POOL, cuda_event=b"e" * 64)
    for s in specs:
        layout = msg.tensors.add(
            index=s.index, shape=s.shape, dtype=s.dtype, offset=s.offset, nbytes=s.nbytes
        )
        layout.device = s.device
    msg.tensors[0].cuda_ipc.CopyFrom(handle)
    back = pb.DataRef.FromString(msg.SerializeToString())
    assert back.tensors[0].device == f"cuda:{GPU_A}" and back.tensors[1].device == "cpu"
    assert back.tensors[0].cuda_ipc.stride == [256, 1] and back.cuda_event == b"e" * 64
    assert not back.tensors[1].HasField("cuda_ipc")


def test_direct_handle_view_must_stay_inside_its_storage() -> None:
    ok = pb.CudaIpcHandle(storage_bytes=4 * 8 * 2, stride=[8, 1], storage_offset=0)
    _cuda_direct.check_direct_handle(ok, (4, 8), 2)
    past = pb.CudaIpcHandle(storage_bytes=4 * 8 * 2, stride=[8, 1], storage_offset=1)
    with pytest.raises(CorruptRefError):
        _cuda_direct.check_direct_handle(past, (4, 8), 2)
    with pytest.raises(CorruptRefError):
        _cuda_direct.check_direct_handle(pb.CudaIpcHandle(storage_bytes=64, stride=[1]), (4, 8), 2)


def test_export_handle_drops_the_ordinal() -> None:
    share = (3, b"m" * 64, 1 << 20, 4096, b"/torch_1_2", 16, b"e" * 64, True)
    h = export_handle(share)
    assert (h.handle, h.storage_bytes, h.storage_offset_bytes) == (b"m" * 64, 1 << 20, 4096)
    assert (h.ref_counter_handle, h.ref_counter_offset, h.event_sync_required) == (
        b"/torch_1_2",
        16,
        True,
    )
    assert "device" not in pb.CudaIpcHandle.DESCRIPTOR.fields_by_name  # no ordinal travels


# ---------------------------------------------------------------- pools and leases


def test_pool_geometry() -> None:
    g = pool_geometry((256 << 20) + 123, SLOT)
    assert g.nslots == 4096 and g.nbytes == 256 << 20
    assert g.header_bytes >= g.nslots * HEADER_STRIDE
    with pytest.raises(ValueError):
        pool_geometry(SLOT - 1, SLOT)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


@pytest.fixture
def gpu_pool(arena: Arena) -> Iterator[CudaPool]:
    geometry = pool_geometry(16 * SLOT, SLOT)
    headers = MappedSegment(
        f"{arena.prefix}.{HEADER_SEGMENT_BASE}", geometry.header_bytes, 0, HEADER_STRIDE,
        create=True,
    )  # fmt: skip
    pool = CudaPool(uuid=GPU_A, device_index=0, geometry=geometry, headers=headers)
    yield pool
    pool.close()


def _manager(arena: Arena, pool: CudaPool, reclaimed: list[str]) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=4 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, pools={pool.name: pool},
        hooks=Hooks(reclaimed=lambda reason, n: reclaimed.extend([reason.value] * n)),
    )  # fmt: skip


def _session(m: LeaseManager, stage: str, frames: list[pb.SessionFrame]):  # type: ignore[no-untyped-def]
    s = m.open_session(pid=1, stages=[stage], gpu_uuids=[GPU_A])
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def _publish(m, s, grant, slot: int, n: int) -> int:  # type: ignore[no-untyped-def]
    lease_id = m.new_generation_base(grant) + slot + 1
    m.on_reserve(s, pb.Reserve(lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot + slot,
                               nslots=n, generation=lease_id, request_id="r", to_stage="talker",
                               from_stage=s.stages[0]))  # fmt: skip
    m.on_publish(
        s, pb.Publish(lease_id=lease_id, nbytes=n * SLOT, transport=pb.TRANSPORT_CUDA_IPC_POOL)
    )
    return lease_id


def test_gpu_pool_uses_the_arena_lease_rules(arena: Arena, gpu_pool: CudaPool) -> None:
    reclaimed: list[str] = []
    m = _manager(arena, gpu_pool, reclaimed)
    w, r = _session(m, "thinker", []), _session(m, "talker", [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0, gpu_pool.name))
    assert grant.run.pool == gpu_pool.name and arena.used_bytes == 0
    lid = _publish(m, w, grant, 0, 2)
    gpu_pool.headers.write_header(grant.run.slot, lid, 2 * SLOT)  # the writer stamps it
    m.on_claim(r, pb.Claim(lease_id=lid, generation=lid))
    assert m.leases[lid].state is LeaseState.CLAIMED
    assert m.lease_slots(gpu_pool.name) == 2 and m.lease_slots() == 0
    m.on_release(r, pb.Release(lease_id=lid, generation=lid))
    # Freed into the pool's header segment and allocator, not the arena's.
    assert gpu_pool.header(0, grant.run.slot) == (0, 0)
    m.close_session(w.id)
    assert gpu_pool.used_bytes == 0 and gpu_pool.free_slots == gpu_pool.nslots
    assert reclaimed == []


def test_gpu_pool_reclaims_on_writer_and_reader_death(arena: Arena, gpu_pool: CudaPool) -> None:
    reclaimed: list[str] = []
    m = _manager(arena, gpu_pool, reclaimed)
    w, r = _session(m, "thinker", []), _session(m, "talker", [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0, gpu_pool.name))
    read = _publish(m, w, grant, 0, 1)
    unread = _publish(m, w, grant, 1, 1)
    assert unread in m.leases
    m.on_claim(r, pb.Claim(lease_id=read, generation=read))
    m.close_session(w.id)
    # An unread GPU lease goes with its writer (its CUDA event does); the one
    # a reader is copying out of stays until that reader lets go.
    assert unread not in m.leases and gpu_pool.header(0, grant.run.slot + 1) == (0, 0)
    assert reclaimed == ["writer_died"] and gpu_pool.used_bytes == SLOT
    m.close_session(r.id)  # the claimed one dies with its reader
    assert reclaimed == ["writer_died", "reader_died"] and gpu_pool.used_bytes == 0
    m.drop_all()
    assert gpu_pool.used_bytes == 0 and arena.used_bytes == 0


def test_a_dying_gpu_writers_slots_wait_until_it_has_exited(
    arena: Arena, gpu_pool: CudaPool
) -> None:
    """Defect: slots went back while a killed writer's copy into them could still
    run; the next lease there would be overwritten with no generation change."""
    from relayd.pools import returns

    exiting = {7: True}
    now = [1000.0]
    m = LeaseManager(
        arena, grant_bytes=4 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, pools={gpu_pool.name: gpu_pool}, clock=lambda: now[0],
        gpu_work_may_run=lambda pid: exiting.get(pid, False),
    )  # fmt: skip
    s = m.open_session(pid=7, stages=["thinker"], gpu_uuids=[GPU_A])
    w = m.bind(s.id, s.token, [].append, pid=7, uid=0, gid=0)
    grant = asyncio.run(m.grant(w, 4 * SLOT, 1.0, gpu_pool.name))
    _publish(m, w, grant, 0, 2)
    reading = _publish(m, w, grant, 2, 1)
    s = m.open_session(pid=70, stages=["talker"], gpu_uuids=[GPU_A])
    r = m.bind(s.id, s.token, [].append, pid=70, uid=0, gid=0)
    m.on_claim(r, pb.Claim(lease_id=reading, generation=reading))
    m.close_session(w.id)  # killed: its socket closed while it is still exiting
    # Unread and half-read leases are gone (the reader's check after its copy
    # sees the cleared header); the slots are held while the writer exits.
    assert m.leases == {} and gpu_pool.header(0, grant.run.slot + 2) == (0, 0)
    assert gpu_pool.used_bytes == 4 * SLOT
    m.on_release(r, pb.Release(lease_id=reading, generation=reading))  # harmless now
    m.reap()
    assert gpu_pool.used_bytes == 4 * SLOT
    exiting[7] = False  # exited (or a zombie): its CUDA context is gone
    m.reap()
    assert gpu_pool.used_bytes == 0 and gpu_pool.free_slots == gpu_pool.nslots
    # A writer that never finishes exiting holds them at most GPU_FENCE_LIMIT_S.
    exiting[8] = True
    s = m.open_session(pid=8, stages=["thinker"], gpu_uuids=[GPU_A])
    w = m.bind(s.id, s.token, [].append, pid=8, uid=0, gid=0)
    asyncio.run(m.grant(w, 2 * SLOT, 1.0, gpu_pool.name))
    m.close_session(w.id)
    assert gpu_pool.used_bytes == 4 * SLOT  # a whole grant's run
    now[0] += returns.GPU_FENCE_LIMIT_S
    m.reap()
    assert gpu_pool.used_bytes == 0


def test_a_writer_that_closed_and_lives_on_gives_gpu_slots_back_at_once(
    arena: Arena, gpu_pool: CudaPool
) -> None:
    asked: list[int] = []
    m = LeaseManager(
        arena, grant_bytes=4 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, pools={gpu_pool.name: gpu_pool},
        gpu_work_may_run=lambda pid: asked.append(pid) or False,
    )  # fmt: skip
    s = m.open_session(pid=9, stages=["thinker"], gpu_uuids=[GPU_A])
    w = m.bind(s.id, s.token, [].append, pid=9, uid=0, gid=0)
    asyncio.run(m.grant(w, 4 * SLOT, 1.0, gpu_pool.name))
    m.close_session(w.id)
    assert gpu_pool.used_bytes == 0 and set(asked) == {9}


def test_gpu_work_may_run_only_while_a_process_exits(tmp_path: Any) -> None:
    import subprocess
    import sys

    from relayd.pools.cuda import gpu_work_may_run
    from tests._daemon import wait_until

    assert gpu_work_may_run(os.getpid()) is False  # alive, not exiting
    assert gpu_work_may_run(0) is False and gpu_work_may_run(2**22 + 17) is False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:

        def zombie() -> bool:
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] == b"Z"

        wait_until(zombie, 30, "the child to exit unreaped")
        assert gpu_work_may_run(child.pid) is False
    finally:
        child.wait(10)
    # An exiting process (PF_EXITING in the flags field), as /proc shows it.
    (tmp_path / "4321").mkdir()
    stat = "4321 (py thon) R 1 4321 4321 0 -1 {flags} 0 0 0 0\n"
    (tmp_path / "4321" / "stat").write_text(stat.format(flags=0x400044))
    assert gpu_work_may_run(4321, proc=str(tmp_path)) is True
    (tmp_path / "4321" / "stat").write_text(stat.format(flags=0x400040))
    assert gpu_work_may_run(4321, proc=str(tmp_path)) is False


def test_published_shm_leases_still_outlive_their_writer(arena: Arena, gpu_pool: CudaPool) -> None:
    m = _manager(arena, gpu_pool, [])
    w = _session(m, "thinker", [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = _publish(m, w, grant, 0, 1)
    m.close_session(w.id)
    assert lid in m.leases and arena.used_bytes == SLOT


def test_full_gpu_pool_does_not_block_arena_waiters(arena: Arena, gpu_pool: CudaPool) -> None:
    m = _manager(arena, gpu_pool, [])
    a, b, c = _session(m, "a", []), _session(m, "b", []), _session(m, "c", [])

    async def scenario() -> None:
        held = await m.grant(a, 8 * SLOT, 1.0, gpu_pool.name)  # the pool's quota: half
        with pytest.raises(ResourceExhaustedError, match="quota"):
            await m.grant(a, 9 * SLOT, 0.05, gpu_pool.name)
        await m.grant(b, 8 * SLOT, 1.0, gpu_pool.name)  # now the pool is full
        waiting = asyncio.ensure_future(m.grant(c, SLOT, 5.0, gpu_pool.name))
        await asyncio.sleep(0)
        assert not waiting.done()
        shm = await asyncio.wait_for(m.grant(c, SLOT, 1.0), 1.0)  # not stuck behind it
        assert shm.run.pool == "shm"
        m.return_grant(a, held.id)
        assert (await waiting).run.pool == gpu_pool.name

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_unknown_pool_is_refused(arena: Arena, gpu_pool: CudaPool) -> None:
    from relayd_client import InvalidArgumentError

    m = _manager(arena, gpu_pool, [])
    s = _session(m, "a", [])
    with pytest.raises(InvalidArgumentError):
        asyncio.run(m.grant(s, SLOT, 0.1, f"cuda:{GPU_B}"))


def test_pool_status_and_attach_description(gpu_pool: CudaPool) -> None:
    from relayd.pools.cuda import pool_status

    run = gpu_pool.allocate(3)
    assert run is not None and run.pool == f"cuda:{GPU_A}"
    st = pool_status(gpu_pool, 3, 4)
    assert st["name"] == f"cuda:{GPU_A}" and st["used_bytes"] == 3 * SLOT
    assert st["largest_free_run_bytes"] == 13 * SLOT and st["free_slots"] == 13
    d = gpu_pool.describe()
    assert d.gpu_uuid == GPU_A and d.nslots == 16 and d.headers.name == gpu_pool.headers.name
    # A client maps the header segment exactly as announced.
    seg = MappedSegment(d.headers.name, d.headers.size, 0, HEADER_STRIDE)
    gpu_pool.headers.write_header(5, 77, 88)
    assert seg.read_header(5) == (77, 88)
    seg.close()


def test_daemon_routes_gpu_edges_with_the_probed_peer_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relayd.pools import cuda as cuda_pools
    from relayd.routing.router import PayloadFacts, Placement, route

    writer = Placement("n", "p:1", "ipc", True, (GPU_A,), ("thinker",))
    same = Placement("n", "p:2", "ipc", True, (GPU_A,), ("talker",))
    other = Placement("n", "p:3", "ipc", True, (GPU_B,), ("talker",))
    facts = PayloadFacts(encoded_bytes=1 << 20, inline_meta_bytes=400, cuda_uuids=(GPU_A,))
    peers = cuda_pools.peer_access
    # Same GPU: the pool, unless the writer opted into direct.
    assert route(writer, same, facts, peer_access=peers).transport is Transport.CUDA_IPC_POOL
    facts = dataclasses.replace(facts, direct_allowed=True)
    assert route(writer, same, facts, peer_access=peers).transport is Transport.CUDA_IPC_DIRECT
    # An unprobed pair stages through shm, up front.
    assert route(writer, other, facts, peer_access=peers).transport is Transport.SHM
    monkeypatch.setitem(cuda_pools._PEERS, (GPU_A, GPU_B), True)
    assert route(writer, other, facts, peer_access=peers).transport is Transport.CUDA_IPC_POOL
    # What the client then does with the daemon's answer.
    mine = _cuda_facts.payload_facts([_cuda_facts.device_field(GPU_A)])
    chosen = _cuda.carry_out_route(mine, pools={GPU_A}, daemon_route=Transport.CUDA_IPC_POOL)
    assert chosen is Transport.CUDA_IPC_POOL


# ---------------------------------------------------------------- pool import, pinning


def _pool_desc(handle: bytes, nslots: int = 4) -> pb.CudaPool:
    return pb.CudaPool(
        name=cuda_ipc.pool_name(GPU_A), gpu_uuid=GPU_A, nslots=nslots, slot_size=SLOT,
        storage=pb.CudaIpcHandle(handle=handle, storage_bytes=nslots * SLOT),
    )  # fmt: skip


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """This process "sees" GPU A; opening a handle gives a CPU tensor (counted)."""
    import torch

    opened: list[int] = []

    def open_storage(ordinal, h):  # type: ignore[no-untyped-def]
        opened.append(ordinal)
        return torch.zeros(h.storage_bytes, dtype=torch.uint8)

    monkeypatch.setattr(_cuda_pool, "local_uuids", lambda: (GPU_A,))
    monkeypatch.setattr(_cuda_pool, "_open_storage", open_storage)
    monkeypatch.setattr(_cuda_pool, "_POOLS", {})
    monkeypatch.setattr(cuda_ipc, "_OWN_EXPORTS", {})
    return opened


def test_pool_import_happens_once_per_process(fake_gpu: list[int]) -> None:
    before = _cuda_pool.pool_imports
    first = _cuda_pool.import_pool(_pool_desc(b"h" * 65))
    assert _cuda_pool.import_pool(_pool_desc(b"h" * 65)) is first
    assert fake_gpu == [0] and _cuda_pool.pool_imports == before + 1
    _cuda_pool.import_pool(_pool_desc(b"n" * 65))  # a new daemon epoch exports a new handle
    assert fake_gpu == [0, 0] and _cuda_pool.pool_imports == before + 2


def test_reattach_to_a_new_epoch_forgets_the_old_pools(
    fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    collected: list[int] = []
    monkeypatch.setattr(
        _cuda_pool,
        "torch_cuda",
        lambda: type("C", (), {"ipc_collect": lambda: collected.append(1)}),
    )
    old = _cuda_pool.import_pool(_pool_desc(b"h" * 65), "node-a", "e1")
    other_node = _cuda_pool.import_pool(_pool_desc(b"x" * 65), "node-b", "e1")
    assert _cuda_pool.forget_pools("node-a", "e1") == 0 and collected == []  # same epoch: kept
    assert _cuda_pool.import_pool(_pool_desc(b"h" * 65), "node-a", "e1") is old
    assert _cuda_pool.forget_pools("node-a", "e2") == 1 and collected == [1]
    # node-a's old mapping is gone (re-imported if named again); node-b's is not.
    assert _cuda_pool.import_pool(_pool_desc(b"x" * 65), "node-b", "e1") is other_node
    assert set(_cuda_pool._POOLS) == {("node-b", "e1", _pool_desc(b"x" * 65).name, b"x" * 65)}


def test_pool_import_checks_visibility_and_size(
    fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayd_client import PeerUnavailableError

    small = _pool_desc(b"s" * 65)
    small.storage.storage_bytes = SLOT  # less than nslots * slot_size
    with pytest.raises(CorruptRefError):
        _cuda_pool.import_pool(small)
    monkeypatch.setattr(_cuda_pool, "local_uuids", lambda: (GPU_B,))
    with pytest.raises(PeerUnavailableError, match="CUDA_VISIBLE_DEVICES"):
        _cuda_pool.import_pool(_pool_desc(b"h" * 65))


def test_a_pool_exported_by_this_process_is_not_reopened(
    fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA IPC cannot open a handle in its own process: a client living in the
    daemon's process gets the daemon's tensor, and closing the pool forgets it."""
    import torch

    memory = torch.zeros(4 * SLOT, dtype=torch.uint8)
    geometry = pool_geometry(4 * SLOT, SLOT)
    headers = MappedSegment(
        f"relayd.unit.{os.urandom(4).hex()}.{HEADER_SEGMENT_BASE}", geometry.header_bytes, 0,
        HEADER_STRIDE, create=True,
    )  # fmt: skip
    export = pb.CudaIpcHandle(handle=b"o" * 65, storage_bytes=4 * SLOT)
    pool = CudaPool(uuid=GPU_A, device_index=0, geometry=geometry, headers=headers,
                    memory=memory, export=export)  # fmt: skip
    cuda_ipc.register_own_export(export.handle, memory)
    assert _cuda_pool.import_pool(pool.describe()) is memory and fake_gpu == []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    pool.close()
    assert _cuda_pool.import_pool(pool.describe()) is not memory and fake_gpu == [0]


class _FakeCudart:
    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert flags == 1  # cudaHostRegisterPortable
        code = self.codes.pop(0)
        if code == 0:
            self.registered.append(ptr)
        return code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_failed_pin_unpins_and_clears_the_cuda_error(
    mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch
    from relayd_client import RelayError

    cudart = _FakeCudart([0, 2])  # the second segment fails (cudaErrorMemoryAllocation)
    cleared: list[bool] = []
    monkeypatch.setattr(_cuda_staging, "uses_cuda", lambda: True)
    monkeypatch.setattr(_cuda_staging, "torch_cuda", lambda: SimpleNamespace(cudart=lambda: cudart))
    monkeypatch.setattr(_cuda_staging, "_clear_cuda_error", lambda: cleared.append(True))
    views = [torch.zeros(SLOT, dtype=torch.uint8), torch.zeros(SLOT, dtype=torch.uint8)]
    if mode == "on":
        with pytest.raises(RelayError, match="RLIMIT_MEMLOCK"):
            _cuda_staging.pin_host(views, mode)
    else:
        assert _cuda_staging.pin_host(views, mode) == []
        assert "stay pageable" in caplog.text
    assert cudart.unregistered == cudart.registered == [views[0].data_ptr()]
    assert cleared == [True]  # the next kernel launch must not inherit the error


def test_pinning_succeeds_and_unpins_on_close(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    cudart = _FakeCudart([0, 0])
    monkeypatch.setattr(_cuda_staging, "uses_cuda", lambda: True)
    monkeypatch.setattr(_cuda_staging, "torch_cuda", lambda: SimpleNamespace(cudart=lambda: cudart))
    views = [torch.zeros(SLOT, dtype=torch.uint8), torch.zeros(SLOT, dtype=torch.uint8)]
    pinned = _cuda_staging.pin_host(views, "auto")
    assert pinned == [v.data_ptr() for v in views]
    _cuda_staging.unpin_host(pinned)
    assert cudart.unregistered == [v.data_ptr() for v in views] and pinned == []
    assert _cuda_staging.pin_host(views, "off") == []


def test_clearing_the_cuda_error_is_harmless_without_cuda() -> None:
    _cuda_staging._clear_cuda_error()  # no libcudart loaded here: nothing to do, nothing raised


@pytest.mark.parametrize(
    "conf",
    [
        "expandable_segments:True",
        "backend:cudaMallocAsync",
        "max_split_size_mb:64, expandable_segments: true",
    ],
)
def test_gpu_preflight_refuses_allocators_without_ipc(
    conf: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayd.config import Settings
    from relayd.pools.cuda import preflight

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    why = preflight(Settings(gpu_pool_size=256 << 20))
    assert why is not None and "CUDA IPC" in why


# ---------------------------------------------------------------- streams


class _FakeCudaC:
    """The three calls of ``torch._C`` that :class:`_cuda_copy.on_stream` makes."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.current = {0: (10, 0, 1), 1: (11, 1, 1)}  # device -> (stream id, device, type)
        self.calls: list[tuple[int, int]] = []

    def _cuda_getDevice(self) -> int:
        return self.device

    def _cuda_getCurrentStream(self, index: int) -> tuple[int, int, int]:
        return self.current[index]

    def _cuda_setStream(self, *, stream_id: int, device_index: int, device_type: int) -> None:
        self.calls.append((stream_id, device_index))
        self.current[device_index] = (stream_id, device_index, device_type)
        self.device = device_index  # as PyTorch's does


def test_on_stream_makes_a_stream_current_and_restores_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from relayd_client import _cuda_copy, _gpu_order

    fake = _FakeCudaC(device=0)
    for name in ("_cuda_getDevice", "_cuda_getCurrentStream", "_cuda_setStream"):
        monkeypatch.setattr(torch._C, name, getattr(fake, name), raising=False)
    copy_stream = SimpleNamespace(stream_id=77, device_index=0, device_type=1)

    def copy() -> tuple[int, int, int]:
        return fake.current[0]

    seen = _gpu_order.run_on_streams([copy_stream], _cuda_copy.on_stream, copy)
    assert seen == (77, 0, 1)  # the copy ran on the copy stream
    assert fake.current[0] == (10, 0, 1) and fake.device == 0  # and it was put back
    assert fake.calls == [(77, 0), (10, 0)]

    # Restored on an error too.
    with pytest.raises(ValueError), _cuda_copy.on_stream(copy_stream):
        raise ValueError("copy failed")
    assert fake.current[0] == (10, 0, 1)

    # A stream of another device takes torch.cuda.stream, device and all.
    entered: list[str] = []

    class Ctx:
        def __init__(self, s: Any) -> None:
            entered.append(f"enter {s.stream_id}")

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    other = SimpleNamespace(stream_id=88, device_index=1, device_type=1)
    fake.calls.clear()
    with _cuda_copy.on_stream(other):
        pass
    assert entered == ["enter 88", "exit"] and fake.calls == []
