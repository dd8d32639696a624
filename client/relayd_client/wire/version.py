"""The protocol version both ends check at Attach and at a peer's Hello.

An incompatible peer fails with a message saying which side to upgrade, not
with a decode error somewhere later.
"""

from __future__ import annotations

from .proto import relay_pb2 as pb

PROTOCOL_VERSION: int = pb.PROTOCOL_VERSION_CURRENT
