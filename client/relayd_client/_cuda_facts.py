"""GPU facts: which GPU a tensor is on, by UUID, and what this process uses.

Importing this module never imports torch; every function that needs CUDA
imports it when called, so a CPU-only stage pays nothing (the same holds for
every ``_cuda*`` module).

GPU identity. A GPU is its UUID (``"GPU-58b9e9e8-..."``), never an ordinal:
``CUDA_VISIBLE_DEVICES`` remaps ordinals per process, so ``cuda:0`` in the
writer and ``cuda:0`` in the reader can be two GPUs. DataRefs carry
``"cuda:<uuid>"`` in ``TensorLayout.device`` and pools are named
``"cuda:<uuid>"``; each process maps a UUID to its own ordinal
(:func:`local_ordinal`).

Which processes "use CUDA". One that has initialized CUDA
(``torch.cuda.is_initialized()``) when it attaches or reads. Such a reader
gets CUDA leaves back on its current device; a process that never touched
CUDA gets CPU tensors and never creates a CUDA context (which would cost
GPU memory in every CPU stage on a GPU node). CPU leaves are always
restored on CPU.

The payload's GPU facts (:func:`payload_facts`) are what a writer reports in
its Route request, for ``relayd``'s router to decide the transport from.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

from .wire.cuda_ipc import uuid_of
from .wire.errors import CorruptRefError


def torch_cuda() -> Any:
    """``torch.cuda`` as Any: its Event and cudart have no type hints."""
    import torch

    return torch.cuda


def device_field(uuid: str) -> str:
    """``TensorLayout.device`` of a tensor on GPU ``uuid``."""
    return f"cuda:{uuid}"


def leaf_gpu(device: str) -> str | None:
    """The GPU UUID of a ``TensorLayout.device``; None for a CPU tensor.

    An ordinal (``"cuda:0"``) names a GPU only inside the writer; it is
    accepted as "some GPU" (``""``) so a CUDA leaf still lands on a GPU.
    """
    if device == "cpu" or not device:
        return None
    if not device.startswith("cuda:"):
        raise CorruptRefError(f"tensor device {device[:80]!r} is neither cpu nor cuda:<uuid>")
    rest = device[5:]
    return "" if rest.isdigit() else rest


def local_ordinal(uuid: str, local: Sequence[str]) -> int | None:
    """This process's ordinal of GPU ``uuid`` given its UUIDs in ordinal order."""
    for ordinal, candidate in enumerate(local):
        if candidate == uuid:
            return ordinal
    return None


@functools.cache
def local_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, by its own ordinal (initializes CUDA)."""
    import torch

    return tuple(
        uuid_of(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())
    )


def uses_cuda() -> bool:
    """This process has initialized CUDA (never initializes it itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def used_gpus() -> tuple[str, ...]:
    """GPUs this process works on, for Attach: its current device, if it uses CUDA."""
    if not uses_cuda():
        return ()
    import torch

    return (local_uuids()[torch.cuda.current_device()],)


@functools.cache
def _peer_ok(src_ordinal: int, dst_ordinal: int) -> bool:
    import torch

    return bool(torch.cuda.can_device_access_peer(dst_ordinal, src_ordinal))


def peer_access(src_uuid: str, dst_uuid: str) -> bool:
    """Can GPU ``dst`` read ``src`` directly; probed once per pair per process."""
    if src_uuid == dst_uuid:
        return True
    local = local_uuids()
    src, dst = local_ordinal(src_uuid, local), local_ordinal(dst_uuid, local)
    return src is not None and dst is not None and _peer_ok(src, dst)


def reader_device() -> Any:
    """Where this process's CUDA leaves land: its current GPU, or the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadGpuFacts:
    """What one put holds, as far as the GPU rows care."""

    cuda_uuids: tuple[str, ...] = ()  # distinct, sorted
    has_cpu_tensors: bool = False
    direct_meta_bytes: int = 0  # DataRef size if CUDA tensors travel as handles


# Handle, event handle, refcount file name, strides: what one tensor adds.
_DIRECT_BYTES_PER_TENSOR = 320


def payload_facts(devices: Sequence[str], header_bytes: int = 0) -> PayloadGpuFacts:
    """Facts from the ``TensorLayout.device`` of every non-empty tensor."""
    gpus = {g for g in (leaf_gpu(d) for d in devices) if g is not None}
    n_cuda = sum(1 for d in devices if leaf_gpu(d) is not None)
    return PayloadGpuFacts(
        cuda_uuids=tuple(sorted(gpus)),
        has_cpu_tensors=any(leaf_gpu(d) is None for d in devices),
        direct_meta_bytes=direct_meta_estimate(n_cuda, header_bytes),
    )


def direct_meta_estimate(n_cuda_tensors: int, header_bytes: int = 0) -> int:
    """Roughly how large a DataRef gets when ``n`` CUDA tensors travel as handles."""
    return header_bytes + _DIRECT_BYTES_PER_TENSOR * n_cuda_tensors


def restores_on_gpu(specs: Sequence[Any]) -> bool:
    """An shm read whose CUDA leaves go back to a GPU in this process."""
    return uses_cuda() and any(leaf_gpu(s.device) is not None for s in specs)


def name_gpus(specs: list[Any]) -> list[Any]:
    """Replace ``cuda:<ordinal>`` by ``cuda:<uuid>`` in the writer's layout."""
    if not any(s.device.startswith("cuda") for s in specs):
        return specs
    local = local_uuids()
    out = []
    for s in specs:
        if s.device.startswith("cuda"):
            index = int(s.device.partition(":")[2] or 0)
            s = dataclasses.replace(s, device=device_field(local[index]))
        out.append(s)
    return out
