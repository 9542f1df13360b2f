"""The OpenAI face's model rules (:class:`publisher.openai.admission.Admission`), unit level,
over a view that is a fixed snapshot of the ledger's status, as a remote view holds one: what
``/v1/models`` lists, what a first turn may name, what a bound session may name, and when a
cached binding was released elsewhere (``SESSION_CLOSED``, saying why)."""

from __future__ import annotations

import msgspec
import pytest

from projections.status import LedgerStatus, VersionStatus
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound
from publisher.openai.admission import Admission, Ask, parse_ask
from publisher.openai.errors import OpenAICode

pytestmark = pytest.mark.anyio


class SnapshotView:
    """A :class:`~publisher.gateway.LedgerView` over one status snapshot (``None``: none read
    yet, as a remote view before its first read), with the routable holders of each name and
    the sessions it knows are unbound."""

    def __init__(
        self,
        status: LedgerStatus | None,
        holders: dict[str, tuple[str, ...]] | None = None,
        unbound: frozenset[str] = frozenset(),
    ) -> None:
        self._status = status
        self._holders = holders or {}
        self._unbound = unbound
        self.refreshes = 0

    def holders(self, lora_name: str) -> tuple[str, ...]:
        return self._holders.get(lora_name, ())

    default_revision = 0
    max_staleness = None

    def incarnation(self, engine: str) -> str:
        return ""

    def status(self) -> LedgerStatus:
        if self._status is None:
            raise LedgerError(Code.LEDGER_CLOSED, "no status read yet")
        return self._status

    def knows_unbound(self, session: str) -> bool:
        return session in self._unbound

    async def refresh(self) -> None:
        self.refreshes += 1


def version(version_id: int, state: str, *, bound: int = 0) -> VersionStatus:
    return VersionStatus(
        version_id=version_id,
        lora_name=f"policy@v{version_id}",
        digest=f"d{version_id}",
        state=state,
        attempt=1,
        bound=bound,
        revision=version_id,
        holders=(),
    )


def status(*versions: VersionStatus, default: int | None) -> LedgerStatus:
    return LedgerStatus(
        deployment="dep",
        epoch=1,
        last_seq=10,
        capacity=3,
        capacity_used=len(versions),
        default=default,
        default_revision=default or 0,
        sessions_bound=0,
        tombstones=0,
        owners=1,
        blocked_by=(),
        versions=versions,
        engines=(),
    )


def bound(version_id: int) -> Bound:
    return Bound(
        session="s1",
        version_id=version_id,
        lora_name=f"policy@v{version_id}",
        digest=f"d{version_id}",
        revision=version_id,
        new=False,
    )


def ask(model: str, *, session: str | None = "s1") -> Ask:
    headers = {"x-session-id": session} if session else {}
    body = msgspec.json.encode({"model": model})
    return parse_ask(
        body, headers, chat=True, alias="policy", max_body_bytes=1 << 20, one_turn_prefix="gw"
    )


def closed(admission: Admission, b: Bound) -> str:
    """The message of the ``SESSION_CLOSED`` that ``binding_gone`` answers for ``b``."""
    error = admission.binding_gone(b)
    assert isinstance(error, LedgerError) and error.code == Code.SESSION_CLOSED, error
    assert error.details["session"] == "s1"
    return error.message


def test_a_cached_binding_is_gone_when_its_version_is_reclaimed_unlisted_or_unbound() -> None:
    """Each ``SESSION_CLOSED`` says why: the version's state, that it is gone from the list,
    or that no session is bound to it; a version still bound and published is not gone."""
    snapshot = status(
        version(1, "RECLAIMING", bound=1),
        version(2, "RECLAIMED", bound=1),
        version(3, "RETIRED", bound=0),
        version(4, "PUBLISHED", bound=2),
        default=4,
    )
    admission = Admission(SnapshotView(snapshot), "policy")
    for version_id, why in [
        (1, "policy@v1 is RECLAIMING"),
        (2, "policy@v2 is RECLAIMED"),
        (3, "no session is bound to policy@v3 any more"),
        (9, "policy@v9 is gone"),
    ]:
        assert closed(admission, bound(version_id)) == (
            f"session s1 was released elsewhere ({why}): another gateway process or its idle "
            "release ended it; start a new session"
        )
    assert admission.binding_gone(bound(4)) is None
    assert Admission(SnapshotView(None), "policy").binding_gone(bound(1)) is None


def test_what_models_lists_the_alias_then_each_version_engines_hold_or_may_serve() -> None:
    snapshot = status(
        version(1, "RECLAIMED"),
        version(2, "RECLAIMING"),  # reclaiming but still held by an engine: listed
        version(3, "RETIRED"),
        version(4, "PUBLISHED"),
        version(5, "LOADING"),
        version(6, "PUBLISHED"),  # published, held by no engine yet: listed, not routable
        default=4,
    )
    view = SnapshotView(snapshot, holders={"policy@v2": ("e1",), "policy@v4": ("e1", "e2")})
    cards = Admission(view, "policy").cards(snapshot, 1234)
    assert cards[0] == {
        "id": "policy",
        "object": "model",
        "created": 1234,
        "owned_by": "loraledger",
        "root": "policy@v4",
        "parent": None,
        "default_version": 4,
    }
    assert [c["id"] for c in cards[1:]] == ["policy@v2", "policy@v3", "policy@v4", "policy@v6"]
    assert cards[4]["routable"] is False
    assert cards[3] == {
        "id": "policy@v4",
        "object": "model",
        "created": 1234,
        "owned_by": "loraledger",
        "root": "policy@v4",
        "parent": "policy",
        "version_id": 4,
        "digest": "d4",
        "state": "PUBLISHED",
        "routable": True,
    }
    assert (cards[1]["routable"], cards[2]["routable"]) == (True, False)
    nothing = status(version(1, "RECLAIMED"), default=None)
    (alias,) = Admission(SnapshotView(nothing), "policy").cards(nothing, 0)
    assert (alias["root"], alias["default_version"]) == (None, None)


async def test_a_name_outside_the_list_is_not_found_after_the_view_is_read_again() -> None:
    snapshot = status(version(1, "RECLAIMED"), version(2, "PUBLISHED"), default=2)
    view = SnapshotView(snapshot)
    admission = Admission(view, "policy")
    for name in ("gpt-4o", "policy@v1"):  # unknown, or no longer served
        refusal = await admission.before_bind(ask(name))
        assert refusal is not None and refusal[0] == OpenAICode.MODEL_NOT_FOUND
        assert repr(name) in refusal[1] and "'policy'" in refusal[1]
    assert view.refreshes == 2
    assert await admission.before_bind(ask("policy")) is None
    assert await admission.before_bind(ask("policy@v2")) is None  # the default
    assert view.refreshes == 2  # nothing refused: the copy is not read again


async def test_a_first_turn_naming_a_version_not_the_default_is_refused_only_when_provable() -> (
    None
):
    """Provably unbound: a one-turn request, or a session the view knows holds no binding;
    otherwise the bind decides (the session may be bound to that version already)."""
    snapshot = status(version(1, "RETIRED"), version(2, "PUBLISHED"), default=2)
    admission = Admission(SnapshotView(snapshot, unbound=frozenset({"fresh"})), "policy")
    rest = (
        "model 'policy@v1' (version 1) is served only to sessions already bound to it: send "
        "'policy', or that version's name on a session bound to it"
    )
    assert await admission.before_bind(ask("policy@v1", session=None)) == (
        OpenAICode.VERSION_NOT_BOUND,
        "a request without a session id is a new one-turn session, and a first turn binds to "
        f"the current default, policy@v2 (version 2); {rest}",
    )
    assert await admission.before_bind(ask("policy@v1", session="fresh")) == (
        OpenAICode.VERSION_NOT_BOUND,
        "session fresh is not bound yet, and a first turn binds to the current default, "
        f"policy@v2 (version 2); {rest}",
    )
    assert await admission.before_bind(ask("policy@v1", session="maybe-bound")) is None
    no_default = status(version(1, "RETIRED"), default=None)
    refusal = await Admission(SnapshotView(no_default), "policy").before_bind(
        ask("policy@v1", session=None)
    )
    assert refusal == (
        OpenAICode.VERSION_NOT_BOUND,
        "a request without a session id is a new one-turn session, and a first turn binds to "
        f"the default once one is published; {rest}",
    )


async def test_without_a_status_or_a_readable_ledger_the_bind_decides() -> None:
    class Unreachable(SnapshotView):
        async def refresh(self) -> None:
            raise LedgerError(Code.LEDGER_CLOSED, "the ledger is restarting")

    admission = Admission(SnapshotView(None), "policy")
    assert await admission.before_bind(ask("gpt-4o")) is None
    assert admission.named_version(ask("policy@v1")) is None
    snapshot = status(version(2, "PUBLISHED"), default=2)
    assert await Admission(Unreachable(snapshot), "policy").before_bind(ask("gpt-4o")) is None


def test_a_first_turn_expects_the_version_it_names_and_a_bound_one_keeps_its_own() -> None:
    snapshot = status(version(1, "RECLAIMED"), version(2, "PUBLISHED"), default=2)
    admission = Admission(SnapshotView(snapshot), "policy")
    assert admission.named_version(ask("policy")) is None
    assert admission.named_version(ask("policy@v2")) == 2
    assert admission.named_version(ask("policy@v1")) == 1  # listed in the status
    assert admission.named_version(ask("gpt-4o")) is None
    assert admission.after_bind(ask("policy"), bound(1)) is None
    assert admission.after_bind(ask("policy@v1"), bound(1)) is None
    refusal = admission.after_bind(ask("policy@v2"), bound(1))
    assert refusal is not None and refusal[0] == OpenAICode.VERSION_NOT_BOUND
    assert "bound to policy@v1 (version 1)" in refusal[1]
