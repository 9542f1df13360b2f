"""The provenance rows kept beside a log, read as ``loraledger audit`` reads them (read-only,
next to a live writer or not)."""

from __future__ import annotations

import os
from collections.abc import Collection

from publisher.gateway.provenance import ProvenanceRow, decode_stored
from tools.logfile import open_provenance_beside


async def stored_rows(
    log: str | os.PathLike[str], sessions: Collection[str] | None = None
) -> list[ProvenanceRow]:
    """The rows of ``sessions`` (all when None) in the store beside the log at ``log``; the
    test fails when there is no store there."""
    async with open_provenance_beside(log) as store:
        assert store is not None, f"no provenance store beside {log}"
        return decode_stored(await store.read(sessions))
