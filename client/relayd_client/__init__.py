"""relayd_client: the thin client of the relayd per-node tensor relay.

::

    async with RelayClient(stage="thinker", socket=path) as client:
        ref = await client.put({"hidden": h}, to_stage="talker", request_id="r1")
        wire = ref.to_bytes()            # send over the app's own channel
    # in the talker
        obj = await client.get(DataRef.from_bytes(wire))

``SyncRelayClient`` does the same without an event loop, from any thread.

Importing this package never imports the daemon's dependencies (uvloop,
prometheus-client, Mooncake).
"""

from typing import TYPE_CHECKING, Any

from ._refs import TensorRef
from .wire.dataref import DataRef
from .wire.errors import (
    AbortedError,
    CorruptRefError,
    DaemonUnavailableError,
    DrainingError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    KeyExistsError,
    NotFoundError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    ResourceExhaustedError,
    SessionClosedError,
    StaleEpochError,
    StaleRefError,
    StreamError,
    UnsafePayloadError,
    VersionMismatchError,
)
from .wire.transport import Transport

if TYPE_CHECKING:
    from ._client import RelayClient
    from ._connection import ClientState
    from ._sync import SyncRelayClient

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # RelayClient pulls in torch (~2 s); tools that only need the wire types
    # (the daemon, `relayd status`) import this package without paying for it.
    if name == "RelayClient":
        from . import _client

        return _client.RelayClient
    if name == "ClientState":
        from . import _connection

        return _connection.ClientState
    if name == "SyncRelayClient":
        from . import _sync

        return _sync.SyncRelayClient
    raise AttributeError(f"module 'relayd_client' has no attribute {name!r}")


__all__ = [
    "AbortedError",
    "ClientState",
    "CorruptRefError",
    "DaemonUnavailableError",
    "DataRef",
    "DrainingError",
    "ErrorCode",
    "InternalError",
    "InvalidArgumentError",
    "KeyExistsError",
    "NotFoundError",
    "PeerUnavailableError",
    "PermissionDeniedError",
    "RelayClient",
    "RelayError",
    "RelayTimeoutError",
    "ResourceExhaustedError",
    "SessionClosedError",
    "StaleEpochError",
    "StaleRefError",
    "StreamError",
    "SyncRelayClient",
    "TensorRef",
    "Transport",
    "UnsafePayloadError",
    "VersionMismatchError",
]
