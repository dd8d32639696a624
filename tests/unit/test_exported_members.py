"""The client's public surface is pinned, and it never pulls in daemon-only dependencies."""

from __future__ import annotations

import subprocess
import sys

import relayd_client


def test_public_api() -> None:
    assert sorted(relayd_client.__all__) == sorted(
        [
            "AbortedError", "ClientState", "CorruptRefError", "DaemonUnavailableError", "DataRef",
            "DrainingError", "ErrorCode", "InternalError", "InvalidArgumentError", "KeyExistsError",
            "NotFoundError", "PeerUnavailableError", "PermissionDeniedError", "RelayClient", "RelayError",
            "RelayTimeoutError", "ResourceExhaustedError", "SessionClosedError", "StaleEpochError",
            "StaleRefError", "StreamError", "SyncRelayClient", "TensorRef", "Transport", "UnsafePayloadError",
            "VersionMismatchError",
        ]
    )  # fmt: skip
    for name in relayd_client.__all__:
        assert getattr(relayd_client, name).__module__.startswith("relayd_client")


def test_every_error_is_a_relay_error_with_its_own_code() -> None:
    errors = [getattr(relayd_client, n) for n in relayd_client.__all__ if n.endswith("Error")]
    assert all(issubclass(e, relayd_client.RelayError) for e in errors)
    codes = [e.code for e in errors if e is not relayd_client.RelayError]
    assert len(codes) == len(set(codes))


BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"uvloop", "prometheus_client", "mooncake", "relayd"}:
            raise ImportError(f"client imported daemon-only module {name}")
sys.meta_path.insert(0, Block())
import relayd_client
from relayd_client import RelayClient, DataRef
print("ok")
"""


def test_client_imports_without_daemon_dependencies() -> None:
    cp = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr
