"""Framework payloads as relayd's codec takes them: tensors kept, records as dicts.

vllm-omni hands its connectors dicts of tensors, but also msgspec structs
(``OmniPayloadStruct``, vLLM's ``SamplingParams``), dataclasses, enums and
sets. Its own connectors msgpack them, which turns every record into a map of
its fields, every enum into its value and every set into a list. relayd's
safe codec takes only exact dicts, lists, tuples, tensors and plain values,
so :func:`plain` applies the same type erasure up front - without touching a
tensor's bytes. Anything else (numpy arrays, PIL images, ...) is left as it
is for the codec to refuse, or to pickle where the user opted in.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import torch

from .._codec import MAX_DEPTH
from ..wire.errors import UnsafePayloadError

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def plain(obj: Any, depth: int = 0) -> Any:
    """``obj`` with records, enums, sets and container subclasses made plain."""
    t = type(obj)
    if t in _SCALARS or isinstance(obj, torch.Tensor):
        return obj
    if depth >= MAX_DEPTH:
        raise UnsafePayloadError(f"payload nests deeper than {MAX_DEPTH} levels")
    d = depth + 1
    if isinstance(obj, Mapping):
        return {plain(k, d): plain(v, d) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v, d) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v, d) for v in obj)
    if isinstance(obj, enum.Enum):
        return plain(obj.value, d)
    if isinstance(obj, (set, frozenset)):
        return [plain(v, d) for v in obj]
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if hasattr(t, "__struct_fields__"):
        return {k: plain(v, d) for k, v in _struct_items(obj)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name), d) for f in dataclasses.fields(obj)}
    return obj


def _struct_items(obj: Any) -> list[tuple[str, Any]]:
    """A msgspec struct's fields as msgpack encodes them (defaults left out if so configured)."""
    import msgspec  # present: obj is one of its structs

    omit = bool(getattr(getattr(obj, "__struct_config__", None), "omit_defaults", False))
    items = []
    for f in msgspec.structs.fields(obj):
        value = getattr(obj, f.name)
        if omit and _is_default(value, f):
            continue
        items.append((f.encode_name, value))
    return items


def _is_default(value: Any, f: Any) -> bool:
    import msgspec

    if f.default is not msgspec.NODEFAULT:
        return value is f.default or (type(value) in _SCALARS and value == f.default)
    if f.default_factory is not msgspec.NODEFAULT:
        return type(value) in (list, dict, set) and not value
    return False
