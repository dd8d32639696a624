"""The CUDA IPC pieces the daemon's GPU pools and the client's GPU paths share.

A GPU is named by its UUID (``"GPU-<uuid>"``, as nvidia-smi prints it), never
by an ordinal, and its slot pool by :func:`pool_name`. A pool travels as a
``relayd.v1.CudaIpcHandle`` made by :func:`export_handle` from PyTorch's own
share tuple. Nothing here imports torch: callers hand in what torch gave them.
"""

from __future__ import annotations

from typing import Any

from .errors import RelayError
from .proto import relay_pb2 as pb

# handle -> the memory behind it, for pools this process exported itself (a
# daemon with a client in the same process): cudaIpcOpenMemHandle refuses a
# handle in the process that made it, so such a pool is used directly.
_OWN_EXPORTS: dict[bytes, Any] = {}


def uuid_of(props: object) -> str:
    """``"GPU-<uuid>"`` for ``torch.cuda.get_device_properties(i)`` (as nvidia-smi prints it)."""
    raw = str(getattr(props, "uuid", "")).strip()
    if not raw:
        raise RelayError("this torch does not report GPU UUIDs; relayd needs torch >= 2.0")
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def pool_name(uuid: str) -> str:
    return f"cuda:{uuid}"


def register_own_export(handle: bytes, tensor: Any) -> None:
    """Called by the daemon for each pool it exports (see :func:`own_export`)."""
    _OWN_EXPORTS[bytes(handle)] = tensor


def forget_own_export(handle: bytes) -> None:
    _OWN_EXPORTS.pop(bytes(handle), None)


def own_export(handle: bytes) -> Any | None:
    """The memory behind ``handle`` if this process exported it itself, else None."""
    return _OWN_EXPORTS.get(bytes(handle))


def export_handle(share: tuple[Any, ...]) -> pb.CudaIpcHandle:
    """``relayd.v1.CudaIpcHandle`` from a ``_share_cuda_()`` tuple (device dropped).

    Used by the daemon to export its pools and by writers for direct handles.
    """
    (_device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = share
    return pb.CudaIpcHandle(
        handle=bytes(handle),
        storage_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle or b""),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )
