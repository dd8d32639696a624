"""``relayd bench``: tensor hand-off between processes, relayd against its baselines.

Usage: ``relayd bench [--quick] [--methods ...] [--sizes ...] [--json F] [--plot F.png]``.
The method contract is in ``_api``, the method registry in ``_registry``.
"""

from __future__ import annotations

from relayd_bench._cli import main

__all__ = ["main"]
