"""The transport of each edge, as the daemon's router answered it, cached.

The daemon's ``route()`` decides every transport, inline and local_object
included, from the facts this client reports about a put (its real encoded
size among them). The answer depends on those facts only through the key
below - the edge, the payload's kind and :func:`fits_inline` of its size -
so this client asks once per key and keeps the answer until a session event
announces a new registry version: a put in steady state makes no round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _cuda_facts
from .wire.errors import RelayError
from .wire.proto import relay_pb2 as pb

if TYPE_CHECKING:
    from ._connection import Connection

log = logging.getLogger(__name__)

# (to_stage, has CPU tensors, GPUs holding CUDA tensors, fits inline)
RouteKey = tuple[str, bool, tuple[str, ...], bool]


class Routes:
    """Cached route answers of one client, and the stages it pushes to."""

    def __init__(self, conn: Connection, from_stage: str, cuda_ipc_direct: bool) -> None:
        self._conn = conn
        self._from_stage = from_stage
        self._cuda_ipc_direct = cuda_ipc_direct
        self._answers: dict[RouteKey, int] = {}
        # The cached transport of a key, or None: the dict's own lookup, since
        # every put asks (cleared in place, never replaced).
        self.cached: Callable[[RouteKey], int | None] = self._answers.get
        # Stages the daemon routed to another node: their puts ask for a push.
        self.remote_stages: set[str] = set()
        self.registry_version = 0

    def forget(self) -> None:
        """Ask the daemon again at the next put of every key."""
        self._answers.clear()

    def registry(self, version: int) -> None:
        """A session event announced ``version``: answers of older versions are stale.

        Versions only grow within a session; an event older than an answer
        already taken (it travels on another channel) changes nothing.
        """
        if version > self.registry_version:
            self.bound(version)

    def bound(self, version: int) -> None:
        """Forget every answer: the registry is at ``version`` now (at a bind, even a
        lower one: the daemon may be a restarted one)."""
        self.registry_version = version
        self.forget()
        self.remote_stages.clear()

    async def ask(
        self, key: RouteKey, encoded_bytes: int, is_chunk: bool, chunk_carries_tensors: bool
    ) -> int:
        """The registry's transport for this edge: asked once, then cached until it changes."""
        cached = self.cached(key)
        if cached is not None:
            return cached
        to_stage, has_cpu, cuda_uuids, fits = key
        conn = self._conn
        conn.require_open()  # a closed or lost session is the caller's error, not a route's
        try:
            resp: pb.RouteResponse = await conn.call(
                "Route",
                pb.RouteRequest(
                    from_stage=self._from_stage,
                    to_stage=to_stage,
                    encoded_bytes=encoded_bytes,
                    is_chunk=is_chunk,
                    chunk_meta_has_tensor=chunk_carries_tensors,
                    has_cpu_tensors=has_cpu,
                    cuda_uuids=list(cuda_uuids),
                    inline_meta_bytes=_cuda_facts.direct_meta_estimate(len(cuda_uuids)),
                    allow_cuda_ipc_direct=self._cuda_ipc_direct,
                ),
                conn.timeout,
            )
        except RelayError as exc:
            # Inline needs no daemon, and one that cannot route still serves
            # shm (or the socket); not cached, so the next put asks again.
            log.debug("route %s -> %s failed: %s", self._from_stage, to_stage, exc)
            if fits:
                return pb.TRANSPORT_INLINE
            return pb.TRANSPORT_SOCKET if conn.socket_fallback else pb.TRANSPORT_SHM
        # An answer computed before a registry change we have seen since is
        # stale; one at least as new as every change seen is current, even when
        # that change's event landed while the call was in flight.
        if resp.registry_version >= self.registry_version:
            self.registry_version = resp.registry_version
            self._answers[key] = int(resp.transport)
            if resp.transport == pb.TRANSPORT_MOONCAKE:
                self.remote_stages.add(to_stage)
            elif resp.transport != pb.TRANSPORT_INLINE:
                # Inline is chosen before the reader's node is looked at: it
                # must not unmark a reader the edge's large puts push to.
                self.remote_stages.discard(to_stage)
        return int(resp.transport)
