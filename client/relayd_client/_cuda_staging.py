"""The GPU side of the shm path: the arena page-locked for DMA, CUDA leaves restored.

A CUDA tensor that goes through shm (GPU -> CPU edges, no peer access, mixed
payloads) is copied device-to-host into the arena by the writer
(``_copies``), and back host-to-device by a reader that uses CUDA
(:func:`restore_on_device`). Both copies are DMA when the arena's mappings
are page-locked (:func:`pin_host`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from ._cuda_copy import wait_event
from ._cuda_facts import leaf_gpu, reader_device, torch_cuda, uses_cuda
from .wire.errors import RelayError

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: pinned for every CUDA context of the process,
# not only the current device's (a stage may drive several GPUs).
_HOST_REGISTER_PORTABLE = 1


def pin_host(views: Sequence[Any], mode: str) -> list[int]:
    """Page-lock the arena mappings (``cudaHostRegister``) so GPU copies through
    them are DMA; returns the registered addresses for :func:`unpin_host`.

    Only in a process that uses CUDA, and not when the daemon says ``off``. A
    failure (RLIMIT_MEMLOCK, usually) is an error with ``on`` and a warning
    with ``auto``: the arena still works, through pageable copies.
    """
    if mode == "off" or not uses_cuda():
        return []

    cudart = torch_cuda().cudart()
    pinned: list[int] = []
    for view in views:
        ptr, size = int(view.data_ptr()), int(view.numel())
        rc = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        if int(rc) != 0:
            _clear_cuda_error()
            unpin_host(pinned)
            message = (
                f"cudaHostRegister of {size} arena bytes failed (error {int(rc)}); raise "
                "RLIMIT_MEMLOCK (ulimit -l unlimited) for page-locked staging"
            )
            if mode == "on":
                raise RelayError(message)
            log.warning("%s; GPU copies through the arena stay pageable", message)
            return []
        pinned.append(ptr)
    return pinned


def unpin_host(pinned: list[int]) -> None:
    if not pinned:
        return

    cudart = torch_cuda().cudart()
    failed = False
    for ptr in pinned:
        with contextlib.suppress(RuntimeError):
            failed |= int(cudart.cudaHostUnregister(ptr)) != 0
    pinned.clear()
    if failed:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call handled here.

    ``torch.cuda.cudart()`` returns the error code of ``cudaHostRegister``
    without clearing it, and PyTorch's next kernel-launch check
    (``cudaGetLastError``) in this thread would then fail an unrelated
    kernel with it. The binding has no ``cudaGetLastError``, so it is called
    through ctypes on the libcudart this process already loaded (the same
    instance torch uses); a torch that links cudart statically is left as is.
    """
    import ctypes

    with contextlib.suppress(Exception):
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {
                line.split(None, 5)[5].strip()
                for line in maps
                if "libcudart.so" in line and len(line.split(None, 5)) == 6
            }
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()


async def restore_on_device(
    tensors: list[Any], specs: Sequence[Any], copy: bool, deadline: float | None = None
) -> list[Any]:
    """Put the CUDA leaves of an shm read back on this process's GPU.

    ``tensors`` are views into the arena (or copies when ``copy`` is set for
    CPU leaves). The host-to-device copies read the (pinned) arena directly;
    this returns once they are complete, so the lease can be released.
    """
    import torch

    dst = reader_device()
    if dst.type != "cuda":
        return [t.clone() if copy else t for t in tensors]
    out = list(tensors)
    moved = False
    with torch.no_grad():
        for spec in specs:
            if leaf_gpu(spec.device) is None:
                if copy:
                    out[spec.index] = tensors[spec.index].clone()
                continue
            out[spec.index] = tensors[spec.index].to(dst, non_blocking=True)
            moved = True
    if moved:
        with torch.cuda.device(dst):
            done = torch_cuda().Event()
            done.record(torch.cuda.current_stream(dst))
        await wait_event(done, deadline, "the copy from the arena to the GPU")
    return out
