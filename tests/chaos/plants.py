"""Known bugs planted in a chaos run, to show the checker catches them (never in the code
under test: a test-only engine wrapper, or a patched copy of the source tree).

* an engine plant, carried out by ``tests/chaos/recording_engine.py --plant``: ``default`` (a
  turn served on the newest default instead of its session's version: pinning);
* source plants, one text replacement in a copy of the tree that ``serve`` and the gateway
  processes run from: ``resend`` (every failed dispatch tried on another holder, an ambiguous
  one too: at most once), ``release-on-restart`` (the gateway registers as an ordinary worker,
  not a relay, so a new life of it releases the sessions it bound: continuity),
  ``answer-before-commit`` (the ledger answers a batch, then appends it 0.3 s later: a
  ``serve`` killed in between loses what it acknowledged; durability),
  ``unload-ignores-inflight`` (the reclaim driver decides on no in-flight evidence at all, so
  a retired version no session is bound to is claimed and unloaded while a request still runs
  on it -- the run's abandoned sessions make that case in every seed: safe reclaim).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.paths import REPO

ENGINE_PLANTS = ("default",)
SOURCE_PLANTS: dict[str, tuple[str, str, str]] = {
    "resend": (
        "publisher/gateway/failures.py",
        "    if not exc.dispatched:\n        return True\n",
        "    return True  # planted: an ambiguous dispatch is resent\n",
    ),
    "release-on-restart": (
        "tools/gateway.py",
        "ttl_s=opts.ttl_s, sessions_idle_s=opts.session_idle_s",
        "ttl_s=opts.ttl_s, sessions_idle_s=None",
    ),
    "answer-before-commit": (
        "publisher/core/ledger.py",
        "            seqs = await self._store.append(",
        "            self._deliver(batch, decided)  # planted: answered before the COMMIT\n"
        "            await anyio.sleep(0.3)\n"
        "            seqs = await self._store.append(",
    ),
    "unload-ignores-inflight": (
        "publisher/drivers/reclaim.py",
        "        reports.extend(self._ledger.inflight_evidence(version_id))\n"
        "        return reports\n",
        "        return []  # planted: no request in flight, whatever the reporters say\n",
    ),
}
PLANTS = (*ENGINE_PLANTS, *SOURCE_PLANTS)
_PACKAGES = ("evlog", "projections", "publisher", "engines", "tools")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def planted_tree(dest: Path, plant: str) -> Path:
    """A copy of the source packages in ``dest`` with ``plant`` applied; fails if the text it
    replaces is gone (a plant that silently changes nothing would prove nothing)."""
    path, old, new = SOURCE_PLANTS[plant]
    for package in _PACKAGES:
        shutil.copytree(REPO / package, dest / package, ignore=_IGNORE)
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    source = (dest / path).read_text()
    assert source.count(old) == 1, f"plant {plant}: {old!r} is not once in {path}"
    (dest / path).write_text(source.replace(old, new))
    return dest
