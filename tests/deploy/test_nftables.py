"""deploy/nftables/relayd.nft: nft accepts it, and loaded it does what SECURITY.md says.

``nft -c`` needs CAP_NET_ADMIN for its netlink cache even when it only checks.
Every run here happens in a fresh network namespace (``unshare -n`` as root, a
user namespace with ``unshare -rn`` otherwise), so nothing touches the host's
rules; the test skips only when nft is missing or neither namespace can be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "nftables" / "relayd.nft"
TOOL_TIMEOUT = 60
NOBODY = 65534


def _nft() -> str:
    nft = shutil.which("nft") or next(
        (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None
    )
    if nft is None:
        pytest.skip("nft is not installed (Debian package: nftables; scripts/test.sh installs it)")
    return nft


def _in_netns(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``args`` in a fresh network namespace; skips when none can be made here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    tried = []
    for prefix in ([unshare, "-n"], [unshare, "-rn"]):
        cp = subprocess.run(
            [*prefix, *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=False
        )
        if "unshare failed" in cp.stderr or "Operation not permitted" in cp.stderr:
            tried.append(f"{' '.join(prefix)}: {cp.stderr.strip()}")
            continue
        return cp
    pytest.skip("nft cannot check here: " + " | ".join(tried))


def test_nft_accepts_the_recipe() -> None:
    cp = _in_netns([_nft(), "-c", "-f", str(RULES)])
    assert cp.returncode == 0, cp.stderr


def test_a_broken_recipe_is_refused(tmp_path: Path) -> None:
    """The check can fail: a typo in a rule is an error, not a skip."""
    broken = tmp_path / "broken.nft"
    broken.write_text(RULES.read_text().replace("skuid != $RELAYD_UID", "skuid != $RELAYD_UIDX"))
    cp = _in_netns([_nft(), "-c", "-f", str(broken)])
    assert cp.returncode != 0 and "RELAYD_UIDX" in cp.stderr, cp.stderr


_PROBE = (
    "import socket, sys; "
    "socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5); print('connected')"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="loading rules and switching uid need root")
def test_loaded_rules_admit_relayds_uid_and_refuse_another_local_user(tmp_path: Path) -> None:
    """In a private network namespace: a listener on a Mooncake port and on the Peer port;
    the rules, with relayd's uid set to root's, admit root and reset another uid."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    rules = tmp_path / "relayd.nft"
    rules.write_text(RULES.read_text().replace("RELAYD_UID = 10001", "RELAYD_UID = 0"))
    nobody = f"{setpriv} --reuid {NOBODY} --regid {NOBODY} --clear-groups"
    script = f"""
set -u
ip link set lo up
{_nft()} -f {rules}
{sys.executable} -c '
import socket, sys, time
ls = [socket.create_server(("127.0.0.1", p)) for p in (15000, 9092, 18000)]
print("listening", flush=True)
time.sleep(60)
' &
server=$!
trap 'kill $server' EXIT
while ! grep -q ':3A98 ' /proc/net/tcp; do sleep 0.05; done  # 15000, listening
for port in 15000 9092 18000; do
  echo "root $port: $({sys.executable} -c "{_PROBE}" $port 2>&1 | tail -1)"
  echo "other $port: $({nobody} {sys.executable} -c "{_PROBE}" $port 2>&1 | tail -1)"
done
"""
    cp = _in_netns(["bash", "-c", script])
    assert cp.returncode == 0, cp.stderr
    got = dict(line.split(": ", 1) for line in cp.stdout.splitlines() if ": " in line)
    assert got["root 15000"] == "connected" and got["root 9092"] == "connected", got
    for port in ("15000", "9092"):
        assert "ConnectionRefusedError" in got[f"other {port}"], got
    # Ports that are not relayd's are left alone.
    assert got["other 18000"] == "connected", got
