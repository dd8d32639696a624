"""What one local uid may hold of the daemon's connections.

The session socket knows who connects (SO_PEERCRED), so it is where one uid's
share is enforced: every session needs one session-socket connection, so
capping a uid's connections caps its sessions too. A uid at its cap is refused
further connections until one of its own closes; other uids keep their room.
"""

from __future__ import annotations

from ..shares import Shares


class UidLimits:
    def __init__(self, per_uid: int) -> None:
        self.per_uid = per_uid
        self._open: Shares[int] = Shares()

    def open(self, uid: int) -> bool:
        """Count a new connection of ``uid``; False (and not counted) if it is at its cap."""
        if self._open[uid] >= self.per_uid:
            return False
        self._open.add(uid)
        return True

    def close(self, uid: int) -> None:
        self._open.take(uid)

    def held(self, uid: int) -> int:
        return self._open[uid]
