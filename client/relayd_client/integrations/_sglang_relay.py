"""RelaydRelay: sglang-omni's ``Relay`` contract on top of :class:`RelayClient`.

Who calls what (sglang-omni 0.1.9, ``sglang_omni/comm``), all on the stage's
event loop:

* ``put_async(tensor, request_id, receiver_id=to_stage)`` - the stage's send
  worker, once per payload and once per stream chunk (and per tensor in a
  chunk's metadata), with one flat ``uint8`` tensor it packed. The returned
  operation's ``metadata`` travels in the stage's DataReady message; its
  ``transfer_info["size"]`` sizes the receiver's buffer. Stream chunks pass
  their object id (``"{request}:stream:..."``) as ``request_id``; the relay
  files them under the request so that an abort finds them.
* ``get_async(metadata, dest_tensor, request_id)`` - the receiving stage, with
  a buffer of that size; the read happens in ``wait_for_completion``.
* ``mark_receiver_done`` / ``mark_receiver_failed`` then ``wait_for_completion``
  on a put - the sender's ACK watcher, when the DataAck arrives (or does not).
  A put is complete once published (relayd owns the bytes from then on); a
  failed or unacknowledged one is discarded so it does not wait for its TTL.
* ``cleanup(request_id)`` - in two places: right after each payload read
  (``stage_io.read_payload``, in the reading task) and when the stage aborts
  the request (``Stage.on_abort``, its abort listener). After a read there is
  nothing left to free (the read released it), and an abort then would refuse
  the request's further transfers through this stage; so a cleanup of the
  request that the same task has just read is that release, and any other is
  an abort: every lease of the request on the node is freed and its readers
  and writers hear of it.
* ``close()`` - the stage's comm engine at shutdown.

A forwarding stage that will not read a relay object addressed to it frees
it with :meth:`RelaydRelay.discard` (relayd's discard: only the object's
writer's stage or the stage it is addressed to may free it unread).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import re
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from sglang_omni.relay.base import Relay, RelayOperation, register_relay

from .._client import RelayClient
from .._connection import ClientState
from ..wire.dataref import DataRef
from ..wire.errors import (
    AbortedError,
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    SessionClosedError,
    StaleRefError,
)

log = logging.getLogger(__name__)

RELAY_NAME = "relayd"
# sglang-omni's stream objects are named "{request}:stream:{from}:{to}:{chunk}:..."
# (and their metadata tensors "{that}:meta:{i}"); the request is what an abort names.
_STREAM_OBJECT = re.compile(r"(?s)(.+?):stream:")
# How long a close() from another thread waits for the session to end.
_CLOSE_WAIT_S = 5.0
# Aborted requests remembered, so that the stage's drain of one fails at once.
_ABORTED_MEMORY = 4096


class OpKind(enum.Enum):
    PUT = "put"
    GET = "get"


def request_of(request_id: str) -> str:
    """The request an sglang-omni relay ``request_id`` (or object id) belongs to."""
    m = _STREAM_OBJECT.match(request_id)
    return m.group(1) if m else request_id


def _ref_from(metadata: object) -> tuple[DataRef, int]:
    """The DataRef and byte size a put's metadata carries; it came off a socket."""
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"relay metadata must be a dict, got {type(metadata).__name__}")
    info = metadata.get("transfer_info")
    body = metadata.get("relayd")
    if not isinstance(info, Mapping) or not isinstance(body, Mapping):
        raise InvalidArgumentError(
            "relay metadata lacks transfer_info or relayd (not a relayd put?)"
        )
    size = info.get("size")
    wire = body.get("ref")
    if type(size) is not int or size < 0:
        raise InvalidArgumentError(f"transfer_info.size must be a non-negative int, got {size!r}")
    if not isinstance(wire, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError("relayd.ref must be the DataRef's bytes")
    ref = DataRef.from_bytes(wire)
    if ref.nbytes != size:
        raise InvalidArgumentError(
            f"transfer_info.size {size} disagrees with the DataRef's {ref.nbytes} bytes"
        )
    return ref, size


class RelaydOperation(RelayOperation):  # type: ignore[misc]  # sglang-omni is untyped
    """One put or get through relayd; see the module docstring for who calls what."""

    def __init__(
        self,
        relay: RelaydRelay,
        kind: OpKind,
        metadata: dict[str, Any],
        ref: DataRef,
        *,
        request_id: str = "",
        dest: torch.Tensor | None = None,
    ) -> None:
        self.relay = relay
        self.kind = kind
        self._metadata = metadata
        self.ref = ref
        self.request_id = request_id
        self.dest = dest
        self.completed = False
        self._receiver: asyncio.Future[None] | None = None
        if kind is OpKind.PUT:
            self._receiver = asyncio.get_running_loop().create_future()

    @property
    def metadata(self) -> dict[str, Any]:
        return self._metadata

    def mark_receiver_done(self) -> None:
        if self._receiver is not None and not self._receiver.done():
            self._receiver.set_result(None)

    def mark_receiver_failed(self, exc: BaseException) -> None:
        if self._receiver is not None and not self._receiver.done():
            self._receiver.set_exception(exc)

    async def wait_for_completion(self, timeout: float = 30.0) -> None:
        if self.completed:
            return
        try:
            if self.kind is OpKind.GET:
                await asyncio.wait_for(self._read(), timeout)
                # In the reading task (wait_for ran the read in another one),
                # with nothing awaited before stage_io's cleanup(request_id).
                self.relay._note_read(self.request_id)
            else:
                await self._settle(timeout)
        finally:
            self.completed = True

    async def _read(self) -> None:
        assert self.dest is not None
        self.relay._check_not_aborted(self.request_id)
        client = await self.relay.client()
        nbytes = self.ref.nbytes
        dest = self.dest.view(torch.uint8).reshape(-1)
        if dest.numel() < nbytes:
            raise InvalidArgumentError(
                f"destination has {dest.numel()} bytes, the transfer {nbytes}"
            )
        async with client.view(self.ref) as src:
            if not isinstance(src, torch.Tensor):
                raise InvalidArgumentError("the DataRef does not hold one flat tensor")
            dest[:nbytes].copy_(src.reshape(-1).view(torch.uint8))

    async def _settle(self, timeout: float) -> None:
        assert self._receiver is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._receiver), timeout)
        except BaseException as exc:
            # The reader failed, timed out or is gone: free what it may not
            # have read rather than leave it to the TTL.
            await self.relay._discard_quietly(self.ref)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"relayd object {self.ref.object_id} was not acknowledged in {timeout}s"
                ) from None
            raise


@register_relay(RELAY_NAME)
class RelaydRelay(Relay):  # type: ignore[misc]  # sglang-omni is untyped
    """sglang-omni ``Relay`` backed by the node's relayd.

    ``stage`` is the sglang-omni stage this relay serves (relayd addresses
    data to stages; sglang-omni passes the target stage as ``receiver_id``).
    ``socket`` defaults to the client's (``RELAYD_SOCKET`` or the runtime
    directory). ``device`` is where received buffers are allocated by
    sglang-omni; ``engine_id`` is only echoed in the metadata. The relayd
    session opens on the stage's event loop at first use.
    """

    def __init__(
        self,
        stage: str,
        socket: str | None = None,
        *,
        device: str = "cpu",
        engine_id: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        if not isinstance(stage, str) or not stage:
            raise InvalidArgumentError("RelaydRelay needs the name of the stage it serves (stage=)")
        self.stage = stage
        self.device = device
        self.engine_id = engine_id or f"{stage}_relayd"
        self._client = RelayClient(stage, socket, timeout=timeout)
        self._opening: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reads: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task[None]] = set()
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._closed = False

    async def client(self) -> RelayClient:
        """The relay's session with relayd, opened on first use."""
        c = self._client
        if c.state is ClientState.OPENED:
            return c
        if self._closed:
            raise SessionClosedError("RelaydRelay is closed")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if c.state is ClientState.UNOPENED:
                await c.open()
                self._loop = asyncio.get_running_loop()
        return c

    # -- the Relay contract -----------------------------------------------------------

    async def put_async(
        self,
        tensor: torch.Tensor,
        request_id: str | None = None,
        dst_rank: int | None = None,
        receiver_id: str | None = None,
    ) -> RelaydOperation:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"put_async takes a tensor, got {type(tensor).__name__}")
        if not receiver_id:
            raise InvalidArgumentError(
                "relayd delivers to a stage: put_async needs receiver_id (the target stage)"
            )
        rid = request_of(request_id) if request_id else uuid.uuid4().hex
        self._check_not_aborted(rid)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        client = await self.client()
        ref = await client.put(flat, to_stage=receiver_id, request_id=rid)
        metadata: dict[str, Any] = {
            "engine_id": self.engine_id,
            "transfer_info": {"size": ref.nbytes, "req_id": rid},
            "relayd": {"ref": ref.to_bytes()},
        }
        return RelaydOperation(self, OpKind.PUT, metadata, ref, request_id=rid)

    async def get_async(
        self,
        metadata: dict[str, Any],
        dest_tensor: torch.Tensor,
        request_id: str | None = None,
    ) -> RelaydOperation:
        ref, _size = _ref_from(metadata)
        if not isinstance(dest_tensor, torch.Tensor):
            raise InvalidArgumentError("get_async needs a destination tensor")
        return RelaydOperation(
            self, OpKind.GET, dict(metadata), ref, request_id=request_id or "", dest=dest_tensor
        )

    def cleanup(self, request_id: str) -> None:
        """Free everything of ``request_id`` on the node (abort), unless it is the
        release that follows this task's read of it (see the module docstring)."""
        task = _current_task()
        if task is not None and self._reads.pop(task, None) == request_id:
            return
        rid = request_of(request_id)
        # At once for this stage: what it has not read yet of the request is
        # never read (the daemon frees it a moment later).
        self._aborted[rid] = None
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            t = running.create_task(self._abort(rid))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        elif self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._abort(rid), self._loop)
        else:
            log.debug("cleanup(%r) with no event loop and no session: nothing to free", rid)

    def close(self) -> None:
        """Close the relayd session (on the loop it runs on, or now if none runs)."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._client.state is not ClientState.OPENED:
            self._client.state = ClientState.CLOSED
        elif running is not None and running is self._loop:
            t = running.create_task(self._client.close())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        elif self._loop is not None and self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._client.close(), self._loop)
            with contextlib.suppress(Exception):
                fut.result(_CLOSE_WAIT_S)
        elif self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())

    async def aclose(self) -> None:
        """Close from a coroutine, waiting for the session to end."""
        self.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- beyond the contract ----------------------------------------------------------

    async def discard(self, metadata: dict[str, Any]) -> None:
        """Free the object a put's ``metadata`` describes without reading it.

        For a stage that forwards or drops data it will not read, addressed to
        it or written by it (another stage's is :class:`PermissionDeniedError`).
        A second discard, or a discard after the read, raises
        :class:`StaleRefError`.
        """
        ref, _size = _ref_from(metadata)
        client = await self.client()
        await client.discard(ref)

    async def _discard_quietly(self, ref: DataRef) -> None:
        try:
            client = await self.client()
            await client.discard(ref)
        except (StaleRefError, AbortedError, SessionClosedError):
            pass  # read, freed or aborted already: nothing is left
        except RelayError as exc:
            log.warning("could not discard relayd object %s: %s", ref.object_id, exc)

    async def _abort(self, request_id: str) -> None:
        try:
            client = await self.client()
            freed = await client.abort(request_id)
            log.debug("aborted %r: %d leases freed", request_id, freed)
        except PermissionDeniedError:
            pass  # this stage neither wrote nor read it: nothing of ours to free
        except SessionClosedError:
            pass
        except RelayError as exc:
            log.warning("relayd abort of %r failed: %s", request_id, exc)

    def _check_not_aborted(self, request_id: str) -> None:
        if request_id and request_of(request_id) in self._aborted:
            raise AbortedError(f"request {request_of(request_id)!r} was aborted")

    def _note_read(self, request_id: str) -> None:
        # One-shot and per task: only the cleanup that follows this read in
        # the same task is its release. Stream reads (object ids) are never
        # followed by one.
        task = _current_task()
        if task is not None and request_id and request_of(request_id) == request_id:
            self._reads[task] = request_id


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None
