"""Every method ``relayd bench`` knows, by name, in table order.

An entry is data only: the class lives behind ``target`` ("module:Class") and is
imported in the benchmark processes, never here (those modules import torch,
which costs seconds). What the parent must decide before spawning anything, an
entry says: whether it is one process or a pair, whether it needs the daemon,
which cheap imports must work, and which sizes it applies to.

To add a method: write a class against ``relayd.bench._api`` (``PairMethod``,
``AsyncPairMethod``, ``LocalMethod`` or ``AsyncLocalMethod``) and add an
``Entry`` to ``BASELINES`` or ``RELAYD`` below.
"""

from __future__ import annotations

import dataclasses
import importlib

INLINE_LIMIT = 16 * 1024  # DESIGN.md: a put whose whole encoding fits 16 KiB travels inline

STREAM = "stream"  # the workload name; runs the methods in --stream-methods


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    target: str
    summary: str
    local: bool = False  # one process (a LocalMethod) instead of a writer/reader pair
    needs_daemon: bool = False
    requires: tuple[str, ...] = ()  # "module:attr" that must import in the parent
    min_size: int = 0
    max_size: int | None = None
    size_note: str = ""
    needs_reader_socket: bool = False

    def unavailable(self, reader_socket: str | None) -> str | None:
        """Why this method cannot run at all here, or None."""
        for req in self.requires:
            module, _, attr = req.partition(":")
            try:
                mod = importlib.import_module(module)
            except Exception as exc:  # any import-time failure means "not ready yet"
                return f"cannot import {module}: {type(exc).__name__}: {exc}"
            if attr and not hasattr(mod, attr):
                return f"{module} has no {attr} yet"
        if self.needs_reader_socket and not reader_socket:
            return "needs --reader-socket: a daemon on another node, Mooncake peer of --socket's"
        return None

    def skip_size(self, size: int) -> str | None:
        if size < self.min_size or (self.max_size is not None and size > self.max_size):
            return self.size_note or "does not apply at this size"
        return None


BASELINES: tuple[Entry, ...] = (
    Entry("memcpy", "relayd.bench._baselines:Memcpy", "hot in-process copy", local=True),
    Entry("floor", "relayd.bench._baselines:Floor", "pooled /dev/shm, reader copies out"),
    Entry("floor-view", "relayd.bench._baselines:FloorView", "pooled /dev/shm, zero-copy read"),
    Entry("floor-async", "relayd.bench._baselines:FloorAsync", "floor, hooks on an event loop"),
    Entry(
        "shm-per-transfer",
        "relayd.bench._baselines:ShmPerTransfer",
        "new SharedMemory segment per transfer",
    ),
    Entry("pickle-uds", "relayd.bench._baselines:PickleUds", "pickled tensor over a Unix socket"),
)

# ---- relayd methods plug in here ------------------------------------------------------
# One Entry per way relayd moves a payload; classes in relayd.bench._relayd.
_CLIENT = ("relayd_client:RelayClient", "relayd_client:DataRef")
_SHM_NOTE = f"puts <= {INLINE_LIMIT // 1024} KiB go inline (see relayd-inline)"
RELAYD: tuple[Entry, ...] = (
    Entry(
        "relayd-local",
        "relayd.bench._relayd:RelaydLocal",
        "both stages in one process (local_object)",
        local=True,
        needs_daemon=True,
        requires=_CLIENT,
    ),
    Entry(
        "relayd-inline",
        "relayd.bench._relayd:RelaydInline",
        "payload inside the DataRef",
        needs_daemon=True,
        requires=_CLIENT,
        max_size=INLINE_LIMIT,
        size_note=f"inline applies only to puts <= {INLINE_LIMIT // 1024} KiB",
    ),
    Entry(
        "relayd-shm",
        "relayd.bench._relayd:RelaydShm",
        "daemon arena, reader get() copies",
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
    ),
    Entry(
        "relayd-shm-view",
        "relayd.bench._relayd:RelaydShmView",
        "daemon arena, reader view() zero-copy",
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
    ),
    Entry(
        "relayd-mooncake",
        "relayd.bench._relayd:RelaydMooncake",
        "reader on another node's daemon (Mooncake TE)",
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
        needs_reader_socket=True,
    ),
)
# ---------------------------------------------------------------------------------------

ENTRIES: dict[str, Entry] = {e.name: e for e in BASELINES + RELAYD}
DEFAULT_STREAM_METHODS = ("floor", "relayd-shm")


def known_names() -> list[str]:
    return [*ENTRIES, STREAM]


def select(spec: str | None) -> list[str]:
    """Names from a comma list ("all" or None: everything), in registry order."""
    if spec is None or spec.strip() in ("", "all"):
        return known_names()
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    groups = {"baselines": [e.name for e in BASELINES], "relayd": [e.name for e in RELAYD]}
    names: set[str] = set()
    for w in wanted:
        if w in groups:
            names.update(groups[w])
        elif w in ENTRIES or w == STREAM:
            names.add(w)
        else:
            raise ValueError(f"unknown method {w!r}; known: {', '.join(known_names())}")
    return [n for n in known_names() if n in names]
