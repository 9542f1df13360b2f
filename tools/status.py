"""``loraledger status``: the live ``LedgerStatus`` of a running ``loraledger serve``.

The service answers ``GET /status`` with exactly the ``LedgerStatus`` struct the ledger
computes; the service client (:class:`~publisher.remote.http.ServiceClient`, the one every
client of ``serve`` uses) decodes it back into that struct (an incompatible answer fails
loudly) and the CLI renders it with the same view as ``replay``.
"""

from __future__ import annotations

import anyio

from evlog.errors import LoraLedgerError
from projections.status import LedgerStatus
from publisher.remote.http import LedgerUnreachable, RemoteLedgerError, ServiceClient
from tools.exitcodes import Exit, ToolError


def fetch_status(url: str, *, token: str | None = None, timeout: float = 5.0) -> LedgerStatus:
    async def fetch() -> LedgerStatus:
        client = ServiceClient(url, token=token, timeout_s=timeout)
        try:
            return await client.get("/status", LedgerStatus)
        finally:
            await client.aclose()

    target = url.rstrip("/") + "/status"
    try:
        return anyio.run(fetch)
    except LedgerUnreachable as exc:
        raise ToolError(
            Exit.UNREACHABLE, f"{exc}; is `loraledger serve` running at {url}?"
        ) from None
    except RemoteLedgerError as exc:
        if exc.details.get("status") == 200:  # an answer, but not a ledger's status
            raise ToolError(
                Exit.FAILED, f"{target} did not answer a ledger status: {exc.message}"
            ) from None
        raise ToolError(Exit.UNREACHABLE, exc.message) from None  # not a ledger service
    except LoraLedgerError as exc:
        raise ToolError(Exit.UNREACHABLE, f"{target} refused: {exc.code}: {exc.message}") from None
