"""The session frames of the lease table's events: one place for their wire layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL

from ..pools.events import (
    Aborted,
    Declined,
    Draining,
    Freed,
    Landed,
    LocalLease,
    Reclaim,
    RegistryChanged,
    SessionError,
    SessionEvent,
    Sink,
)


def session_frame(event: SessionEvent) -> pb.SessionFrame:
    """The ``SessionFrame`` that tells a client ``event``."""
    match event:
        case Freed(lease_ids):
            return pb.SessionFrame(freed=pb.Freed(lease_ids=lease_ids))
        case Aborted(request_id):
            return pb.SessionFrame(aborted=[pb.Aborted(request_id=request_id)])
        case Landed(origin, lease, request_id, to_stage):
            landed = _push(origin, to_stage, lease=lease_ref(lease), request_id=request_id)
            return pb.SessionFrame(landed=[landed])
        case Declined(origin, to_stage):
            return pb.SessionFrame(declined=[_push(origin, to_stage)])
        case SessionError(code, message):
            ev = pb.Event(
                kind=pb.EVENT_KIND_ERROR, code=cast(pb.ErrorCode, int(code)), message=message
            )
        case Draining():
            ev = pb.Event(
                kind=pb.EVENT_KIND_DRAINING,
                code=pb.ERROR_CODE_DRAINING,
                message="daemon is draining",
            )
        case Reclaim():
            ev = pb.Event(kind=pb.EVENT_KIND_RECLAIM)
        case RegistryChanged(version):
            ev = pb.Event(kind=pb.EVENT_KIND_REGISTRY, registry_version=version)
    return pb.SessionFrame(event=[ev])


def _push(origin: tuple[str, str, int, int], to_stage: str, **fields: Any) -> pb.LandedPush:
    """A ``LandedPush`` naming the push of the writer's lease ``origin``."""
    node, epoch, lease_id, generation = origin
    return pb.LandedPush(
        origin_node_id=node,
        origin_daemon_epoch=epoch,
        lease_id=lease_id,
        generation=generation,
        to_stage=to_stage,
        **fields,
    )


def lease_ref(lease: LocalLease) -> pb.LeaseRef:
    """The wire form of a daemon's lease, as a FetchResult or a LandedPush names it."""
    return pb.LeaseRef(
        pool=SHM_POOL,
        segment=lease.segment,
        slot=lease.slot,
        nslots=lease.nslots,
        offset=lease.offset,
        length=lease.length,
        generation=lease.lease_id,
        lease_id=lease.lease_id,
    )


def frame_sink(
    send: Callable[[pb.SessionFrame], None],
    apart: Callable[[pb.SessionFrame], bool] | None = None,
) -> Sink:
    """A session's sink that sends each event as its frame; a push's (Landed,
    Declined) first to ``apart``, the session's announcement socket, and on the
    session socket only if ``apart`` did not take it."""

    def sink(event: SessionEvent) -> None:
        frame = session_frame(event)
        if apart is not None and isinstance(event, Landed | Declined) and apart(frame):
            return
        send(frame)

    return sink
