"""The socket directory and the files the daemon keeps there, safe from other local users.

Whoever can write the socket directory can replace the daemon's sockets with
their own (clients then hand them their tensors) or plant a symlink where the
daemon writes its lock file. So the daemon accepts a directory only when
nobody but itself and root can change it:

- the directory (symlinks resolved) is owned by the daemon's uid or by root;
- it is not writable by group or others (``0750`` with the stage users'
  group, as systemd's ``RuntimeDirectoryMode=0750`` and the Kubernetes init
  container make it, is fine; ``/tmp`` itself, ``0770`` or ``1777`` are not);
- if the path's last component is a symlink, the link is owned by the daemon's
  uid or root (in a sticky directory such as ``/tmp`` only its owner can swap it).

A directory that does not exist is created by the daemon with a private mode
(owner only, plus group/other *search and read* where ``--socket-mode`` grants
them the sockets). Files in it are opened with ``O_NOFOLLOW`` (and ``O_EXCL``
when created); leftover socket and lock files must be the daemon's own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UnsafeRuntimeDirError(RuntimeError):
    """The socket directory or a file in it could be changed by another user."""


def directory_mode(socket_mode: int) -> int:
    """Mode for a directory the daemon creates: traversable by whom the sockets admit."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def _owner_ok(st: os.stat_result, uid: int) -> bool:
    return st.st_uid in (uid, 0)


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"


def prepare(directory: str, socket_mode: int, uid: int | None = None) -> None:
    """Create ``directory`` privately if missing; refuse it if another user could change it."""
    uid = os.geteuid() if uid is None else uid
    directory = directory or "."
    if not os.path.lexists(directory):
        parent = os.path.dirname(os.path.abspath(directory))
        os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # someone was first: checked below
            os.mkdir(directory, 0o700)
            os.chmod(directory, directory_mode(socket_mode))
    link = os.lstat(directory)
    if stat.S_ISLNK(link.st_mode) and not _owner_ok(link, uid):
        raise UnsafeRuntimeDirError(
            f"socket directory {directory} is a symlink owned by uid {link.st_uid}: another "
            "user could point it elsewhere. Remove it (the daemon creates the directory "
            "itself) or point --socket at a directory only relayd's user can change"
        )
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDirError(f"socket directory {directory} is not a directory")
    if not _owner_ok(st, uid) or st.st_mode & _WRITABLE_BY_OTHERS:
        raise UnsafeRuntimeDirError(
            f"socket directory {directory} ({_describe(st)}) could be changed by another user: "
            f"it must be owned by uid {uid} or root and not writable by group or others. "
            f"Remove it (the daemon creates it with mode "
            f"{directory_mode(socket_mode):04o}), or `chown {uid} {directory} && chmod "
            f"go-w {directory}`, or point --socket elsewhere"
        )


def check_leftover(path: str, uid: int | None = None) -> None:
    """A socket file left by a dead daemon may be replaced only if it was ours."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not _owner_ok(st, uid) or not stat.S_ISSOCK(st.st_mode):
        raise UnsafeRuntimeDirError(
            f"{path} is not a socket left by relayd ({_describe(st)}); remove it by hand "
            "after checking who put it there"
        )


def open_lock(path: str, uid: int | None = None) -> int:
    """Open (creating it exclusively if new) the lock file, never through a symlink."""
    uid = os.geteuid() if uid is None else uid
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRuntimeDirError(
                f"{path} is a symlink; relayd will not write through it. Remove it"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not _owner_ok(st, uid) or st.st_mode & _WRITABLE_BY_OTHERS:
        os.close(fd)
        raise UnsafeRuntimeDirError(
            f"lock file {path} ({_describe(st)}) is not relayd's own; remove it"
        )
    return fd


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a lock taken on a file
    another process unlinked meanwhile guards nothing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class SocketInUseError(RuntimeError):
    """Another live daemon serves on the requested socket."""


class SocketLock:
    """One daemon per socket: an flock beside it, released by the kernel if the daemon dies.

    Holding it makes the daemon the owner of the sockets named here: leftover
    ones (of a dead daemon, and only if they were relayd's) are replaced on
    :meth:`acquire`, and :meth:`release` removes them with the lock file.
    """

    def __init__(self, socket: str, session_socket: str, socket_mode: int) -> None:
        self.socket = socket
        self.session_socket = session_socket
        self.socket_mode = socket_mode
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Take the lock (``SocketInUseError`` if a live daemon holds it)."""
        prepare(os.path.dirname(self.socket), self.socket_mode)
        path = self.socket + ".lock"
        while True:
            fd = open_lock(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise SocketInUseError(
                    f"another relayd (pid {owner or '?'}) is serving on {self.socket}; stop it "
                    "or pick another --socket"
                ) from None
            # A stopping owner unlinks the file before letting go of it: a lock
            # taken on that unlinked file would leave the path free for a third.
            if same_file(fd, path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        # Ownership (and release()'s unlinking) only once both paths are ours
        # to replace: a refused file stays for the operator to look at.
        try:
            for stale in (self.socket, self.session_socket):
                check_leftover(stale)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        for stale in (self.socket, self.session_socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """Sockets bound inside get ``--socket-mode`` from their first instant (a umask),
        not only after the chmod that follows."""
        old = os.umask(0o777 & ~self.socket_mode)
        try:
            yield
        finally:
            os.umask(old)

    def release(self) -> None:
        """Remove the sockets and the lock file, then let go of the lock."""
        if self._fd < 0:
            return
        for path in (self.socket, self.session_socket, self.socket + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.close(self._fd)
        self._fd = -1
