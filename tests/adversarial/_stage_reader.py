"""A stage process of another uid that waits for one keyed put; run by test_stage_owner.

Prints one JSON line once its session is bound (``{"bound": session id}``),
then one with the payload's SHA-256, or the error either step raised.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any

# How long the reader waits for the put; the test's own bound on the process is longer.
TAKE_TIMEOUT = 60.0


async def read_key(socket: str, stage: str, key: str, from_stage: str) -> dict[str, Any]:
    from relayd_client import RelayClient

    async with RelayClient(stage, socket, timeout=10) as c:
        print(json.dumps({"bound": c.session_id}), flush=True)
        payload = await c.get_key(key, from_stage=from_stage, timeout=TAKE_TIMEOUT)
        return {"sha256": hashlib.sha256(payload["x"].numpy().tobytes()).hexdigest()}


def main(argv: list[str]) -> int:
    try:
        out = asyncio.run(read_key(*argv))
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
