"""Process-local objects, stream buffers and forwarded-ref encoding, without a daemon."""

from __future__ import annotations

import pytest
import torch
from relayd_client import CorruptRefError, DataRef, TensorRef, _local
from relayd_client._codec import encode
from relayd_client._codec_decode import decode
from relayd_client._flatten import flatten
from relayd_client._header_tree import RefSlot, TensorSlot
from relayd_client._refs import substitute
from relayd_client.wire.dataref import VERSION
from relayd_client.wire.proto import relay_pb2 as pb


class _Client:
    pass


def test_local_object_is_the_same_object_and_read_once() -> None:
    c = _Client()
    _local.serve(("b",), c)
    try:
        assert _local.serves("b") and not _local.serves("nobody")
        obj = {"x": torch.ones(3), "meta": [1, 2]}
        _local.put(obj, "b", "r", "o1")
        assert _local.take("o1") is obj
        with pytest.raises(KeyError):
            _local.take("o1")
    finally:
        _local.unserve(("b",), c)
    assert not _local.serves("b")


def test_fan_out_gives_each_target_its_own_containers() -> None:
    obj = {"x": torch.ones(3), "meta": [1, (2, 3)]}
    _local.put(obj, "b", "r", "o1")
    _local.put(obj, "c", "r", "o2")
    first, second = _local.take("o1"), _local.take("o2")
    assert first is obj
    assert second == {"x": obj["x"], "meta": [1, (2, 3)]}
    assert second is not obj and second["meta"] is not obj["meta"]
    assert second["x"] is obj["x"]  # leaves are shared, read-only
    # once both were taken, a new put of the object hands it over as is
    _local.put(obj, "b", "r", "o3")
    assert _local.take("o3") is obj


def test_abort_and_closing_the_reader_drop_unread_objects() -> None:
    c = _Client()
    _local.serve(("b",), c)
    _local.put({"a": 1}, "b", "r1", "o1")
    _local.put({"a": 2}, "b", "r2", "o2")
    assert _local.abort("r1") == 1
    with pytest.raises(KeyError):
        _local.take("o1")
    _local.unserve(("b",), c)
    with pytest.raises(KeyError):
        _local.take("o2")


def _tensor_ref(to_stage: str = "C") -> TensorRef:
    m = pb.DataRef(
        version=VERSION,
        object_id="t",
        request_id="r",
        chunk_id=-1,
        to_stage=to_stage,
        transport=pb.TRANSPORT_SHM,
        header_codec=pb.HEADER_CODEC_SAFE,
        header=encode(TensorSlot(0)),
        lease=pb.LeaseRef(pool="shm", nslots=256, length=16 << 20, generation=7, lease_id=7),
    )
    m.tensors.add(index=0, shape=[16 << 20], dtype="uint8", nbytes=16 << 20, device="cpu")
    return TensorRef(m)


def test_tensor_refs_become_ref_slots_and_come_back() -> None:
    t = _tensor_ref()
    refs: list[object] = []
    tree, tensors = flatten({"big": t, "again": [t], "h": torch.zeros(2)}, refs)
    assert refs == [t] and len(tensors) == 1
    assert tree == {"big": RefSlot(0), "again": [RefSlot(0)], "h": TensorSlot(0)}
    assert decode(encode(tree)) == tree
    back = substitute(tree, [t])
    assert back["big"] is t and back["again"][0] is t  # type: ignore[index]
    with pytest.raises(CorruptRefError):
        substitute({"x": RefSlot(3)}, [t])
    assert t.nbytes == 16 << 20 and t.consumer_stage == "C" and t.shape == (16 << 20,)


def test_dataref_with_forwarded_refs_round_trips_and_malformed_ones_are_refused() -> None:
    m = pb.DataRef(
        version=VERSION, object_id="o", request_id="r", chunk_id=-1, to_stage="B",
        transport=pb.TRANSPORT_INLINE, header_codec=pb.HEADER_CODEC_SAFE,
        header=encode({"big": RefSlot(0)}),
    )  # fmt: skip
    m.refs.append(_tensor_ref().proto)
    back = DataRef.from_bytes(DataRef(m).to_bytes())
    assert back.proto.refs[0].to_stage == "C"
    bad = pb.DataRef()
    bad.CopyFrom(m)
    bad.refs[0].tensors.add(index=1, shape=[1], dtype="uint8", nbytes=1, device="cpu")
    with pytest.raises(CorruptRefError):
        DataRef.from_bytes(DataRef(bad).to_bytes())
    nested = pb.DataRef()
    nested.CopyFrom(m)
    nested.refs[0].refs.append(_tensor_ref().proto)
    with pytest.raises(CorruptRefError):
        DataRef.from_bytes(DataRef(nested).to_bytes())


def test_an_abort_tells_the_other_clients_of_this_process_not_the_aborting_one() -> None:
    heard: dict[str, list[str]] = {"a": [], "b": []}

    class _Listening:
        def __init__(self, name: str) -> None:
            self.name = name

        def on_abort(self, request_id: str) -> None:
            heard[self.name].append(request_id)

    a, b = _Listening("a"), _Listening("b")
    _local.serve(("sa",), a, a.on_abort)
    _local.serve(("sb",), b, b.on_abort)
    try:
        _local.put({"x": 1}, "sb", "r1", "o1")
        assert _local.abort("r1", by=a) == 1
        assert heard == {"a": [], "b": ["r1"]}
        with pytest.raises(KeyError):
            _local.take("o1")
    finally:
        _local.unserve(("sa",), a)
        _local.unserve(("sb",), b)
    _local.abort("r2", by=a)
    assert heard == {"a": [], "b": ["r1"]}  # a closed client hears nothing
