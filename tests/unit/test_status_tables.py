"""Snapshot tests of the status views.

Regenerate the snapshots after an intended change with
``RELAYD_UPDATE_SNAPSHOTS=1 pytest tests/unit/test_status_tables.py`` and review the diff.
"""

from __future__ import annotations

import copy
import os
import pathlib
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st
from relayd_client.wire.latency import BOUNDS, NBUCKETS

from relayd.status_tables import (
    WIDTH,
    format_bar,
    format_bytes,
    format_duration,
    render_leases,
    render_status,
    render_top,
)

UPDATE = os.environ.get("RELAYD_UPDATE_SNAPSHOTS")
SNAPSHOTS = pathlib.Path(__file__).parent / "snapshots"

GPU = "cuda:GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
MiB = 1 << 20

PEERS = [
    {
        "peer": "10.0.0.2:7600",
        "up": True,
        "notice_channel": True,
        "daemon_epoch": "5c7dd4189c",
        "mooncake_session": "10.0.0.2:15459",
        "credits_in_use": 12,
        "credits_capacity": 32,
        "pulls_in_flight_max": 17,
    },
    {
        "peer": "relayd-1.relayd.serving.svc.cluster.local:7600",
        "up": False,
        "credits_in_use": 0,
        "credits_capacity": "32",
        "last_error": "relayd daemon unavailable: failed to connect to all addresses",
    },
]


def _buckets(**at: int) -> list[int]:
    """Counts per latency bucket, by index: ``_buckets(b4=10)`` puts 10 in the 200 us bucket."""
    out = [0] * NBUCKETS
    for name, n in at.items():
        out[int(name[1:])] = n
    return out


# (from, to, transport, transfers, bytes, put buckets, get buckets) now, and an
# interval earlier (previous_state): bucket 4 is <= 200 us, 6 <= 1 ms, 9 <= 10 ms.
EDGE_TRAFFIC = [
    ("audio-encoder", "thinker", 7, 3, 3 * 65536, _buckets(b9=3), _buckets(b9=2, b12=1)),
    ("talker", "vocoder", 2, 12, 12 * MiB, _buckets(b1=12), _buckets(b0=12)),
    ("thinker", "talker", 1, 9120, 9120 * 512, _buckets(b2=9000, b3=120), _buckets(b1=9120)),
    ("thinker", "talker", 4, 3377, 3377 * 4 * MiB, _buckets(b4=3300, b6=77), _buckets(b5=3377)),
]
EDGE_TRAFFIC_BEFORE = [
    ("audio-encoder", "thinker", 7, 3, 3 * 65536, _buckets(b9=3), _buckets(b9=2, b12=1)),
    ("thinker", "talker", 1, 9000, 9000 * 512, _buckets(b2=9000), _buckets(b1=9000)),
    ("thinker", "talker", 4, 3000, 3000 * 4 * MiB, _buckets(b4=3000), _buckets(b5=3000)),
]


def _edge_traffic(spec: list[tuple[Any, ...]]) -> list[Any]:
    from relayd_client.wire.proto import relay_pb2 as pb

    return [
        pb.EdgeTraffic(
            from_stage=src,
            to_stage=dst,
            transport=transport,
            transfers=n,
            bytes=nbytes,
            put_buckets=put,
            get_buckets=get,
        )
        for src, dst, transport, n, nbytes, put, get in spec
    ]


def _edge_traffic_json(spec: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [MessageToDict(m, preserving_proto_field_name=True) for m in _edge_traffic(spec)]


# What MessageToDict(StatusResponse, preserving_proto_field_name=True) yields for
# status_response() below; test_fixture_is_what_the_wire_gives keeps the two in step.
STATUS: dict[str, Any] = {
    "node_id": "gpu-node-7-3f9a1c2e",
    "daemon_epoch": "k3x9q2",
    "state": "DAEMON_STATE_SERVING",
    "uptime_seconds": 11523.4,
    "pools": [
        {
            "name": "shm",
            "capacity_bytes": "4294967296",
            "used_bytes": "2233466880",
            "granted_bytes": "536870912",
            "largest_free_run_bytes": "1073741824",
            "slot_size": "65536",
            "slots": "65536",
            "free_slots": "31456",
        },
        {
            "name": "cuda:GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
            "capacity_bytes": "1073741824",
            "largest_free_run_bytes": "1073741824",
            "slot_size": "65536",
            "slots": "16384",
            "free_slots": "16384",
        },
    ],
    "leases": [
        {
            "lease_id": "101",
            "state": "LEASE_STATE_PUBLISHED",
            "pool": "shm",
            "bytes": "4194304",
            "request_id": "req-7f3e",
            "from_stage": "thinker",
            "to_stage": "talker",
            "age_seconds": 58.25,
            "session_id": "s-a1",
        },
        {
            "lease_id": "102",
            "state": "LEASE_STATE_PUBLISHED",
            "pool": "shm",
            "bytes": "524288",
            "request_id": "req-7f3e",
            "from_stage": "thinker",
            "to_stage": "talker",
            "age_seconds": 12.5,
            "session_id": "s-a1",
        },
        {
            "lease_id": "117",
            "state": "LEASE_STATE_RESERVED",
            "pool": "shm",
            "bytes": "1048576",
            "request_id": "req-8c21",
            "from_stage": "thinker",
            "to_stage": "talker",
            "age_seconds": 0.4,
            "session_id": "s-a1",
        },
        {
            "lease_id": "98",
            "state": "LEASE_STATE_CLAIMED",
            "pool": "cuda:GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
            "bytes": "3145728",
            "request_id": "req-6a00",
            "from_stage": "talker",
            "to_stage": "vocoder",
            "age_seconds": 131.0,
            "session_id": "s-b2",
        },
        {
            "lease_id": "120",
            "state": "LEASE_STATE_PUBLISHED",
            "pool": "shm",
            "bytes": "65536",
            "request_id": "req-9d4b-long-request-identifier-01",
            "from_stage": "audio-encoder",
            "to_stage": "thinker",
            "age_seconds": 2.0,
            "session_id": "s-c3",
        },
        {
            "lease_id": "121",
            "state": "LEASE_STATE_PUBLISHED",
            "pool": "shm",
            "bytes": "2097152",
            "request_id": "req-9d4b",
            "from_stage": "thinker",
            "to_stage": "talker",
            "age_seconds": 1.25,
            "session_id": "s-a1",
        },
        {
            "lease_id": "18446744073709551557",
            "state": "LEASE_STATE_PUBLISHED",
            "pool": "shm",
            "bytes": "8388608",
            "request_id": "req-0001",
            "from_stage": "talker",
            "to_stage": "vocoder",
            "age_seconds": 3605.0,
            "session_id": "s-b2",
        },
    ],
    "sessions": [
        {
            "session_id": "3c1d9e0a-5b7f-4e21-9a8c-2f6b1d0e7a44",
            "pid": 41872,
            "stages": ["thinker"],
            "granted_bytes": "268435456",
            "leases": 4,
            "age_seconds": 11490.0,
            "uid": 1000,
        },
        {
            "session_id": "s-b2",
            "pid": 41901,
            "stages": ["talker", "vocoder"],
            "granted_bytes": "67108864",
            "leases": 2,
            "age_seconds": 11488.5,
            "uid": 1000,
        },
        {
            "session_id": "s-c3",
            "pid": 42010,
            "stages": ["audio-encoder"],
            "leases": 1,
            "age_seconds": 95.0,
        },
    ],
    "leases_by_state": {"reserved": "1", "claimed": "1", "published": "5"},
    "transfers_by_transport": {
        "shm": "48213",
        "inline": "9120",
        "cuda_ipc_pool": "3377",
        "mooncake": "412",
    },
    "reclaimed_by_reason": {"ttl": "3", "session_closed": "2"},
    "version": "0.1.0",
    "registry_version": "7",
    "stages": [
        {
            "stage": "thinker",
            "session_id": "3c1d9e0a-5b7f-4e21-9a8c-2f6b1d0e7a44",
            "node_id": "gpu-node-7-3f9a1c2e",
            "process_key": "pid:[4026531836]:41872:99120",
            "can_map_shm": True,
            "gpu_uuids": ["GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"],
            "pid": 41872,
        },
        {
            "stage": "talker",
            "session_id": "s-b2",
            "node_id": "gpu-node-7-3f9a1c2e",
            "process_key": "pid:[4026531836]:41901:99175",
            "can_map_shm": True,
            "gpu_uuids": ["GPU-77aa01bc-0000-1111-2222-333344445555"],
            "pid": 41901,
        },
        {
            "stage": "vocoder",
            "session_id": "s-b2",
            "node_id": "gpu-node-7-3f9a1c2e",
            "process_key": "pid:[4026531836]:41901:99175",
            "can_map_shm": True,
            "gpu_uuids": ["GPU-77aa01bc-0000-1111-2222-333344445555"],
            "pid": 41901,
        },
        {
            "stage": "audio-encoder",
            "session_id": "s-c3",
            "node_id": "gpu-node-7-3f9a1c2e",
            "process_key": "pid:[4026532455]:7:31337",
            "pid": 42010,
        },
    ],
    "edges": [
        {
            "from_stage": "audio-encoder",
            "to_stage": "thinker",
            "transport": "TRANSPORT_SOCKET",
            "reason": "writer cannot map daemon SHM",
            "count": "3",
        },
        {
            "from_stage": "talker",
            "to_stage": "vocoder",
            "transport": "TRANSPORT_LOCAL_OBJECT",
            "reason": "same process",
            "count": "12",
        },
        {
            "from_stage": "thinker",
            "to_stage": "talker",
            "transport": "TRANSPORT_CUDA_IPC_POOL",
            "reason": "GPU-8a1b2c3d -> GPU-77aa01bc (different GPUs)",
            "count": "2",
        },
    ],
    "edge_traffic": _edge_traffic_json(EDGE_TRAFFIC),
    "latency_bucket_bounds": list(BOUNDS),
}


def status_response() -> Any:
    from relayd_client.wire.proto import relay_pb2 as pb

    resp = pb.StatusResponse(
        node_id="gpu-node-7-3f9a1c2e",
        daemon_epoch="k3x9q2",
        state=pb.DAEMON_STATE_SERVING,
        uptime_seconds=11523.4,
        version="0.1.0",
        leases_by_state={"reserved": 1, "published": 5, "claimed": 1},
        transfers_by_transport={
            "shm": 48213,
            "inline": 9120,
            "cuda_ipc_pool": 3377,
            "mooncake": 412,
        },
        reclaimed_by_reason={"ttl": 3, "session_closed": 2},
    )
    resp.pools.add(
        name="shm",
        capacity_bytes=4 << 30,
        used_bytes=2233466880,
        granted_bytes=512 * MiB,
        largest_free_run_bytes=1 << 30,
        slot_size=65536,
        slots=65536,
        free_slots=31456,
    )
    resp.pools.add(
        name=GPU,
        capacity_bytes=1 << 30,
        largest_free_run_bytes=1 << 30,
        slot_size=65536,
        slots=16384,
        free_slots=16384,
    )
    leases = [
        (101, 2, "shm", 4 * MiB, "req-7f3e", "thinker", "talker", 58.25, "s-a1"),
        (102, 2, "shm", 512 << 10, "req-7f3e", "thinker", "talker", 12.5, "s-a1"),
        (117, 1, "shm", MiB, "req-8c21", "thinker", "talker", 0.4, "s-a1"),
        (98, 3, GPU, 3 * MiB, "req-6a00", "talker", "vocoder", 131.0, "s-b2"),
        (
            120,
            2,
            "shm",
            65536,
            "req-9d4b-long-request-identifier-01",
            "audio-encoder",
            "thinker",
            2.0,
            "s-c3",
        ),
        (121, 2, "shm", 2 * MiB, "req-9d4b", "thinker", "talker", 1.25, "s-a1"),
        (2**64 - 59, 2, "shm", 8 * MiB, "req-0001", "talker", "vocoder", 3605.0, "s-b2"),
    ]
    for lease_id, state, pool, nbytes, request, src, dst, age, session in leases:
        resp.leases.add(
            lease_id=lease_id,
            state=state,
            pool=pool,
            bytes=nbytes,
            request_id=request,
            from_stage=src,
            to_stage=dst,
            age_seconds=age,
            session_id=session,
        )
    resp.sessions.add(
        session_id="3c1d9e0a-5b7f-4e21-9a8c-2f6b1d0e7a44",
        pid=41872,
        stages=["thinker"],
        granted_bytes=256 * MiB,
        leases=4,
        age_seconds=11490.0,
        uid=1000,
    )
    resp.sessions.add(
        session_id="s-b2",
        pid=41901,
        stages=["talker", "vocoder"],
        granted_bytes=64 * MiB,
        leases=2,
        age_seconds=11488.5,
        uid=1000,
    )
    resp.sessions.add(
        session_id="s-c3", pid=42010, stages=["audio-encoder"], leases=1, age_seconds=95.0
    )
    resp.registry_version = 7
    for stage in STATUS["stages"]:
        resp.stages.add(**stage)
    for edge in STATUS["edges"]:
        resp.edges.add(**{**edge, "count": int(edge["count"])})
    resp.edge_traffic.extend(_edge_traffic(EDGE_TRAFFIC))
    resp.latency_bucket_bounds.extend(BOUNDS)
    return resp


def state() -> dict[str, Any]:
    """What ``relayd status --json`` holds, plus peers (not in the proto yet)."""
    d = copy.deepcopy(STATUS)
    d["peers"] = copy.deepcopy(PEERS)
    return d


def previous_state() -> dict[str, Any]:
    d = state()
    d["transfers_by_transport"] = {"inline": "9000", "shm": "48000", "cuda_ipc_pool": "3377"}
    d["edge_traffic"] = _edge_traffic_json(EDGE_TRAFFIC_BEFORE)
    return d


def assert_snapshot(name: str, text: str) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert too_wide == []
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text()


def test_fixture_is_what_the_wire_gives() -> None:
    assert MessageToDict(status_response(), preserving_proto_field_name=True) == STATUS
    assert STATUS["pools"][0]["capacity_bytes"] == "4294967296"  # uint64 -> str
    assert "used_bytes" not in STATUS["pools"][1]  # defaults are left out


@pytest.mark.parametrize(
    ("name", "render"),
    [
        ("status", lambda: render_status(state())),
        ("leases", lambda: render_leases(state())),
        ("leases_stage_talker", lambda: render_leases(state(), stage="talker")),
        ("leases_request", lambda: render_leases(state(), request="req-7f3e")),
        ("top", lambda: render_top(state(), previous_state(), 2.0)),
        ("status_empty", lambda: render_status({})),
    ],
)
def test_snapshot(name: str, render: Any) -> None:
    assert_snapshot(name, render())


def test_defaults_printed_or_not_render_the_same() -> None:
    full = MessageToDict(
        status_response(),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    full["peers"] = copy.deepcopy(PEERS)
    assert render_status(full) == render_status(state())
    assert render_leases(full, stage="talker") == render_leases(state(), stage="talker")


def _numbers_as_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_as_ints(v) for v in value]
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def test_integers_and_enum_numbers_are_accepted() -> None:
    d = _numbers_as_ints(state())
    numbers = {"LEASE_STATE_RESERVED": 1, "LEASE_STATE_PUBLISHED": 2, "LEASE_STATE_CLAIMED": 3}
    for lease in d["leases"]:
        lease["state"] = numbers[lease["state"]]
    assert render_status(d) == render_status(state())
    assert render_leases(d) == render_leases(state())


def test_lease_counts_come_from_the_list_without_leases_by_state() -> None:
    d = state()
    del d["leases_by_state"]
    assert "LEASES  7 (1 reserved, 5 published, 1 claimed), oldest first" in render_status(d)


def test_leases_filter_matches_either_stage_and_request() -> None:
    talker = render_leases(state(), stage="talker").splitlines()
    assert talker[0] == "LEASES  6 of 7 (stage=talker), oldest first"
    assert len(talker) == 2 + 6
    both = render_leases(state(), stage="vocoder", request="req-6a00").splitlines()
    assert both[0] == "LEASES  1 of 7 (stage=vocoder, request=req-6a00), oldest first"
    assert render_leases(state(), request="nope") == "LEASES  0 of 7 (request=nope)"


def test_peer_link_names_the_path_notices_take() -> None:
    d = state()
    d["peers"][0]["notice_channel"] = False

    def links(d: dict[str, Any]) -> list[str]:
        lines = render_status(d).splitlines()
        header = lines.index("PEERS  2") + 1
        start = lines[header].index("LINK")
        return [line[start:].split()[0] for line in lines[header : header + 3]]

    assert links(state()) == ["LINK", "up/tcp", "down"]
    assert links(d) == ["LINK", "up/grpc", "down"]


def test_top_without_comparable_previous_shows_no_rates() -> None:
    first = render_top(state(), None, 2.0)
    restarted = previous_state()
    restarted["daemon_epoch"] = "older"
    for text in (first, render_top(state(), restarted, 2.0)):
        lines = text.splitlines()
        start = lines.index("TRANSFERS")
        assert lines[start + 1 : start + 6] == [
            "  TRANSPORT      TOTAL  PER SECOND",
            "  cuda_ipc_pool   3377           -",
            "  inline          9120           -",
            "  mooncake         412           -",
            "  shm            48213           -",
        ]


def test_top_counter_reset_shows_no_rate() -> None:
    before = previous_state()
    before["transfers_by_transport"]["shm"] = "99999"
    assert "  shm            48213           -" in render_top(state(), before, 2.0).splitlines()


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (64 * MiB, "64.0 MiB"),
        (1024 * MiB - 1, "1.0 GiB"),
        (2**64 - 1, "16384.0 PiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-1.0, "0.0s"),
        (0.04, "0.0s"),
        (59.24, "59.2s"),
        (60.0, "1m00s"),
        (723.9, "12m03s"),
        (11523.4, "3h12m"),
        (183600.0, "2d03h"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("used", "capacity", "text"),
    [
        (0, 100, "[..........]   0%"),
        (52, 100, "[#####.....]  52%"),
        (100, 100, "[##########] 100%"),
        (150, 100, "[##########] 100%"),
        (5, 0, "[..........]    -"),
    ],
)
def test_format_bar(used: int, capacity: int, text: str) -> None:
    assert format_bar(used, capacity) == text


_word = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=70)
_u64 = st.integers(min_value=0, max_value=2**64 - 1)
_num = st.one_of(_u64, _u64.map(str))
_age = st.floats(min_value=0, max_value=1e9, allow_nan=False)

_pool = st.fixed_dictionaries(
    {"name": _word, "capacity_bytes": _num, "used_bytes": _num, "granted_bytes": _num},
    optional={"largest_free_run_bytes": _num},
)
_lease = st.fixed_dictionaries(
    {
        "lease_id": _num,
        "state": st.sampled_from(["LEASE_STATE_PUBLISHED", 1, "weird"]),
        "pool": _word,
        "bytes": _num,
        "request_id": _word,
        "from_stage": _word,
        "to_stage": _word,
        "age_seconds": _age,
    }
)
_session = st.fixed_dictionaries(
    {
        "session_id": _word,
        "pid": st.integers(0, 2**32 - 1),
        "uid": st.integers(0, 2**32 - 1),
        "stages": st.lists(_word, max_size=4),
        "granted_bytes": _num,
        "leases": st.integers(0, 2**32 - 1),
        "age_seconds": _age,
    }
)
_peer = st.fixed_dictionaries(
    {
        "peer": _word,
        "up": st.booleans(),
        "notice_channel": st.booleans(),
        "credits_in_use": _num,
        "credits_capacity": _num,
    }
)
_state = st.fixed_dictionaries(
    {
        "node_id": _word,
        "daemon_epoch": _word,
        "state": _word,
        "version": _word,
        "uptime_seconds": _age,
        "pools": st.lists(_pool, max_size=3),
        "leases": st.lists(_lease, max_size=8),
        "sessions": st.lists(_session, max_size=3),
        "peers": st.lists(_peer, max_size=3),
        "transfers_by_transport": st.dictionaries(_word, _num, max_size=4),
        "reclaimed_by_reason": st.dictionaries(_word, _num, max_size=3),
    }
)


@settings(max_examples=150, deadline=None)
@given(d=_state, stage=st.one_of(st.none(), _word))
def test_every_view_fits_80_columns(d: dict[str, Any], stage: str | None) -> None:
    for text in (render_status(d), render_leases(d, stage, None), render_top(d, d, 1.0)):
        assert [line for line in text.splitlines() if len(line) > WIDTH] == []
