"""relayd_client: the thin client of the relayd per-node tensor relay.

::

    async with RelayClient(stage="thinker", socket=path) as client:
        ref = await client.put({"hidden": h}, to_stage="talker", request_id="r1")
        wire = ref.to_bytes()            # send over the app's own channel
    # in the talker
        obj = await client.get(DataRef.from_bytes(wire))

Importing this package never imports the daemon's dependencies (uvloop,
prometheus-client, Mooncake).
"""

from ._client import ClientState, RelayClient
from ._dataref import DataRef
from ._errors import (
    AbortedError,
    CorruptRefError,
    DaemonUnavailableError,
    DrainingError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
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
from ._transport import Transport

__version__ = "0.1.0"

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
    "Transport",
    "UnsafePayloadError",
    "VersionMismatchError",
]
