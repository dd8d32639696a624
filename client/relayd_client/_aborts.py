"""The requests this client knows are aborted, and the one check every path makes.

An abort reaches a client three ways: its own ``abort()``, an ``aborted``
notice on the session socket (another stage aborted it on this node), and a
same-process client's abort of a request whose stream this client reads. From
then on nothing of the request is put or read here, whether or not the daemon
has freed its leases yet (the writer's notices may still be on the way).
"""

from __future__ import annotations

from ._recent import Recent
from .wire.errors import AbortedError

# Aborted request ids remembered per client; the oldest are forgotten first.
ABORTED_MEMORY = 4096


class AbortedRequests:
    """A bounded, ordered set of aborted request ids."""

    def __init__(self, memory: int = ABORTED_MEMORY) -> None:
        self._ids: Recent[str] = Recent(memory)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def remember(self, request_id: str) -> None:
        self._ids.add(request_id)

    def forget(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def check(self, request_id: str) -> None:
        """Raise :class:`AbortedError` if ``request_id`` was aborted."""
        if request_id in self._ids:
            raise AbortedError(f"request {request_id!r} was aborted")
