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

**Renewals ride a timer; a count the ledger has not seen does not.** The client forwards at
most one renewal round trip per ``renew_interval`` (every life's newest counts in one body:
many admissions in an interval cost one round trip), and that is enough for every count but
one kind. In-flight counts are reclaim evidence: a version is unloaded only when no session is
bound to it *and* no reporter counts a request on it. While a session is bound to the version,
the binding alone blocks the reclaim and the count is moot; it matters when the request
outlives its binding -- a client-held session released as idle or by an operator while its
turn runs, an owner life replaced by a new incarnation (the old life's last forwarded counts
stay evidence until its lease would lapse) -- and none of those waits for the next tick. So a
count that would reach the ledger only at the next tick leaves a window, up to one interval
long, in which a reclaim can act on a version with a request running on it.

What closes it cheaply: the ledger's evidence per ``(engine, version)`` blocks the reclaim
whatever the number, as long as it is not zero. A key the ledger already holds at one or more
from this life (*seen*: an answered forward carried it, and no forward taken since carried it
at zero) stays blocked until the next forward, and the next forward carries the newest counts,
this request's included: a later request on a seen key rides the timer. A request on a key not
seen (the first on that engine and version, or the first since a forward said zero) is
forwarded at once and waited for before it is sent (:meth:`PendingRenewals.unseen`, read by
``RemoteLedger.confirm_lease``); requests admitted meanwhile share that round trip. A key
leaves *seen* when a forward carrying it at zero is taken (it may be applied before the next
request's count is), and every key of a life does when a forward of it fails (the ledger may
have restarted and lost its soft state). Reclaim asking the holders before it acts was the
other choice: it would make every reclaim wait on every gateway process, reachable or not,
where this costs a round trip only on the first request of a key.
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
        # Keys each life's ledger evidence holds at >= 1 until its next forward (docstring).
        self._seen: dict[Life, set[tuple[str, int]]] = {}
        self._last_take: dict[Life, int] = {}  # the number of the last take that carried it
        self.takes = 0  # takes so far: the number of the one just taken, read right after it
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
        self.takes += 1
        for life, counts in taken.items():
            self._last_take[life] = self.takes
            seen = self._seen.get(life)
            if seen:  # a key sent at zero may be applied before a new count: not seen now
                seen.intersection_update(counts)
        return taken

    def answered(self, lives: Mapping[Life, Counts], take: int) -> None:
        """The ledger applied the forward of take number ``take`` (``lives``): its keys are
        seen, unless a later take carried the life (its zeros, if any, may land last)."""
        for life, counts in lives.items():
            if self._last_take.get(life) == take and life not in self._lost:
                self._seen.setdefault(life, set()).update(counts)

    def unseen(self, life: Life) -> bool:
        """Whether ``life`` counts a request on a key its ledger evidence may hold at zero:
        then its renewal must reach the ledger before that request is sent (docstring)."""
        seen = self._seen.get(life, set())
        return any(key not in seen for key in self._newest.get(life, {}))

    def take_sessions(self) -> dict[Life, tuple[str, ...]]:
        """The sessions each life touched since the last take, to forward with its counts."""
        taken, self._sessions = self._sessions, {}
        return {life: tuple(sorted(sessions)) for life, sessions in taken.items()}

    def keep(self, life: Life, counts: Counts, sessions: Iterable[str] = ()) -> None:
        """A forward that did not reach the ledger: send it next time, unless a newer renewal
        of the same life was recorded meanwhile (its sessions are sent either way). Nothing
        of the life is seen any more: the ledger may be a new process without its counts."""
        self._seen.pop(life, None)
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
        self._seen.pop(life, None)
        self._last_take.pop(life, None)
