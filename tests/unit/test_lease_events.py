"""The lease table speaks in domain events; only the rpc layer knows their frames."""

from __future__ import annotations

import ast
import pathlib

import pytest
from relayd_client.wire.errors import ErrorCode
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.events import (
    Aborted,
    Draining,
    Freed,
    Landed,
    LocalLease,
    Reclaim,
    RegistryChanged,
    SessionError,
    SessionEvent,
)
from relayd.pools.records import LeaseState
from relayd.rpc.frames import frame_sink, session_frame

POOLS = pathlib.Path(__file__).resolve().parents[2] / "relayd" / "pools"
# The pools themselves, not the lease table: a GPU pool describes itself to
# clients as a CudaPool message (its IPC handles) in the Attach answer.
NOT_THE_LEASE_TABLE = {"cuda.py"}


def test_no_lease_table_module_imports_the_wire_protobufs() -> None:
    offenders = []
    for path in sorted(p for p in POOLS.glob("*.py") if p.name not in NOT_THE_LEASE_TABLE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names]
                module = node.module if isinstance(node, ast.ImportFrom) else ""
                if any("proto" in n or "pb2" in n for n in [module or "", *names]):
                    offenders.append(f"{path.name}: {ast.unparse(node)}")
    assert offenders == []


@pytest.mark.parametrize(
    ("event", "frame"),
    [
        (Freed((5, 6)), pb.SessionFrame(freed=pb.Freed(lease_ids=[5, 6]))),
        (Aborted("r1"), pb.SessionFrame(aborted=[pb.Aborted(request_id="r1")])),
        (
            SessionError(ErrorCode.PERMISSION_DENIED, "no"),
            pb.SessionFrame(
                event=[
                    pb.Event(
                        kind=pb.EVENT_KIND_ERROR, code=pb.ERROR_CODE_PERMISSION_DENIED, message="no"
                    )
                ]
            ),
        ),
        (
            Draining(),
            pb.SessionFrame(
                event=[
                    pb.Event(
                        kind=pb.EVENT_KIND_DRAINING,
                        code=pb.ERROR_CODE_DRAINING,
                        message="daemon is draining",
                    )
                ]
            ),
        ),
        (Reclaim(), pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_RECLAIM)])),
        (
            RegistryChanged(7),
            pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_REGISTRY, registry_version=7)]),
        ),
        (
            Landed(
                ("node-a", "e1", 9 << 32 | 1, 9 << 32 | 1),
                LocalLease(77, 0, 4, 2, 4096, 300),
                "r1",
                "talker",
            ),
            pb.SessionFrame(
                landed=[
                    pb.LandedPush(
                        origin_node_id="node-a",
                        origin_daemon_epoch="e1",
                        lease_id=9 << 32 | 1,
                        generation=9 << 32 | 1,
                        lease=pb.LeaseRef(
                            pool="shm",
                            segment=0,
                            slot=4,
                            nslots=2,
                            offset=4096,
                            length=300,
                            generation=77,
                            lease_id=77,
                        ),
                        request_id="r1",
                        to_stage="talker",
                    )
                ]
            ),
        ),
    ],
)
def test_each_event_has_its_frame(event: SessionEvent, frame: pb.SessionFrame) -> None:
    assert session_frame(event) == frame
    sent: list[pb.SessionFrame] = []
    frame_sink(sent.append)(event)
    assert sent == [frame]


def test_lease_states_carry_the_wire_numbers() -> None:
    assert {s.value: f"LEASE_STATE_{s.name}" for s in LeaseState} == {
        pb.LeaseState.Value(name): name
        for name in pb.LeaseState.keys()  # noqa: SIM118 (an enum wrapper, not a dict)
        if "UNSPECIFIED" not in name
    }
