"""Keys of keyed delivery: what a key may be, checked the same way by client and daemon.

A key names one payload for one consumer stage, from one writer stage:
the index is keyed by ``(to_stage, from_stage, key)``. Keys come from
applications (``f"{request}_{stage}_{chunk}"``) and, at the daemon, from any
session or peer, so they are bounded and restricted to printable ASCII
without spaces: nothing that could smuggle a control character into a log
line or a status table.
"""

from __future__ import annotations

import re

from ._errors import InvalidArgumentError

MAX_KEY_CHARS = 256
_KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")


def check_key(key: object) -> str:
    """``key`` if it is a valid key, else InvalidArgumentError."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        shown = key[:64] if isinstance(key, str) else type(key).__name__
        raise InvalidArgumentError(
            f"key {shown!r} must be 1-{MAX_KEY_CHARS} printable ASCII characters without spaces"
        )
    return key
