"""Owner leases and in-flight reports: soft state kept at the edge, never logged per renewal.

A rollout worker renews its lease every few seconds and, with each renewal, reports how many
requests it has in flight per (engine, version). Logging every heartbeat would drown the log;
instead the *decisions* carry the evidence they relied on: ``OwnerLeaseExpired`` records the
last renewal it saw, ``ReclaimClaimed`` records the in-flight reports. A replay therefore
explains every decision without the heartbeats.

After a controller restart every registered owner gets a full ttl of grace (its last renewal
is unknown), so a restart can never expire a live worker. Its in-flight counts are unknown too
(they were only ever in the previous controller's memory): such an owner is *unheard* until
its first renewal, or until its lease ends, and reclaim waits for it (:meth:`LeaseBook.unheard`)
rather than read the missing counts as zero.

A new incarnation may replace a live life without that life's secret (a crashed worker must
restart at once), so anyone allowed to register could otherwise wipe a running life's counts
and make its version look idle. The replaced life's last non-zero counts therefore stay in the
evidence until its lease would have lapsed (last renewal + its ttl), as if it still ran: a
replacement can fence a life, never shorten how long its running requests hold a version.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from evlog.events import InFlight


class Lease(msgspec.Struct):
    last_seen: float
    inflight: dict[tuple[str, int], int] = msgspec.field(default_factory=dict)


class ReplacedLife(msgspec.Struct, frozen=True, kw_only=True):
    """A life replaced while its lease ran: its last counts hold until ``until``."""

    owner: str
    incarnation: str
    last_seen: float
    until: float
    inflight: dict[tuple[str, int], int]


class LeaseBook:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._replaced: list[ReplacedLife] = []
        self._unheard: set[str] = set()

    def grant(self, owner: str, now: float, *, heard: bool = True) -> None:
        """Start (or restart after a controller restart) a lease at ``now``; ``heard=False``
        (a controller's start): the owner's in-flight counts are unknown until it renews."""
        if owner not in self._leases and not heard:
            self._unheard.add(owner)
        self._leases.setdefault(owner, Lease(last_seen=now))

    def unheard(self) -> list[str]:
        """Owners granted at a controller's start that have not renewed since, their leases
        still running: requests of theirs may run that no in-flight count shows."""
        return sorted(self._unheard)

    def restart(self, owner: str, now: float, *, replaced: str = "", ttl_s: float = 0.0) -> None:
        """A new incarnation of ``owner``: a fresh lease without its predecessor's in-flight
        counts (they were that process's; the new one reports its own). The predecessor (life
        ``replaced``, lease ``ttl_s``) keeps its non-zero counts in the evidence until its
        lease would have lapsed, if it had not lapsed at ``now``."""
        self._replaced = [life for life in self._replaced if now < life.until]
        self._unheard.discard(owner)
        old = self._leases.get(owner)
        if old is not None and old.inflight and now - old.last_seen < ttl_s:
            self._replaced.append(
                ReplacedLife(
                    owner=owner,
                    incarnation=replaced,
                    last_seen=old.last_seen,
                    until=old.last_seen + ttl_s,
                    inflight=dict(old.inflight),
                )
            )
        self._leases[owner] = Lease(last_seen=now)

    def renew(
        self, owner: str, now: float, inflight: Mapping[tuple[str, int], int] | None = None
    ) -> None:
        lease = self._leases.setdefault(owner, Lease(last_seen=now))
        lease.last_seen = max(lease.last_seen, now)
        if inflight is not None:
            lease.inflight = {key: n for key, n in inflight.items() if n}
            self._unheard.discard(owner)

    def drop(self, owner: str) -> None:
        self._leases.pop(owner, None)
        self._unheard.discard(owner)

    def last_seen(self, owner: str) -> float | None:
        lease = self._leases.get(owner)
        return None if lease is None else lease.last_seen

    def overdue(self, now: float, ttls: Mapping[str, float]) -> list[tuple[str, float]]:
        """Owners (with their last renewal) whose lease ran out at ``now``."""
        return sorted(
            (owner, lease.last_seen)
            for owner, lease in self._leases.items()
            if owner in ttls and now - lease.last_seen >= ttls[owner]
        )

    def inflight(self, version_id: int, now: float) -> list[InFlight]:
        """Evidence for a reclaim claim: one entry per live owner (its count per engine where
        non-zero, else a single zero entry for all engines, dated by its last renewal), then
        the non-zero counts of each replaced life whose lease would still run at ``now``."""
        self._replaced = [life for life in self._replaced if now < life.until]
        reports: list[InFlight] = []
        for owner, lease in sorted(self._leases.items()):
            busy = sorted(
                (engine, n) for (engine, vid), n in lease.inflight.items() if vid == version_id
            )
            if not busy:
                busy = [("*", 0)]
            reports.extend(
                InFlight(reporter=owner, engine=engine, count=n, at=lease.last_seen)
                for engine, n in busy
            )
        for life in self._replaced:
            reports.extend(
                InFlight(
                    reporter=f"{life.owner} (replaced life {life.incarnation})",
                    engine=engine,
                    count=n,
                    at=life.last_seen,
                )
                for (engine, vid), n in sorted(life.inflight.items())
                if vid == version_id
            )
        return reports
