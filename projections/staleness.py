"""Staleness, defined once: how many versions were published between the one a session is
bound to and the default (docs/sessions.md#staleness).

Revisions count commits (every ``VersionPublished`` takes the next one, rollbacks included),
so ``staleness = default_revision - bound_revision``: 0 for a session on the default, 3 for
one bound three publications ago. The gateway stamps it on every generation (provenance
``staleness``), the metrics histogram counts it, ``audit`` reports it, and the deployment's
``max_staleness`` bounds it. Pure arithmetic, here so that every one of them computes the same
number the same way.
"""

from __future__ import annotations

# The ``SessionReleased.cause`` of a session released because its staleness exceeded the
# deployment's ``max_staleness``.
TOO_STALE = "too_stale"


def staleness(bound_revision: int, default_revision: int) -> int:
    """Versions published since the session bound (never negative)."""
    return max(0, default_revision - bound_revision)


def too_stale(bound_revision: int, default_revision: int, max_staleness: int | None) -> bool:
    """Whether a session bound at ``bound_revision`` may not take another turn: its staleness
    exceeds ``max_staleness`` (``None``: no bound)."""
    return max_staleness is not None and staleness(bound_revision, default_revision) > max_staleness
