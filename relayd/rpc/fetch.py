"""Cross-node reads: one implementation for gRPC ``Fetch`` and the session's ``FetchCall``.

The pull itself is the peer layer's (:meth:`relayd.peers.PeerManager.fetch`);
this checks the caller, bounds the wait and answers with this node's identity.
A read whose push has already landed is answered at once, with no task: the
reader waits for that answer and nothing else.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from relayd_client.wire.errors import PeerUnavailableError, SessionClosedError
from relayd_client.wire.proto import relay_pb2 as pb

from ..pools.sessions import Session, SessionState

MAX_FETCH_TIMEOUT = 3600.0

Answer = pb.FetchResponse | Coroutine[Any, Any, pb.FetchResponse]
"""A fetch's answer now, or the work that waits for it."""


class PeerFetch(Protocol):
    """The peer layer as a fetch sees it."""

    def start_fetch(
        self, session: Session, data: bytes, timeout: float
    ) -> pb.LeaseRef | Coroutine[Any, Any, pb.LeaseRef]: ...


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
        got = self.start(session, data_ref, timeout)
        return got if isinstance(got, pb.FetchResponse) else await got

    def on_session(self, session: Session, data_ref: bytes, asked: float) -> Answer:
        """A session's ``FetchCall``, which asks for its own timeout."""
        return self.start(session, data_ref, self.timeout(asked))

    def start(self, session: Session, data_ref: bytes, timeout: float) -> Answer:
        """:meth:`fetch`'s answer now when the push has landed, else the work that
        waits for it; a bad call raises here."""
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket before fetching")
        if self.peers is None:
            raise PeerUnavailableError(
                "this daemon has no peers (--peer-address is not set); cross-node DataRefs "
                "cannot be read here"
            )
        got = self.peers.start_fetch(session, data_ref, timeout)
        if isinstance(got, pb.LeaseRef):
            return self._response(got)
        return self._later(got)

    async def _later(self, pending: Coroutine[Any, Any, pb.LeaseRef]) -> pb.FetchResponse:
        return self._response(await pending)

    def _response(self, lease: pb.LeaseRef) -> pb.FetchResponse:
        return pb.FetchResponse(lease=lease, node_id=self.node_id, daemon_epoch=self.epoch)


__all__ = ["MAX_FETCH_TIMEOUT", "Answer", "Fetcher", "PeerFetch"]
