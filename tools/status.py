"""``loraledger status``: the live ``LedgerStatus`` of a running ``loraledger serve``.

The service answers ``GET /status`` with exactly the ``LedgerStatus`` struct the ledger
computes, so this decodes it back into that struct (an incompatible answer fails loudly) and
the CLI renders it with the same view as ``replay``.
"""

from __future__ import annotations

import httpx
import msgspec

from projections.status import LedgerStatus
from tools.exitcodes import Exit, ToolError


def fetch_status(url: str, *, token: str | None = None, timeout: float = 5.0) -> LedgerStatus:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    target = url.rstrip("/") + "/status"
    try:
        # trust_env=False: a proxy from the environment must never see loopback traffic.
        with httpx.Client(trust_env=False, timeout=timeout) as client:
            reply = client.get(target, headers=headers)
    except httpx.HTTPError as exc:
        raise ToolError(
            Exit.UNREACHABLE,
            f"no ledger answered at {target} ({type(exc).__name__}: {exc}); "
            "is `loraledger serve` running there?",
        ) from None
    if reply.status_code != 200:
        raise ToolError(
            Exit.UNREACHABLE,
            f"{target} answered HTTP {reply.status_code}: {reply.text[:200]}",
        )
    try:
        return msgspec.json.decode(reply.content, type=LedgerStatus)
    except msgspec.DecodeError as exc:
        raise ToolError(Exit.FAILED, f"{target} did not answer a ledger status: {exc}") from None
