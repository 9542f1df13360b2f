"""Which model a request may name, and the list ``/v1/models`` shows: the OpenAI face's rules of
admission, read from the ledger's view.

* ``model`` **is the alias** (``policy`` by default), meaning "my session's version", rewritten
  to the bound engine-side name; or a **full version name**, accepted only if it is the bound
  one (else ``409 VERSION_NOT_BOUND``).
* **Refused before any bind** (a refused request leaves no trace in the ledger): a name that is
  neither the alias nor a listed version is ``404 model_not_found`` (OpenAI's and vLLM's answer;
  the SDK raises ``NotFoundError``); a listed version that is not the default, on a session
  provably not bound yet, is ``409 VERSION_NOT_BOUND`` (its first turn would bind it to the
  default).
* **After the bind**, the rule itself (:meth:`Admission.after_bind`): what could not be settled
  before (a session perhaps bound elsewhere, the default moved meanwhile) is settled by the
  binding the ledger answered.
* A cached binding **released elsewhere** (:meth:`Admission.binding_gone`) is ``SESSION_CLOSED``,
  not a retryable ``NO_ROUTE`` that would be retried in vain.
"""

from __future__ import annotations

from typing import Any

from evlog.errors import LoraLedgerError
from projections.status import LedgerStatus, VersionStatus
from projections.transitions import VersionState
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound
from publisher.gateway import LedgerView
from publisher.logs import get_logger
from publisher.openai.errors import OpenAICode
from publisher.openai.request import Ask

log = get_logger("loraledger.openai")

Refusal = tuple[str, str]  # (code, message)


class Admission:
    """The model rules over one view of the ledger and one alias."""

    def __init__(self, view: LedgerView, alias: str) -> None:
        self.view = view
        self.alias = alias

    def served(self, status: LedgerStatus) -> list[VersionStatus]:
        """The versions ``/v1/models`` lists, hence the only names ``model`` may take besides
        the alias: those engines hold (routably) or may serve (published, retired)."""
        return [
            v
            for v in status.versions
            if v.state in ("PUBLISHED", "RETIRED") or self.view.holders(v.lora_name)
        ]

    def cards(self, status: LedgerStatus, created: int) -> list[dict[str, Any]]:
        """The entries of ``/v1/models``: the alias (what clients should send) plus each version
        engines serve, with its state; ``routable`` says whether some engine may serve it now."""
        default = next((v for v in status.versions if v.version_id == status.default), None)
        cards: list[dict[str, Any]] = [
            {
                "id": self.alias,
                "object": "model",
                "created": created,
                "owned_by": "loraledger",
                "root": default.lora_name if default else None,
                "parent": None,
                "default_version": status.default,
            }
        ]
        for v in self.served(status):
            cards.append(
                {
                    "id": v.lora_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "loraledger",
                    "root": v.lora_name,
                    "parent": self.alias,
                    "version_id": v.version_id,
                    "digest": v.digest,
                    "state": v.state,
                    "routable": bool(self.view.holders(v.lora_name)),
                }
            )
        return cards

    def not_found(self, model: str) -> Refusal:
        return (
            OpenAICode.MODEL_NOT_FOUND,
            f"the model {model!r} does not exist here: send {self.alias!r} (your "
            "session's version) or a version name listed by GET /v1/models",
        )

    async def before_bind(self, ask: Ask) -> Refusal | None:
        """What ``model`` alone refuses, decided before anything is bound, from the view's
        version list (module docstring). Provably unbound: a one-turn request (its session id
        is new, made by this gateway), or a view that knows the ledger holds no binding and no
        tombstone of it (``LedgerView.knows_unbound``). Otherwise the session may already be
        bound to that very version (by another gateway process, or an earlier life of this
        one): the bind decides, and :meth:`after_bind` refuses any other version. That also
        covers the race where the default moves between this check and the bind.

        A remote view is a snapshot: before refusing, it is refreshed and asked again (a
        version published since is not refused); if the ledger cannot be read, the bind
        decides, as it would without this check."""
        if ask.model == self.alias or self._judge(ask) is None:
            return None
        try:
            await self.view.refresh()
        except Exception as exc:  # the ledger unreachable: the bind says what it can
            log.warning("openai.refresh_failed", rid=ask.request_id, error=repr(exc))
            return None
        return self._judge(ask)

    def _judge(self, ask: Ask) -> Refusal | None:
        model = ask.model
        try:
            status = self.view.status()
        except LoraLedgerError:  # no status read yet: the bind decides
            return None
        named = next((v for v in self.served(status) if v.lora_name == model), None)
        if named is None:
            return self.not_found(model)
        if named.version_id == status.default:
            return None
        if not ask.one_turn and not self.view.knows_unbound(ask.session):
            return None
        default = next((v for v in status.versions if v.version_id == status.default), None)
        binds_to = (
            f"the current default, {default.lora_name} (version {default.version_id})"
            if default is not None
            else "the default once one is published"
        )
        who = (
            "a request without a session id is a new one-turn session"
            if ask.one_turn
            else f"session {ask.session} is not bound yet"
        )
        return (
            OpenAICode.VERSION_NOT_BOUND,
            f"{who}, and a first turn binds to {binds_to}; model {model!r} (version "
            f"{named.version_id}) is served only to sessions already bound to it: send "
            f"{self.alias!r}, or that version's name on a session bound to it",
        )

    def after_bind(self, ask: Ask, bound: Bound) -> Refusal | None:
        """The rule itself, by the binding the ledger answered: the alias or the session's
        own version name."""
        if ask.model in (self.alias, bound.lora_name):
            return None
        return (
            OpenAICode.VERSION_NOT_BOUND,
            f"session {ask.session} is bound to {bound.lora_name} (version {bound.version_id}); "
            f"model {ask.model!r} is not its version: send {self.alias!r} or that name",
        )

    def binding_gone(self, bound: Bound) -> LedgerError | None:
        """``SESSION_CLOSED`` when the ledger no longer holds this cached binding, as the
        (just refreshed) view shows it: the version is being reclaimed or is reclaimed, or no
        session is bound to it at all. A binding is cached by every process that served the
        session, so it can be released behind this one's back (a release or an idle release
        through another gateway process); once its version is gone the turn cannot be served
        anywhere."""
        try:
            status = self.view.status()
        except LoraLedgerError:
            return None
        version = next((v for v in status.versions if v.version_id == bound.version_id), None)
        if version is None or version.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            why = f"{bound.lora_name} is {version.state if version else 'gone'}"
        elif version.bound == 0:
            why = f"no session is bound to {bound.lora_name} any more"
        else:
            return None
        return LedgerError(
            Code.SESSION_CLOSED,
            f"session {bound.session} was released elsewhere ({why}): another gateway process "
            "or its idle release ended it; start a new session",
            session=bound.session,
        )
