"""Cross-node reads: one implementation for gRPC ``Fetch`` and the session's ``FetchCall``.

The pull itself is the peer layer's (:meth:`relayd.peers.PeerManager.fetch`);
this checks the caller, bounds the wait and answers with this node's identity.
"""

from __future__ import annotations

from typing import Protocol

from relayd_client.wire.errors import PeerUnavailableError, SessionClosedError
from relayd_client.wire.proto import relay_pb2 as pb

from ..pools.sessions import Session, SessionState

MAX_FETCH_TIMEOUT = 3600.0


class PeerFetch(Protocol):
    """The peer layer as a fetch sees it."""

    async def fetch(self, session: Session, data: bytes, timeout: float) -> pb.LeaseRef: ...


class Fetcher:
    def __init__(self, node_id: str, epoch: str, *, default_timeout: float) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.default_timeout = default_timeout
        self.peers: PeerFetch | None = None
        """Set once the peer layer runs (``--peer-address``); until then, fetches fail."""

    def timeout(self, asked: float) -> float:
        """The budget of a fetch that asked for ``asked`` seconds (<= 0 or NaN: default)."""
        return min(asked, MAX_FETCH_TIMEOUT) if asked > 0 else self.default_timeout

    async def fetch(self, session: Session, data_ref: bytes, timeout: float) -> pb.FetchResponse:
        """Pull a foreign DataRef into this arena for ``session``."""
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket before fetching")
        if self.peers is None:
            raise PeerUnavailableError(
                "this daemon has no peers (--peer-address is not set); cross-node DataRefs "
                "cannot be read here"
            )
        lease = await self.peers.fetch(session, data_ref, timeout)
        return pb.FetchResponse(lease=lease, node_id=self.node_id, daemon_epoch=self.epoch)

    async def on_session(self, session: Session, data_ref: bytes, asked: float) -> pb.FetchResponse:
        """A session's ``FetchCall``, which asks for its own timeout."""
        return await self.fetch(session, data_ref, self.timeout(asked))


__all__ = ["MAX_FETCH_TIMEOUT", "Fetcher", "PeerFetch"]
