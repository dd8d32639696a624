"""Cross-node reads: have the local daemon pull a foreign DataRef into its arena.

A DataRef whose origin is another node cannot be mapped here. The client asks
its own daemon (``Relay.Fetch``) to pull the bytes from the writer's daemon
through Mooncake Transfer Engine; the answer is a local lease addressed to
this session, and the returned DataRef is the original one with that lease
and this node's origin, read and released exactly like a local SHM lease.
One gRPC round trip per cross-node get, next to a network transfer.
"""

from __future__ import annotations

import grpc

from ._dataref import DataRef
from ._proto import relay_pb2 as pb
from ._proto import relay_pb2_grpc as pb_grpc
from ._status import from_rpc_error


def is_foreign(ref: DataRef, node_id: str) -> bool:
    """The DataRef's lease lives in another node's arena."""
    origin = ref.proto.origin
    return bool(origin.node_id) and origin.node_id != node_id


async def fetch(
    stub: pb_grpc.RelayStub, attach: pb.AttachResponse, ref: DataRef, timeout: float
) -> pb.DataRef:
    """The local DataRef for ``ref`` once this node's daemon holds its bytes."""
    try:
        resp: pb.FetchResponse = await stub.Fetch(
            pb.FetchRequest(
                session_id=attach.session_id,
                session_token=attach.session_token,
                data_ref=ref.to_bytes(),
                timeout_seconds=timeout,
            ),
            timeout=timeout + 1.0,
        )
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    local = pb.DataRef()
    local.CopyFrom(ref.proto)
    local.lease.CopyFrom(resp.lease)
    local.origin.node_id = resp.node_id
    local.origin.daemon_epoch = resp.daemon_epoch
    local.transport = pb.TRANSPORT_SHM
    return local
