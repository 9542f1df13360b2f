"""Lease renewals of a remote client, kept per *life* until they are forwarded.

``HttpLedger`` and ``RayLedger`` take a worker's ``renew_lease`` locally (it is synchronous
and must never wait for the network) and forward the newest one per life in the background.
A life is ``(owner, incarnation)``, never the owner alone: one client may carry two lives of
the same owner, a worker that restarted in the same process while its predecessor (a zombie)
still renews. Keyed by owner, the predecessor's refusal (``OWNER_RESTARTED``) would be
charged to its successor, and each life's renewal would overwrite the other's; keyed by life,
the zombie hears its refusal and the successor is untouched.

A relay's renewal also names the client-held sessions it had a turn of (docs/sessions.md, "Who
owns a session"). Counts are a state (the newest replaces the older), sessions are news: every
session recorded since the last forward is sent, the sets of several renewals joined.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import anyio

from evlog.errors import LoraLedgerError

Life = tuple[str, str]
"""``(owner, incarnation)``: one process's life as an owner."""

Counts = dict[tuple[str, int], int]
"""In-flight requests per ``(engine, version_id)``, zeros left out."""


class PendingRenewals:
    """The newest renewal of each life not yet forwarded, and the lives the ledger refused.

    Not thread-safe and free of awaits: everything runs on the client's event loop, so a
    ``take`` and the ``record`` that follows it never interleave halfway."""

    def __init__(self) -> None:
        self._pending: dict[Life, Counts] = {}
        self._newest: dict[Life, Counts] = {}  # each life's newest counts, forwarded or not
        self._sessions: dict[Life, set[str]] = {}
        self._lost: dict[Life, LoraLedgerError] = {}
        self.wanted = anyio.Event()  # set while something waits to be forwarded

    def record(
        self,
        owner: str,
        incarnation: str,
        inflight: Mapping[tuple[str, int], int] | None,
        sessions: Iterable[str] = (),
    ) -> None:
        """Keep this renewal of ``(owner, incarnation)`` (it replaces an older one not yet
        forwarded; its ``sessions`` join theirs). Raises the ledger's refusal if it refused
        this life before: a stale worker learns it is stale on its next renewal, from memory."""
        life = (owner, incarnation)
        lost = self._lost.get(life)
        if lost is not None:
            raise lost
        counts = {k: n for k, n in (inflight or {}).items() if n}
        self._pending[life] = self._newest[life] = counts
        if sessions:
            self._sessions.setdefault(life, set()).update(sessions)
        self.wanted.set()

    def pend(self, life: Life) -> None:
        """Have ``life`` forwarded with the next renewals even if nothing new was recorded
        (its newest counts again): a confirmation needs the ledger's answer about it."""
        self._pending.setdefault(life, self._newest.get(life, {}))
        self.wanted.set()

    def lost(self, life: Life) -> LoraLedgerError | None:
        """The ledger's refusal of ``life``, if it refused it."""
        return self._lost.get(life)

    def take(self) -> dict[Life, Counts]:
        """Everything to forward now (with :meth:`take_sessions`, read right after, no await
        between); the next ``record`` wakes the forwarder again."""
        self.wanted = anyio.Event()
        taken, self._pending = self._pending, {}
        return taken

    def take_sessions(self) -> dict[Life, tuple[str, ...]]:
        """The sessions each life touched since the last take, to forward with its counts."""
        taken, self._sessions = self._sessions, {}
        return {life: tuple(sorted(sessions)) for life, sessions in taken.items()}

    def keep(self, life: Life, counts: Counts, sessions: Iterable[str] = ()) -> None:
        """A forward that did not reach the ledger: send it next time, unless a newer renewal
        of the same life was recorded meanwhile (its sessions are sent either way)."""
        self._pending.setdefault(life, counts)
        if sessions:
            self._sessions.setdefault(life, set()).update(sessions)
        self.wanted.set()

    def refused(self, life: Life, error: LoraLedgerError) -> None:
        """The ledger refused ``life`` for good (``OWNER_RESTARTED``, ``LEASE_EXPIRED``, ...):
        its next ``record`` raises ``error`` (the first refusal heard is the one kept)."""
        self._lost.setdefault(life, error)

    def registered(self, life: Life) -> None:
        """``life`` was (re-)registered: whatever was refused of it before is moot."""
        self._lost.pop(life, None)

    def ended(self, life: Life) -> None:
        """``life`` deregistered: nothing more of it is forwarded."""
        self._pending.pop(life, None)
        self._newest.pop(life, None)
        self._sessions.pop(life, None)
