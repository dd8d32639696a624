"""What the peer layer (``peers``, ``pull``, ``push``, ``rpc/peer_service``) uses of
the rest of the daemon, and nothing more: the lease table's cross-node calls, and
hooks into the registry, the metrics and keyed delivery. The daemon builds these
once; a test builds them from real parts without a daemon. :class:`PeerParts` is
what the parts of the peer layer share among themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from .config import Settings
from .peer_links import PeerLinks
from .peer_notices import PeerNotifier
from .pools.arena import Arena
from .pools.crossnode import CrossNodeLeases
from .pools.reclaim import Aborter
from .pools.records import Lease
from .pools.requests import RequestInfo
from .pools.sessions import Session
from .transports.base import RemoteTransport
from .transports.credits import CreditPool


class PeerLeases(Protocol):
    """The lease table as the peer layer sees it (``pools.leases.LeaseManager``)."""

    @property
    def sessions(self) -> Mapping[str, Session]: ...
    @property
    def leases(self) -> Mapping[int, Lease]: ...
    @property
    def requests(self) -> Mapping[str, RequestInfo]: ...

    on_push: Callable[[Lease], None] | None
    """Called with each lease published with ``Publish.push`` set."""

    @property
    def crossnode(self) -> CrossNodeLeases:
        """Pulled, pushed and peer-released leases: the peer layer's own lease calls."""

    def hold(self, lease: Lease) -> None: ...
    def unhold(self, lease: Lease) -> None: ...
    def abort_from_peer(
        self,
        request_id: str,
        stages: tuple[str, ...] = (),
        narrow: bool = False,
        by: Aborter | None = None,
    ) -> tuple[int, tuple[str, ...] | None]: ...
    def flush(self) -> None: ...
    def wake(self) -> None:
        """Serve grant waiters: arena space came back past the lease table."""


@dataclasses.dataclass(frozen=True)
class PeerHooks:
    """What the peer layer tells, and asks of, the rest of the daemon."""

    local_stages: Callable[[], list[str]] = lambda: []
    """The stages this node's data sessions serve, sorted: the registry's, which
    holds bound sessions only, and no operator's (what peers are told, and the
    stages a peer may push to)."""
    peer_stages: Callable[[str, Iterable[str] | None], None] = lambda node, stages: None
    """A peer node serves these stages (None: it is gone): the registry's."""
    pull_seconds: Callable[[float], None] = lambda seconds: None
    """How long a cross-node pull took (a histogram's observe)."""
    keyed_from_peer: Callable[[str, str, bytes], None] = lambda node, key, ref: None
    """A peer's keyed put (node id, key, DataRef bytes) for a stage served here."""
    keyed_withdraw: Callable[[str, str, bytes], bool] = lambda node, key, ref: False
    """A peer takes back its keyed put (node id, key, DataRef bytes): whether it went."""
    aborted: Callable[[str, tuple[str, ...] | None], object] = lambda request_id, stages: None
    """A peer aborted a request: its keys here go too (with stages, only those to or
    from them: the abort was narrowed to them)."""


@dataclasses.dataclass(frozen=True)
class PeerParts:
    """What the peer manager, the pull and the push share; built once by PeerManager."""

    settings: Settings
    epoch: str
    arena: Arena
    leases: PeerLeases
    hooks: PeerHooks
    transport: RemoteTransport
    credits: CreditPool
    links: PeerLinks
    notifier: PeerNotifier
    local_bases: list[int] = dataclasses.field(default_factory=list)
    """Each arena segment's address, in segment order (filled at start)."""


__all__ = ["PeerHooks", "PeerLeases", "PeerParts"]
