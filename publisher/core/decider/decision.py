"""What the decider answers: the events to append, and an outcome or a refusal.

Its own module because every handler builds one and ``decide`` imports every handler: defined
beside ``decide``, it would make each aggregate import the module that imports it (a cycle).
"""

from __future__ import annotations

import msgspec

from evlog.events import Event
from publisher.core.errors import LedgerError
from publisher.core.outcomes import Outcome


class Decision(msgspec.Struct, frozen=True):
    """Events to append (possibly empty), and either an outcome or a refusal."""

    events: tuple[Event, ...] = ()
    outcome: Outcome | None = None
    error: LedgerError | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None
