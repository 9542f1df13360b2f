"""The rollout side of a session: bind on the first generation, pin every later turn, release
once, and keep a lease so a dead worker cannot pin a version forever (docs/sessions.md).

``port`` (what a worker needs of a ledger, and retries), ``binder`` (one session:
:class:`SessionBinder`), ``worker`` (the owner of many: :class:`RolloutWorker`).
"""

from publisher.sessions.binder import IDLE_CAUSE, SessionBinder
from publisher.sessions.port import OWNER_LOST_CODES, RETRYABLE_CODES, LedgerPort, RetryPolicy
from publisher.sessions.worker import RolloutWorker

__all__ = [
    "IDLE_CAUSE",
    "OWNER_LOST_CODES",
    "RETRYABLE_CODES",
    "LedgerPort",
    "RetryPolicy",
    "RolloutWorker",
    "SessionBinder",
]
