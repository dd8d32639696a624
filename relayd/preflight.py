"""Startup checks: fail fast, and say what to fix.

``relayd serve`` calls :func:`check_all` before it creates anything. Every
check runs, even after one has failed, so an operator fixes a bad node in one
round instead of one restart per problem. Each check is a small function that
returns ``None`` when it passes and otherwise one sentence naming the problem
and its fix; :class:`PreflightError` carries them all.

Two checks belong to modules that own the resource and are called through
hooks, only when those modules exist:

* ``relayd.transports.mooncake.preflight(settings) -> str | None`` when peers
  are configured (it imports ``mooncake.engine`` and checks the NICs; without
  the hook, preflight only checks that ``mooncake.engine`` imports);
* ``relayd.pools.cuda.preflight(settings) -> str | None`` when GPU pools are
  enabled and CUDA is available (peer access between the GPUs).

A hook that raises is reported as a failure, not propagated.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import pathlib
import resource
import socket
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from relayd_client.wire.paths import SHM_DIR

from relayd.config import ARENA_FLOOR, Settings
from relayd.status_tables import format_bytes

logger = logging.getLogger(__name__)

ImportModule = Callable[[str], ModuleType]

#: Free space /dev/shm must have beyond the arena (other processes' segments, slack).
SHM_MARGIN = 16 << 20
#: sun_path holds 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107
_ADDRESS_SETTINGS = ("peer_address", "metrics_address", "health_address")
_MOONCAKE_INSTALL = (
    "pip install 'relayd[mooncake]' ('relayd[mooncake-cuda]' on GPU nodes) "
    "and apt-get install libibverbs1"
)


class PreflightError(Exception):
    """The node cannot run relayd as configured; ``failures`` says what to fix, one per check."""

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures: tuple[str, ...] = tuple(failures)
        n = len(self.failures)
        lines = [f"cannot start: {n} preflight check{'s' if n != 1 else ''} failed"]
        lines += [f"  - {failure}" for failure in self.failures]
        super().__init__("\n".join(lines))


def check_all(
    settings: Settings,
    *,
    cuda_available: bool | None = None,
    shm_dir: str = SHM_DIR,
) -> None:
    """Run every check; raise :class:`PreflightError` listing all that failed.

    ``cuda_available=None`` detects CUDA (see :func:`detect_cuda`), and only
    when a check needs to know.
    """
    if cuda_available is None and (
        settings.gpu_pool_size > 0 or settings.pin_host_memory == "auto"
    ):
        cuda_available = detect_cuda()
    cuda = bool(cuda_available)
    results = [
        check_shm_space(settings, shm_dir=shm_dir),
        check_memlock(settings, cuda_available=cuda),
        check_socket_dir(settings),
        *(check_tcp_address(name, getattr(settings, name)) for name in _ADDRESS_SETTINGS),
        check_distinct_addresses(settings),
        check_mooncake(settings),
        check_gpu(settings, cuda_available=cuda),
    ]
    failures = [r for r in results if r is not None]
    if failures:
        raise PreflightError(failures)
    logger.debug("preflight passed")


def detect_cuda() -> bool:
    """``torch.cuda.is_available()``, without importing torch on a host with no NVIDIA driver."""
    if "torch" not in sys.modules and not any(
        os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/dxg")
    ):
        return False
    import torch

    return bool(torch.cuda.is_available())


# ---------------------------------------------------------------- /dev/shm


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes an unprivileged process can still allocate under ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check_shm_space(
    settings: Settings, *, shm_dir: str = SHM_DIR, free_bytes: int | None = None
) -> str | None:
    """The arena plus :data:`SHM_MARGIN` must fit in ``shm_dir``'s free space.

    ``free_bytes`` overrides the measurement (tests).
    """
    if free_bytes is None:
        try:
            free_bytes = shm_free_bytes(shm_dir)
        except OSError as exc:
            return (
                f"{shm_dir} is not usable ({exc.strerror}); relayd keeps its SHM arena there: "
                "mount a tmpfs on it (containers: hostIPC or a host /dev/shm mount)"
            )
    need = settings.shm_pool_size + SHM_MARGIN
    if free_bytes >= need:
        return None
    return (
        f"{shm_dir} has {format_bytes(free_bytes)} free but the SHM arena needs "
        f"{format_bytes(need)} (shm_pool_size {format_bytes(settings.shm_pool_size)} + "
        f"{format_bytes(SHM_MARGIN)} margin). Containers get a 64 MB {shm_dir} by default: "
        "run with docker --shm-size (e.g. --shm-size=2g), use hostIPC: true on Kubernetes, "
        "or lower --shm-pool-size"
    )


def small_shm_advice(
    settings: Settings, *, shm_dir: str = SHM_DIR, free_bytes: int | None = None
) -> str | None:
    """A warning for a /dev/shm too small for the default arena floor (a container's
    64 MB default), which relayd starts on anyway; None when there is room."""
    if free_bytes is None:
        try:
            free_bytes = shm_free_bytes(shm_dir)
        except OSError:
            return None
    if free_bytes >= 2 * ARENA_FLOOR + SHM_MARGIN:
        return None
    return (
        f"{shm_dir} has only {format_bytes(free_bytes)} free (a container's default is "
        f"64 MB), so the SHM arena is {format_bytes(settings.shm_pool_size)}: puts larger "
        "than that fail and big streams wait for space. Give the container "
        "the host's IPC namespace (docker run --ipc=host, which stages need anyway to "
        "map the arena) or a larger /dev/shm (--shm-size=2g)"
    )


# ---------------------------------------------------------------- memlock


def memlock_soft_limit() -> int:
    """RLIMIT_MEMLOCK's soft limit in bytes; ``resource.RLIM_INFINITY`` when unlimited."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def check_memlock(
    settings: Settings, *, cuda_available: bool, limit: int | None = None
) -> str | None:
    """When the arena is page-locked, RLIMIT_MEMLOCK must cover it.

    ``limit`` overrides the measurement (tests).
    """
    if settings.pin_host_memory == "off":
        return None
    if settings.pin_host_memory == "auto" and not cuda_available:
        return None
    if limit is None:
        limit = memlock_soft_limit()
    if limit == resource.RLIM_INFINITY or limit >= settings.shm_pool_size:
        return None
    why = "on" if settings.pin_host_memory == "on" else "auto and CUDA is available"
    return (
        f"RLIMIT_MEMLOCK is {format_bytes(limit)} but pin_host_memory is {why}, which "
        f"page-locks the {format_bytes(settings.shm_pool_size)} SHM arena: set "
        "LimitMEMLOCK=infinity in the systemd unit, run `ulimit -l unlimited` "
        "(docker: --ulimit memlock=-1), or use --pin-host-memory off"
    )


# ---------------------------------------------------------------- socket directory


def check_socket_dir(settings: Settings) -> str | None:
    """The socket's directory exists or can be created, and is writable; the path fits AF_UNIX."""
    longest = settings.session_socket
    if len(os.fsencode(longest)) > _SUN_PATH_MAX:
        return (
            f"socket path {longest} is longer than the {_SUN_PATH_MAX} bytes a Unix socket "
            "address holds; choose a shorter --socket"
        )
    directory = pathlib.Path(os.path.abspath(settings.socket)).parent
    existing = directory
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return (
            f"socket directory {directory} cannot be created: {existing} is not a directory; "
            "choose another --socket"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == directory:
            problem = f"socket directory {directory} is not writable"
        else:
            problem = f"socket directory {directory} does not exist and {existing} is not writable"
        return (
            f"{problem} by uid {os.getuid()}; fix its owner or mode "
            "(systemd: RuntimeDirectory=relayd) or choose another --socket"
        )
    return None


# ---------------------------------------------------------------- TCP addresses


def parse_host_port(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[V6]:PORT"`` -> ``(host, port)``; empty host: all interfaces."""
    if address.startswith("["):
        host, bracket, rest = address[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"not [HOST]:PORT: {address!r}")
        port_text = rest[1:]
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon or ":" in host:
            raise ValueError(f"not HOST:PORT: {address!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in {address!r}")
    return host, int(port_text)


def check_tcp_address(setting: str, address: str) -> str | None:
    """A non-empty ``address`` parses and its port can be bound now.

    The probe sets SO_REUSEADDR like the gRPC server does: a listening socket
    still conflicts, connections in TIME_WAIT from a previous run do not.
    """
    if not address:
        return None
    flag = "--" + setting.replace("_", "-")
    try:
        host, port = parse_host_port(address)
    except ValueError:
        return f"{setting} {address!r} is not HOST:PORT (IPv6: [ADDR]:PORT); fix {flag}"
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"{setting} {address}: cannot resolve {host!r} ({exc.strerror}); fix {flag}"
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (
                f"{setting} {address}: the port is taken (address already in use); stop "
                f"what listens there or choose another port with {flag}"
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{setting} {address}: {host} is not an address of this machine; fix {flag}"
        if exc.errno == errno.EACCES:
            return (
                f"{setting} {address}: ports below 1024 need CAP_NET_BIND_SERVICE; "
                f"choose another port with {flag}"
            )
        return f"{setting} {address}: cannot bind ({exc.strerror}); fix {flag}"
    return None


def check_distinct_addresses(settings: Settings) -> str | None:
    """No two TCP settings name the same fixed port (each server needs its own)."""
    seen: dict[tuple[str, int], str] = {}
    for name in _ADDRESS_SETTINGS:
        address = getattr(settings, name)
        try:
            key = parse_host_port(address) if address else None
        except ValueError:
            continue  # reported by check_tcp_address
        if key is None or key[1] == 0:
            continue
        if key in seen:
            return (
                f"{seen[key]} and {name} are both {address}; give each its own port "
                f"(--{name.replace('_', '-')})"
            )
        seen[key] = name
    return None


# ---------------------------------------------------------------- hooks: Mooncake, GPU


def check_mooncake(
    settings: Settings, *, import_module: ImportModule = importlib.import_module
) -> str | None:
    """With peers configured, Mooncake Transfer Engine must work here.

    The transport module's hook judges (it knows which native library needs
    which fix); without that hook, ``mooncake.engine`` must at least import.
    """
    if not (settings.peer_address or settings.peers):
        return None
    module_name = "relayd.transports.mooncake"
    try:
        module: ModuleType | None = import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_mooncake(exc):
            return _mooncake_failure(exc)
        if exc.name != module_name:
            return _import_failure(module_name, exc)
        module = None  # not part of this build
    except ImportError as exc:
        return _import_failure(module_name, exc)
    if module is not None and getattr(module, "preflight", None) is not None:
        return _call_hook(module_name, module, settings)
    try:
        import_module("mooncake.engine")
    except ImportError as exc:
        return _mooncake_failure(exc)
    return None


def _is_mooncake(exc: ImportError) -> bool:
    return isinstance(exc, ModuleNotFoundError) and exc.name in ("mooncake", "mooncake.engine")


def _mooncake_failure(exc: ImportError) -> str:
    if _is_mooncake(exc):
        what = "the mooncake package is not installed"
    else:
        what = f"mooncake.engine cannot be imported ({exc})"
    return (
        f"peers are configured (peer_address/peers) but {what}: {_MOONCAKE_INSTALL}, "
        "or leave --peer-address and --peers empty"
    )


def _import_failure(module_name: str, exc: ImportError) -> str:
    return f"{module_name} cannot be imported ({exc})"


def check_gpu(
    settings: Settings,
    *,
    cuda_available: bool,
    import_module: ImportModule = importlib.import_module,
) -> str | None:
    """GPU pools need a CUDA device; peer access is the GPU pool module's hook to check."""
    if settings.gpu_pool_size <= 0:
        return None
    if not cuda_available:
        return (
            f"gpu_pool_size set ({format_bytes(settings.gpu_pool_size)}) but no CUDA device "
            "is visible (check the driver, CUDA_VISIBLE_DEVICES and the container's GPU "
            "runtime), or use --gpu-pool-size 0"
        )
    module_name = "relayd.pools.cuda"
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None  # not part of this build: nothing of it to check
        return _import_failure(module_name, exc)
    except ImportError as exc:
        return _import_failure(module_name, exc)
    return _call_hook(module_name, module, settings)


def _call_hook(module_name: str, module: ModuleType, settings: Settings) -> str | None:
    """``module.preflight(settings)`` if it exists; an exception becomes the failure."""
    hook: Callable[[Settings], object] | None = getattr(module, "preflight", None)
    if hook is None:
        return None
    try:
        result = hook(settings)
    except Exception as exc:
        logger.debug("%s.preflight raised", module_name, exc_info=True)
        return f"{module_name}.preflight failed unexpectedly: {exc!r}"
    return None if result is None else str(result)
