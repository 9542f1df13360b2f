"""The ledger across a process boundary: ``wire`` (every request and reply body), ``routing``
(the tables a remote gateway routes by), ``service`` (what the ledger's process answers, for
every transport), ``renewals`` (a client's lease renewals, kept per life), ``client`` (the one
remote ledger over a transport), ``http`` (``serve`` over HTTP: the service client and
:class:`HttpLedger`), ``uploads`` (adapter bytes a remote trainer sends, received into the
artifact store) and ``trainer`` (:class:`HttpTrainerClient`, the trainer's side of them). The
Ray transport lives with the Ray deployment (``publisher.ray``).
"""

from publisher.remote.client import RemoteLedger, RemoteView, Transport
from publisher.remote.http import (
    HttpLedger,
    LedgerUnreachable,
    RemoteLedgerError,
    ServiceClient,
)
from publisher.remote.service import LedgerService
from publisher.remote.trainer import HttpTrainerClient
from publisher.remote.uploads import AdapterUploads

__all__ = [
    "AdapterUploads",
    "HttpLedger",
    "HttpTrainerClient",
    "LedgerService",
    "LedgerUnreachable",
    "RemoteLedger",
    "RemoteLedgerError",
    "RemoteView",
    "ServiceClient",
    "Transport",
]
