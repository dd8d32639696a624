"""The rules for stage names, request ids and keys, shared by client and daemon.

A stage name must pass the same check at ``put(to_stage=...)`` as at attach,
or a put addressed to a name no stage can ever attach under waits for its
TTL. Request ids are the application's own (often a UUID or an HTTP request
id), so any printable text is allowed; control characters are not, because
ids end up in ``relayd leases``/``top`` tables and in the daemon's log.
Whatever reaches a terminal or a log still goes through :func:`printable`:
the daemon also shows what older or hostile clients sent.

A key names one payload of keyed delivery for one consumer stage, from one
writer stage: the index is keyed by ``(to_stage, from_stage, key)``. Keys come
from applications (``f"{request}_{stage}_{chunk}"``) and, at the daemon, from
any session or peer, so they are bounded and restricted to printable ASCII
without spaces: nothing that could smuggle a control character into a log
line or a status table.
"""

from __future__ import annotations

import re

from .errors import InvalidArgumentError

STAGE_NAME_MAX = 128
REQUEST_ID_MAX = 256
MAX_KEY_CHARS = 256
#: The stages one session may serve.
MAX_SESSION_STAGES = 16
_STAGE_NAME_RE = re.compile(rf"[A-Za-z0-9_.:/@-]{{1,{STAGE_NAME_MAX}}}")
_KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")
# Names that passed: a writer puts to the same few stages over and over, and
# the regex on every put cost more than the set look-up (cold after a copy).
# The verdict is a pure function of the (immutable) string; bounded, as names
# may come from hostile input.
_VALID_STAGES: set[str] = set()
_VALID_STAGES_MEMORY = 1024


def check_stage(value: object, what: str = "stage name") -> str:
    """``value`` if it is a valid stage name, else InvalidArgumentError saying why."""
    if type(value) is str and value in _VALID_STAGES:
        return value
    if not isinstance(value, str) or not _STAGE_NAME_RE.fullmatch(value):
        shown = printable(value if isinstance(value, str) else repr(value))[:64]
        raise InvalidArgumentError(
            f"{what} {shown!r} must be 1-{STAGE_NAME_MAX} characters of letters, digits and _.:/@-"
        )
    if type(value) is str:  # a str subclass could hash or compare as something else
        if len(_VALID_STAGES) >= _VALID_STAGES_MEMORY:
            _VALID_STAGES.clear()
        _VALID_STAGES.add(value)
    return value


def check_request_id(value: object) -> str:
    """``value`` if it is a valid request id, else InvalidArgumentError saying why."""
    if not isinstance(value, str) or not 1 <= len(value) <= REQUEST_ID_MAX:
        raise InvalidArgumentError(f"request_id must be 1-{REQUEST_ID_MAX} characters")
    if not value.isprintable():
        raise InvalidArgumentError(
            f"request_id {printable(value)[:64]!r} contains a control character "
            "(newline, tab, escape, ...)"
        )
    return value


def check_key(key: object) -> str:
    """``key`` if it is a valid key, else InvalidArgumentError."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        shown = key[:64] if isinstance(key, str) else type(key).__name__
        raise InvalidArgumentError(
            f"key {shown!r} must be 1-{MAX_KEY_CHARS} printable ASCII characters without spaces"
        )
    return key


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
