"""Exit codes of the ``loraledger`` command, and the one error type commands raise to use them.

Why distinct codes: ``verify`` runs in scripts and CI jobs that must tell "the file is gone"
(a path or mount problem) from "the file was cut short" (a disk or copy problem) from "someone
edited a record" (a security problem) from "the ledger code broke an invariant" (a bug),
without parsing messages. The codes are part of the CLI's contract; the messages are for humans.
"""

from __future__ import annotations

from enum import IntEnum

from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.locations import redacted
from publisher.core.errors import Code


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # anything not classified below (a bug: the message says what)
    USAGE = 2  # bad arguments (also click's own code for usage errors)
    MISSING = 3  # the log file does not exist
    EMPTY = 4  # the file is empty, or a ledger with no events
    NOT_A_LEDGER = 5  # not SQLite, or SQLite but not a loraledger log
    CORRUPT = 6  # the database itself is damaged (truncated, fails its integrity check)
    TAMPERED = 7  # a record does not match its hash, or the chain is broken
    INVARIANT = 8  # replaying the events breaks an invariant (a ledger bug)
    UNKNOWN_SCHEMA = 9  # the log is newer than this code (upgrade loraledger)
    UNREACHABLE = 10  # no ledger service answered at --url
    # refused configuration: listening beyond loopback without a token, or an agent holding the
    # engine's token without one of its own
    UNSAFE = 11
    ENGINE_UNAVAILABLE = 12  # an engine the command needs cannot be set up here
    FENCED = 13  # another controller took the log over: this one stopped (do not auto-restart)
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as the shell reports it)
    BROKEN_PIPE = 141  # stdout's reader went away (128 + SIGPIPE, as for a Unix tool)


EXIT_HELP = (
    "Exit codes: 0 ok, 1 failed, 2 usage, 3 missing file, 4 empty log, 5 not a ledger, "
    "6 corrupt/truncated file, 7 tampered record or broken chain, 8 invariant violated, "
    "9 log newer than this code, 10 service unreachable, 11 unsafe configuration refused, "
    "12 engine unavailable, 13 fenced by another controller, 130 interrupted, "
    "141 output pipe closed."
)

_BY_LEDGER_CODE = {
    INVALID_INPUT: Exit.USAGE,  # a store's own argument (an unusable postgresql:// URL)
    StoreCode.CORRUPT_STORE: Exit.CORRUPT,
    StoreCode.CORRUPT_RECORD: Exit.TAMPERED,
    StoreCode.CHAIN_BROKEN: Exit.TAMPERED,
    StoreCode.UNKNOWN_SCHEMA: Exit.UNKNOWN_SCHEMA,
    Code.FENCED: Exit.FENCED,  # however it reached the command (an append refused, a watch)
}


class ToolError(Exception):
    """A failure the CLI reports as one clear message and a distinct exit code (never a
    traceback). ``seq`` names the first bad record when there is one."""

    def __init__(self, exit_code: Exit, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message
        self.seq = seq

    @classmethod
    def from_ledger(cls, exc: LoraLedgerError, *, path: str | None = None) -> ToolError:
        """Classify a store error; ``CORRUPT_STORE`` on open means the file is not usable."""
        where = f"{redacted(path)}: " if path else ""
        code = _BY_LEDGER_CODE.get(exc.code, Exit.FAILED)
        seq = exc.details.get("seq")
        return cls(code, f"{where}{exc.code}: {exc.message}", seq=seq)
