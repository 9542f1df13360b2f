"""The decider: ``decide(state, command) -> Decision``, a pure function.

It reads the registry state and the command, nothing else (no clock, no engine, no store), and
never mutates the state. A decision is the events to append plus the outcome to answer, or a
refusal (a ``LedgerError`` with a stable code). Most refusals write nothing; refused engine
receipts are recorded (``ReceiptRejected``) so an incident replay shows them.

The semantics, the order of the checks and the error codes are those of docs/state-machine.md
(its check-order table), extended by deliberate improvements: an N-engine fleet that changes,
fatal/ambiguous entries resolved by inventory evidence, owner leases, recorded skips.

A stale or duplicate input is an outcome too: it either returns the earlier outcome (no event)
or is refused; it never changes the state twice.

One module per aggregate. ``decide`` runs the steps every command shares, then hands the
command to the handler of its aggregate, which runs the command's own checks top to bottom in
the order of the check-order table; so a reader follows the table command by command in one
module at a time, and the shared validators are written once:

- ``decide``: ``decide`` (the common steps) and the handler table, on one screen;
- ``decision``: ``Decision``, what every handler returns;
- ``checks``: the common steps' type check and fingerprint, and the validators every aggregate
  shares (``_ident``, ``_key``, ``_version``, ``_member``, ...);
- ``fleet``: the deployment, the controller, engine membership, repair, health, inventories;
- ``absence_proofs``: when a fatal entry or a reclaim has every proof it needs, and who owes
  the drop (inventories, departures, suspensions and unloads all complete them);
- ``allocation``: ``Allocate``, whether a new attempt may start; who holds the capacity slots;
- ``publication``: an attempt after its allocation: claim, receipts, commit, failure;
- ``owners``: owner lives, and ``check_lease``, the one lease rule;
- ``sessions``: bind, release, forget;
- ``reclaim``: the reclaim claim, unload confirmations, ambiguous unloads.

Names with a leading underscore belong to the package: its modules share them. Callers import
the names below. This file only re-exports: the mutation campaign (tests/mutation/campaign.py)
mutates the modules above and names each mutant's file after its module.
"""

from publisher.core.decider.allocation import slot_holders
from publisher.core.decider.decide import decide
from publisher.core.decider.decision import Decision
from publisher.core.decider.owners import check_lease

__all__ = ["Decision", "check_lease", "decide", "slot_holders"]
