"""How much of a bounded resource each holder (a uid, a stage) has now.

A holder at zero is forgotten at once: holders come and go for the daemon's
whole life (every uid that ever connected, every stage ever named), so a table
that kept them would grow without bound, and a cap on "how many holders" would
count the gone ones.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Shares(Generic[K]):
    def __init__(self) -> None:
        self._held: dict[K, int] = {}

    def __getitem__(self, holder: K) -> int:
        return self._held.get(holder, 0)

    def __contains__(self, holder: object) -> bool:
        return holder in self._held

    def __len__(self) -> int:
        """Holders with a share now."""
        return len(self._held)

    def as_dict(self) -> dict[K, int]:
        return dict(self._held)

    def add(self, holder: K, n: int = 1) -> None:
        self._held[holder] = self._held.get(holder, 0) + n

    def take(self, holder: K, n: int = 1) -> None:
        """Give back ``n`` of ``holder``'s share; more than it holds leaves it none."""
        left = self._held.get(holder, 0) - n
        if left > 0:
            self._held[holder] = left
        else:
            self._held.pop(holder, None)
