"""The transports an edge can take, mirroring ``relayd.v1.Transport`` one to one.

The router (daemon side) picks one from the topology; the client writes it into
every DataRef, and the reader dispatches on it. Values are the lower-case names
shown in ``relayd status`` and used as metric label values.

A transport is spelled three ways: the label (``"shm"``), the proto enum name
(``"TRANSPORT_SHM"``, as a status reply turned into JSON shows it) and the
proto number (5). :meth:`Transport.parse` is the one place that reads any of
them, and it raises on anything else: a guessed transport would count or read
the wrong thing.

The proto numbers are spelled out here instead of imported from the generated
stubs so that this module stays importable without protobuf; a unit test checks
them against ``relay_pb2.Transport``.

The limits that decide between transports live here too, once: the client's
put paths and the daemon's router import them.
"""

from __future__ import annotations

import enum

#: The whole encoded put (header, tensor bytes, layout) rides inside the DataRef
#: at or below this size.
INLINE_LIMIT = 16 * 1024
#: The most metadata a cuda_ipc_direct DataRef may carry (its storage handles).
DIRECT_META_LIMIT = 64 * 1024


def fits_inline(encoded_bytes: int, chunk_carries_tensors: bool = False) -> bool:
    """Whether a put's size lets it ride inside its DataRef: the whole encoded put
    within :data:`INLINE_LIMIT`, and not a stream chunk whose payload holds a
    tensor (a chunk's tensors travel with it, never inline).

    The router's inline row asks it; the client asks it too, to key its cached
    route answers by the one size fact the router distinguishes.
    """
    return encoded_bytes <= INLINE_LIMIT and not chunk_carries_tensors


class Transport(enum.Enum):
    """How one put's bytes travel from writer to reader (see DESIGN.md, "Transports")."""

    INLINE = "inline"
    LOCAL_OBJECT = "local_object"
    CUDA_IPC_DIRECT = "cuda_ipc_direct"
    CUDA_IPC_POOL = "cuda_ipc_pool"
    SHM = "shm"
    MOONCAKE = "mooncake"
    SOCKET = "socket"

    def to_proto(self) -> int:
        """The ``relayd.v1.Transport`` number (never 0, TRANSPORT_UNSPECIFIED)."""
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, number: int) -> Transport:
        """The member for a ``relayd.v1.Transport`` number.

        Raises ValueError for TRANSPORT_UNSPECIFIED (0) and numbers this version
        does not know: a DataRef without a transport cannot be read, and guessing
        one would read the wrong memory. Decoders turn this into CorruptRefError.
        """
        try:
            return _FROM_PROTO[number]
        except KeyError:
            raise ValueError(f"unknown relayd.v1.Transport number: {number!r}") from None

    @classmethod
    def parse(cls, spelling: str | int) -> Transport:
        """The member for a label, a proto enum name or a proto number; ValueError otherwise."""
        if isinstance(spelling, bool):
            raise ValueError(f"not a transport: {spelling!r}")
        if isinstance(spelling, int):
            return cls.from_proto(spelling)
        member = _BY_SPELLING.get(spelling)
        if member is None:
            raise ValueError(f"unknown transport {spelling!r}")
        return member


_PROTO_PREFIX = "TRANSPORT_"
_TO_PROTO: dict[Transport, int] = {
    Transport.INLINE: 1,
    Transport.LOCAL_OBJECT: 2,
    Transport.CUDA_IPC_DIRECT: 3,
    Transport.CUDA_IPC_POOL: 4,
    Transport.SHM: 5,
    Transport.MOONCAKE: 6,
    Transport.SOCKET: 7,
}
_FROM_PROTO: dict[int, Transport] = {number: member for member, number in _TO_PROTO.items()}
_BY_SPELLING: dict[str, Transport] = {
    **{member.value: member for member in Transport},
    **{f"{_PROTO_PREFIX}{member.name}": member for member in Transport},
}
