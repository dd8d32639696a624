"""Which process is behind the daemon's sockets, checked before anything is sent.

A socket path alone proves nothing: a local user who could create the
socket's directory first (``/tmp/relayd-<uid>`` on the embedded default) can
serve a daemon of their own there and receive every tensor a stage puts. So
the client asks the kernel who is listening (``SO_PEERCRED``) and talks only
to a daemon running as root or as the uid it trusts:

- ``daemon_uid=`` of :class:`RelayClient`, else ``RELAYD_DAEMON_UID``: that
  uid (and root) only;
- by default: the client's own uid, root, or the owner of the socket's
  directory when no other user could have put a socket there (the directory
  and each directory above it are owned by root or by that uid and not
  writable by group or others; systemd's ``/run/relayd`` and the Kubernetes
  hostPath are).

The gRPC socket is pinned before it is checked: the client opens the socket
file itself (``O_PATH``) and both the check and gRPC connect through
``/proc/self/fd/N``, so the file cannot be swapped between the check and the
calls. The session socket is checked on the connection that carries the bind.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import socket
import stat
import struct

from .errors import DaemonUnavailableError, PermissionDeniedError

ENV_DAEMON_UID = "RELAYD_DAEMON_UID"
_CREDS = struct.Struct("3i")
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    return str(uid)


def _group(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    return str(gid)


def configured_daemon_uid(daemon_uid: int | None) -> int | None:
    """The uid the caller pinned (argument, else ``RELAYD_DAEMON_UID``), or None."""
    if daemon_uid is not None:
        return daemon_uid
    raw = os.environ.get(ENV_DAEMON_UID, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(raw).pw_uid
    raise PermissionDeniedError(f"{ENV_DAEMON_UID}={raw!r} is neither a uid nor a user name")


def _held_by(directory: str) -> int | None:
    """The uid that alone (with root) controls ``directory`` and every directory above it."""
    path = os.path.realpath(directory)
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return None
    while True:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if st.st_uid not in (0, owner) or st.st_mode & _WRITABLE_BY_OTHERS:
            return None
        parent = os.path.dirname(path)
        if parent == path:
            return owner
        path = parent


def trusted_uids(socket_path: str, daemon_uid: int | None) -> frozenset[int]:
    pinned = configured_daemon_uid(daemon_uid)
    if pinned is not None:
        return frozenset((0, pinned))
    uids = {0, os.geteuid()}
    holder = _held_by(os.path.dirname(os.path.abspath(socket_path)))
    if holder is not None:
        uids.add(holder)
    return frozenset(uids)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return int(pid), int(uid), int(gid)


def peer_uid(sock: socket.socket) -> int:
    return peer_credentials(sock)[1]


def check_peer(sock: socket.socket, path: str, trusted: frozenset[int]) -> None:
    uid = peer_uid(sock)
    if uid not in trusted:
        raise PermissionDeniedError(
            f"the daemon behind {path} runs as uid {_user(uid)}, which this client does not "
            f"trust (it trusts uids {', '.join(_user(u) for u in sorted(trusted))}); another "
            f"local user may have taken the socket directory. Set {ENV_DAEMON_UID} (or "
            "RelayClient(daemon_uid=...)) to the uid relayd runs as if this daemon is yours"
        )


def permission_problem(path: str, exc: OSError) -> PermissionDeniedError:
    """What to do when the socket (or its directory) may not be opened by this user."""
    me = _user(os.geteuid())
    target = path
    try:
        st = os.stat(path)
    except OSError:
        target = os.path.dirname(path) or "."
        try:
            st = os.stat(target)
        except OSError:
            return PermissionDeniedError(
                f"permission denied on relayd socket {path} for uid {me} ({exc.strerror}); "
                "a directory above it is closed to this user"
            )
    try:
        join = f"usermod -aG {grp.getgrgid(st.st_gid).gr_name} <user>, then log in again"
    except KeyError:
        join = f"add the user to group {st.st_gid}"
    return PermissionDeniedError(
        f"permission denied on {target} for uid {me}: it is owned by uid {_user(st.st_uid)}, "
        f"group {_group(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}. relayd admits its "
        f"own uid, root and members of its group: run as one of them or join the group ({join})"
    )


class PinnedSocket:
    """The daemon's gRPC socket file held open, checked once, connected to by descriptor."""

    def __init__(self, path: str, trusted: frozenset[int], timeout: float) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DaemonUnavailableError(
                f"no relayd socket at {path}; is `relayd serve` running?"
            ) from None
        except PermissionError as exc:
            raise permission_problem(path, exc) from None
        try:
            if not stat.S_ISSOCK(os.fstat(self._fd).st_mode):
                raise DaemonUnavailableError(f"{path} is not a socket")
            proc = f"/proc/self/fd/{self._fd}"
            self.address = proc if os.path.exists(proc) else path
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout)
                try:
                    probe.connect(self.address)
                except PermissionError as exc:
                    raise permission_problem(path, exc) from None
                except (ConnectionRefusedError, FileNotFoundError, TimeoutError) as exc:
                    raise DaemonUnavailableError(
                        f"relayd socket {path} does not answer ({exc.strerror or exc}); "
                        "is `relayd serve` running?"
                    ) from None
                check_peer(probe, path, trusted)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
