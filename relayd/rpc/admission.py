"""Who may bind a session, which stages it may serve, and which bound sessions
may operate the daemon.

The session socket is where the daemon learns who calls (SO_PEERCRED and the
peer's groups); what it learns there is kept in :class:`Roles`, which the gRPC
service consults for Drain and the full Status.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Collection, Iterable, Mapping

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 65536


def peer_groups(sock: socket.socket, pid: int) -> frozenset[int]:
    """The peer's supplementary groups, as the kernel recorded them when it connected.

    SO_PEERGROUPS (Linux 4.13) is what the connecting process held at connect;
    /proc/<pid>/status is the fallback on older kernels.
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _MAX_GROUPS * 4)
        return frozenset(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


class Admission:
    """Who may bind a session, and who may operate the daemon.

    Admitted, like the file system admits to a file of the daemon's user and
    group: root, the daemon's own uid, ``--allow-uid``, and any process whose
    primary *or supplementary* groups meet ``--allow-gid`` (default: the
    daemon's group), so ``usermod -aG relayd <user>`` admits that user.
    Operators (Drain, the full Status): root, the daemon's uid and members of
    ``--admin-gid``.

    Stage names are the client's own word at Attach; ``--stage-owner`` lets a
    stage be served only by the uids it lists. Root and the daemon's uid may
    serve any stage, as they pass every other rule here: either can take the
    daemon over anyway (ptrace, the segments by name), so refusing them would
    protect nothing. Stages without a list are open to every admitted uid.
    """

    def __init__(
        self,
        uids: Collection[int],
        gids: Collection[int],
        *,
        daemon_uid: int,
        admin_gids: Collection[int] = (),
        stage_owners: Mapping[str, Collection[int]] | None = None,
    ) -> None:
        self.daemon_uid = daemon_uid
        self.uids = frozenset(uids) | {daemon_uid}
        self.gids = frozenset(gids)
        self.admin_gids = frozenset(admin_gids)
        self.stage_owners = {
            stage: frozenset(owners) for stage, owners in (stage_owners or {}).items()
        }

    def admits(self, uid: int, gid: int, groups: Collection[int] = ()) -> bool:
        return uid == 0 or uid in self.uids or gid in self.gids or not self.gids.isdisjoint(groups)

    def is_admin(self, uid: int, gid: int, groups: Collection[int] = ()) -> bool:
        return (
            uid in (0, self.daemon_uid)
            or gid in self.admin_gids
            or not self.admin_gids.isdisjoint(groups)
        )

    def stage_refused(self, stages: Iterable[str], uid: int) -> str | None:
        """The first of ``stages`` whose owner list leaves ``uid`` out; None: it may serve all."""
        if uid in (0, self.daemon_uid):
            return None
        for stage in stages:
            owners = self.stage_owners.get(stage)
            if owners is not None and uid not in owners:
                return stage
        return None


@dataclasses.dataclass
class Roles:
    """Ids of bound sessions by what they may do; the session socket keeps them."""

    admins: set[str] = dataclasses.field(default_factory=set)
    """Sessions whose process may operate the daemon (Drain, the full Status)."""
    operators: set[str] = dataclasses.field(default_factory=set)
    """Operator sessions (the CLI's): no data path, left out of status."""

    def forget(self, session_id: str) -> None:
        self.admins.discard(session_id)
        self.operators.discard(session_id)


__all__ = ["Admission", "Roles", "peer_groups"]
