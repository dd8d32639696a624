"""Keyed puts handed to the peer serving their consumer, and taken back there.

The writer's daemon hands a keyed DataRef over with ``Peer.KeyedPut``
(:meth:`KeyedHandOver.put`); the policy around it (which peer, what a refusal
means for the writer's lease) is :mod:`relayd.rpc.keyed`'s. A hand-over given
up on without the peer's answer - this side's deadline passed (the answer came
late, or never), the connection dropped, or the call was cancelled because its
writer's session went or the writer withdrew the put - may still have been
indexed there, naming a lease the writer's daemon frees at once. It is taken
back (``Peer.KeyedWithdraw``) in the background: the writer has its answer
already (but a withdrawal that cancelled the call waits for the take-back, so
that its writer hears of it only once the key is gone), the call is bounded by
the peer timeout, and a failure (an older peer answers UNIMPLEMENTED) is
logged, the entry then going when its reader's read fails (StaleRefError) or
at its TTL. A clean refusal - the peer's handler answered with a relayd error
code - indexed nothing and needs no take-back.

A put of a key that is being taken back from the same peer waits for that
first (bounded by its own timeout): overtaking it, the writer's retry would
find the failed put's entry (KeyExistsError).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from relayd_client.wire.errors import (
    ErrorCode,
    PeerUnavailableError,
    RelayError,
    RelayTimeoutError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import from_rpc_error, relayd_code

from .peer_links import PeerLinks, PeerState

log = logging.getLogger(__name__)


def _refused(exc: grpc.RpcError) -> bool:
    """The peer's handler answered the call with a refusal (its relayd error code rides
    the status), so it indexed nothing. Any other failure (gRPC's own deadline on this
    side, a dropped connection, a bug there) may come after the peer indexed."""
    code = relayd_code(exc)
    return code is not None and code != str(int(ErrorCode.INTERNAL))


class KeyedHandOver:
    def __init__(self, links: PeerLinks, node_id: str, peer_timeout: float) -> None:
        self.links = links
        self.node_id = node_id
        self.peer_timeout = peer_timeout
        # (peer address, key) -> the keyed put being taken back there.
        self._taking_back: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def close(self) -> None:
        """Cancel the take-backs still under way (the links close next)."""
        tasks = list(self._taking_back.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def put(
        self, peer: PeerState, key: str, data_ref: bytes, timeout: float | None = None
    ) -> None:
        """Hand a keyed DataRef to ``peer`` within ``timeout`` (None: the peer timeout);
        its errors are ours. Given up on without a clean answer, it is taken back."""
        earlier = self._taking_back.get((peer.address, key))
        if earlier is not None:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait({earlier}, timeout=timeout or self.peer_timeout)
            if timeout is not None:
                timeout -= loop.time() - started
                if timeout <= 0:
                    raise RelayTimeoutError("the keyed put's timeout passed before it was sent")
        put = pb.PeerKeyedPutRequest(node_id=self.node_id, key=key, data_ref=data_ref)
        try:
            await self.links.call(peer, "KeyedPut", put, timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if not _refused(exc):
                self._take_back(peer, key, data_ref, f"its hand-over failed: {err}")
            raise err from None
        except RelayError:
            raise  # not sent: the peer is not connected
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            why = "its hand-over was cancelled" if cancelled else f"its hand-over failed: {exc!r}"
            taking_back = self._take_back(peer, key, data_ref, why)
            if not cancelled:
                raise
            # Ended once the peer has taken back what it may have indexed (a second
            # cancel leaves that to the background): the writer's withdrawal, which
            # cancelled this call, is answered after, and a reader that polls once the
            # writer heard it must not find the key.
            await asyncio.wait({taking_back}, timeout=self.peer_timeout)
            raise

    async def withdraw(self, peer: PeerState, key: str, data_ref: bytes) -> bool:
        """Have ``peer`` drop its unread entry of the keyed put of ``data_ref`` under
        ``key``, if it names that very lease: whether it did. A peer that predates the
        call is PeerUnavailableError."""
        request = pb.PeerKeyedWithdrawRequest(node_id=self.node_id, key=key, data_ref=data_ref)
        try:
            resp: Any = await self.links.call(peer, "KeyedWithdraw", request)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise PeerUnavailableError(
                    f"peer {peer.address} predates Peer.KeyedWithdraw (UNIMPLEMENTED)"
                ) from None
            raise from_rpc_error(exc) from None
        return bool(resp.withdrawn)

    def _take_back(
        self, peer: PeerState, key: str, data_ref: bytes, why: str
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._taken_back(peer, key, data_ref, why))
        slot = (peer.address, key)
        self._taking_back[slot] = task

        def done(task: asyncio.Task[None]) -> None:
            if self._taking_back.get(slot) is task:
                del self._taking_back[slot]

        task.add_done_callback(done)
        return task

    async def _taken_back(self, peer: PeerState, key: str, data_ref: bytes, why: str) -> None:
        try:
            withdrawn = await self.withdraw(peer, key, data_ref)
        except RelayError as err:
            log.warning(
                "keyed put of %r not taken back from peer %s (%s): %s; an entry it indexed "
                "stays until its reader's read fails or its TTL",
                key[:64],
                peer.address,
                why,
                err,
            )
            return
        if withdrawn:
            log.info("keyed put of %r taken back from peer %s (%s)", key[:64], peer.address, why)


__all__ = ["KeyedHandOver"]
