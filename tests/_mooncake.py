"""Whether Mooncake Transfer Engine imports here, for the tests that need it."""

from __future__ import annotations

import pytest

from relayd.transports.mooncake_engine import PACKAGE


def _missing() -> str:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"mooncake.engine cannot be imported ({exc}); install {PACKAGE}"
    return ""


NO_MOONCAKE = _missing()
requires_mooncake = pytest.mark.skipif(bool(NO_MOONCAKE), reason=NO_MOONCAKE)
