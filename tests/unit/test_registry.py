"""The stage registry: versions, restarts, replicas, peers, edges and the status view."""

from __future__ import annotations

import json

import pytest
from relayd_client.wire.transport import Transport

from relayd.routing.registry import StageRegistry
from relayd.routing.router import PayloadFacts, Placement, Route, route

GPU_A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
GPU_X = "GPU-eeeeeeee-0000-4000-8000-000000000000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def place(
    pid: int, *stages: str, node: str = "n1", gpus: tuple[str, ...] = (), start: int = 1
) -> Placement:
    return Placement(node, f"ns:{pid}:{start}", "ipc", True, gpus, stages)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(clock: Clock) -> StageRegistry:
    return StageRegistry("n1", clock=clock)


def test_empty(reg: StageRegistry) -> None:
    assert reg.version == 0
    assert reg.lookup("talker") is None
    assert reg.lookup_all("talker") == ()


def test_register_and_unregister_bump_version(reg: StageRegistry) -> None:
    p = place(1, "thinker", "encoder")
    reg.register("s1", p)
    assert reg.version == 1
    assert reg.lookup("thinker") is p and reg.lookup("encoder") is p
    assert reg.unregister("s1") is True
    assert reg.version == 2
    assert reg.lookup("thinker") is None


def test_unregister_unknown_changes_nothing(reg: StageRegistry) -> None:
    reg.register("s1", place(1, "thinker"))
    assert reg.unregister("nope") is False
    assert reg.version == 1


def test_reregister_replaces_the_session(reg: StageRegistry) -> None:
    reg.register("s1", place(1, "thinker", "encoder"))
    reg.register("s1", place(1, "thinker"))
    assert reg.version == 2
    assert reg.lookup("encoder") is None
    assert len(reg.lookup_all("thinker")) == 1


def test_restart_on_another_gpu_returns_new_placement(reg: StageRegistry) -> None:
    writer = place(1, "thinker", gpus=(GPU_A,))
    old = place(2, "talker", gpus=(GPU_A,), start=1)
    new = place(2, "talker", gpus=(GPU_B,), start=2)  # same pid reused, new start time
    reg.register("w", writer)
    reg.register("talker-1", old)
    facts = PayloadFacts(1 << 20, inline_meta_bytes=1024, cuda_uuids=(GPU_A,), direct_allowed=True)
    before = reg.version
    assert route(writer, reg.lookup("talker"), facts).transport is Transport.CUDA_IPC_DIRECT

    reg.unregister("talker-1")
    reg.register("talker-2", new)
    assert reg.version == before + 2  # a cached route for thinker -> talker is now stale
    assert reg.lookup("talker") == new
    assert route(writer, reg.lookup("talker"), facts).transport is Transport.SHM


def test_restart_seen_before_old_session_is_reaped(reg: StageRegistry) -> None:
    old = place(2, "talker", gpus=(GPU_A,), start=1)
    new = place(3, "talker", gpus=(GPU_B,), start=2)
    reg.register("talker-1", old)
    reg.register("talker-2", new)  # old socket's EOF not seen yet
    assert reg.lookup("talker") == new
    reg.unregister("talker-1")
    assert reg.lookup("talker") == new


def test_replicas_pick_newest_registration(reg: StageRegistry, clock: Clock) -> None:
    # Same clock reading for all three: order comes from registration, not time.
    a, b, c = place(1, "talker"), place(2, "talker"), place(3, "talker")
    for sid, p in (("sa", a), ("sb", b), ("sc", c)):
        reg.register(sid, p)
    assert reg.lookup("talker") is c
    assert reg.lookup_all("talker") == (c, b, a)
    reg.unregister("sc")
    assert reg.lookup("talker") is b


def test_register_refuses_another_node(reg: StageRegistry) -> None:
    with pytest.raises(ValueError, match="node"):
        reg.register("s1", place(1, "talker", node="n2"))
    assert reg.version == 0


def test_remote_stages(reg: StageRegistry) -> None:
    far = place(9, "vocoder", "talker", node="n2", gpus=(GPU_X,))
    assert reg.update_remote("n2", {"vocoder": far, "talker": far}) is True
    assert reg.version == 1
    assert reg.lookup("vocoder") is far

    # A periodic re-send of the same table must not invalidate route caches.
    assert reg.update_remote("n2", {"vocoder": far, "talker": far}) is False
    assert reg.version == 1

    assert reg.update_remote("n2", {"vocoder": far}) is True
    assert reg.version == 2
    assert reg.lookup("talker") is None

    assert reg.drop_remote("n2") is True
    assert reg.version == 3
    assert reg.lookup("vocoder") is None
    assert reg.drop_remote("n2") is False
    assert reg.version == 3


def test_local_beats_remote_and_smallest_peer_wins(reg: StageRegistry) -> None:
    on_n3 = place(9, "talker", node="n3")
    on_n2 = place(9, "talker", node="n2")
    reg.update_remote("n3", {"talker": on_n3})
    reg.update_remote("n2", {"talker": on_n2})
    assert reg.lookup("talker") is on_n2
    here = place(1, "talker")
    reg.register("s1", here)
    assert reg.lookup("talker") is here
    assert reg.lookup_all("talker") == (here, on_n2, on_n3)


def test_remote_update_is_checked(reg: StageRegistry) -> None:
    with pytest.raises(ValueError, match="own id"):
        reg.update_remote("n1", {})
    with pytest.raises(ValueError, match="reports stage"):
        reg.update_remote("n2", {"talker": place(9, "talker", node="n3")})
    assert reg.version == 0


def test_edges_keep_last_route_without_bumping(reg: StageRegistry, clock: Clock) -> None:
    reg.register("s1", place(1, "thinker"))
    reg.note_edge("thinker", "talker", Route(Transport.SHM, "reader unknown"))
    clock.now = 1005.0
    reg.note_edge("thinker", "talker", Route(Transport.CUDA_IPC_POOL, "different GPUs"))
    assert reg.version == 1
    rec = reg.edges()[("thinker", "talker")]
    assert rec.route.transport is Transport.CUDA_IPC_POOL
    assert (rec.count, rec.last_at) == (2, 1005.0)


def test_edges_end_with_their_writer_stage(reg: StageRegistry) -> None:
    reg.register("s1", place(1, "thinker"))
    reg.note_edge("thinker", "talker", Route(Transport.SHM, "x"))
    reg.register("s1", place(1, "thinker", "encoder"))  # re-register: still served
    assert ("thinker", "talker") in reg.edges()
    reg.register("s2", place(2, "thinker"))
    reg.unregister("s1")  # another process still serves thinker
    assert ("thinker", "talker") in reg.edges()
    reg.unregister("s2")
    assert reg.edges() == {}


def test_snapshot_shape(reg: StageRegistry, clock: Clock) -> None:
    reg.register("s1", place(1, "thinker", gpus=(GPU_A,)))
    clock.now = 1001.0
    reg.update_remote("n2", {"talker": place(9, "talker", node="n2")})
    reg.note_edge("thinker", "talker", Route(Transport.MOONCAKE, "reader on node n2"))

    snap = reg.snapshot()
    assert json.loads(json.dumps(snap)) == snap  # JSON-ready as is
    assert snap == {
        "node_id": "n1",
        "version": 2,
        "stages": {
            "thinker": [
                {
                    "session_id": "s1",
                    "attached_at": 1000.0,
                    "node_id": "n1",
                    "process_key": "ns:1:1",
                    "ipc_namespace": "ipc",
                    "can_map_shm": True,
                    "gpu_uuids": [GPU_A],
                    "stages": ["thinker"],
                }
            ]
        },
        "remote": {
            "n2": {
                "updated_at": 1001.0,
                "stages": {
                    "talker": {
                        "node_id": "n2",
                        "process_key": "ns:9:1",
                        "ipc_namespace": "ipc",
                        "can_map_shm": True,
                        "gpu_uuids": [],
                        "stages": ["talker"],
                    }
                },
            }
        },
        "edges": [
            {
                "from_stage": "thinker",
                "to_stage": "talker",
                "transport": "mooncake",
                "reason": "reader on node n2",
                "count": 1,
                "last_at": 1001.0,
            }
        ],
    }
