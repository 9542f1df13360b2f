"""Prometheus metrics of a running ledger (``loraledger serve``, ``GET /metrics``).

Two sources, chosen so no number can drift from the truth:

* **Gauges are read from the live state at scrape time** (a custom collector): version counts
  per state, capacity used and limit, sessions bound per version, requests in flight per
  engine (from the owners' lease renewals and any in-process gateway), routable engines, the
  head seq and epoch. Nothing is incremented by hand, so nothing can be forgotten.
* **Counters and the latency histogram are fed from the log itself** (:meth:`observe` gets
  every committed record): events appended per type, and publish latency measured from a
  version's allocation to its commit using the records' ``recorded_at`` (the same numbers a
  later ``replay`` shows).

Each service gets its own ``CollectorRegistry`` (never the process-global one), so tests and
embedded uses can run several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from evlog.events import InFlight, VersionAllocated, VersionPublished
from evlog.record import Record
from projections.registry import RegistryState, VersionState

PUBLISH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
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
            routable.add_metric([engine], 1 if member.routable else 0)
        yield per_engine
        yield routable
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


class LedgerMetrics:
    """The metrics of one ledger. ``observe`` every committed record (the service's log
    follower does); scrape ``registry``."""

    def __init__(
        self,
        state: Callable[[], RegistryState],
        inflight: Iterable[InFlightReport] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._inflight = list(inflight)
        self.registry.register(_StateCollector(state, self._inflight))
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
        self._allocated: dict[int, float] = {}

    def add_inflight(self, report: InFlightReport) -> None:
        self._inflight.append(report)

    def observe(self, record: Record) -> None:
        event = record.event
        self.events.labels(record.type).inc()
        if isinstance(event, VersionAllocated):
            self._allocated[event.version_id] = record.recorded_at
        elif isinstance(event, VersionPublished):
            started = self._allocated.pop(event.version_id, None)
            if started is not None:
                self.publish_latency.observe(max(record.recorded_at - started, 0.0))
