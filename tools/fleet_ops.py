"""``loraledger fleet suspend|resume|remove ENGINE``: an operator's action on one engine of a
running ``loraledger serve``, over its token-protected ``POST /engines/{engine}/{action}``
(through the service client every client of ``serve`` uses).

Each action is recorded in the log with its cause ``operator`` (``EngineSuspended``,
``EngineResumed``, ``EngineLeft``), so an incident replay shows who took an engine out and
when. A refusal keeps the ledger's code (``UNKNOWN_ENGINE``, ``ENGINE_SUSPENDED``, ...).
"""

from __future__ import annotations

from typing import Any

import anyio

from evlog.errors import LoraLedgerError
from publisher.remote import wire
from publisher.remote.http import LedgerUnreachable, ServiceClient, segment
from tools.exitcodes import Exit, ToolError

ACTIONS = ("suspend", "resume", "remove")


def engine_action(
    url: str,
    engine: str,
    action: str,
    *,
    token: str | None,
    detail: str = "",
    timeout: float = 10.0,
) -> dict[str, Any]:
    """POST the action; returns the service's JSON answer or raises ``ToolError``."""
    if action not in ACTIONS:
        raise ToolError(Exit.USAGE, f"action {action!r} must be one of {', '.join(ACTIONS)}")

    async def post() -> Any:
        client = ServiceClient(url, token=token, timeout_s=timeout)
        try:
            path = f"/engines/{segment(engine)}/{action}"
            return await client.post(path, wire.EngineAction(detail=detail), Any)
        finally:
            await client.aclose()

    try:
        answer = anyio.run(post)
    except LedgerUnreachable as exc:
        raise ToolError(
            Exit.UNREACHABLE, f"{exc}; is `loraledger serve` running at {url}?"
        ) from None
    except LoraLedgerError as exc:
        raise ToolError(
            Exit.FAILED, f"{action} {engine} refused: {exc.code}: {exc.message}"
        ) from None
    return answer if isinstance(answer, dict) else {"answer": answer}
