"""local_object: two stages served in one OS process exchange Python references.

Every open :class:`~relayd_client.RelayClient` enters the stages it serves
here; a put addressed to one of them, when the router says ``local_object``
(same process), stores the object under a fresh object id instead of copying
it anywhere, and the reader's ``get`` takes that very object back. The daemon
never sees a lease (there is none); the transfer is counted through the
writer's batched ``TransferReport``.

Read-only contract: the reader receives the writer's own object - the same
dicts, lists and tensors, not copies. Neither side may mutate it after the
put. Fan-out (the same object put to several stages before the first reader
took it) gives every later target its own copy of the containers, so one
reader rebinding a key cannot change what another reader sees; the tensors
and other leaves stay shared and stay read-only.

An object that is never read is dropped when its request is aborted or when
the client serving its target stage closes. The daemon never hears of these
transfers, so it cannot tell this process's other clients about an abort:
:func:`abort` does, through the ``on_abort`` each client registered with
:func:`serve`.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Object ids carry this process's identity, so a local_object DataRef that
# leaks into another process (or a forked child) is refused, not misread.
_TOKEN = secrets.token_hex(6)


@dataclass(slots=True)
class _Entry:
    obj: Any
    request_id: str
    to_stage: str


_SERVED: dict[str, weakref.ReferenceType[Any]] = {}
# id(client) -> its on_abort, held weakly (a bound method would keep the client alive).
_ON_ABORT: dict[int, weakref.WeakMethod[Callable[[str], None]]] = {}
_OBJECTS: dict[str, _Entry] = {}
# id(obj) of objects waiting for a reader -> how many puts of them are unread.
_PENDING: dict[int, int] = {}
# Blocking clients' callers put and take on their own threads while another
# client's loop aborts or closes: a walk of _OBJECTS, and the read-modify-write
# of _PENDING, must not interleave with them. Held briefly, never across a call out.
_LOCK = threading.Lock()


def _new_lock() -> None:
    # A fork while another thread held it would leave the child's copy held for good.
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def process_tag() -> str:
    return f"{os.getpid()}-{_TOKEN}"


def serve(
    stages: tuple[str, ...], client: Any, on_abort: Callable[[str], None] | None = None
) -> None:
    """``client`` (an open RelayClient) serves ``stages`` in this process.

    ``on_abort(request_id)`` (a method of ``client``) is called when another
    client of this process aborts a request.
    """
    for stage in stages:
        _SERVED[stage] = weakref.ref(client)
    if on_abort is not None:
        _ON_ABORT[id(client)] = weakref.WeakMethod(on_abort)


def unserve(stages: tuple[str, ...], client: Any) -> None:
    _ON_ABORT.pop(id(client), None)
    for stage in stages:
        ref = _SERVED.get(stage)
        if ref is not None and ref() in (client, None):
            del _SERVED[stage]
    with _LOCK:
        for oid in [k for k, e in _OBJECTS.items() if e.to_stage in stages]:
            _drop(oid)


def serves(stage: str) -> bool:
    ref = _SERVED.get(stage)
    return ref is not None and ref() is not None


def put(obj: Any, to_stage: str, request_id: str, object_id: str) -> None:
    with _LOCK:
        if _PENDING.get(id(obj)):
            obj = _copy_containers(obj)
        _PENDING[id(obj)] = _PENDING.get(id(obj), 0) + 1
        _OBJECTS[object_id] = _Entry(obj, request_id, to_stage)


def take(object_id: str) -> Any:
    """The object put under ``object_id``; KeyError if it is not (or no longer) here."""
    with _LOCK:
        entry = _OBJECTS[object_id]
        _drop(object_id)
    return entry.obj


def abort(request_id: str, by: Any = None) -> int:
    """Drop the unread objects of ``request_id``; tell every client but ``by`` of the abort.

    Returns how many objects were dropped.
    """
    with _LOCK:
        dropped = [k for k, e in _OBJECTS.items() if e.request_id == request_id]
        for oid in dropped:
            _drop(oid)
    if by is not None:
        for key, ref in list(_ON_ABORT.items()):
            on_abort = ref()
            if key != id(by) and on_abort is not None:
                on_abort(request_id)
    return len(dropped)


def _drop(object_id: str) -> None:
    """Forget an object (``_LOCK`` held)."""
    entry = _OBJECTS.pop(object_id, None)
    if entry is None:
        return
    key = id(entry.obj)
    left = _PENDING.get(key, 0) - 1
    if left > 0:
        _PENDING[key] = left
    else:
        _PENDING.pop(key, None)


def _copy_containers(obj: Any) -> Any:
    t = type(obj)
    if t is dict:
        return {k: _copy_containers(v) for k, v in obj.items()}
    if t is list:
        return [_copy_containers(v) for v in obj]
    if t is tuple:
        return tuple(_copy_containers(v) for v in obj)
    return obj
