"""Forwarded tensor references: publish a tensor once, pass it through stages untouched.

A large tensor that stage A produces for stage C but that travels inside a
payload through stage B must not be copied at B. ``client.ref(tensor,
consumer_stage="C", request_id=...)`` publishes it once - an SHM lease
addressed to C - and returns a :class:`TensorRef`. Put inside any payload, it
is encoded as ``RefSlot(i)`` in the header plus entry ``i`` of the DataRef's
``refs`` table (a one-tensor DataRef). ``get`` at any stage other than the
consumer returns the TensorRef as it is - no byte of the tensor is read, the
lease stays PUBLISHED - and that stage can put it in its own payload. ``get``
at the consumer materializes it: claim, copy out, release.

A TensorRef belongs to its request: ``abort(request_id)`` frees it if it was
not consumed yet, and an unread one expires with the lease TTL.
"""

from __future__ import annotations

from typing import Any

from ._header_tree import RefSlot, fill
from .wire.dataref import DataRef
from .wire.proto import relay_pb2 as pb


class TensorRef:
    """A tensor published for ``consumer_stage``; embed it in payloads to forward it."""

    __slots__ = ("_msg",)

    def __init__(self, msg: pb.DataRef) -> None:
        self._msg = msg

    @property
    def proto(self) -> pb.DataRef:
        return self._msg

    @property
    def consumer_stage(self) -> str:
        return self._msg.to_stage

    @property
    def request_id(self) -> str:
        return self._msg.request_id

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._msg.tensors[0].shape)

    @property
    def dtype(self) -> str:
        return self._msg.tensors[0].dtype

    @property
    def nbytes(self) -> int:
        return int(self._msg.tensors[0].nbytes)

    def data_ref(self) -> DataRef:
        """The one-tensor DataRef the consumer reads."""
        return DataRef(self._msg)

    def __repr__(self) -> str:
        return (
            f"TensorRef({self.dtype}{list(self.shape)}, for={self.consumer_stage!r}, "
            f"request={self.request_id!r})"
        )

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, TensorRef) and self._msg == other._msg

    def __hash__(self) -> int:
        return hash(self._msg.SerializeToString(deterministic=True))


def substitute(tree: object, values: list[object]) -> object:
    """Put ``values[i]`` where :class:`RefSlot` ``i`` is; containers without one are kept."""
    return fill(tree, RefSlot, values, "forwarded ref", "the DataRef")
