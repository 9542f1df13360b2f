"""``loraledger fleet suspend|resume|remove ENGINE``: an operator's action on one engine of a
running ``loraledger serve``, over its token-protected ``POST /engines/{engine}/{action}``.

Each action is recorded in the log with its cause ``operator`` (``EngineSuspended``,
``EngineResumed``, ``EngineLeft``), so an incident replay shows who took an engine out and
when. A refusal keeps the ledger's code (``UNKNOWN_ENGINE``, ``ENGINE_SUSPENDED``, ...).
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

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
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    target = f"{url.rstrip('/')}/engines/{engine}/{action}"
    try:
        # trust_env=False: a proxy from the environment must never see loopback traffic.
        with httpx.Client(trust_env=False, timeout=timeout) as client:
            reply = client.post(target, headers=headers, json={"detail": detail})
    except httpx.HTTPError as exc:
        raise ToolError(
            Exit.UNREACHABLE,
            f"no ledger answered at {target} ({type(exc).__name__}: {exc}); "
            "is `loraledger serve` running there?",
        ) from None
    try:
        body: Any = msgspec.json.decode(reply.content)
    except msgspec.DecodeError:
        body = {"message": reply.text[:200]}
    if reply.status_code != 200:
        code = body.get("code", "") if isinstance(body, dict) else ""
        message = body.get("message", "") if isinstance(body, dict) else str(body)
        raise ToolError(
            Exit.FAILED, f"{action} {engine} refused: HTTP {reply.status_code} {code}: {message}"
        )
    return body if isinstance(body, dict) else {"answer": body}
