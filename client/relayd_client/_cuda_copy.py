"""What every GPU copy path shares: storages another process exported,
destinations shaped by a layout entry, the caller's streams on a worker
thread, and waiting for a copy with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from . import _gpu_order
from ._cuda_facts import torch_cuda, uses_cuda
from .wire.errors import PeerUnavailableError
from .wire.proto import relay_pb2 as pb

# Destinations of copies abandoned at their deadline: the copy may still run.
ABANDONED = _gpu_order.Quarantine()
# How long a GPU copy of this process's own may take when no deadline is given.
_GPU_WAIT_S = 60.0


def open_shared_storage(ordinal: int, h: pb.CudaIpcHandle) -> Any:
    """The storage another process exported as ``h``, opened on ``cuda:<ordinal>``.

    ``cudaIpcOpenMemHandle`` through PyTorch, as ``torch.multiprocessing``
    rebuilds a CUDA tensor; the writer's sharing event is waited on there.
    """
    import torch

    storage: Any = torch.UntypedStorage
    try:
        return storage._new_shared_cuda(
            ordinal,
            h.handle,
            h.storage_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle,
            h.event_sync_required,
        )
    except RuntimeError as exc:
        raise PeerUnavailableError(
            f"cannot open a CUDA IPC handle on cuda:{ordinal}: {exc}"
        ) from exc


def tensor_over(
    storage: Any,
    ordinal: int,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int],
    storage_offset: int,
) -> Any:
    """A tensor of ``dtype`` viewing ``storage`` on ``cuda:<ordinal>``."""
    import torch

    from ._packing import dtype_from_name

    out = torch.empty((0,), dtype=dtype_from_name(dtype), device=f"cuda:{ordinal}")
    return out.set_(storage, storage_offset, tuple(shape), tuple(stride))


def empty_like_spec(spec: Any, device: Any) -> Any:
    """A fresh tensor on ``device`` with the dtype and shape of layout entry ``spec``."""
    import torch

    from ._packing import dtype_from_name

    # Bytes seen as the dtype: no ComplexHalf allocation warning, same memory.
    raw = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


async def wait_event(event: Any, deadline: float | None = None, what: str = "a GPU copy") -> None:
    """Wait for a CUDA event without blocking the event loop, up to ``deadline``."""
    limit = time.monotonic() + _GPU_WAIT_S if deadline is None else deadline
    await _gpu_order.wait_event(event, limit, what)


def worker_streams(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """The calling thread's current stream on each device of the CUDA tensors, for
    :func:`run_on_worker`: a copy on a worker thread must run after the
    producer's work on these streams (see :func:`._gpu_order.caller_streams`)."""
    if not uses_cuda():
        return ()
    devices = (t.device.index if t.is_cuda else None for t in tensors)
    return _gpu_order.caller_streams(devices, torch_cuda().current_stream)


def run_on_worker(streams: Sequence[Any], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on this (worker) thread with the caller's ``streams`` current."""
    if not streams:
        return fn(*args)
    return _gpu_order.run_on_streams(streams, torch_cuda().stream, fn, *args)


class on_stream:
    """``torch.cuda.stream(s)``, for a copy's few calls.

    For a stream of the current device it saves and restores that device's
    current stream with PyTorch's own two calls (what ``torch.cuda.set_stream``
    and ``current_stream`` call), skipping the device lookups that
    ``StreamContext`` makes on enter and exit: on a GPU machine's cold CPU
    they were most of a pool read's stream switch (measured). A stream of
    another device goes through ``torch.cuda.stream``, which also leaves the
    current device as it found it.
    """

    __slots__ = ("_other", "_prev", "_stream")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._prev: tuple[int, int, int] | None = None
        self._other: Any = None

    def __enter__(self) -> None:
        import torch

        c: Any = torch._C
        s = self._stream
        index = s.device_index
        if c._cuda_getDevice() == index:
            self._prev = c._cuda_getCurrentStream(index)
            c._cuda_setStream(stream_id=s.stream_id, device_index=index, device_type=s.device_type)
        else:
            self._other = torch.cuda.stream(s)
            self._other.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._other is not None:
            self._other.__exit__(*exc)
            return
        import torch

        prev = self._prev
        assert prev is not None
        c: Any = torch._C
        c._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
