"""The client's GPU side carries out the router's transport; it never decides one.

``relayd.routing.router.route`` decides every transport; ``_cuda.carry_out_route``
may only take the router's answer or fall back along the router's own order
(cuda_ipc_direct -> cuda_ipc_pool -> shm) where this client cannot carry it out.
"""

from __future__ import annotations

import itertools

import pytest
from relayd_client import _cuda, _cuda_facts
from relayd_client.wire.transport import DIRECT_META_LIMIT, Transport

from relayd.routing.router import PayloadFacts, Placement, route

GPU_A = "GPU-58b9e9e8-0000-0000-0000-00000000000a"
GPU_B = "GPU-58b9e9e8-0000-0000-0000-00000000000b"

# What a route may become on the client: itself, or a later row of the router.
FALLBACKS = {
    Transport.CUDA_IPC_DIRECT: (
        Transport.CUDA_IPC_DIRECT,
        Transport.CUDA_IPC_POOL,
        Transport.SHM,
    ),
    Transport.CUDA_IPC_POOL: (Transport.CUDA_IPC_POOL, Transport.SHM),
}

DEVICE_SETS = [
    (),
    ("cpu",),
    (GPU_A,),
    (GPU_B,),
    (GPU_A, GPU_A),
    (GPU_A, GPU_B),
    ("cpu", GPU_A),
    ("cuda:0",),
]


def _fields(devices: tuple[str, ...]) -> list[str]:
    return [d if d.startswith(("cpu", "cuda:")) else _cuda_facts.device_field(d) for d in devices]


@pytest.mark.parametrize("devices", DEVICE_SETS)
@pytest.mark.parametrize("header_bytes", [0, DIRECT_META_LIMIT])
def test_the_gpu_side_never_answers_a_transport_the_router_ranks_higher(
    devices: tuple[str, ...], header_bytes: int
) -> None:
    facts = _cuda_facts.payload_facts(_fields(devices), header_bytes)
    for routed, pools in itertools.product(Transport, [set(), {GPU_A}, {GPU_A, GPU_B}]):
        got = _cuda.carry_out_route(facts, pools=pools, daemon_route=routed)
        assert got in FALLBACKS.get(routed, (Transport.SHM,)), (devices, routed, pools, got)


@pytest.mark.parametrize("direct_allowed", [False, True])
@pytest.mark.parametrize("reader_gpus", [(), (GPU_A,), (GPU_B,), (GPU_B, GPU_A)])
@pytest.mark.parametrize("devices", DEVICE_SETS[:-1])  # the router refuses ordinals itself
@pytest.mark.parametrize("peers", [False, True])
def test_a_route_this_client_can_serve_is_taken_as_routed(
    direct_allowed: bool, reader_gpus: tuple[str, ...], devices: tuple[str, ...], peers: bool
) -> None:
    """With a pool for the payload's one GPU and handles that fit, the client's
    answer is the router's, whatever the router decided."""
    facts = _cuda_facts.payload_facts(_fields(devices))
    writer = Placement("n", "p:1", "ipc", True, (GPU_A, GPU_B), ("thinker",))
    reader = Placement("n", "p:2", "ipc", True, reader_gpus, ("talker",))
    routed = route(
        writer,
        reader,
        PayloadFacts(
            encoded_bytes=1 << 20,
            inline_meta_bytes=facts.direct_meta_bytes,
            cuda_uuids=facts.cuda_uuids,
            has_cpu_tensors=facts.has_cpu_tensors,
            direct_allowed=direct_allowed,
        ),
        peer_access=lambda src, dst: peers,
    ).transport
    got = _cuda.carry_out_route(facts, pools={GPU_A, GPU_B}, daemon_route=routed)
    if routed is Transport.CUDA_IPC_POOL and len(facts.cuda_uuids) > 1:
        assert got is Transport.SHM  # one lease lives in one pool
    elif routed in _cuda.GPU_TRANSPORTS:
        assert got is routed
    else:
        assert got is Transport.SHM  # not a GPU path: the put goes on as the router said


def test_one_pool_holds_a_payload_on_one_gpu_that_has_a_pool() -> None:
    assert _cuda.one_pool_holds((GPU_A,), {GPU_A})
    assert not _cuda.one_pool_holds((GPU_B,), {GPU_A})
    assert not _cuda.one_pool_holds((GPU_A, GPU_B), {GPU_A, GPU_B})
    assert not _cuda.one_pool_holds((), {GPU_A})


def test_a_storage_another_process_exported_is_opened_with_every_handle_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pool imports and direct reads open storages through one call, which
    turns PyTorch's RuntimeError into PeerUnavailableError."""
    torch = pytest.importorskip("torch")
    from relayd_client import PeerUnavailableError, _cuda_copy
    from relayd_client.wire.proto import relay_pb2 as pb

    calls: list[tuple[object, ...]] = []

    def new_shared_cuda(*args: object) -> str:
        calls.append(args)
        if args[0] == 1:
            raise RuntimeError("invalid device context")
        return "storage"

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    h = pb.CudaIpcHandle(
        handle=b"H" * 64, storage_bytes=4096, storage_offset_bytes=512,
        ref_counter_handle=b"/rc", ref_counter_offset=16, event_handle=b"E" * 64,
        event_sync_required=True,
    )  # fmt: skip
    assert _cuda_copy.open_shared_storage(0, h) == "storage"
    assert calls == [(0, b"H" * 64, 4096, 512, b"/rc", 16, b"E" * 64, True)]
    with pytest.raises(PeerUnavailableError, match=r"cuda:1: invalid device context"):
        _cuda_copy.open_shared_storage(1, h)
