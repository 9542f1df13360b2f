"""Raw asyncpg access to a PostgreSQL log, bypassing the store: how the PostgreSQL tests read,
damage or forge a database the way an operator, an attacker or another application would."""

from __future__ import annotations

from typing import Any

import asyncpg

COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"


async def sql(url: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows ``query`` returns, on a connection of its own."""
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(query, *args)]
    finally:
        await conn.close()


async def execute(url: str, query: str, *args: Any) -> str:
    """Run ``query`` (several statements when it has no arguments) on a connection of its own;
    the server's status line (``UPDATE 1``)."""
    conn = await asyncpg.connect(url)
    try:
        return await conn.execute(query, *args)
    finally:
        await conn.close()
