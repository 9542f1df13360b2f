"""Prometheus metrics of a running ledger (``loraledger serve``, ``GET /metrics``).

Two sources, chosen so no number can drift from the truth:

* **Gauges are read from the live state at scrape time** (a custom collector): version counts
  per state, capacity used and limit, sessions bound per version, requests in flight per
  engine (from the owners' lease renewals and any in-process gateway), routable engines, the
  head seq and epoch; and what the alert rules of ``deploy/prometheus/`` fire on: engines
  suspended or unreachable, the newest publication stalled, owners per state, sessions past
  the staleness bound. Nothing is incremented by hand, so nothing can be forgotten.
* **Counters and the latency histogram are fed from the log itself** (:meth:`observe` gets
  every committed record): events appended per type, sessions released per cause (``too_stale``
  among them), publications skipped per code, and publish latency measured from a version's
  allocation to its commit using the records' ``recorded_at`` (the same numbers a later
  ``replay`` shows).
* **Staleness** (docs/sessions.md#staleness), two histograms: of the sessions bound now (read
  from the state at scrape time: a session's staleness is its version's distance from the
  default revision), and of the generations served (``loraledger_generation_staleness``), fed
  by the gateways of this process through :class:`StalenessSink` around their provenance sink
  (generations are not in the log, so a service without an in-process gateway shows it empty).
* **The drivers' loops**: the reclaim driver's sweeps (``loraledger_reclaim_sweeps_total``)
  and the reconciler's health-loop wakes (``loraledger_health_wakes_total``), read from the
  drivers at scrape time when the service runs them: a loop is alive while its count grows.

Each service gets its own ``CollectorRegistry`` (never the process-global one), so tests and
embedded uses can run several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from evlog.events import (
    InFlight,
    PublicationSkipped,
    SessionReleased,
    VersionAllocated,
    VersionPublished,
)
from evlog.record import Record
from projections.registry import SERVING_STATES, RegistryState, VersionState
from projections.staleness import staleness, too_stale
from publisher.gateway.provenance import ProvenanceRow, Sink

PUBLISH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# In published versions: 0 is on-policy; async RL bounds typically sit at 1-8.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_LIVE = (
    VersionState.LOADING,
    VersionState.PUBLISHED,
    VersionState.RETIRED,
    VersionState.RECLAIMING,
)

InFlightReport = Callable[[int], Iterable[InFlight]]  # version id -> in-flight reports


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], RegistryState], inflight: list[InFlightReport]):
        self._state = state
        self._inflight = inflight

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        versions = GaugeMetricFamily("loraledger_versions", "Versions per state.", labels=["state"])
        counts = {state: 0 for state in VersionState}
        for v in s.versions.values():
            counts[v.state] += 1
        for state, n in counts.items():
            versions.add_metric([str(state)], n)
        yield versions
        yield GaugeMetricFamily(
            "loraledger_capacity_used", "Versions holding a capacity slot.", value=s.capacity_used()
        )
        yield GaugeMetricFamily(
            "loraledger_capacity_limit", "Capacity slots of the deployment.", value=s.capacity
        )
        bound = GaugeMetricFamily(
            "loraledger_bound_sessions",
            "Sessions bound per version (live versions only).",
            labels=["version", "state"],
        )
        inflight: dict[str, int] = {engine: 0 for engine in s.engines}
        for v in sorted(s.versions.values(), key=lambda v: v.version_id):
            if v.state in _LIVE:
                bound.add_metric([str(v.version_id), str(v.state)], v.bound)
                for report in self._inflight:
                    for x in report(v.version_id):
                        if x.engine in inflight:
                            inflight[x.engine] += x.count
        yield bound
        per_engine = GaugeMetricFamily(
            "loraledger_inflight_requests",
            "Generation requests in flight per engine, as reported by rollout workers' "
            "lease renewals and in-process gateways.",
            labels=["engine"],
        )
        routable = GaugeMetricFamily(
            "loraledger_engine_routable", "1 if the engine may serve.", labels=["engine"]
        )
        for engine, member in sorted(s.engines.items()):
            per_engine.add_metric([engine], inflight[engine])
            routable.add_metric([engine], 1 if member.serving else 0)
        yield per_engine
        yield routable
        yield from _engine_troubles(s)
        yield _open_stalls(s)
        yield _owners(s)
        yield GaugeMetricFamily(
            "loraledger_sessions_bound", "Sessions bound in total.", value=len(s.sessions)
        )
        yield GaugeMetricFamily(
            "loraledger_last_seq", "Seq of the newest record.", value=s.last_seq
        )
        yield GaugeMetricFamily("loraledger_epoch", "Controller epoch.", value=s.epoch)
        yield GaugeMetricFamily(
            "loraledger_default_revision",
            "Commits of a new default so far.",
            value=s.default_revision,
        )
        yield _bound_staleness(s)
        if s.max_staleness is not None:
            yield GaugeMetricFamily(
                "loraledger_max_staleness",
                "The deployment's bound on a session's staleness (absent: unbounded).",
                value=s.max_staleness,
            )
        yield GaugeMetricFamily(
            "loraledger_sessions_over_staleness_bound",
            "Sessions bound to a version more than max_staleness behind the default (0 when "
            "unbounded): refused at their next turn, and pinning their versions until then.",
            value=_over_bound(s),
        )


def _engine_troubles(s: RegistryState) -> Iterator[Metric]:
    """Why an engine is out of routing, apart: a suspension lasts until a repair or an
    operator lifts it (publication stops waiting for the engine), an outage until a probe
    answers (publication still waits). An alert tells them apart; ``routable`` cannot."""
    suspended = GaugeMetricFamily(
        "loraledger_engine_suspended",
        "1 while the engine is suspended (quarantined until repaired or resumed).",
        labels=["engine"],
    )
    unreachable = GaugeMetricFamily(
        "loraledger_engine_unreachable",
        "1 while an outage of the engine lasts (it could not be reached; out of routing).",
        labels=["engine"],
    )
    for engine, member in sorted(s.engines.items()):
        suspended.add_metric([engine], 1 if member.suspended else 0)
        unreachable.add_metric([engine], 0 if member.unreachable is None else 1)
    yield suspended
    yield unreachable


def _open_stalls(s: RegistryState) -> GaugeMetricFamily:
    """Publications waiting on a refusal (``PublicationBlocked``) not yet lifted, per refusal
    code. A stall ends when its version is allocated; one whose version a newer default has
    passed is moot (the trainer moved on), so it is not counted: an alert on this gauge fires
    only while a trainer's newest publication waits."""
    per_code: dict[str, int] = {}
    for version_id, stall in s.stalls.items():
        if s.default is None or version_id > s.default:
            per_code[stall.code] = per_code.get(stall.code, 0) + 1
    family = GaugeMetricFamily(
        "loraledger_publications_stalled",
        "Publications refused until something else happens (a blocking version, one in "
        "progress, no routable engine, capacity), per refusal code.",
        labels=["code"],
    )
    for code, n in sorted(per_code.items()):
        family.add_metric([code], n)
    return family


def _owners(s: RegistryState) -> GaugeMetricFamily:
    """Owner ids by how their current life stands: ``live``, ``expired`` (the lease ran out:
    its sessions were released) or ``exited`` (deregistered cleanly)."""
    counts = {"live": 0, "expired": 0, "exited": 0}
    for owner in s.owners.values():
        counts["expired" if owner.expired else "exited" if owner.exited else "live"] += 1
    family = GaugeMetricFamily(
        "loraledger_owners", "Owners (rollout workers, relays) per state.", labels=["state"]
    )
    for state, n in counts.items():
        family.add_metric([state], n)
    return family


def _over_bound(s: RegistryState) -> int:
    """Bound sessions past the staleness bound (each is bound at its version's revision, as
    in :func:`_bound_staleness`)."""
    return sum(
        v.bound
        for v in s.versions.values()
        if v.state in SERVING_STATES
        and v.revision is not None
        and too_stale(v.revision, s.default_revision, s.max_staleness)
    )


def _bound_staleness(s: RegistryState) -> HistogramMetricFamily:
    """Sessions bound now, by staleness: every session of a version bound at its revision (a
    bind takes the default), so the histogram is one pass over the versions, not the sessions."""
    per_value: dict[int, int] = {}
    for v in s.versions.values():
        if v.state in SERVING_STATES and v.bound and v.revision is not None:
            behind = staleness(v.revision, s.default_revision)
            per_value[behind] = per_value.get(behind, 0) + v.bound
    buckets: list[tuple[str, float]] = []
    for bound in STALENESS_BUCKETS:
        buckets.append((str(float(bound)), sum(n for k, n in per_value.items() if k <= bound)))
    total = sum(per_value.values())
    buckets.append(("+Inf", total))
    total_sum = sum(k * n for k, n in per_value.items())
    family = HistogramMetricFamily(
        "loraledger_bound_session_staleness",
        "Sessions bound now, by staleness (versions published since they bound).",
    )
    family.add_metric([], buckets, total_sum)
    return family


class _DriverLoops(Collector):
    """How often the control plane's loops ran since this service started, read from the
    drivers at scrape time (each one the service runs): the evidence that a loop is alive, and
    what a caller waits on to know that a loop has looked at the state again since some change
    (a pass that starts after the change ends before the next one starts)."""

    def __init__(
        self, reclaim_sweeps: Callable[[], int] | None, health_wakes: Callable[[], int] | None
    ) -> None:
        self._reclaim_sweeps = reclaim_sweeps
        self._health_wakes = health_wakes

    def collect(self) -> Iterator[Metric]:
        if self._reclaim_sweeps is not None:
            yield CounterMetricFamily(
                "loraledger_reclaim_sweeps",
                "Sweeps of the reclaim driver since this service started.",
                value=self._reclaim_sweeps(),
            )
        if self._health_wakes is not None:
            yield CounterMetricFamily(
                "loraledger_health_wakes",
                "Wakes of the reconciler's health loop (a probe tick, or a report of an "
                "engine's trouble) since this service started.",
                value=self._health_wakes(),
            )


class LedgerMetrics:
    """The metrics of one ledger. ``observe`` every committed record (the service's log
    follower does); scrape ``registry``."""

    def __init__(
        self,
        state: Callable[[], RegistryState],
        inflight: Iterable[InFlightReport] = (),
        reclaim_sweeps: Callable[[], int] | None = None,
        health_wakes: Callable[[], int] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._inflight = list(inflight)
        self.registry.register(_StateCollector(state, self._inflight))
        self.registry.register(_DriverLoops(reclaim_sweeps, health_wakes))
        self.events = Counter(
            "loraledger_events_appended",
            "Events appended to the log since this service started, per type.",
            ["type"],
            registry=self.registry,
        )
        self.publish_latency = Histogram(
            "loraledger_publish_latency_seconds",
            "From a version's allocation to its commit as the default (recorded times).",
            buckets=PUBLISH_BUCKETS,
            registry=self.registry,
        )
        self.generation_staleness = Histogram(
            "loraledger_generation_staleness",
            "Staleness of served generations at dispatch (versions published between the "
            "session's version and the default), from this process's gateways.",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self.released = Counter(
            "loraledger_sessions_released",
            "Sessions released since this service started, per cause (closed, lease_expired, "
            "too_stale, ...).",
            ["cause"],
            registry=self.registry,
        )
        self.skipped = Counter(
            "loraledger_publications_skipped",
            "Publications refused for good since this service started, per code "
            "(CAPACITY_ERROR: every slot held, the trainer's version is dropped; "
            "VERSION_REGRESSION).",
            ["code"],
            registry=self.registry,
        )
        self._allocated: dict[int, float] = {}

    def observe_generation(self, row: ProvenanceRow) -> None:
        self.generation_staleness.observe(row.staleness)

    def add_inflight(self, report: InFlightReport) -> None:
        self._inflight.append(report)

    def observe(self, record: Record) -> None:
        event = record.event
        self.events.labels(record.type).inc()
        if isinstance(event, VersionAllocated):
            self._allocated[event.version_id] = record.recorded_at
        elif isinstance(event, SessionReleased):
            self.released.labels(event.cause).inc()
        elif isinstance(event, PublicationSkipped):
            self.skipped.labels(event.code).inc()
        elif isinstance(event, VersionPublished):
            started = self._allocated.pop(event.version_id, None)
            if started is not None:
                self.publish_latency.observe(max(record.recorded_at - started, 0.0))


class StalenessSink:
    """A provenance sink that counts every row's staleness in ``metrics`` before handing the
    rows on: wrap a gateway's sink with it (``ProvenanceRecorder(StalenessSink(sink,
    metrics))``) to expose the staleness of the generations it serves."""

    def __init__(self, inner: Sink, metrics: LedgerMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def write(self, rows: Sequence[ProvenanceRow]) -> None:
        for row in rows:
            self.metrics.observe_generation(row)
        self.inner.write(rows)
