"""Payload packing: byte-exact round trips for every dtype and view, layout checks, rebuild."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayd_client._codec import encode
from relayd_client._codec_decode import decode
from relayd_client._copies import (
    allocate,
    copy_plan,
    pack_at,
    pack_bytes,
    pack_into,
    pack_plan,
    run_copies,
    unpack,
    unpack_bytes,
    unpack_from,
)
from relayd_client._flatten import flat_tensors, flatten, rebuild
from relayd_client._header_tree import RefSlot, TensorSlot
from relayd_client._packing import (
    TensorSpec,
    dtype_from_name,
    dtype_name,
    payload_nbytes,
    plan_layout,
    validate_layout,
)
from relayd_client.wire.errors import CorruptRefError, InvalidArgumentError, UnsafePayloadError

ALL_DTYPES = [
    name
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    )
    if hasattr(torch, name)
]  # fmt: skip
SHAPES = [(), (0, 3), (3, 0, 2), (7,), (2, 3, 4)]


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, in logical (row-major) order: compares NaNs and odd dtypes exactly."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included) - valid 0/1 for bool."""
    dt = dtype_from_name(name)
    numel = math.prod(shape)
    high = 2 if dt is torch.bool else 256
    data = torch.randint(0, high, (numel * dt.itemsize,), dtype=torch.uint8, generator=gen)
    return data.view(dt).reshape(shape)


def round_trip(tensors: list[torch.Tensor], *, copy: bool | str) -> list[torch.Tensor]:
    """Through a region (``copy`` True or False) or as inline bytes (``copy="inline"``)."""
    specs, total = plan_layout(tensors)
    region = torch.full((total + 64,), 0xAB, dtype=torch.uint8)
    pack_into(region, tensors, specs)
    if copy == "inline":
        data = pack_bytes(tensors, specs, total)
        # Padding reads as zeros there and as the region's old bytes here; the
        # tensors' own bytes must agree.
        assert len(data) == total
        for spec in specs:
            end = spec.offset + spec.nbytes
            assert data[spec.offset : end] == region[spec.offset : end].numpy().tobytes()
        validate_layout(specs, len(data))
        return unpack_bytes(data, specs)
    return unpack(region, specs, copy=bool(copy))


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(raw(got), raw(want))


# ---------------------------------------------------------------- dtypes


def test_whitelist_names_round_trip() -> None:
    for name in ALL_DTYPES:
        dt = dtype_from_name(name)
        assert dtype_name(dt) == name
        assert str(dt) == f"torch.{name}"
    assert dtype_name(torch.half) == "float16"  # aliases map to the canonical name


@pytest.mark.parametrize("name", ["", "float", "torch.float32", "qint8", "uint4", "__class__", 3])
def test_unknown_dtype_names_are_corrupt(name: str) -> None:
    with pytest.raises(CorruptRefError, match="unknown dtype"):
        dtype_from_name(name)


@pytest.mark.parametrize(
    "dt", [getattr(torch, n) for n in ("qint8", "quint8", "uint4", "int2") if hasattr(torch, n)]
)
def test_dtypes_without_plain_bytes_cannot_be_sent(dt: torch.dtype) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be relayed"):
        dtype_name(dt)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("copy", [True, False, "inline"])
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_and_shape_round_trips_byte_exact(name: str, copy: bool | str) -> None:
    gen = torch.Generator().manual_seed(ALL_DTYPES.index(name))
    tensors = [random_tensor(name, shape, gen) for shape in SHAPES]
    out = round_trip(tensors, copy=copy)
    for got, want in zip(out, tensors, strict=True):
        assert_same_tensor(got, want)


@pytest.mark.parametrize(
    "name", ["float64", "float32", "float16", "bfloat16", "complex64", "int32", "int8", "bool"]
)
def test_values_compare_equal_not_just_bytes(name: str) -> None:
    dt = dtype_from_name(name)
    t = torch.arange(24).reshape(2, 3, 4).to(dt)
    (out,) = round_trip([t], copy=True)
    assert torch.equal(out, t)


def _views() -> dict[str, torch.Tensor]:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    c = torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    return {
        "transpose": base.transpose(0, 2),
        "step slice": base[:, ::2, 1::3],
        "expand": torch.arange(3, dtype=torch.int64).reshape(3, 1).expand(3, 1000),
        "expand 0-d": torch.tensor(7.0).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "storage offset": base.reshape(-1)[7:19],
        "bf16 transpose": base.to(torch.bfloat16).permute(2, 0, 1),
        "bool slice": (base > 20)[::2],
        "conj": c.conj(),
        "neg (imag of conj)": c.conj().imag,
        "conj transpose": c.conj().t(),
        "0-d": torch.tensor(3.5),
    }


def test_the_lazy_views_really_are_lazy() -> None:
    views = _views()
    assert views["conj"].is_conj() and views["conj transpose"].is_conj()
    assert views["neg (imag of conj)"].is_neg()
    assert 0 in views["expand"].stride()
    assert not views["transpose"].is_contiguous() and not views["step slice"].is_contiguous()


@pytest.mark.parametrize("copy", [True, False, "inline"])
@pytest.mark.parametrize("label", list(_views()))
def test_non_contiguous_and_lazy_views_are_materialized(label: str, copy: bool | str) -> None:
    view = _views()[label]
    specs, _ = plan_layout([view])
    # A stride-0 or strided source still costs its full logical size.
    assert specs[0].nbytes == view.numel() * view.element_size()
    (out,) = round_trip([view], copy=copy)
    assert out.is_contiguous()
    assert not out.is_conj() and not out.is_neg()
    assert torch.equal(out, view.resolve_conj().resolve_neg())


def test_requires_grad_source_is_copied_as_data_and_dst_joins_no_graph() -> None:
    src = torch.randn(4, 4, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(3))
    tensors = [src * 2, param]  # a non-leaf with a grad_fn and a leaf Parameter
    specs, total = plan_layout(tensors)
    region = torch.zeros(total, dtype=torch.uint8)
    pack_into(region, tensors, specs)
    assert not region.requires_grad and region.grad_fn is None
    out = unpack(region, specs, copy=True)
    assert not any(t.requires_grad for t in out)
    assert torch.equal(out[0], (src * 2).detach()) and torch.equal(out[1], param.detach())


def test_copy_false_returns_views_and_copy_true_fresh_tensors() -> None:
    t = torch.arange(16, dtype=torch.int32)
    specs, total = plan_layout([t])
    region = torch.zeros(total, dtype=torch.uint8)
    pack_into(region, [t], specs)
    (view,) = unpack(region, specs, copy=False)
    (fresh,) = unpack(region, specs, copy=True)
    region.zero_()
    assert torch.equal(view, torch.zeros(16, dtype=torch.int32))
    assert torch.equal(fresh, t)


def test_copy_plans_fill_the_allocated_outputs_by_address_only() -> None:
    # get() allocates on the loop's thread and copies on a worker, which gets
    # addresses only: the copies must land in the tensors allocated, in index
    # order, and a plan must hold no tensor (the worker would keep it alive).
    tensors = [torch.arange(10, dtype=torch.float64), torch.ones(3, 4, dtype=torch.bfloat16)]
    specs, total = plan_layout(tensors)
    specs = list(reversed(specs))  # the table's order need not be index order
    region = torch.zeros(total, dtype=torch.uint8)
    pack_into(region, tensors, specs)
    out = allocate(specs)
    assert [(o.shape, o.dtype) for o in out] == [(t.shape, t.dtype) for t in tensors]
    plan = copy_plan(region.data_ptr(), specs, out)
    assert all(type(v) is int for copy in plan for v in copy)
    run_copies(plan)
    assert all(torch.equal(o, t) for o, t in zip(out, tensors, strict=True))


def test_pack_plan_lists_pack_at_copies_or_declines_what_torch_must_copy() -> None:
    tensors = [torch.arange(100, dtype=torch.int64), torch.zeros(0), torch.ones(7)]
    specs, total = plan_layout(tensors)
    segment = torch.full((64 + total + 64,), 0xCD, dtype=torch.uint8)
    expected = segment.clone()
    pack_at(expected, 64, total, tensors, specs)
    plan = pack_plan(segment, 64, total, tensors, specs)
    assert plan is not None and len(plan) == 2  # the empty tensor copies nothing
    assert all(type(v) is int for copy in plan for v in copy)
    run_copies(plan)
    assert torch.equal(segment, expected)
    strided = torch.ones(14)[::2]  # same dtype and shape, but not one run of memory
    assert pack_plan(segment, 64, total, [tensors[0], tensors[1], strided], specs) is None
    with pytest.raises(InvalidArgumentError, match="layout entry says"):
        pack_plan(segment, 64, total, [tensors[0], tensors[1], torch.ones(8)], specs)
    with pytest.raises(InvalidArgumentError, match="outside the segment"):
        pack_plan(segment, segment.numel() - total + 1, total, tensors, specs)


def test_pack_at_and_unpack_from_match_the_sliced_region_paths() -> None:
    # The put and get hot paths copy by address into a whole segment; plain
    # and non-plain sources (the latter through a lazily built slice) alike.
    views = _views()
    tensors = [torch.arange(100, dtype=torch.int64), views["transpose"], views["conj"]]
    specs, total = plan_layout(tensors)
    start = 4096
    segment = torch.full((start + total + 4096,), 0xCD, dtype=torch.uint8)
    expected = segment.clone()
    pack_into(expected[start : start + total], tensors, specs)
    pack_at(segment, start, total, tensors, specs)
    assert torch.equal(segment, expected)  # nothing written outside the lease
    got = unpack_from(segment.data_ptr() + start, specs)
    for g, t in zip(got, tensors, strict=True):
        assert torch.equal(g, t.resolve_conj())
    with pytest.raises(InvalidArgumentError, match="outside the segment"):
        pack_at(segment, segment.numel() - total + 1, total, tensors, specs)


def test_copy_true_works_from_a_misaligned_region_and_views_refuse_it() -> None:
    t = torch.arange(4, dtype=torch.float64)
    specs, total = plan_layout([t])
    backing = torch.zeros(total + 3, dtype=torch.uint8)
    region = backing[3:]  # storage offset 3: no float64 view can start here
    with pytest.raises(InvalidArgumentError, match="aligned"):
        pack_into(region, [t], specs)
    region[:total].copy_(t.view(torch.uint8))
    (out,) = unpack(region, specs, copy=True)
    assert torch.equal(out, t)
    with pytest.raises(InvalidArgumentError, match="aligned"):
        unpack(region, specs, copy=False)


def test_empty_tensors_take_no_bytes_and_come_back_fresh() -> None:
    tensors = [torch.empty(0, 3), torch.empty(3, 0, 2, dtype=torch.bfloat16)]
    specs, total = plan_layout(tensors)
    assert total == 0 and payload_nbytes(specs) == 0
    region = torch.empty(0, dtype=torch.uint8)
    pack_into(region, tensors, specs)
    out = unpack(region, specs, copy=False)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert [o.dtype for o in out] == [t.dtype for t in tensors]


# ---------------------------------------------------------------- flatten / rebuild


def test_flatten_replaces_tensors_in_depth_first_order() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    payload = {"x": [a, {"y": (b, 1)}], "z": c, "meta": {"k": "v"}}
    tree, tensors = flatten(payload)
    assert len(tensors) == 3 and all(x is y for x, y in zip(tensors, [a, b, c], strict=True))
    assert tree == {
        "x": [TensorSlot(0), {"y": (TensorSlot(1), 1)}],
        "z": TensorSlot(2),
        "meta": {"k": "v"},
    }
    assert tree["meta"] is payload["meta"]  # type: ignore[index]  # untouched subtrees are shared
    assert payload["z"] is c  # the input is not modified


_T, _U = torch.zeros(2), torch.ones(3)


@pytest.mark.parametrize(
    "payload",
    [{"t": _T}, {"a": _T, "b": _U}, {"b": _U, "a": _T}, {}, {"": _T[1:]}],
    ids=["one", "two", "two-reversed", "empty", "view"],
)
def test_a_dict_of_tensors_is_named_by_its_keys_as_the_walk_names_it(payload: object) -> None:
    flat = flat_tensors(payload)
    assert flat is not None
    keys, tensors = flat
    tree, walked = flatten(payload)
    assert keys == tuple(payload)  # type: ignore[arg-type]
    assert [id(t) for t in tensors] == [id(t) for t in walked]
    assert encode({k: TensorSlot(i) for i, k in enumerate(keys)}) == encode(tree)


@pytest.mark.parametrize(
    "payload",
    [
        _T,
        [_T],
        {1: _T},  # 1 == 1.0 == True as keys, with three different headers
        {True: _T},
        {"a": _T, "b": _T},  # one tensor under two keys: one slot
        {"a": torch.nn.Parameter(torch.zeros(1))},
        {"a": _T, "meta": 1},
        {"a": {"b": _T}},
    ],
    ids=["tensor", "list", "int-key", "bool-key", "shared", "subclass", "mixed", "nested"],
)
def test_anything_but_a_dict_of_distinct_plain_tensors_takes_the_walk(payload: object) -> None:
    assert flat_tensors(payload) is None


def test_flatten_without_tensors_returns_the_input_itself() -> None:
    payload = {"a": [1, (2, "x")], "b": None}
    tree, tensors = flatten(payload)
    assert tree is payload and tensors == []
    t = torch.zeros(2)
    tree, tensors = flatten(t)
    assert tree == TensorSlot(0) and tensors[0] is t


def test_the_same_tensor_twice_is_sent_once_and_comes_back_shared() -> None:
    t = torch.arange(5.0)
    tree, tensors = flatten({"a": t, "b": [t], "c": t[1:]})
    assert len(tensors) == 2  # t once; its view t[1:] is another tensor
    assert tree == {"a": TensorSlot(0), "b": [TensorSlot(0)], "c": TensorSlot(1)}
    out = rebuild(decode(encode(tree)), round_trip(tensors, copy=True))
    assert isinstance(out, dict)
    assert out["a"] is out["b"][0]
    assert torch.equal(out["a"], t) and torch.equal(out["c"], t[1:])


@pytest.mark.parametrize(
    "payload",
    [{torch.zeros(1): 1}, {("k", torch.zeros(1)): 1}, [{"ok": {(1, (2, torch.ones(1))): 0}}]],
)
def test_tensor_dict_keys_are_refused(payload: object) -> None:
    with pytest.raises(UnsafePayloadError, match="dict key"):
        flatten(payload)


def test_tensor_key_error_names_the_dict() -> None:
    with pytest.raises(UnsafePayloadError, match=r"dict key in payload\[0\]\['ok'\]"):
        flatten([{"ok": {(1, torch.ones(1)): 0}}])


def test_self_containing_payload_is_refused() -> None:
    loop: list[object] = [torch.zeros(1)]
    loop.append(loop)
    with pytest.raises(UnsafePayloadError, match="contains itself"):
        flatten(loop)


def test_tensors_inside_other_containers_are_left_for_the_codec_to_refuse() -> None:
    payload = {"s": {1, 2}}
    tree, tensors = flatten(payload)
    assert tree is payload and tensors == []
    with pytest.raises(UnsafePayloadError, match="set"):
        encode(tree)


def test_full_payload_round_trip_through_header_and_region() -> None:
    gen = torch.Generator().manual_seed(1)
    payload = {
        "hidden": torch.randn(4, 8, generator=gen).to(torch.bfloat16),
        "codes": [torch.randint(0, 1024, (16,), generator=gen), (torch.tensor(True), "eos")],
        "ref": RefSlot(0),
        "step": 3,
    }
    tree, tensors = flatten(payload)
    header = encode(tree)
    out = rebuild(decode(header), round_trip(tensors, copy=True))
    assert isinstance(out, dict)
    assert set(out) == set(payload) and out["ref"] == RefSlot(0) and out["step"] == 3
    assert torch.equal(out["hidden"], payload["hidden"])
    assert torch.equal(out["codes"][0], payload["codes"][0])  # type: ignore[index]
    assert type(out["codes"][1]) is tuple and torch.equal(out["codes"][1][0], torch.tensor(True))


def test_rebuild_refuses_slots_outside_the_layout() -> None:
    with pytest.raises(CorruptRefError, match="refers to tensor 2, but the layout has 2"):
        rebuild({"a": [TensorSlot(2)]}, [torch.zeros(1), torch.zeros(1)])


def test_rebuild_leaves_ref_slots_and_keys_alone() -> None:
    tree = {"r": RefSlot(5), TensorSlot(0): "key"}
    assert rebuild(tree, []) is tree


# ---------------------------------------------------------------- layout


def test_plan_layout_aligns_each_tensor() -> None:
    tensors = [
        torch.zeros(3, dtype=torch.int8),
        torch.zeros(5),
        torch.zeros(2, dtype=torch.complex128),
    ]
    specs, total = plan_layout(tensors)
    assert [s.offset for s in specs] == [0, 64, 128]
    assert [s.nbytes for s in specs] == [3, 20, 32]
    assert total == 160
    assert [s.dtype for s in specs] == ["int8", "float32", "complex128"]
    assert [s.device for s in specs] == ["cpu"] * 3
    assert payload_nbytes(specs) == 55
    # alignment=1 still honours each element's own size.
    specs, total = plan_layout(tensors, alignment=1)
    assert [s.offset for s in specs] == [0, 4, 32] and total == 64


def test_plan_layout_from_a_base_offset() -> None:
    specs, total = plan_layout([torch.zeros(2), torch.zeros(0)], base=10)
    assert specs[0].offset == 64 and specs[1].offset == 10
    assert total == 64 + 8 - 10  # bytes from base to the end of the last tensor
    validate_layout(specs, 10 + total)


def test_plan_layout_with_no_bytes_is_empty() -> None:
    assert plan_layout([]) == ([], 0)
    specs, total = plan_layout([torch.zeros(0), torch.zeros(2, 0)])
    assert total == 0 and [s.nbytes for s in specs] == [0, 0]


@pytest.mark.parametrize("alignment", [0, 3, 48, -64])
def test_plan_layout_refuses_bad_alignment(alignment: int) -> None:
    with pytest.raises(InvalidArgumentError, match="power of two"):
        plan_layout([torch.zeros(1)], alignment=alignment)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(2, 2).to_sparse(),
        torch.zeros(3, device="meta"),
        torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
    ],
    ids=["sparse", "meta", "nested"],
)
def test_plan_layout_refuses_tensors_without_plain_bytes(tensor: torch.Tensor) -> None:
    with pytest.raises(InvalidArgumentError):
        plan_layout([tensor])


def test_pack_into_checks_its_arguments() -> None:
    t = torch.zeros(4)
    specs, total = plan_layout([t])
    with pytest.raises(InvalidArgumentError, match="1-D contiguous uint8"):
        pack_into(torch.zeros(total, dtype=torch.float32), [t], specs)
    with pytest.raises(InvalidArgumentError, match="1-D contiguous uint8"):
        pack_into(torch.zeros(2, total, dtype=torch.uint8), [t], specs)
    with pytest.raises(InvalidArgumentError, match="past the destination"):
        pack_into(torch.zeros(total - 1, dtype=torch.uint8), [t], specs)
    with pytest.raises(InvalidArgumentError, match="layout entry says"):
        pack_into(torch.zeros(total, dtype=torch.uint8), [torch.zeros(5)], specs)
    with pytest.raises(InvalidArgumentError, match="1 tensors but 0"):
        pack_into(torch.zeros(total, dtype=torch.uint8), [t], [])


GOOD = TensorSpec(index=0, shape=(2, 3), dtype="float32", offset=64, nbytes=24, device="cpu")


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([dataclasses.replace(GOOD, index=1)], "index 1 is out of range"),
        ([dataclasses.replace(GOOD, index=-1)], "out of range"),
        ([GOOD, dataclasses.replace(GOOD, offset=128)], "repeated"),
        ([dataclasses.replace(GOOD, index=True)], "out of range"),
        ([dataclasses.replace(GOOD, dtype="qint8")], "unknown dtype 'qint8'"),
        ([dataclasses.replace(GOOD, dtype="Tensor")], "unknown dtype"),
        ([dataclasses.replace(GOOD, shape=(2, -3), nbytes=-24)], "invalid shape"),
        ([dataclasses.replace(GOOD, shape=[2, 3])], "invalid shape"),
        ([dataclasses.replace(GOOD, shape=(2.0, 3))], "invalid shape"),
        ([dataclasses.replace(GOOD, shape=(1,) * 65, nbytes=4)], "invalid shape"),
        ([dataclasses.replace(GOOD, shape=(0, 2**62, 2**62), nbytes=0)], "too large"),
        ([dataclasses.replace(GOOD, shape=(2**40, 2**40), nbytes=2**82)], "too large"),
        ([dataclasses.replace(GOOD, nbytes=25)], "does not match shape"),
        ([dataclasses.replace(GOOD, nbytes=23)], "does not match shape"),
        ([dataclasses.replace(GOOD, offset=-64)], "outside the region"),
        ([dataclasses.replace(GOOD, offset=1.0)], "outside the region"),
        ([dataclasses.replace(GOOD, offset=100)], "outside the region"),
        ([dataclasses.replace(GOOD, offset=2**64)], "outside the region"),
        ([dataclasses.replace(GOOD, offset=66)], "not a multiple of 4"),
        ([dataclasses.replace(GOOD, dtype="int64", shape=(3,), offset=68)], "not a multiple of 8"),
        (
            [GOOD, dataclasses.replace(GOOD, index=1, offset=72)],
            "entries 0 and 1 overlap at byte 72",
        ),
        (
            [dataclasses.replace(GOOD, offset=0), dataclasses.replace(GOOD, index=1, offset=20)],
            "overlap",
        ),
    ],
)
def test_validate_layout_refuses_each_inconsistency(specs: list[TensorSpec], match: str) -> None:
    with pytest.raises(CorruptRefError, match=match):
        validate_layout(specs, 100)


def test_validate_layout_accepts_a_consistent_layout() -> None:
    validate_layout([GOOD], 88)
    validate_layout([GOOD, dataclasses.replace(GOOD, index=1, offset=88)], 112)
    # Empty tensors may sit anywhere inside (or at the end of) the region.
    empty = dataclasses.replace(GOOD, index=1, shape=(0, 3), nbytes=0, offset=88)
    validate_layout([GOOD, empty], 88)
    validate_layout([], 0)


def test_validate_layout_applies_the_alignment_argument() -> None:
    spec = dataclasses.replace(GOOD, offset=32)
    validate_layout([spec], 64)
    with pytest.raises(CorruptRefError, match="not a multiple of 64"):
        validate_layout([spec], 64, alignment=64)


def test_unpack_validates_before_touching_bytes() -> None:
    region = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(CorruptRefError, match="outside the region"):
        unpack(region, [GOOD], copy=True)


# ---------------------------------------------------------------- property

tensor_lists = st.lists(
    st.tuples(
        st.sampled_from(ALL_DTYPES),
        st.lists(st.integers(0, 5), max_size=3).map(tuple),
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensor_lists, st.sampled_from([1, 2, 8, 64, 256]), st.integers(0, 100), st.integers(0, 2**16)
)
def test_plan_layout_gives_aligned_disjoint_specs_within_total(
    described: list[tuple[str, tuple[int, ...]]], alignment: int, base: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = [random_tensor(name, shape, gen) for name, shape in described]
    specs, total = plan_layout(tensors, alignment=alignment, base=base)
    assert [s.index for s in specs] == list(range(len(tensors)))
    used = sorted((s.offset, s.offset + s.nbytes) for s in specs if s.nbytes)
    for (_, end), (start, _) in itertools.pairwise(used):
        assert start >= end
    for spec, t in zip(specs, tensors, strict=True):
        assert spec.nbytes == t.numel() * t.element_size()
        assert base <= spec.offset and spec.offset + spec.nbytes <= base + total
        if spec.nbytes:
            assert spec.offset % max(alignment, t.element_size()) == 0
    assert total == (used[-1][1] - base if used else 0)
    validate_layout(specs, base + total, alignment=alignment)
    region = torch.zeros(-(-(base + total) // 64) * 64, dtype=torch.uint8)
    pack_into(region, tensors, specs)
    for got, want in zip(unpack(region, specs, copy=False), tensors, strict=True):
        assert_same_tensor(got, want)
