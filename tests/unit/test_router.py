"""The router: every row of the transport table, every tie-break between rows, purity."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from relayd_client.wire.proto import relay_pb2
from relayd_client.wire.transport import DIRECT_META_LIMIT, INLINE_LIMIT, Transport

from relayd.routing.router import (
    PayloadFacts,
    Placement,
    Route,
    route,
)

# Physical GPUs of node n1, in the order `nvidia-smi -L` lists them.
GPU_A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
GPU_C = "GPU-cccccccc-0000-4000-8000-000000000000"
GPU_D = "GPU-dddddddd-0000-4000-8000-000000000000"
NODE_GPUS = (GPU_A, GPU_B, GPU_C, GPU_D)
GPU_X = "GPU-eeeeeeee-0000-4000-8000-000000000000"  # on node n2

MiB = 1024 * 1024

INLINE = Transport.INLINE
LOCAL = Transport.LOCAL_OBJECT
DIRECT = Transport.CUDA_IPC_DIRECT
POOL = Transport.CUDA_IPC_POOL
SHM = Transport.SHM
MOONCAKE = Transport.MOONCAKE
SOCKET = Transport.SOCKET


def proc(pid: int, *, node: str = "n1", gpus: tuple[str, ...] = (), shm: bool = True) -> Placement:
    return Placement(
        node_id=node,
        process_key=f"4026531836:{pid}:1000",
        ipc_namespace="4026531839",
        can_map_shm=shm,
        gpu_uuids=gpus,
    )


def cuda(
    *uuids: str, size: int = MiB, meta: int = 2048, cpu: bool = False, direct: bool = True
) -> PayloadFacts:
    """A CUDA payload; ``direct``: the writer opted into cuda_ipc_direct."""
    return PayloadFacts(encoded_bytes=size, inline_meta_bytes=meta, cuda_uuids=uuids,
                        has_cpu_tensors=cpu, direct_allowed=direct)  # fmt: skip


def cpu_only(size: int = MiB) -> PayloadFacts:
    return PayloadFacts(encoded_bytes=size, has_cpu_tensors=True)


def allow(*pairs: tuple[str, str]) -> Any:
    granted = set(pairs)
    return lambda src, dst: (src, dst) in granted


W_A = proc(100, gpus=(GPU_A,))
R_A = proc(200, gpus=(GPU_A,))
R_B = proc(200, gpus=(GPU_B,))
R_CPU = proc(200)
REMOTE = proc(200, node="n2", gpus=(GPU_X,))
REMOTE_SAME_UUID = proc(200, node="n2", gpus=(GPU_A,))  # impossible, but proves the order

# id, writer, reader, facts, keyword arguments, transport, words expected in the reason
CASES: list[tuple[str, Placement, Placement | None, PayloadFacts, dict[str, Any], Transport, str]]
CASES = [
    # 2 inline - beats every row but local_object
    ("inline-small-cpu", W_A, R_CPU, cpu_only(100), {}, INLINE, "fits inline"),
    ("inline-at-limit", W_A, R_CPU, cpu_only(INLINE_LIMIT), {}, INLINE, "inline"),
    ("inline-one-over-limit", W_A, R_CPU, cpu_only(INLINE_LIMIT + 1), {}, SHM, "no CUDA"),
    ("inline-beats-cross-node", W_A, REMOTE, cuda(GPU_A, size=4096), {}, INLINE, "inline"),
    ("same-process-beats-inline", W_A, W_A, cuda(GPU_A, size=4096), {}, LOCAL, "same process"),
    ("same-process-beats-inline-cpu", W_A, W_A, cpu_only(4096), {}, LOCAL, "same process"),
    ("inline-beats-direct", W_A, R_A, cuda(GPU_A, size=4096), {}, INLINE, "inline"),
    ("inline-beats-socket", proc(1, shm=False), R_CPU, cpu_only(10), {}, INLINE, "inline"),
    ("inline-beats-unknown-reader", W_A, None, cpu_only(10), {}, INLINE, "inline"),
    ("inline-chunk-plain-meta",
     W_A, R_CPU, PayloadFacts(100, is_chunk=True), {}, INLINE, "inline"),
    ("chunk-tensor-in-meta-not-inline",
     W_A, R_CPU, PayloadFacts(100, is_chunk=True, chunk_meta_has_tensor=True, has_cpu_tensors=True),
     {}, SHM, "no CUDA"),
    ("chunk-tensor-in-meta-gpu-goes-direct",
     W_A, R_A, dataclasses.replace(cuda(GPU_A, size=100), is_chunk=True,
                                   chunk_meta_has_tensor=True),
     {}, DIRECT, "same GPU"),
    ("non-chunk-ignores-chunk-flag",
     W_A, R_CPU, PayloadFacts(100, chunk_meta_has_tensor=True), {}, INLINE, "inline"),
    # 1 local_object - same OS process, whatever the payload (inline included)
    ("same-process-gpu", W_A, W_A, cuda(GPU_A), {}, LOCAL, "same process"),
    ("same-process-cpu", W_A, W_A, cpu_only(), {}, LOCAL, "same process"),
    ("same-process-beats-socket",
     proc(1, shm=False), proc(1, shm=False), cpu_only(), {}, LOCAL, "same process"),
    ("same-process-key-other-node", W_A, proc(100, node="n2"), cpu_only(), {}, MOONCAKE, "n2"),
    # 3 mooncake - cross-node wins over every same-node row
    ("cross-node-gpu", W_A, REMOTE, cuda(GPU_A), {}, MOONCAKE, "reader on node n2"),
    ("cross-node-cpu", W_A, REMOTE, cpu_only(), {}, MOONCAKE, "n2"),
    ("cross-node-beats-direct",
     W_A, REMOTE_SAME_UUID, cuda(GPU_A), {"peer_access": allow((GPU_A, GPU_A))}, MOONCAKE, "n2"),
    ("cross-node-writer-no-shm",
     proc(1, shm=False), REMOTE, cpu_only(), {}, MOONCAKE, "writer via socket"),
    ("cross-node-reader-no-shm",
     W_A, proc(2, node="n2", shm=False), cpu_only(), {}, MOONCAKE, "reader via socket"),
    # 4 socket - same node, one side cannot map the daemon's SHM
    ("writer-no-shm", proc(1, shm=False), R_CPU, cpu_only(), {}, SOCKET, "writer cannot map"),
    ("reader-no-shm", W_A, proc(2, shm=False), cpu_only(), {}, SOCKET, "reader cannot map"),
    ("socket-beats-direct",
     W_A, proc(2, gpus=(GPU_A,), shm=False), cuda(GPU_A), {}, SOCKET, "reader cannot map"),
    ("both-no-shm-names-writer",
     proc(1, shm=False), proc(2, shm=False), cpu_only(), {}, SOCKET, "writer"),
    ("unknown-reader-writer-no-shm",
     proc(1, gpus=(GPU_A,), shm=False), None, cuda(GPU_A), {}, SOCKET, "writer cannot map"),
    # reader not attached yet - shm, which every later row can still serve from
    ("unknown-reader-cpu", W_A, None, cpu_only(), {}, SHM, "reader unknown"),
    ("unknown-reader-gpu", W_A, None, cuda(GPU_A), {}, SHM, "reader unknown"),
    # 5 cuda_ipc_direct
    ("direct-same-gpu", W_A, R_A, cuda(GPU_A), {}, DIRECT, "same GPU GPU-aaaaaaaa"),
    ("direct-meta-at-limit", W_A, R_A, cuda(GPU_A, meta=DIRECT_META_LIMIT), {}, DIRECT, "same"),
    ("direct-two-shared-gpus",
     proc(1, gpus=(GPU_A, GPU_B)), proc(2, gpus=(GPU_B, GPU_A)), cuda(GPU_A, GPU_B), {},
     DIRECT, "GPU-aaaaaaaa,GPU-bbbbbbbb"),
    ("direct-reader-wants-gpu-explicit",
     W_A, R_A, cuda(GPU_A), {"reader_wants_gpu": True}, DIRECT, "same GPU"),
    ("direct-needs-payload-gpu-on-both-sides",
     proc(1, gpus=(GPU_A, GPU_B)), proc(2, gpus=(GPU_A,)), cuda(GPU_A, GPU_B),
     {"peer_access": allow((GPU_B, GPU_A))}, POOL, "different GPUs"),
    ("direct-rejected-meta-over-limit-pool",
     W_A, R_A, cuda(GPU_A, meta=DIRECT_META_LIMIT + 1), {}, POOL, "metadata 65537 B > 64 KiB"),
    ("direct-rejected-mixed-cpu", W_A, R_A, cuda(GPU_A, cpu=True), {}, SHM, "mixed CPU and CUDA"),
    # direct is the writer's opt-in: without it a same-GPU edge uses the pool
    ("direct-not-opted-in-pool",
     W_A, R_A, cuda(GPU_A, direct=False), {}, POOL, "direct not opted into by the writer"),
    ("direct-not-opted-in-two-gpus-no-peer-shm",
     proc(1, gpus=(GPU_A, GPU_B)), proc(2, gpus=(GPU_B, GPU_A)), cuda(GPU_A, GPU_B, direct=False),
     {}, SHM, "no peer access"),
    ("writer-placement-stale-pool",
     proc(1), R_A, cuda(GPU_A), {}, POOL, "writer placement lacks"),
    # 6 cuda_ipc_pool
    ("pool-peer-access", W_A, R_B, cuda(GPU_A), {"peer_access": allow((GPU_A, GPU_B))},
     POOL, "GPU-aaaaaaaa -> GPU-bbbbbbbb (different GPUs)"),
    ("pool-same-uuid-counts-as-access",
     W_A, R_A, cuda(GPU_A, meta=MiB), {"peer_access": allow()}, POOL, "GPU-aaaaaaaa -> GPU-aaa"),
    ("pool-lands-on-reader-gpu-holding-data",
     proc(1, gpus=(GPU_A, GPU_B)), proc(2, gpus=(GPU_C, GPU_B)), cuda(GPU_A, GPU_B),
     {"peer_access": allow((GPU_A, GPU_B))}, POOL, "-> GPU-bbbbbbbb"),
    # 7 shm
    ("no-peer-access", W_A, R_B, cuda(GPU_A), {}, SHM, "no peer access GPU-aaaaaaaa -> GPU-bbbb"),
    ("peer-access-one-way-only",
     W_A, R_B, cuda(GPU_A), {"peer_access": allow((GPU_B, GPU_A))}, SHM, "no peer access"),
    ("multi-gpu-one-pair-missing",
     proc(1, gpus=(GPU_A, GPU_C)), R_B, cuda(GPU_A, GPU_C),
     {"peer_access": allow((GPU_A, GPU_B))}, SHM, "no peer access GPU-cccccccc -> GPU-bbbb"),
    ("gpu-to-cpu-reader", W_A, R_CPU, cuda(GPU_A), {}, SHM, "GPU -> CPU"),
    ("reader-wants-cpu-on-same-gpu",
     W_A, R_A, cuda(GPU_A), {"reader_wants_gpu": False}, SHM, "GPU -> CPU"),
    ("reader-wants-gpu-but-has-none",
     W_A, R_CPU, cuda(GPU_A), {"reader_wants_gpu": True}, SHM, "reader's GPU unknown"),
    ("cpu-tensors", W_A, R_A, cpu_only(), {}, SHM, "no CUDA tensors"),
    ("no-tensors-large-header", W_A, R_A, PayloadFacts(MiB), {}, SHM, "no CUDA tensors"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("writer", "reader", "facts", "kwargs", "transport", "why"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_route_table(
    writer: Placement,
    reader: Placement | None,
    facts: PayloadFacts,
    kwargs: dict[str, Any],
    transport: Transport,
    why: str,
) -> None:
    got = route(writer, reader, facts, **kwargs)
    assert got.transport is transport, got.reason
    assert why in got.reason


def test_every_transport_is_reachable() -> None:
    assert {case[5] for case in CASES} == set(Transport)


def visible(cuda_visible_devices: str, *ordinals_used: int) -> tuple[str, ...]:
    """The UUIDs behind the ordinals a process uses under a CUDA_VISIBLE_DEVICES setting."""
    remapped = [NODE_GPUS[int(i)] for i in cuda_visible_devices.split(",")]
    return tuple(remapped[i] for i in ordinals_used)


def test_ordinal_zero_in_two_processes_is_two_gpus() -> None:
    # Both processes put their tensors on "cuda:0", but each sees a different GPU.
    writer = proc(1, gpus=visible("2", 0))
    reader = proc(2, gpus=visible("3", 0))
    assert writer.gpu_uuids == (GPU_C,) and reader.gpu_uuids == (GPU_D,)
    facts = cuda(GPU_C)
    assert route(writer, reader, facts).transport is SHM  # no peer access known
    peered = route(writer, reader, facts, peer_access=allow((GPU_C, GPU_D)))
    assert peered == Route(POOL, "GPU-cccccccc -> GPU-dddddddd (different GPUs)")


def test_different_ordinals_same_gpu_goes_direct() -> None:
    # Writer's cuda:1 and reader's cuda:0 are the same physical GPU.
    writer = proc(1, gpus=visible("0,1", 1))
    reader = proc(2, gpus=visible("1", 0))
    assert route(writer, reader, cuda(GPU_B)).transport is DIRECT


@pytest.mark.parametrize("bad", ["0", " 1", "cuda:0", ""])
def test_ordinals_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="UUID"):
        proc(1, gpus=(bad,))
    with pytest.raises(ValueError, match="UUID"):
        cuda(bad)


def test_peer_access_is_not_asked_about_one_gpu() -> None:
    asked: list[tuple[str, str]] = []

    def probe(src: str, dst: str) -> bool:
        asked.append((src, dst))
        return False

    got = route(W_A, R_A, cuda(GPU_A, meta=MiB), peer_access=probe)
    assert got.transport is POOL and asked == []


# ---------------------------------------------------------------- purity

uuids = st.lists(st.sampled_from((*NODE_GPUS, GPU_X)), max_size=3, unique=True).map(tuple)
placements = st.builds(
    Placement,
    node_id=st.sampled_from(("n1", "n2")),
    process_key=st.sampled_from(("k1", "k2", "k3")),
    ipc_namespace=st.just("ipc"),
    can_map_shm=st.booleans(),
    gpu_uuids=uuids,
)
facts_st = st.builds(
    PayloadFacts,
    encoded_bytes=st.integers(0, 4 * MiB),
    inline_meta_bytes=st.integers(0, 2 * DIRECT_META_LIMIT),
    cuda_uuids=uuids,
    has_cpu_tensors=st.booleans(),
    is_chunk=st.booleans(),
    chunk_meta_has_tensor=st.booleans(),
)
peer_pairs = st.frozensets(st.tuples(st.sampled_from(NODE_GPUS), st.sampled_from(NODE_GPUS)))


@given(placements, st.none() | placements, facts_st, peer_pairs, st.none() | st.booleans())
def test_route_is_pure_and_keeps_its_invariants(
    writer: Placement,
    reader: Placement | None,
    facts: PayloadFacts,
    pairs: frozenset[tuple[str, str]],
    wants_gpu: bool | None,
) -> None:
    before = (dataclasses.replace(writer), reader and dataclasses.replace(reader),
              dataclasses.replace(facts))  # fmt: skip
    kwargs: dict[str, Any] = {"peer_access": lambda s, d: (s, d) in pairs,
                              "reader_wants_gpu": wants_gpu}  # fmt: skip
    first = route(writer, reader, facts, **kwargs)
    assert route(writer, reader, facts, **kwargs) == first
    assert (writer, reader, facts) == before

    t = first.transport
    assert first.reason
    fits = facts.encoded_bytes <= INLINE_LIMIT
    same_process = reader is not None and (reader.node_id, reader.process_key) == (
        writer.node_id, writer.process_key)  # fmt: skip
    assert (t is LOCAL) == same_process
    assert (t is INLINE) == (
        fits and not (facts.is_chunk and facts.chunk_meta_has_tensor) and not same_process
    )
    if t is LOCAL:
        assert reader is not None
        assert (reader.node_id, reader.process_key) == (writer.node_id, writer.process_key)
    if t is MOONCAKE:
        assert reader is not None and reader.node_id != writer.node_id
    if t in (DIRECT, POOL, SHM):
        assert writer.can_map_shm and (reader is None or reader.can_map_shm)
    if t in (DIRECT, POOL):
        assert reader is not None and reader.node_id == writer.node_id
        assert facts.cuda_uuids and not facts.has_cpu_tensors and wants_gpu is not False
    if t is DIRECT:
        assert reader is not None
        assert set(facts.cuda_uuids) <= set(writer.gpu_uuids) & set(reader.gpu_uuids)
        assert facts.inline_meta_bytes <= DIRECT_META_LIMIT


# ---------------------------------------------------------------- Transport <-> proto


@pytest.mark.parametrize("member", list(Transport), ids=lambda m: m.value)
def test_transport_matches_proto_enum(member: Transport) -> None:
    number = relay_pb2.Transport.Value(f"TRANSPORT_{member.name}")
    assert member.to_proto() == number
    assert Transport.from_proto(number) is member


def test_transport_covers_every_proto_value() -> None:
    known = {n for n in relay_pb2.Transport.values() if n != relay_pb2.TRANSPORT_UNSPECIFIED}
    assert {m.to_proto() for m in Transport} == known


@pytest.mark.parametrize("number", [0, 8, -1])
def test_transport_from_unknown_number(number: int) -> None:
    with pytest.raises(ValueError, match=r"relayd\.v1\.Transport"):
        Transport.from_proto(number)
