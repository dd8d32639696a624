"""Cross-node reads: have the local daemon pull a foreign DataRef into its arena.

A DataRef whose origin is another node cannot be mapped here. The client asks
its own daemon (a ``FetchCall`` on the session socket, ``Relay.Fetch``'s work)
to pull the bytes from the writer's daemon
through Mooncake Transfer Engine; the answer is a local lease addressed to
this session, and the returned DataRef is the original one with that lease
and this node's origin, read and released exactly like a local SHM lease.
One round trip on the session socket per cross-node get, next to the pull.
"""

from __future__ import annotations

from ._session import SessionChannel
from .wire.dataref import DataRef
from .wire.proto import relay_pb2 as pb


def is_foreign(ref: DataRef | pb.DataRef, node_id: str) -> bool:
    """The DataRef's lease lives in another node's arena (a message: no wrapper to build)."""
    origin = (ref.proto if isinstance(ref, DataRef) else ref).origin
    return bool(origin.node_id) and origin.node_id != node_id


async def fetch(
    session: SessionChannel, attach: pb.AttachResponse, ref: DataRef, timeout: float
) -> pb.DataRef:
    """The local DataRef for ``ref`` once this node's daemon holds its bytes."""
    resp = await session.fetch(ref.to_bytes(), timeout)
    local = pb.DataRef()
    local.CopyFrom(ref.proto)
    local.lease.CopyFrom(resp.lease)
    local.origin.node_id = resp.node_id
    local.origin.daemon_epoch = resp.daemon_epoch
    local.transport = pb.TRANSPORT_SHM
    return local
