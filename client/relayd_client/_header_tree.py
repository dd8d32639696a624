"""The header tree's placeholders, and the walks over a decoded tree.

A payload's header is its nesting of dicts, lists and tuples with a
:class:`TensorSlot` where a tensor was and a :class:`RefSlot` where a
forwarded reference was (``_flatten.flatten`` puts them there). The codec
(``_codec``, ``_codec_decode``) writes and reads these trees; this module owns
what is done with one on either side of it: filling the placeholders back in,
and measuring a tree a reader got from a DataRef before it touches any memory.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relayd_client.wire.errors import CorruptRefError

__all__ = ["LEAVES", "RefSlot", "TensorSlot", "fill", "refilled_fresh", "slot_bounds"]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Placeholder for tensor number ``index`` of the DataRef's layout table."""

    index: int


@dataclass(frozen=True, slots=True)
class RefSlot:
    """Placeholder for forwarded reference number ``index``."""

    index: int


# Types that are never tensors nor hold any: walks skip them before anything
# costlier (an isinstance against torch.Tensor costs ~0.15 us a value).
LEAVES: frozenset[type] = frozenset({str, int, float, bool, type(None), bytes, complex})


def fill(
    tree: object, slot: type[TensorSlot | RefSlot], values: Sequence[object], what: str, where: str
) -> object:
    """``tree`` with ``values[i]`` wherever a ``slot`` placeholder of index ``i`` is.

    Containers holding no such placeholder are returned as they are (a decoded
    header is fresh, so nothing is shared by mistake). An index outside
    ``values`` raises :class:`CorruptRefError`: "payload header refers to
    {what} {i}, but {where} has {len(values)}".
    """
    t = type(tree)
    if t in LEAVES:
        return tree
    if t is slot:
        index: int = tree.index  # type: ignore[attr-defined]
        if not 0 <= index < len(values):
            raise CorruptRefError(
                f"payload header refers to {what} {index}, but {where} has {len(values)}"
            )
        return values[index]
    if t is dict:
        d: dict[object, object] = tree  # type: ignore[assignment]
        out: dict[object, object] = {}
        changed = False
        for key, value in d.items():
            if type(value) in LEAVES:
                out[key] = value
                continue
            new = fill(value, slot, values, what, where)
            changed = changed or new is not value
            out[key] = new
        return out if changed else tree
    if t is list or t is tuple:
        seq: list[object] | tuple[object, ...] = tree  # type: ignore[assignment]
        items = [fill(value, slot, values, what, where) for value in seq]
        if all(new is old for new, old in zip(items, seq, strict=True)):
            return tree
        return items if t is list else tuple(items)
    return tree


def refilled_fresh(tree: object) -> bool:
    """Does :func:`fill` return new containers for every list and dict of ``tree``?

    True when each of them holds a placeholder somewhere below it (tuples
    and leaves cannot be changed, so they may be shared); False for any other
    type.
    """
    try:
        _holds_slot(tree)
    except _Shared:
        return False
    return True


class _Shared(Exception):
    pass


def _holds_slot(tree: object) -> bool:
    t = type(tree)
    if t is TensorSlot or t is RefSlot:
        return True
    if t is dict:
        found = False
        for value in tree.values():  # type: ignore[attr-defined]
            found = _holds_slot(value) or found
        if not found:
            raise _Shared
        return True
    if t is list:
        if not any([_holds_slot(v) for v in tree]):  # type: ignore[attr-defined]
            raise _Shared
        return True
    if t is tuple:
        return any([_holds_slot(v) for v in tree])  # type: ignore[attr-defined]
    if t in LEAVES:
        return False
    raise _Shared  # anything else might be changed by whoever gets it


def slot_bounds(tree: object) -> tuple[int, int]:
    """How many layout entries and forwarded refs ``tree`` needs: one past the
    highest :class:`TensorSlot` and :class:`RefSlot` index in it.

    The same walk as :func:`fill`, without building anything: a reader checks
    these against the DataRef before it claims a lease, so a forged header
    consumes nothing. A negative index raises :class:`CorruptRefError`.
    """
    t = type(tree)
    if t in LEAVES:
        return 0, 0
    if t is TensorSlot or t is RefSlot:
        index: int = tree.index  # type: ignore[attr-defined]
        if index < 0:
            raise CorruptRefError(f"payload header refers to slot {index}")
        return (index + 1, 0) if t is TensorSlot else (0, index + 1)
    if t is dict:
        values: Iterable[object] = tree.values()  # type: ignore[attr-defined]
    elif t is list or t is tuple:
        values = tree  # type: ignore[assignment]
    else:
        return 0, 0
    tensors = refs = 0
    for value in values:
        if type(value) not in LEAVES:
            nt, nr = slot_bounds(value)
            tensors, refs = max(tensors, nt), max(refs, nr)
    return tensors, refs
