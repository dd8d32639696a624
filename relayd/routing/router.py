"""Pick an edge's transport from where its two ends are.

There is no setting that chooses a backend: :func:`route` derives it from the
writer's and reader's :class:`Placement` and the facts of one payload. It is a
pure function (no I/O, no clock, no state, inputs are frozen), so the daemon and
the client can both call it, cache its answer per edge, and recompute it whenever
the stage registry's version changes.

Rows, checked top to bottom; the first match wins::

    #  transport         when
    1  local_object      writer and reader are one OS process (same node, same
                         process_key), whatever the payload's size
    2  inline            whole encoded put <= 16 KiB (a stream chunk: and no tensor
                         in the chunk's metadata)
    3  mooncake          the reader is on another node
    4  socket            same node, but the writer or the reader cannot map the
                         daemon's SHM (also: reader unknown and the writer cannot)
    -  shm               reader unknown (not attached yet)
    5  cuda_ipc_direct   the writer opted in, payload only CUDA tensors, all on
                         GPUs both ends use (by UUID), reader wants GPU tensors,
                         handle metadata <= 64 KiB
    6  cuda_ipc_pool     same node, GPU -> GPU, not direct, and every source GPU
                         can reach the reader's GPU (peer access; same UUID counts)
    7  shm               otherwise: no CUDA tensors, CPU and CUDA tensors mixed,
                         GPU -> CPU, or no peer access

Why this order, and where it departs from the table in DESIGN.md:

* **local_object first, whatever the size.** Handing over a Python reference
  beats every copy, the inline one included: a 4 KiB payload encoded into the
  DataRef and decoded again costs about twice what a 1 MiB one passed by
  reference does. One process is trivially one node. We also require the same
  ``node_id``: a process_key is only unique per host (the initial PID namespace
  has the same inode number on every Linux host). A client that cannot hand the
  object over after all (the stage closed meanwhile, or the payload forwards
  refs the reader must materialize) publishes what this function answers for
  another process of its node: inline when it fits, else a lease.
* **inline second, even across nodes.** The bytes ride inside the DataRef,
  which crosses the application's own channel anyway; nothing is leased,
  nothing is freed, and beyond "another process" the answer does not depend on
  the reader, so a DataRef that is forwarded or fanned out stays readable
  everywhere. At <= 16 KiB the copy costs less than any lookup another row
  would need. ``encoded_bytes`` is the real size: the client reports it and
  keys its cached answers by :func:`fits_inline`, the only size fact this
  function distinguishes.
* **mooncake third, not last.** DESIGN.md lists it last because its condition
  ("the reader is on another node") is disjoint from the same-node rows, but two
  later rows do not say "same node": shm's "receiver not yet known / otherwise"
  would swallow a cross-node edge, and cuda_ipc_direct only compares GPU UUIDs.
  Checking it right after local_object and inline makes every later row same-node by
  construction. A writer or reader that cannot map its daemon's SHM still gets
  mooncake - its leg to its own daemon falls back to the socket, which the reason
  says - because the reader's daemon has to pull the bytes either way.
* **socket before the GPU rows.** A client that cannot map the daemon's segments
  (a container without the host's IPC namespace) cannot open CUDA IPC handles
  from another process either, so direct and pool would fail at read time; the
  socket always works and shows up in status instead of as an error.
* **reader unknown -> shm.** Without a reader nothing below row 4 can be decided.
  The SHM arena is the staging area every later row can still serve from: a
  same-node reader maps it, a GPU reader copies up from it, a socket reader is
  fed from it by the daemon, and a remote daemon pulls it with Mooncake.
* **direct before pool, pool before shm.** direct moves no bytes; the pool is a
  device-to-device copy; shm goes through host memory twice.
* **direct only where the writer opted in.** A direct ref is PyTorch's storage
  handle: its reference count is given back only by a read, so an unread,
  aborted or expired ref keeps the writer's memory for the life of its process,
  and nothing outlives the writer. The pool has leases (abort, TTL, reclaim) and
  costs one device-to-device copy, so it is the default for same-GPU edges;
  ``PayloadFacts.direct_allowed`` (the writer's ``cuda_ipc_direct=True``) says
  the writer takes on PyTorch's contract (see ``relayd_client._cuda_direct``).

``PayloadFacts`` are measured by the writer from the actual tensors; a
``Placement``'s ``can_map_shm`` is proven by the daemon (the client mapped a
segment and echoed a nonce back), never taken from a field the client filled in.
GPUs are always UUIDs: CUDA_VISIBLE_DEVICES remaps ordinals per process, so
"cuda:0" in the writer and "cuda:0" in the reader can be two different GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relayd_client.wire.transport import DIRECT_META_LIMIT, Transport, fits_inline

PeerAccess = Callable[[str, str], bool]


def _check_uuids(field: str, uuids: tuple[str, ...]) -> None:
    # The cheapest guard against the ordinal trap: a bare number is an ordinal,
    # which means a different GPU in each process.
    for uuid in uuids:
        if not uuid or uuid.strip().isdigit() or uuid.startswith("cuda:"):
            raise ValueError(f"{field} must hold GPU UUIDs, not ordinals or devices: {uuid!r}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one stage process runs, as the daemon has established it."""

    node_id: str
    process_key: str  # unique per OS process on a host: f"{pid_ns}:{pid}:{start_time}"
    ipc_namespace: str  # for status; the routing proof of sharing it is can_map_shm
    can_map_shm: bool  # proven by the daemon (mapped a segment, echoed a nonce)
    gpu_uuids: tuple[str, ...] = ()  # GPUs the process uses, in its own ordinal order
    stages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_uuids("gpu_uuids", self.gpu_uuids)


@dataclass(frozen=True, slots=True)
class PayloadFacts:
    """What the writer measured about one put."""

    encoded_bytes: int  # whole encoded put, tensor bytes included
    inline_meta_bytes: int = 0  # metadata size if CUDA tensors travel as IPC handles
    cuda_uuids: tuple[str, ...] = ()  # GPUs holding the payload's CUDA tensors
    has_cpu_tensors: bool = False
    is_chunk: bool = False
    chunk_meta_has_tensor: bool = False
    direct_allowed: bool = False  # the writer opted into cuda_ipc_direct

    def __post_init__(self) -> None:
        _check_uuids("cuda_uuids", self.cuda_uuids)


@dataclass(frozen=True, slots=True)
class Route:
    """The chosen transport and a short, human reason (shown in ``relayd status``)."""

    transport: Transport
    reason: str


def no_peer_access(src_uuid: str, dst_uuid: str) -> bool:
    """Default for :func:`route`: assume none, so an unprobed pair stages through shm."""
    return False


def _gpu(uuid: str) -> str:
    # "GPU-58b9e9e8-..." -> "GPU-58b9e9e8": enough to match `nvidia-smi -L` on one node.
    return uuid[:12]


def _gpus(uuids: tuple[str, ...] | frozenset[str]) -> str:
    return ",".join(_gpu(u) for u in sorted(uuids))


def _socket_legs(writer: Placement, reader: Placement) -> str:
    legs = [side for side, p in (("writer", writer), ("reader", reader)) if not p.can_map_shm]
    return f"; {' and '.join(legs)} via socket (cannot map SHM)" if legs else ""


def route(
    writer: Placement,
    reader: Placement | None,
    facts: PayloadFacts,
    *,
    peer_access: PeerAccess = no_peer_access,
    reader_wants_gpu: bool | None = None,
) -> Route:
    """The transport for one put from ``writer`` to ``reader`` (None: not attached yet).

    ``peer_access(src_uuid, dst_uuid)`` says whether GPU ``src`` can copy into
    ``dst`` directly; it is only asked about two different GPUs. ``reader_wants_gpu``
    overrides whether the reader takes tensors on a GPU; None means "if it uses one".
    """
    same_node = reader is not None and reader.node_id == writer.node_id
    # 1 local_object
    if same_node and reader is not None and reader.process_key == writer.process_key:
        return Route(Transport.LOCAL_OBJECT, "same process")

    # 2 inline
    if fits_inline(facts.encoded_bytes, facts.is_chunk and facts.chunk_meta_has_tensor):
        return Route(Transport.INLINE, f"{facts.encoded_bytes} B fits inline (<= 16 KiB)")

    # 3 mooncake
    if reader is not None and not same_node:
        why = f"reader on node {reader.node_id}{_socket_legs(writer, reader)}"
        return Route(Transport.MOONCAKE, why)

    # 4 socket
    if not writer.can_map_shm:
        return Route(Transport.SOCKET, "writer cannot map daemon SHM")
    if reader is None:
        return Route(Transport.SHM, "reader unknown (not attached yet); shm can serve any reader")
    if not reader.can_map_shm:
        return Route(Transport.SOCKET, "reader cannot map daemon SHM")

    src = frozenset(facts.cuda_uuids)
    wants_gpu = bool(reader.gpu_uuids) if reader_wants_gpu is None else reader_wants_gpu
    shared = frozenset(writer.gpu_uuids) & frozenset(reader.gpu_uuids)
    meta_fits = facts.inline_meta_bytes <= DIRECT_META_LIMIT

    # 5 cuda_ipc_direct
    direct_ok = src and not facts.has_cpu_tensors and wants_gpu and meta_fits and src <= shared
    if direct_ok and facts.direct_allowed:
        return Route(Transport.CUDA_IPC_DIRECT, f"same GPU {_gpus(src)}, handles only")

    # 6 cuda_ipc_pool, else 7 shm with the reason the GPU rows did not apply
    if not src:
        return Route(Transport.SHM, "no CUDA tensors")
    if facts.has_cpu_tensors:
        return Route(Transport.SHM, "mixed CPU and CUDA tensors")
    if not wants_gpu:
        return Route(Transport.SHM, "GPU -> CPU: reader takes CPU tensors")
    if not reader.gpu_uuids:
        return Route(Transport.SHM, "GPU -> GPU but reader's GPU unknown")
    # Land on a reader GPU that already holds the data if there is one (no peer
    # copy needed), else on the reader's first GPU, its default device.
    dst = next((u for u in reader.gpu_uuids if u in src), reader.gpu_uuids[0])
    for s in sorted(src):  # sorted: the same missing pair is named every time
        if s != dst and not peer_access(s, dst):
            return Route(Transport.SHM, f"no peer access {_gpu(s)} -> {_gpu(dst)}")
    if direct_ok:
        not_direct = "direct not opted into by the writer"
    elif not meta_fits:
        not_direct = f"handle metadata {facts.inline_meta_bytes} B > 64 KiB"
    elif not src <= frozenset(reader.gpu_uuids):
        not_direct = "different GPUs"
    else:
        not_direct = "writer placement lacks the payload's GPU"
    return Route(Transport.CUDA_IPC_POOL, f"{_gpus(src)} -> {_gpu(dst)} ({not_direct})")
