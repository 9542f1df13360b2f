"""The gateway: where every face's generation is routed, counted, sent once and recorded.

``view`` (how a process reads the ledger), ``affinity`` (which holder serves a session),
``failures`` (what an engine's error proves), ``inflight`` (the counts reclaim waits for),
``dispatch`` (the one executor, :class:`Gateway`) and ``provenance`` (which version served what).
"""

from publisher.gateway.dispatch import Attempt, Gateway, Owner, Served, version_salt
from publisher.gateway.failures import DispatchCode, DispatchError, try_elsewhere
from publisher.gateway.inflight import InFlightCounter
from publisher.gateway.view import LedgerView, LocalView, refreshed

__all__ = [
    "Attempt",
    "DispatchCode",
    "DispatchError",
    "Gateway",
    "InFlightCounter",
    "LedgerView",
    "LocalView",
    "Owner",
    "Served",
    "refreshed",
    "try_elsewhere",
    "version_salt",
]
