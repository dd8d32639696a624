"""What a client saw lately, in bounded memory: aborted requests, released
leases, inline reads, ended streams.

Each is a set a long-lived client adds to without end, so each keeps only its
newest ``memory`` keys. An ordered dict underneath, so that the membership
test on the read path stays a C call.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


class Recent(collections.OrderedDict[K, None]):
    """The last ``memory`` keys added; the oldest is forgotten first."""

    def __init__(self, memory: int) -> None:
        super().__init__()
        self.memory = memory

    def add(self, key: K) -> None:
        self[key] = None
        while len(self) > self.memory:
            self.popitem(last=False)
