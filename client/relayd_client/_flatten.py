"""A payload to (header tree, tensors) and back.

``flatten`` replaces every tensor of a nested payload by a ``TensorSlot`` and
every forwarded ``TensorRef`` by a ``RefSlot``; what is left is the header tree
the codec encodes. ``rebuild`` puts the reader's tensors back.

Only exact ``dict``, ``list`` and ``tuple`` containers are searched for
tensors, the same containers the safe header codec accepts; a tensor inside
anything else (a namedtuple, a dataclass) stays where it is, and the safe
codec then refuses that container.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relayd_client._codec import MAX_DEPTH
from relayd_client._header_tree import LEAVES as _LEAVES
from relayd_client._header_tree import RefSlot, TensorSlot, fill
from relayd_client._refs import TensorRef
from relayd_client.wire.errors import UnsafePayloadError

__all__ = ["flat_tensors", "flatten", "rebuild"]


def flatten(obj: object, refs: list[Any] | None = None) -> tuple[object, list[torch.Tensor]]:
    """Replace every tensor in ``obj`` by a :class:`TensorSlot`, in depth-first order.

    With a ``refs`` list, every forwarded :class:`~relayd_client._refs.TensorRef`
    is replaced by a :class:`RefSlot` and appended to ``refs`` (deduplicated by
    identity, like tensors); without one a TensorRef stays in the tree and the
    header codec refuses it.

    The same tensor object reached twice gets one slot (deduplicated by
    identity), so it is sent once and the reader gets one tensor back in
    both places, as the writer had. Distinct tensors that share storage
    (views of each other) are separate slots.

    Containers without tensors are returned as they are, not copied. A
    tensor used as (or inside) a dict key raises :class:`UnsafePayloadError`.
    """
    tensors: list[torch.Tensor] = []
    slots: dict[int, TensorSlot | RefSlot] = {}
    return _flatten(obj, tensors, slots, None, 0, refs), tensors


def flat_tensors(obj: object) -> tuple[tuple[str, ...], list[torch.Tensor]] | None:
    """``obj``'s keys and tensors when it is the common payload, a ``dict`` of
    ``str`` keys to distinct plain tensors; None: anything else (walk it with
    :func:`flatten`).

    Such a payload's header tree is ``{key: TensorSlot(i)}`` in key order, so
    its keys alone name its header. Keys must be ``str`` exactly: ``1``,
    ``1.0`` and ``True`` are equal keys with different headers. A tensor
    subclass, or one tensor under two keys (one slot, see :func:`flatten`),
    takes the walk.
    """
    if type(obj) is not dict:
        return None
    tensors: list[Any] = list(obj.values())
    for t in tensors:
        if type(t) is not torch.Tensor:
            return None
    keys: tuple[Any, ...] = tuple(obj)
    for k in keys:
        if type(k) is not str:
            return None
    if len(tensors) > 1 and len({id(t) for t in tensors}) != len(tensors):
        return None
    return keys, tensors


# A path is a chain of (parent, key) pairs, built as the walk descends and
# only turned into text for an error message.
_Path = tuple[object, object] | None


def _path_text(path: _Path) -> str:
    keys: list[object] = []
    while path is not None:
        parent, key = path
        keys.append(key)
        path = parent  # type: ignore[assignment]
    return "payload" + "".join(f"[{key!r}]" for key in reversed(keys))


def _flatten(
    obj: object,
    tensors: list[torch.Tensor],
    slots: dict[int, TensorSlot | RefSlot],
    path: _Path,
    depth: int,
    refs: list[Any] | None,
) -> object:
    t = type(obj)
    if t in _LEAVES:
        return obj
    if t is dict:
        if depth >= MAX_DEPTH:
            raise _too_deep(path)
        d: dict[object, object] = obj  # type: ignore[assignment]
        out: dict[object, object] = {}
        changed = False
        for key, value in d.items():
            if type(key) is not str and _has_tensor(key):
                raise UnsafePayloadError(
                    f"a tensor is used as a dict key in {_path_text(path)}; "
                    "tensors can only be values"
                )
            if type(value) in _LEAVES:  # skip the call for the common plain values
                out[key] = value
                continue
            new = _flatten(value, tensors, slots, (path, key), depth + 1, refs)
            changed = changed or new is not value
            out[key] = new
        return out if changed else obj
    if t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise _too_deep(path)
        seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
        items = [
            _flatten(value, tensors, slots, (path, i), depth + 1, refs)
            for i, value in enumerate(seq)
        ]
        if all(new is old for new, old in zip(items, seq, strict=True)):
            return obj
        return items if t is list else tuple(items)
    if isinstance(obj, torch.Tensor):
        slot = slots.get(id(obj))
        if slot is None:
            # The payload keeps obj alive for the whole walk, so its id stays unique.
            slot = slots[id(obj)] = TensorSlot(len(tensors))
            tensors.append(obj)
        return slot
    if refs is not None and t is TensorRef:
        ref_slot = slots.get(id(obj))
        if ref_slot is None:
            ref_slot = slots[id(obj)] = RefSlot(len(refs))
            refs.append(obj)
        return ref_slot
    return obj


def _too_deep(path: _Path) -> UnsafePayloadError:
    return UnsafePayloadError(
        f"payload nests more than {MAX_DEPTH} containers at {_path_text(path)} (or contains itself)"
    )


def _has_tensor(key: object) -> bool:
    if isinstance(key, torch.Tensor):
        return True
    if type(key) is tuple:
        return any(_has_tensor(k) for k in key)
    return False


def rebuild(tree: object, tensors: Sequence[torch.Tensor]) -> object:
    """Put ``tensors[i]`` back where :class:`TensorSlot` ``i`` is; the inverse of :func:`flatten`.

    :class:`RefSlot` placeholders are left as they are (refs are resolved by
    another layer). An index outside ``tensors`` raises :class:`CorruptRefError`.
    """
    return fill(tree, TensorSlot, tensors, "tensor", "the layout")
