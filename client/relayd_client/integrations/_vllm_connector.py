"""RelaydConnector: vllm-omni's ``OmniConnectorBase`` on relayd's keyed delivery.

Who calls what (vllm-omni 0.30.0), all synchronously and from any thread:

* ``put(from_stage, to_stage, key, data)`` - the orchestrator forwarding a
  request (key: the request id), a stage's chunk sender (key
  ``f"{request}_{stage}_{chunk}"``) and the KV manager (key
  ``f"{request}_{stage}_{chunk}_{from_rank}_{to_rank}"``, a raw tensor since
  this connector ``supports_raw_data``). relayd indexes the payload under the
  key for the consumer stage; nothing needs to travel with the key, so the
  returned metadata is None.
* ``get(from_stage, to_stage, key, metadata=None)`` - the consumer, by key.
  The chunk receiver polls every millisecond and expects ``None`` until the
  payload is there; reading consumes it. Metadata from other connectors
  (shm handles, RDMA addresses) is ignored: the key is the address.
* ``get_with_deadline`` - the same, waiting in the daemon up to the deadline.
* ``cleanup(request_id)`` - frees everything of the request on the node
  (relayd's abort), wherever it waits.
* ``health()`` - the daemon's state and arena, and this connector's counts.
* ``close()`` - end the sessions; idempotent (vllm-omni also calls it from
  ``__del__``).

vllm-omni names stages by id ("0", "1", ...). relayd serves stages by name:
stage ``S`` of the pipeline is relayd stage ``f"{prefix}.{S}"`` (``prefix``
is ``extra["stage"]``, default ``"vllm-omni"``). A connector opens one relayd
session per stage it writes or reads for, on first use.

Keys are filed under their request, so that an abort finds them: the chunk
and KV key shapes above under ``{request}``, any other key under itself.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase

from .._connection import ClientState, default_socket
from .._sync import SyncRelayClient
from ..wire.dataref import DataRef
from ..wire.errors import (
    AbortedError,
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    StaleRefError,
    UnsafePayloadError,
)
from ..wire.proto import relay_pb2 as pb
from ._plain import plain

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "vllm-omni"
DEFAULT_TIMEOUT_S = 10.0
# vllm-omni's keys that carry a request: {req}_{stage}_{chunk}[_{from_rank}_{to_rank}].
_RANKED_KEY = re.compile(r"(?s)(.+)_\d+_\d+_\d+_\d+")
_CHUNK_KEY = re.compile(r"(?s)(.+)_\d+_\d+")


def request_of(key: str) -> str:
    """The request a vllm-omni connector key belongs to."""
    m = _RANKED_KEY.fullmatch(key) or _CHUNK_KEY.fullmatch(key)
    return m.group(1) if m else key


def _own_stage(config: dict[str, Any]) -> Any:
    """This worker's vllm-omni stage: given by vllm-omni directly, or by the edge and role."""
    if "stage_id" in config:
        return config["stage_id"]
    role = config.get("role")
    if role == "receiver" and "to_stage" in config:
        return config["to_stage"]
    if role == "sender" and "from_stage" in config:
        return config["from_stage"]
    return -1


def _payload_size(ref: DataRef) -> int:
    """What the payload weighs: tensor bytes plus the encoded rest (same on both ends)."""
    return ref.nbytes + len(ref.fields.header)


class RelaydConnector(OmniConnectorBase):  # type: ignore[misc]  # vllm-omni is untyped
    """vllm-omni connector backed by the node's relayd; see the module docstring.

    ``config`` is the connector spec's ``extra``: ``socket`` (default: the
    client's, ``RELAYD_SOCKET`` or the runtime directory), ``stage`` (the
    relayd stage-name prefix), ``timeout`` (seconds a blocking call may take)
    and ``allow_pickle`` (payload parts relayd's safe codec refuses - numpy
    arrays, images - are pickled, and pickled payloads are accepted; off by
    default). vllm-omni adds ``stage_id`` (this worker's stage) and ``role``.
    """

    supports_raw_data = True

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()  # the sessions
        self._stats_lock = threading.Lock()
        self._clients: dict[str, SyncRelayClient] = {}
        self._closed = False
        config = dict(config or {})
        self.config = config
        self.socket = str(config.get("socket") or default_socket())
        self.prefix = str(config.get("stage") or DEFAULT_PREFIX)
        self.timeout = float(config.get("timeout", DEFAULT_TIMEOUT_S))
        self.allow_pickle = bool(config.get("allow_pickle", False))
        self.stage_id = _own_stage(config)
        if self.timeout <= 0:
            raise InvalidArgumentError(f"timeout must be positive, got {self.timeout}")
        self._metrics = {"puts": 0, "gets": 0, "bytes_transferred": 0, "errors": 0}

    def relayd_stage(self, stage: object) -> str:
        """The relayd stage that serves vllm-omni stage ``stage``."""
        return f"{self.prefix}.{stage}"

    def _client(self, stage: object) -> SyncRelayClient:
        name = self.relayd_stage(stage)
        c = self._clients.get(name)
        if c is not None:
            return c
        with self._lock:
            if self._closed:
                raise RelayError("RelaydConnector is closed")
            c = self._clients.get(name)
            if c is None:
                c = SyncRelayClient(
                    name, self.socket, timeout=self.timeout, allow_pickle=self.allow_pickle
                )
                c.open()
                self._clients[name] = c
            return c

    # -- OmniConnectorBase ------------------------------------------------------------

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        try:
            client = self._client(from_stage)
            payload = plain(data)
            try:
                ref = client.put(
                    payload,
                    to_stage=self.relayd_stage(to_stage),
                    request_id=request_of(put_key),
                    key=put_key,
                )
            except UnsafePayloadError:
                if not self.allow_pickle:
                    raise
                ref = client.put(
                    payload,
                    to_stage=self.relayd_stage(to_stage),
                    request_id=request_of(put_key),
                    key=put_key,
                    pickle=True,
                )
        except RelayError as exc:
            with self._stats_lock:
                self._metrics["errors"] += 1
            log.error("relayd put of %r (%s -> %s) failed: %s", put_key, from_stage, to_stage, exc)
            return False, 0, None
        size = _payload_size(ref)
        with self._stats_lock:
            self._metrics["puts"] += 1
            self._metrics["bytes_transferred"] += size
        return True, size, None

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        return self._take(from_stage, to_stage, get_key, 0.0)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        return self._take(from_stage, to_stage, get_key, max(deadline - time.monotonic(), 0.0))

    def _take(
        self, from_stage: str, to_stage: str, key: str, wait: float
    ) -> tuple[Any, int] | None:
        client = self._client(to_stage)
        try:
            ref = client.take_key(key, from_stage=self.relayd_stage(from_stage), timeout=wait)
        except RelayTimeoutError:
            return None
        except (StaleRefError, AbortedError):
            return None  # read, discarded, expired or aborted: it will not come
        if ref is None:
            return None
        try:
            obj = client.get(ref)
        except AbortedError:
            return None  # aborted between the take and the read
        size = _payload_size(ref)
        with self._stats_lock:
            self._metrics["gets"] += 1
        return obj, size

    def cleanup(self, request_id: str) -> None:
        """Free everything of ``request_id`` (a request id or one of its keys) on the node."""
        names = {request_id, request_of(request_id)}
        clients = list(self._clients.values())
        if not clients and self.stage_id not in (-1, None):
            clients = [self._client(self.stage_id)]
        for rid in names:
            for client in clients:
                try:
                    client.abort(rid)
                    break
                except PermissionDeniedError:
                    continue  # this stage has no part in it; another may
                except RelayError as exc:
                    log.warning("relayd abort of %r failed: %s", rid, exc)
                    break

    def health(self) -> dict[str, Any]:
        with self._stats_lock:
            out: dict[str, Any] = {"socket": self.socket, **self._metrics}
        try:
            clients = list(self._clients.values())
            client = clients[0] if clients else self._client(self._health_stage())
            st = client.status()
        except RelayError as exc:
            out.update(status="unhealthy", error=f"{type(exc).__name__}: {exc}")
            return out
        out.update(
            status="healthy" if st.state == pb.DAEMON_STATE_SERVING else "unhealthy",
            daemon_state=pb.DaemonState.Name(st.state).removeprefix("DAEMON_STATE_").lower(),
            node_id=st.node_id,
            daemon_epoch=st.daemon_epoch,
            pools=[
                {"name": p.name, "capacity_bytes": p.capacity_bytes, "used_bytes": p.used_bytes}
                for p in st.pools
            ],
            sessions=len(self._clients),
        )
        return out

    def _health_stage(self) -> object:
        # A connector that has moved nothing yet asks as its own stage.
        return self.stage_id if self.stage_id not in (-1, None) else "health"

    def close(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before there was anything to close
            return
        with lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            if c.state is not ClientState.CLOSED:
                try:
                    c.close()
                except RelayError as exc:
                    log.debug("closing a relayd session: %s", exc)
