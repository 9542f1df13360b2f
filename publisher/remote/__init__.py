"""The ledger across a process boundary: ``wire`` (every request and reply body), ``routing``
(the tables a remote gateway routes by), ``service`` (what the ledger's process answers, for
every transport), ``renewals`` (a client's lease renewals, kept per life), ``client`` (the one
remote ledger over a transport), ``http`` (``serve`` over HTTP: the service client and
:class:`HttpLedger`). The Ray transport lives with the Ray deployment (``publisher.ray``).
"""

from publisher.remote.client import RemoteLedger, RemoteView, Transport
from publisher.remote.http import (
    HttpLedger,
    LedgerUnreachable,
    RemoteLedgerError,
    ServiceClient,
)
from publisher.remote.service import LedgerService

__all__ = [
    "HttpLedger",
    "LedgerService",
    "LedgerUnreachable",
    "RemoteLedger",
    "RemoteLedgerError",
    "RemoteView",
    "ServiceClient",
    "Transport",
]
