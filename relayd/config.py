"""Daemon settings, declared once.

Every setting is a field of :class:`Settings` with its help text, and from that
one declaration come the ``relayd serve`` flag (``--shm-pool-size``), the
environment variable (``RELAYD_SHM_POOL_SIZE``) and the config-file key
(``shm_pool_size``). Precedence: config file < environment < flags.

The environment is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from relayd_client.wire.errors import InvalidArgumentError
from relayd_client.wire.framing import session_socket_path
from relayd_client.wire.names import check_stage
from relayd_client.wire.paths import SHM_DIR, default_socket_path
from relayd_client.wire.shm import MAX_SLOT_SIZE, segment_nslots

ENV_PREFIX = "RELAYD_"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip


class ConfigError(ValueError):
    """A setting has a value relayd cannot use; the message says which and why."""


def parse_size(text: str | int) -> int:
    """``"256MiB"`` -> 268435456. Bare numbers are bytes; K/M/G are decimal, Ki/Mi/Gi binary."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (examples: 65536, 64KiB, 256MiB, 2GiB)")
    unit = (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise ConfigError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _parse_list(text: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(text, str):
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return tuple(str(p) for p in text)


def _parse_ints(text: str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(text, str):
        return tuple(int(p) for p in _parse_list(text))
    return tuple(int(p) for p in text)


#: uid_t's largest value is (uid_t)-1, which means "no uid" to the kernel.
_MAX_UID = 2**32 - 2
_OWNER_FORM = "STAGE=UID[,UID...]"
_UID_RE = re.compile(r"-?\d+")


def _owner_uids(stage: str, raw: object) -> set[int]:
    if isinstance(raw, str):
        items: list[object] = [p.strip() for p in raw.split(",") if p.strip()]
    else:
        items = list(raw) if isinstance(raw, list) else [raw]
    uids: set[int] = set()
    for item in items:
        # bool is an int to Python, and int() takes 1.5: neither is a uid anyone wrote.
        if isinstance(item, int) and not isinstance(item, bool):
            uid = item
        elif isinstance(item, str) and _UID_RE.fullmatch(item):
            uid = int(item)
        else:
            raise ConfigError(f"stage_owner: uid {item!r} of stage {stage!r} is not an integer")
        if not 0 <= uid <= _MAX_UID:
            raise ConfigError(f"stage_owner: uid {uid} of stage {stage!r} is not a uid")
        uids.add(uid)
    if not uids:
        raise ConfigError(f"stage_owner: {stage!r} names no uid ({_OWNER_FORM})")
    return uids


def parse_stage_owners(
    value: str | Sequence[object] | Mapping[str, object],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``talker=1001,1002`` -> ``(("talker", (1001, 1002)),)``, sorted by stage.

    A flag per stage (repeated), or ``;`` between stages in one string (the
    environment); the config file may also give a table of stage = uid or
    [uids]. A stage named twice gets the uids of both.
    """
    pairs: list[tuple[str, object]] = []
    if isinstance(value, Mapping):
        pairs = [(str(stage), uids) for stage, uids in value.items()]
    else:
        for item in [value] if isinstance(value, str) else value:
            if not isinstance(item, str):
                raise ConfigError(f"stage_owner: {item!r} is not {_OWNER_FORM}")
            for entry in filter(None, (e.strip() for e in item.split(";"))):
                stage, eq, listed = entry.partition("=")
                if not eq:
                    raise ConfigError(f"stage_owner: {entry!r} is not {_OWNER_FORM}")
                pairs.append((stage.strip(), listed))
    # Here, not at the top: relayd.operator loads gRPC, which reading settings need not.
    from relayd.operator import OPERATOR_STAGE

    owners: dict[str, set[int]] = {}
    for stage, raw in pairs:
        try:
            check_stage(stage)
        except InvalidArgumentError as exc:
            raise ConfigError(f"stage_owner: {exc.message}") from None
        if stage == OPERATOR_STAGE:
            # Listed, it would lock the CLI out for --admin-gid members.
            raise ConfigError(
                f"stage_owner: {OPERATOR_STAGE} is the CLI's own stage; --admin-gid "
                "says who may operate the daemon"
            )
        owners.setdefault(stage, set()).update(_owner_uids(stage, raw))
    return tuple((stage, tuple(sorted(uids))) for stage, uids in sorted(owners.items()))


#: The default arena's floor, and the smaller one where /dev/shm cannot hold it
#: (a container's default 64 MB /dev/shm): there relayd starts on what fits and
#: says so, rather than fail preflight.
ARENA_FLOOR = 64 << 20
SMALL_SHM_ARENA_FLOOR = 16 << 20


def default_shm_pool_size() -> int:
    """1/16 of RAM and half of /dev/shm's free space, between 64 MiB (16 MiB in a small /dev/shm) and 4 GiB."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 << 30
    try:
        st = os.statvfs(SHM_DIR)
        shm_free = st.f_bavail * st.f_frsize
    except OSError:
        shm_free = ram
    size = min(ram // 16, shm_free // 2, 4 << 30)
    floor = ARENA_FLOOR if shm_free // 2 >= ARENA_FLOOR else SMALL_SHM_ARENA_FLOOR
    return max(floor, size - size % (1 << 20))


def default_node_id() -> str:
    """The hostname and /etc/machine-id's prefix (the hostname alone without one)."""
    try:
        mid = pathlib.Path("/etc/machine-id").read_text().strip()
        if mid:
            return f"{socket.gethostname()}-{mid[:8]}"
    except OSError:
        pass
    return socket.gethostname()


def _field(
    default: Any = dataclasses.MISSING,
    *,
    factory: Any = None,
    help: str,
    parse: Any = str,
    metavar: str | None = None,
    repeat: bool = False,
) -> Any:
    meta = {"help": help, "parse": parse, "metavar": metavar, "repeat": repeat}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything ``relayd serve`` can be told. Field name == config key."""

    socket: str = _field(
        factory=default_socket_path,
        metavar="PATH",
        help="gRPC Unix socket; the session socket is PATH.session",
    )
    socket_mode: int = _field(
        0o660,
        parse=lambda v: int(v, 8) if isinstance(v, str) else int(v),
        metavar="OCTAL",
        help="permissions of the socket files",
    )
    shm_pool_size: int = _field(
        factory=default_shm_pool_size,
        parse=parse_size,
        metavar="SIZE",
        help="SHM arena size (e.g. 256MiB)",
    )
    shm_segment_size: int = _field(
        1 << 30,
        parse=parse_size,
        metavar="SIZE",
        help="largest single SHM segment; the arena is cut into these",
    )
    slot_size: int = _field(
        64 << 10, parse=parse_size, metavar="SIZE", help="allocation granule of every pool"
    )
    grant_size: int = _field(
        8 << 20,
        parse=parse_size,
        metavar="SIZE",
        help="default slot run granted to a writer session at a time",
    )
    lease_ttl: float = _field(
        60.0,
        parse=float,
        metavar="SECONDS",
        help="published data nobody reads is reclaimed after this",
    )
    reserve_timeout: float = _field(
        10.0,
        parse=float,
        metavar="SECONDS",
        help="longest a grant waits for space before RESOURCE_EXHAUSTED",
    )
    drain_grace: float = _field(
        10.0, parse=float, metavar="SECONDS", help="how long a drain waits for in-flight leases"
    )
    metrics_address: str = _field(
        "", metavar="HOST:PORT", help="Prometheus endpoint; empty disables it"
    )
    health_address: str = _field(
        "", metavar="HOST:PORT", help="extra TCP address for gRPC health (probes); empty: off"
    )
    node_id: str = _field(factory=default_node_id, metavar="ID", help="this node's identity")
    peer_address: str = _field(
        "", metavar="HOST:PORT", help="TCP address of the Peer service (cross-node); empty: off"
    )
    peers: tuple[str, ...] = _field(
        (),
        parse=_parse_list,
        metavar="HOST:PORT,...",
        help="static peer daemons (or a DNS name resolving to several)",
    )
    peer_token_file: str = _field("", metavar="FILE", help="shared secret peers authenticate with")
    peer_credits: int = _field(32, parse=int, metavar="N", help="in-flight Mooncake pulls per peer")
    peer_notice_port: int = _field(
        0,
        parse=int,
        metavar="PORT",
        help="TCP port for notices between daemons, on the Peer service's host; "
        "0: any free port (advertised to peers); -1: none, notices ride the Peer service",
    )
    peer_timeout: float = _field(
        5.0, parse=float, metavar="SECONDS", help="a peer transfer or call fails after this"
    )
    push_grant_size: int = _field(
        64 << 20,
        parse=parse_size,
        metavar="SIZE",
        help="arena each peer may push into ahead of its readers; 0 turns pushes off",
    )
    push_attach_max: int = _field(
        16 << 20,
        parse=parse_size,
        metavar="SIZE",
        help="pushes up to this size (at most 16MiB) carry their bytes after their Landed "
        "notice on the peer's notice channel instead of a Mooncake WRITE: no round trip; "
        "0: never (with RDMA a WRITE may cost less than the kernel's TCP)",
    )
    mooncake_protocol: str = _field("tcp", metavar="PROTO", help="Mooncake protocol: tcp or rdma")
    mooncake_device: str = _field("", metavar="NICS", help="RDMA NIC allow-list for Mooncake")
    gpu_pool_size: int = _field(
        0, parse=parse_size, metavar="SIZE", help="per-GPU slot pool size; 0 disables GPU pools"
    )
    pin_host_memory: str = _field(
        "auto",
        metavar="auto|on|off",
        help="clients page-lock the arena for DMA (auto: where CUDA is)",
    )
    allow_uid: tuple[int, ...] = _field(
        (),
        parse=_parse_ints,
        metavar="UID,...",
        help="uids admitted on the session socket (default: the daemon's; root always)",
    )
    allow_gid: tuple[int, ...] = _field(
        (),
        parse=_parse_ints,
        metavar="GID,...",
        help="gids admitted on the session socket, primary or supplementary (default: the "
        "daemon's group)",
    )
    admin_gid: tuple[int, ...] = _field(
        (),
        parse=_parse_ints,
        metavar="GID,...",
        help="groups whose members may drain and read the full status (root and the daemon's "
        "uid always may)",
    )
    stage_owner: tuple[tuple[str, tuple[int, ...]], ...] = _field(
        (),
        parse=parse_stage_owners,
        metavar=_OWNER_FORM,
        repeat=True,
        help="only these uids (and root and the daemon's uid) may serve STAGE; repeat per "
        "stage (';' between stages in the environment); stages not listed are open to every "
        "admitted uid",
    )
    max_sessions: int = _field(
        1024, parse=int, metavar="N", help="sessions at once, bound or not yet bound"
    )
    max_stage_bytes: int = _field(
        0,
        parse=parse_size,
        metavar="SIZE",
        help="arena bytes one stage may hold across all its sessions; 0: half the arena",
    )
    max_session_grants: int = _field(
        64,
        parse=int,
        metavar="N",
        help="slot runs one session may hold at once (a client needs a few)",
    )
    max_uid_sessions: int = _field(
        0,
        parse=int,
        metavar="N",
        help="session-socket connections (so sessions) one uid may hold; 0: half of max_sessions",
    )
    max_grant_waits: int = _field(
        4,
        parse=int,
        metavar="N",
        help="Grant calls of one session waiting for space at once",
    )
    max_stage_keys: int = _field(
        4096,
        parse=int,
        metavar="N",
        help="unread keyed puts one consumer stage may have waiting on this node",
    )
    max_edge_labels: int = _field(
        64,
        parse=int,
        metavar="N",
        help="edges (from_stage, to_stage) metrics label by name; the rest read 'other'",
    )
    loop: str = _field("auto", metavar="auto|asyncio|uvloop", help="event loop implementation")
    log_format: str = _field("text", metavar="text|json|logfmt", help="log line format")
    log_level: str = _field("info", metavar="LEVEL", help="debug, info, warning or error")

    def _check_arena_layout(self) -> None:
        """The arena cuts shm_pool_size into segments of up to shm_segment_size and
        stops at a remainder under two slots: its first segment must hold a slot
        with its header, or the daemon would start with nothing to grant."""
        slot, pool, segment = self.slot_size, self.shm_pool_size, self.shm_segment_size
        if pool >= 2 * slot and segment_nslots(min(pool, segment), slot) > 0:
            return
        name, size = (
            ("shm_pool_size", pool)
            if pool < 2 * slot or pool <= segment
            else ("shm_segment_size", segment)
        )
        raise ConfigError(
            f"{name} of {size} bytes holds no slot of {slot} bytes with its header; "
            f"make it at least {2 * slot} or lower slot_size"
        )

    def __post_init__(self) -> None:
        if (
            self.slot_size < 4096
            or self.slot_size > MAX_SLOT_SIZE
            or self.slot_size & (self.slot_size - 1)
        ):
            raise ConfigError(
                f"slot_size must be a power of two from 4096 to {MAX_SLOT_SIZE}, "
                f"got {self.slot_size}"
            )
        self._check_arena_layout()
        if self.grant_size < self.slot_size:
            raise ConfigError("grant_size must be at least one slot")
        if self.loop not in ("auto", "asyncio", "uvloop"):
            raise ConfigError(f"loop must be auto, asyncio or uvloop, not {self.loop!r}")
        if self.log_format not in ("text", "json", "logfmt"):
            raise ConfigError(f"log_format must be text, json or logfmt, not {self.log_format!r}")
        if self.pin_host_memory not in ("auto", "on", "off"):
            raise ConfigError(
                f"pin_host_memory must be auto, on or off, not {self.pin_host_memory!r}"
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(
                f"log_level must be debug, info, warning or error, not {self.log_level!r}"
            )
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ConfigError(
                f"mooncake_protocol must be tcp or rdma, not {self.mooncake_protocol!r}"
            )
        if (
            min(
                self.max_sessions,
                self.max_session_grants,
                self.max_grant_waits,
                self.max_stage_keys,
            )
            < 1
        ):
            raise ConfigError(
                "max_sessions, max_session_grants, max_grant_waits and max_stage_keys must be >= 1"
            )
        if self.max_edge_labels < 0 or self.push_attach_max < 0:
            raise ConfigError("max_edge_labels and push_attach_max must be >= 0")
        if not -1 <= self.peer_notice_port <= 65535:
            raise ConfigError("peer_notice_port must be a port, 0 (any free one) or -1 (none)")
        if self.lease_ttl <= 0 or self.reserve_timeout <= 0 or self.peer_credits <= 0:
            raise ConfigError("lease_ttl, reserve_timeout and peer_credits must be positive")

    @property
    def session_socket(self) -> str:
        return session_socket_path(self.socket)

    @property
    def uid_session_limit(self) -> int:
        return (
            self.max_uid_sessions if self.max_uid_sessions > 0 else max(1, self.max_sessions // 2)
        )

    @property
    def stage_quota_bytes(self) -> int:
        return self.max_stage_bytes or max(self.shm_pool_size // 2, self.slot_size)


def _fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(Settings))


def _format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def default_text(f: dataclasses.Field[Any]) -> str:
    """A setting's default as ``--help`` shows it; computed ones by what they compute."""
    if f.default_factory is not dataclasses.MISSING:
        doc = (f.default_factory.__doc__ or "computed at start").strip()
        return doc.split("\n")[0].rstrip(".")
    value: Any = f.default
    if f.metadata["parse"] is parse_size:
        return _format_size(int(value))
    if f.name == "socket_mode":
        return f"{value:o}"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    if value == "":
        return "empty"
    return f"{value:g}" if isinstance(value, float) else str(value)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; unset flags stay None so lower layers show through."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML config file (keys = setting names) [env {env_name('config')}]",
    )
    for f in _fields():
        shown = default_text(f).replace("%", "%%")
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            action="append" if f.metadata["repeat"] else "store",
            metavar=f.metadata["metavar"],
            help=f"{f.metadata['help']} [default: {shown}; env {env_name(f.name)}]",
        )


def _coerce(name: str, value: Any) -> Any:
    f = next((f for f in _fields() if f.name == name), None)
    if f is None:
        raise ConfigError(f"unknown setting {name!r}")
    try:
        return f.metadata["parse"](value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for {name}: {value!r} ({exc})") from exc


def load(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build :class:`Settings` from file < environment < flags."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        section = data.get("relayd", data)
        for key, value in section.items():
            values[key.replace("-", "_")] = _coerce(key.replace("-", "_"), value)
    for f in _fields():
        raw = env.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _coerce(f.name, raw)
    for key, value in (flags or {}).items():
        if value is not None and key != "config":
            values[key] = _coerce(key, value)
    return Settings(**values)
