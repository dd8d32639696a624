"""Human views of a daemon's status, at most 80 columns wide.

Pure functions from the status dict to text; the CLI fetches and prints. The
dict is ``MessageToDict(StatusResponse, preserving_proto_field_name=True)``,
so every field may be missing (proto3 leaves out defaults), 64-bit integers
may be strings, and enums may be names or numbers; all of that is accepted.
A ``"peers"`` list of ``{node_id or peer, address, up, credits_in_use,
credits_capacity}`` (``PeerStatus``) is rendered when present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from relayd_client.wire.names import printable
from relayd_client.wire.proto import relay_pb2 as pb

from . import edgeview

WIDTH = 80
BAR_WIDTH = 10
OLDEST_SHOWN = 5

_LEASE_STATES = {1: "reserved", 2: "published", 3: "claimed"}
_STATE_ORDER = ("reserved", "published", "claimed")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal."""
    value = float(n)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1023.95:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def format_duration(seconds: float) -> str:
    """``59.2s``, ``12m03s``, ``3h12m``, ``2d03h``."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f}s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def format_bar(used: float, capacity: float) -> str:
    """``[#####.....]  52%``; an unknown capacity shows an empty bar and ``-``."""
    if capacity <= 0:
        return "[" + "." * BAR_WIDTH + "]    -"
    fraction = min(max(used / capacity, 0.0), 1.0)
    filled = round(fraction * BAR_WIDTH)
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {round(fraction * 100):3d}%"


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _items(d: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = d.get(key) or []
    return [item for item in value if isinstance(item, Mapping)]


def _enum_name(value: Any, prefix: str) -> str:
    """``"LEASE_STATE_PUBLISHED"`` -> ``"published"``; names without the prefix pass through, lowercased."""
    text = str(value)
    return (text[len(prefix) :] if text.startswith(prefix) else text).lower()


def _pool_label(name: Any) -> str:
    """``cuda:GPU-8a1b2c3d-4e5f-...`` -> ``cuda:8a1b2c3d``, as wide as a table can afford."""
    text = str(name or "-")
    if text.startswith("cuda:GPU-"):
        return "cuda:" + text[len("cuda:GPU-") :].split("-")[0]
    return text


def _lease_state(value: Any) -> str:
    if isinstance(value, int):
        return _LEASE_STATES.get(value, "unspecified")
    return _enum_name(value or "unspecified", "LEASE_STATE_")


def _daemon_state(value: Any) -> str:
    if isinstance(value, int):
        value = pb.DaemonState.Name(value) if value in pb.DaemonState.values() else "?"
    return _enum_name(value or "?", "DAEMON_STATE_")


def _counts(mapping: Any, prefix: str) -> dict[str, int]:
    if not isinstance(mapping, Mapping):
        return {}
    return {_enum_name(k, prefix): _int(v) for k, v in mapping.items()}


def _transfer_counts(d: Mapping[str, Any]) -> dict[str, int]:
    mapping = d.get("transfers_by_transport")
    if not isinstance(mapping, Mapping):
        return {}
    return {edgeview.transport_name(k): _int(v) for k, v in mapping.items()}


def _fit(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[:width] if width <= 3 else text[: width - 3] + "..."


@dataclasses.dataclass(frozen=True)
class _Col:
    header: str
    right: bool = False
    shrink_to: int | None = None  # None: never truncated
    optional: bool = False  # dropped when the table cannot fit otherwise


def _table(cols: Sequence[_Col], rows: Sequence[Sequence[str]], indent: int = 2) -> list[str]:
    """Columns as wide as their content. To fit :data:`WIDTH`, shrinkable columns give way
    first, then optional ones are dropped (rightmost first)."""
    gap = 2
    # Request ids, stage names and peer errors come from clients and peers.
    rows = [[printable(cell) for cell in row] for row in rows]
    keep = list(range(len(cols)))
    while True:
        widths = {i: max([len(cols[i].header), *(len(r[i]) for r in rows)]) for i in keep}
        excess = indent + sum(widths.values()) + gap * (len(keep) - 1) - WIDTH
        while excess > 0:
            room = [
                (widths[i] - (cols[i].shrink_to or 0), i)
                for i in keep
                if cols[i].shrink_to is not None and widths[i] > (cols[i].shrink_to or 0)
            ]
            if not room:
                break
            _, i = max(room)
            widths[i] -= 1
            excess -= 1
        optional = [i for i in keep if cols[i].optional]
        if excess <= 0 or not optional:
            break
        keep.remove(optional[-1])
    lines = []
    for row in [[c.header for c in cols], *rows]:
        cells = []
        for i in keep:
            text = _fit(row[i], widths[i])
            cells.append(text.rjust(widths[i]) if cols[i].right else text.ljust(widths[i]))
        lines.append(_fit((" " * indent + (" " * gap).join(cells)).rstrip(), WIDTH))
    return lines


def _flow(title: str, pieces: Iterable[str]) -> list[str]:
    """``TITLE  a  b  c`` wrapped at :data:`WIDTH`, continuation lines indented."""
    lines: list[str] = []
    line = _fit(printable(title), WIDTH)
    for piece in pieces:
        piece = _fit(printable(piece), WIDTH - 4)
        if len(line) + 2 + len(piece) > WIDTH:
            lines.append(line)
            line = "   " + piece
        else:
            line = f"{line}  {piece}"
    lines.append(line)
    return lines


def _header(d: Mapping[str, Any]) -> list[str]:
    pieces = [
        f"node {d.get('node_id') or '?'}",
        f"epoch {d.get('daemon_epoch') or '?'}",
        f"state {_daemon_state(d.get('state')).upper()}",
        f"up {format_duration(_float(d.get('uptime_seconds')))}",
    ]
    version = d.get("version")
    return _flow(f"relayd {version}" if version else "relayd", pieces)


def _pools(d: Mapping[str, Any]) -> list[str]:
    pools = _items(d, "pools")
    if not pools:
        return ["POOLS  none"]
    cols = [
        _Col("POOL", shrink_to=8),
        _Col("USE"),
        _Col("USED", right=True),
        _Col("CAPACITY", right=True),
        _Col("GRANTED", right=True),
        _Col("FREE RUN", right=True),
    ]
    rows = []
    for p in pools:
        used, capacity = _int(p.get("used_bytes")), _int(p.get("capacity_bytes"))
        rows.append(
            [
                _pool_label(p.get("name")),
                format_bar(used, capacity),
                format_bytes(used),
                format_bytes(capacity),
                format_bytes(_int(p.get("granted_bytes"))),
                format_bytes(_int(p.get("largest_free_run_bytes"))),
            ]
        )
    return ["POOLS", *_table(cols, rows)]


def _oldest_first(leases: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(leases, key=lambda x: (-_float(x.get("age_seconds")), _int(x.get("lease_id"))))


def _lease_table(leases: Sequence[Mapping[str, Any]]) -> list[str]:
    cols = [
        _Col("LEASE", right=True),
        _Col("STATE"),
        _Col("AGE", right=True),
        _Col("BYTES", right=True),
        _Col("POOL", shrink_to=8, optional=True),
        _Col("REQUEST", shrink_to=8),
        _Col("FROM", shrink_to=6),
        _Col("TO", shrink_to=6),
    ]
    rows = [
        [
            str(_int(x.get("lease_id"))),
            _lease_state(x.get("state")).upper(),
            format_duration(_float(x.get("age_seconds"))),
            format_bytes(_int(x.get("bytes"))),
            _pool_label(x.get("pool")),
            str(x.get("request_id") or "-"),
            str(x.get("from_stage") or "-"),
            str(x.get("to_stage") or "-"),
        ]
        for x in leases
    ]
    return _table(cols, rows)


def _lease_counts(d: Mapping[str, Any]) -> dict[str, int]:
    counts = _counts(d.get("leases_by_state"), "LEASE_STATE_")
    if not counts:
        for lease in _items(d, "leases"):
            state = _lease_state(lease.get("state"))
            counts[state] = counts.get(state, 0) + 1
    ordered = [s for s in _STATE_ORDER if s in counts] + sorted(set(counts) - set(_STATE_ORDER))
    return {s: counts[s] for s in ordered}


def _leases(d: Mapping[str, Any]) -> list[str]:
    counts = _lease_counts(d)
    total = sum(counts.values())
    title = f"LEASES  {total}"
    if total:
        title += " (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")"
    leases = _oldest_first(_items(d, "leases"))
    if not leases:
        return [title]
    lines = [title + ", oldest first", *_lease_table(leases[:OLDEST_SHOWN])]
    if len(leases) > OLDEST_SHOWN:
        lines.append(f"  ... and {len(leases) - OLDEST_SHOWN} more")
    return lines


def _sessions(d: Mapping[str, Any]) -> list[str]:
    sessions = _items(d, "sessions")
    if not sessions:
        return ["SESSIONS  0"]
    cols = [
        _Col("PID", right=True),
        _Col("UID", right=True),
        _Col("STAGES", shrink_to=8),
        _Col("GRANTED", right=True),
        _Col("LEASES", right=True),
        _Col("AGE", right=True),
        _Col("SESSION", shrink_to=8),
    ]
    ordered = sorted(sessions, key=lambda s: -_float(s.get("age_seconds")))
    rows = [
        [
            str(_int(s.get("pid"))),
            str(_int(s.get("uid"))),
            ",".join(str(x) for x in s.get("stages") or []) or "-",
            format_bytes(_int(s.get("granted_bytes"))),
            str(_int(s.get("leases"))),
            format_duration(_float(s.get("age_seconds"))),
            str(s.get("session_id") or "-"),
        ]
        for s in ordered
    ]
    return [f"SESSIONS  {len(sessions)}", *_table(cols, rows)]


def _registry(d: Mapping[str, Any]) -> list[str]:
    """The stage registry (who serves what, and how it moves bytes) and each edge's route."""
    stages, edges = _items(d, "stages"), _items(d, "edges")
    if not stages and not edges:
        return []
    lines = [f"STAGES  {len(stages)}, registry version {_int(d.get('registry_version'))}"]
    if stages:
        cols = [
            _Col("STAGE", shrink_to=8),
            _Col("PID", right=True),
            _Col("DATA"),
            _Col("GPUS", shrink_to=8, optional=True),
            _Col("SESSION", shrink_to=8),
        ]
        rows = [
            [
                str(s.get("stage") or "-"),
                str(_int(s.get("pid"))),
                "shm" if s.get("can_map_shm") else "socket",
                ",".join(_pool_label(f"cuda:{g}")[5:] for g in s.get("gpu_uuids") or []) or "-",
                str(s.get("session_id") or "-"),
            ]
            for s in sorted(stages, key=lambda s: (str(s.get("stage")), str(s.get("session_id"))))
        ]
        lines += _table(cols, rows)
    if edges:
        cols = [
            _Col("EDGE", shrink_to=12),
            _Col("TRANSPORT"),
            _Col("TRANSFERS", right=True),
            _Col("REASON", shrink_to=10),
        ]
        moved = edgeview.transfers_by_edge(d)
        rows = [
            [
                f"{e.get('from_stage') or '?'} -> {e.get('to_stage') or '?'}",
                edgeview.transport_name(e.get("transport")),
                str(moved.get((str(e.get("from_stage")), str(e.get("to_stage"))), 0)),
                str(e.get("reason") or "-"),
            ]
            for e in edges
        ]
        lines += ["", f"EDGES  {len(edges)}", *_table(cols, rows)]
    return lines


def _link(peer: Mapping[str, Any]) -> str:
    if not peer.get("up"):
        return "down"
    return "up/tcp" if peer.get("notice_channel") else "up/grpc"


def _peers(d: Mapping[str, Any]) -> list[str]:
    """Each peer as README lists it: link (when up, with the path this daemon's notices
    to it take: ``tcp``, its notice channel, or ``grpc``, ``Peer.Notify``), epoch,
    Mooncake session, credits in use, the high-water mark of concurrent pulls (MAX),
    and its last error below the table."""
    if "peers" not in d:
        return []
    peers = _items(d, "peers")
    if not peers:
        return ["PEERS  none"]
    cols = [
        _Col("PEER", shrink_to=12),
        _Col("LINK"),
        _Col("EPOCH", shrink_to=6, optional=True),
        _Col("MOONCAKE", shrink_to=10, optional=True),
        _Col("CREDITS"),
        _Col("IN USE", right=True),
        _Col("MAX", right=True),
    ]
    rows = []
    errors = []
    for p in peers:
        name = str(p.get("peer") or p.get("node_id") or p.get("address") or "?")
        in_use, capacity = _int(p.get("credits_in_use")), _int(p.get("credits_capacity"))
        rows.append(
            [
                name,
                _link(p),
                str(p.get("daemon_epoch") or "-"),
                str(p.get("mooncake_session") or "-"),
                format_bar(in_use, capacity),
                f"{in_use}/{capacity}",
                str(_int(p.get("pulls_in_flight_max"))),
            ]
        )
        if p.get("last_error"):
            errors.append(_fit(printable(f"  {name}: {p['last_error']}"), WIDTH))
    return [f"PEERS  {len(peers)}", *_table(cols, rows), *errors]


def _totals(d: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    transfers = _transfer_counts(d)
    if transfers:
        lines += _flow("TRANSFERS", (f"{k} {v}" for k, v in sorted(transfers.items())))
    reclaimed = _counts(d.get("reclaimed_by_reason"), "")
    if reclaimed:
        lines += _flow("RECLAIMED", (f"{k} {v}" for k, v in sorted(reclaimed.items())))
    return lines


def _rates(d: Mapping[str, Any], previous: Mapping[str, Any] | None, interval: float) -> list[str]:
    now = _transfer_counts(d)
    if not now:
        return ["TRANSFERS  none"]
    comparable = (
        previous is not None
        and interval > 0
        and previous.get("daemon_epoch") == d.get("daemon_epoch")
    )
    before = _transfer_counts(previous) if previous else {}

    def rate(name: str) -> str:
        if not comparable or name not in before or now[name] < before[name]:
            return "-"
        return f"{(now[name] - before[name]) / interval:.1f}"

    rows = [[name, str(now[name]), rate(name)] for name in sorted(now)]
    cols = [
        _Col("TRANSPORT", shrink_to=8),
        _Col("TOTAL", right=True),
        _Col("PER SECOND", right=True),
    ]
    return ["TRANSFERS", *_table(cols, rows)]


def _edge_traffic(
    d: Mapping[str, Any], previous: Mapping[str, Any] | None, interval: float
) -> list[str]:
    rows = edgeview.edge_rows(d, previous, interval)
    if not rows:
        return ["EDGES  no transfers yet"]
    cols = [
        _Col("EDGE", shrink_to=12),
        _Col("TRANSPORT", shrink_to=9),
        _Col("XFER/S", right=True),
        _Col("MB/S", right=True),
        _Col("PUT50", right=True),
        _Col("PUT99", right=True),
        _Col("GET50", right=True),
        _Col("GET99", right=True),
    ]
    return [f"EDGES  {len(rows)}, latency over the last {interval:g}s", *_table(cols, rows)]


def _join(sections: Iterable[list[str]]) -> str:
    return "\n".join("\n".join(s) for s in sections if s)


def render_status(d: Mapping[str, Any]) -> str:
    """Header, pools, leases (the oldest few), sessions, stages and edges, peers, counters."""
    sections = [
        _header(d),
        _pools(d),
        _leases(d),
        _sessions(d),
        _registry(d),
        _peers(d),
        _totals(d),
    ]
    return _join(sections[:1] + [["", *s] for s in sections[1:] if s])


def render_leases(
    d: Mapping[str, Any], stage: str | None = None, request: str | None = None
) -> str:
    """Every lease, oldest first; ``stage`` matches either end, ``request`` the request id."""
    leases = _items(d, "leases")
    shown = [
        x
        for x in leases
        if (stage is None or stage in (x.get("from_stage"), x.get("to_stage")))
        and (request is None or x.get("request_id") == request)
    ]
    filters = [f"{k}={v}" for k, v in (("stage", stage), ("request", request)) if v is not None]
    title = f"LEASES  {len(shown)} of {len(leases)}"
    if filters:
        title += " (" + ", ".join(filters) + ")"
    title = _fit(title, WIDTH)
    if not shown:
        return title
    return _join([[title + ", oldest first"], _lease_table(_oldest_first(shown))])


def render_top(d: Mapping[str, Any], previous: Mapping[str, Any] | None, interval: float) -> str:
    """Status plus transfer rates over the ``interval`` seconds since ``previous`` (or None).

    Most wanted first: a terminal too short for all of it cuts from the bottom.
    """
    sections = [
        _header(d),
        _edge_traffic(d, previous, interval),
        _pools(d),
        _rates(d, previous, interval),
        _leases(d),
        _sessions(d),
        _peers(d),
    ]
    head = _fit(f"relayd top - every {interval:g}s", WIDTH)
    return _join([[head], *(["", *s] for s in sections if s)])
