from __future__ import annotations

import os
import pathlib
import resource
import socket
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import pytest

from relayd import preflight
from relayd.config import Settings
from relayd.preflight import (
    PreflightError,
    check_all,
    check_distinct_addresses,
    check_gpu,
    check_memlock,
    check_mooncake,
    check_shm_space,
    check_socket_dir,
    check_tcp_address,
    parse_host_port,
)

MiB = 1 << 20


def make_settings(tmp_path: pathlib.Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "socket": str(tmp_path / "s.sock"),
        "shm_pool_size": 64 * MiB,
        "pin_host_memory": "off",
        "node_id": "n1",
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on, for the length of the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


class FakeImporter:
    """Stands in for importlib.import_module: returns or raises per module name."""

    def __init__(self, modules: Mapping[str, ModuleType | BaseException]) -> None:
        self.modules = dict(modules)
        self.calls: list[str] = []

    def __call__(self, name: str) -> ModuleType:
        self.calls.append(name)
        outcome = self.modules.get(name)
        if outcome is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def module_with_hook(hook: Callable[[Settings], str | None] | None) -> ModuleType:
    module = ModuleType("fake")
    if hook is not None:
        module.preflight = hook  # type: ignore[attr-defined]
    return module


ENGINE_OK: dict[str, ModuleType | BaseException] = {
    "mooncake.engine": ModuleType("mooncake.engine")
}


# ---------------------------------------------------------------- PreflightError


def test_error_lists_every_failure() -> None:
    err = PreflightError(["first problem; fix A", "second problem; fix B"])
    assert err.failures == ("first problem; fix A", "second problem; fix B")
    assert str(err) == (
        "cannot start: 2 preflight checks failed\n"
        "  - first problem; fix A\n"
        "  - second problem; fix B"
    )
    assert str(PreflightError(["only"])) == ("cannot start: 1 preflight check failed\n  - only")


# ---------------------------------------------------------------- /dev/shm


def test_shm_too_small_says_how_to_fix(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path)
    assert check_shm_space(settings, free_bytes=16 * MiB) == (
        "/dev/shm has 16.0 MiB free but the SHM arena needs 80.0 MiB (shm_pool_size "
        "64.0 MiB + 16.0 MiB margin). Containers get a 64 MB /dev/shm by default: run with "
        "docker --shm-size (e.g. --shm-size=2g), use hostIPC: true on Kubernetes, or lower "
        "--shm-pool-size"
    )


def test_shm_needs_pool_plus_margin(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path)
    assert check_shm_space(settings, free_bytes=80 * MiB) is None
    assert check_shm_space(settings, free_bytes=80 * MiB - 1) is not None


def test_shm_measures_the_given_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through a stand-in statvfs: the directory's real free space moves while
    # other processes write there, between any two measurements of it.
    asked: list[str] = []
    real = os.statvfs(tmp_path)
    fake = os.statvfs_result((*real[:4], 12345, *real[5:]))  # f_bavail

    def statvfs(path: str) -> os.statvfs_result:
        asked.append(str(path))
        return fake

    monkeypatch.setattr(preflight.os, "statvfs", statvfs)
    assert preflight.shm_free_bytes(str(tmp_path)) == 12345 * real.f_frsize
    assert asked == [str(tmp_path)]
    monkeypatch.undo()
    small = make_settings(tmp_path, shm_pool_size=128 << 10)
    assert check_shm_space(small, shm_dir=str(tmp_path)) is None


def test_shm_dir_missing(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "nope")
    assert check_shm_space(make_settings(tmp_path), shm_dir=missing) == (
        f"{missing} is not usable (No such file or directory); relayd keeps its SHM arena "
        "there: mount a tmpfs on it (containers: hostIPC or a host /dev/shm mount)"
    )


# ---------------------------------------------------------------- memlock


def test_memlock_too_low_when_pinning_on(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path, pin_host_memory="on")
    assert check_memlock(settings, cuda_available=False, limit=64 << 10) == (
        "RLIMIT_MEMLOCK is 64.0 KiB but pin_host_memory is on, which page-locks the "
        "64.0 MiB SHM arena: set LimitMEMLOCK=infinity in the systemd unit, run "
        "`ulimit -l unlimited` (docker: --ulimit memlock=-1), or use --pin-host-memory off"
    )


def test_memlock_auto_checks_only_with_cuda(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path, pin_host_memory="auto")
    assert check_memlock(settings, cuda_available=False, limit=0) is None
    failure = check_memlock(settings, cuda_available=True, limit=0)
    assert failure is not None
    assert failure.startswith(
        "RLIMIT_MEMLOCK is 0 B but pin_host_memory is auto and CUDA is available, which"
    )


@pytest.mark.parametrize(
    ("pin", "limit"),
    [
        ("off", 0),
        ("on", resource.RLIM_INFINITY),
        ("on", 64 * MiB),
    ],
)
def test_memlock_passes(tmp_path: pathlib.Path, pin: str, limit: int) -> None:
    settings = make_settings(tmp_path, pin_host_memory=pin)
    assert check_memlock(settings, cuda_available=True, limit=limit) is None


# ---------------------------------------------------------------- socket directory


def test_socket_dir_existing_or_creatable(tmp_path: pathlib.Path) -> None:
    assert check_socket_dir(make_settings(tmp_path)) is None
    nested = make_settings(tmp_path, socket=str(tmp_path / "a" / "b" / "s.sock"))
    assert check_socket_dir(nested) is None
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_socket_dir_under_a_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "afile").write_text("")
    settings = make_settings(tmp_path, socket=str(tmp_path / "afile" / "sub" / "s.sock"))
    assert check_socket_dir(settings) == (
        f"socket directory {tmp_path}/afile/sub cannot be created: {tmp_path}/afile is not "
        "a directory; choose another --socket"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_socket_dir_not_writable(tmp_path: pathlib.Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    settings = make_settings(tmp_path, socket=str(locked / "s.sock"))
    assert check_socket_dir(settings) == (
        f"socket directory {locked} is not writable by uid {os.getuid()}; fix its owner or "
        "mode (systemd: RuntimeDirectory=relayd) or choose another --socket"
    )


def test_socket_path_too_long(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / ("x" * 100) / "s.sock")
    assert check_socket_dir(make_settings(tmp_path, socket=path)) == (
        f"socket path {path}.session is longer than the 107 bytes a Unix socket address "
        "holds; choose a shorter --socket"
    )


# ---------------------------------------------------------------- TCP addresses


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
        ("localhost:0", ("localhost", 0)),
        (":7600", ("", 7600)),
        ("[::1]:50051", ("::1", 50051)),
        ("[::]:1", ("::", 1)),
    ],
)
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["9100", "::1:80", "[::1]80", "[::1", "h:", "h:x", "h:65536"])
def test_parse_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(text)


def test_tcp_address_free_or_unset() -> None:
    assert check_tcp_address("metrics_address", "") is None
    assert check_tcp_address("metrics_address", "127.0.0.1:0") is None


def test_tcp_address_ipv6() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    assert check_tcp_address("health_address", "[::1]:0") is None


def test_tcp_port_taken(listening: int) -> None:
    assert check_tcp_address("metrics_address", f"127.0.0.1:{listening}") == (
        f"metrics_address 127.0.0.1:{listening}: the port is taken (address already in "
        "use); stop what listens there or choose another port with --metrics-address"
    )


def test_tcp_address_malformed() -> None:
    assert check_tcp_address("peer_address", "10.0.0.1") == (
        "peer_address '10.0.0.1' is not HOST:PORT (IPv6: [ADDR]:PORT); fix --peer-address"
    )


def test_tcp_address_not_local() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    assert check_tcp_address("health_address", "192.0.2.1:8080") == (
        "health_address 192.0.2.1:8080: 192.0.2.1 is not an address of this machine; "
        "fix --health-address"
    )


def test_tcp_addresses_must_differ(tmp_path: pathlib.Path) -> None:
    same = make_settings(
        tmp_path, metrics_address="127.0.0.1:9100", health_address="127.0.0.1:9100"
    )
    assert check_distinct_addresses(same) == (
        "metrics_address and health_address are both 127.0.0.1:9100; give each its own port "
        "(--health-address)"
    )
    ephemeral = make_settings(tmp_path, metrics_address="127.0.0.1:0", health_address="127.0.0.1:0")
    assert check_distinct_addresses(ephemeral) is None


# ---------------------------------------------------------------- Mooncake

MOONCAKE = "relayd.transports.mooncake"
PACKAGE_MISSING = (
    "peers are configured (peer_address/peers) but the mooncake package is not installed: "
    "pip install 'relayd[mooncake]' ('relayd[mooncake-cuda]' on GPU nodes) and apt-get "
    "install libibverbs1, or leave --peer-address and --peers empty"
)


def with_peers(tmp_path: pathlib.Path) -> Settings:
    return make_settings(tmp_path, peers=("10.0.0.2:7600",))


def test_mooncake_not_checked_without_peers(tmp_path: pathlib.Path) -> None:
    importer = FakeImporter({})
    assert check_mooncake(make_settings(tmp_path), import_module=importer) is None
    assert importer.calls == []


def test_mooncake_package_missing(tmp_path: pathlib.Path) -> None:
    importer = FakeImporter({})
    assert check_mooncake(with_peers(tmp_path), import_module=importer) == PACKAGE_MISSING
    assert importer.calls == [MOONCAKE, "mooncake.engine"]


def test_mooncake_package_missing_at_transport_import(tmp_path: pathlib.Path) -> None:
    missing = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    importer = FakeImporter({MOONCAKE: missing})
    assert check_mooncake(with_peers(tmp_path), import_module=importer) == PACKAGE_MISSING


def test_mooncake_native_library_missing(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path, peer_address="127.0.0.1:0")
    broken = ImportError("libibverbs.so.1: cannot open shared object file")
    assert check_mooncake(settings, import_module=FakeImporter({"mooncake.engine": broken})) == (
        "peers are configured (peer_address/peers) but mooncake.engine cannot be imported "
        "(libibverbs.so.1: cannot open shared object file): pip install 'relayd[mooncake]' "
        "('relayd[mooncake-cuda]' on GPU nodes) and apt-get install libibverbs1, or leave "
        "--peer-address and --peers empty"
    )


def test_mooncake_engine_imports_without_transport_module(tmp_path: pathlib.Path) -> None:
    importer = FakeImporter(ENGINE_OK)
    assert check_mooncake(with_peers(tmp_path), import_module=importer) is None
    assert importer.calls == [MOONCAKE, "mooncake.engine"]


def test_mooncake_hook_decides(tmp_path: pathlib.Path) -> None:
    settings = with_peers(tmp_path)
    seen: list[Settings] = []

    def hook(s: Settings) -> str | None:
        seen.append(s)
        return "mooncake_device lists ['mlx5_9'], not present on this host (found [])"

    importer = FakeImporter({MOONCAKE: module_with_hook(hook)})
    assert check_mooncake(settings, import_module=importer) == (
        "mooncake_device lists ['mlx5_9'], not present on this host (found [])"
    )
    assert seen == [settings]
    assert importer.calls == [MOONCAKE]  # the hook imports the engine itself


def test_mooncake_hook_that_raises_is_reported(tmp_path: pathlib.Path) -> None:
    def hook(s: Settings) -> str | None:
        raise RuntimeError("engine init returned -1")

    importer = FakeImporter({MOONCAKE: module_with_hook(hook)})
    assert check_mooncake(with_peers(tmp_path), import_module=importer) == (
        "relayd.transports.mooncake.preflight failed unexpectedly: "
        "RuntimeError('engine init returned -1')"
    )


def test_mooncake_module_without_hook_checks_the_engine(tmp_path: pathlib.Path) -> None:
    importer = FakeImporter({MOONCAKE: module_with_hook(None)})
    assert check_mooncake(with_peers(tmp_path), import_module=importer) == PACKAGE_MISSING


def test_mooncake_module_broken(tmp_path: pathlib.Path) -> None:
    missing_dep = ModuleNotFoundError("No module named 'uvloop'", name="uvloop")
    importer = FakeImporter({MOONCAKE: missing_dep})
    assert check_mooncake(with_peers(tmp_path), import_module=importer) == (
        "relayd.transports.mooncake cannot be imported (No module named 'uvloop')"
    )


# ---------------------------------------------------------------- GPU


def test_gpu_pools_need_cuda(tmp_path: pathlib.Path) -> None:
    importer = FakeImporter({})
    assert check_gpu(make_settings(tmp_path), cuda_available=False, import_module=importer) is None
    settings = make_settings(tmp_path, gpu_pool_size=256 * MiB)
    assert check_gpu(settings, cuda_available=False, import_module=importer) == (
        "gpu_pool_size set (256.0 MiB) but no CUDA device is visible (check the driver, "
        "CUDA_VISIBLE_DEVICES and the container's GPU runtime), or use --gpu-pool-size 0"
    )
    assert importer.calls == []


def test_gpu_hook_runs_with_cuda(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path, gpu_pool_size=256 * MiB)
    assert check_gpu(settings, cuda_available=True, import_module=FakeImporter({})) is None

    def hook(s: Settings) -> str | None:
        return "GPU 0 cannot access GPU 1's memory (no peer access)"

    importer = FakeImporter({"relayd.pools.cuda": module_with_hook(hook)})
    assert check_gpu(settings, cuda_available=True, import_module=importer) == (
        "GPU 0 cannot access GPU 1's memory (no peer access)"
    )


# ---------------------------------------------------------------- check_all


def test_check_all_passes(tmp_path: pathlib.Path) -> None:
    settings = make_settings(tmp_path, shm_pool_size=128 << 10, metrics_address="127.0.0.1:0")
    check_all(settings, cuda_available=False, shm_dir=str(tmp_path))


def test_check_all_reports_every_failure(tmp_path: pathlib.Path, listening: int) -> None:
    (tmp_path / "afile").write_text("")
    settings = make_settings(
        tmp_path,
        socket=str(tmp_path / "afile" / "s.sock"),
        shm_pool_size=128 << 10,
        health_address=f"127.0.0.1:{listening}",
        gpu_pool_size=MiB,
    )
    with pytest.raises(PreflightError) as info:
        check_all(settings, cuda_available=False, shm_dir=str(tmp_path))
    assert info.value.failures == (
        f"socket directory {tmp_path}/afile cannot be created: {tmp_path}/afile is not a "
        "directory; choose another --socket",
        f"health_address 127.0.0.1:{listening}: the port is taken (address already in use); "
        "stop what listens there or choose another port with --health-address",
        "gpu_pool_size set (1.0 MiB) but no CUDA device is visible (check the driver, "
        "CUDA_VISIBLE_DEVICES and the container's GPU runtime), or use --gpu-pool-size 0",
    )
