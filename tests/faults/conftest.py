from __future__ import annotations

from tests._fixtures import separate_processes

__all__ = ["separate_processes"]
