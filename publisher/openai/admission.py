"""One client request of the OpenAI face, and what it may be served: the rules of admission.

**The request.** The session is the header ``x-session-id``, else the body's ``session_id``
(taken out of the body: no engine sees it). With neither, the request is a one-turn session,
named here after a new uuid -- never after the client's ``x-request-id``: an SDK resends the
same headers after a retryable refusal, and a released session never binds again. The client's
``x-request-id`` (or a new one) is echoed on every reply and is the provenance key. It is a label
(a trace id in default headers, a proxy's stamp, an SDK retry while the first try is being
aborted), while engines key running requests by their id (vLLM refuses a duplicate; SGLang
aborts by prefix), so the id the engine sees is made unique.

**The model** (:class:`Admission`, read from the ledger's view):

* ``model`` **is the alias** (``policy`` by default), meaning "my session's version", rewritten
  to the bound engine-side name; or a **full version name**, accepted only if it is the bound
  one (else ``409 VERSION_NOT_BOUND``).
* **Refused before any bind** (a refused request leaves no trace in the ledger): a name that is
  neither the alias nor a listed version is ``404 model_not_found`` (OpenAI's and vLLM's answer;
  the SDK raises ``NotFoundError``); a listed version that is not the default, on a session
  provably not bound yet, is ``409 VERSION_NOT_BOUND`` (its first turn would bind it to the
  default).
* **The bind**: a first turn that names a version binds only if the ledger's default is that
  version (``Bind.expect_version``, :meth:`Admission.named_version`): where this face's view
  cannot tell whether the session is bound (another process may have bound it) or is old (the
  default moved), the ledger's answer decides, and a refused first turn binds nothing.
* **After the bind**, the rule itself (:meth:`Admission.after_bind`): an existing binding the
  ledger answered (perhaps made elsewhere) serves only the alias or its own version's name.
* A cached binding **released elsewhere** (:meth:`Admission.binding_gone`) is ``SESSION_CLOSED``,
  not a retryable ``NO_ROUTE`` that would be retried in vain.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from evlog.errors import LoraLedgerError
from projections.status import LedgerStatus, VersionStatus
from projections.transitions import VersionState
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound
from publisher.gateway import LedgerView, refreshed
from publisher.logs import get_logger
from publisher.openai.errors import OpenAICode

log = get_logger("loraledger.openai")

MAX_SESSION_CHARS = 256
# stream_options is read into its fields (the engine's copy gets include_usage added), so it is
# bounded: OpenAI's holds one or two booleans, and a huge object would be millions of keys.
MAX_STREAM_OPTIONS_BYTES = 4096
SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"


class BadRequest(Exception):
    """A request the face cannot parse (400, ``INVALID_INPUT``): the message says why."""


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    """One client request, parsed."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    # The client's body field by field, each value the client's own bytes (``msgspec.Raw``),
    # without ``session_id``; ``stream_options``, when given, is read into its own fields.
    fields: dict[str, Any]
    session: str
    one_turn: bool  # no session was given: bound, served, released
    request_id: str  # the client's x-request-id (or a new one): echoed, the provenance key
    engine_request_id: str  # what the engine sees: unique among its running requests
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk of a stream


# The body as its top-level fields, each value kept as the client's bytes: the decoder checks
# the whole body is JSON but builds no Python object inside a value (see parse_ask).
_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])
_UTF8_CHUNK_BYTES = 1024 * 1024


def parse_ask(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    chat: bool,
    alias: str,
    max_body_bytes: int,
    one_turn_prefix: str,
) -> Ask:
    """The request of ``raw`` (its body) and ``headers`` (lower-case names), or
    :class:`BadRequest`. ``one_turn_prefix`` starts the name of a one-turn session.

    Only the fields the face reads are decoded (``model``, ``session_id``, ``stream``,
    ``stream_options``), each to its declared type; every other value stays the client's
    bytes and is forwarded as sent, for the engine to judge (the local engine with the same
    strict parse as every loraledger route; vLLM and SGLang with their own request checks).
    Why: a conversation is most of a body, and a body of millions of tiny values (64 MiB
    allows ~20 million) parsed into Python objects took seconds of the event loop, which every
    other request waits on, and over a gigabyte, all before a bad ``model`` was noticed. This
    costs one pass of msgspec's scanner over the bytes (a tenth of a second for 64 MiB) and no
    object per value."""
    if len(raw) > max_body_bytes:
        raise BadRequest(f"the body is over {max_body_bytes} bytes")
    _check_utf8(raw)
    try:
        fields = _top_level.decode(raw)
    except msgspec.ValidationError:
        raise BadRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    model = _field(fields, "model", str | None)
    if model is None:
        raise BadRequest(f"model is required: {alias!r} means your session's version")
    in_body = fields.pop("session_id", None)
    session = headers.get(SESSION_HEADER) or None
    if session is None and in_body is not None:
        try:
            session = msgspec.json.decode(in_body, type=str | None)
        except msgspec.ValidationError:
            session = ""  # not a string: refused below
    if session is not None and (
        not 0 < len(session) <= MAX_SESSION_CHARS or not session.isprintable()
    ):
        raise BadRequest(f"a session id is 1-{MAX_SESSION_CHARS} printable characters")
    given = headers.get(REQUEST_ID_HEADER)
    rid = given or uuid.uuid4().hex
    if not usable_request_id(rid):
        raise BadRequest("x-request-id must be 1-128 printable ASCII characters")
    stream = bool(_field(fields, "stream", bool | None))
    if len(fields.get("stream_options", b"")) > MAX_STREAM_OPTIONS_BYTES:
        raise BadRequest(f"stream_options: over {MAX_STREAM_OPTIONS_BYTES} bytes")
    options = _field(fields, "stream_options", dict[str, msgspec.Raw] | None)
    if options is None:
        fields.pop("stream_options", None)  # absent or null: the same to every engine
    else:
        fields["stream_options"] = options
    return Ask(
        chat=chat,
        model=model,
        fields=fields,
        session=session or f"{one_turn_prefix}-once-{uuid.uuid4().hex}",
        one_turn=session is None,
        request_id=rid,
        engine_request_id=f"{given}-{uuid.uuid4().hex[:12]}" if given else rid,
        stream=stream,
        wants_usage=bool(options and _field(options, "include_usage", bool | None)),
    )


def _check_utf8(raw: bytes) -> None:
    """:class:`BadRequest` unless ``raw`` is UTF-8, as JSON must be: msgspec's scan does not
    check the text inside a value it keeps raw, and a body the engine cannot read would
    otherwise bind a session before the engine refused it. ASCII (most bodies: base64 images,
    escaped text) is told at C speed without a copy; other text is decoded a chunk at a time,
    so the check never holds a second copy of the body."""
    if raw.isascii():
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    try:
        for start in range(0, len(view), _UTF8_CHUNK_BYTES):
            decoder.decode(view[start : start + _UTF8_CHUNK_BYTES])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not JSON: it is not UTF-8 ({exc.reason})") from None


def _field(fields: Mapping[str, msgspec.Raw], name: str, type_: Any) -> Any:
    """The value of the field ``name`` decoded as ``type_`` (None when absent), or
    :class:`BadRequest` naming the field. Typed: a value of another type is refused at its
    first byte, whatever its size (these types hold no numbers, so nothing here needs the
    strict number rules)."""
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{name}: {exc}") from None


def usable_request_id(text: str) -> bool:
    """1-128 printable ASCII characters. ASCII: the id goes on to the engine in a header,
    which carries nothing else (it failed there, after the bind, as an "ambiguous" dispatch
    that never left)."""
    return 0 < len(text) <= 128 and text.isprintable() and text.isascii()


def reply_request_id(headers: Mapping[str, str]) -> str:
    """The ``x-request-id`` of a refusal made before the request was parsed: the client's when
    it is a usable one, else a new one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if usable_request_id(given) else uuid.uuid4().hex


# --- the model a request may name -----------------------------------------------------------------

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
        if not await refreshed(self.view, request_id=ask.request_id):
            return None  # the ledger unreachable: the bind says what it can
        return self._judge(ask)

    async def listing(self, created: int, request_id: str) -> list[dict[str, Any]]:
        """The entries of ``/v1/models`` as of now: a remote view is read again first (a
        client that was just served a new version must find it listed), and answers from its
        copy when the ledger cannot be read."""
        await refreshed(self.view, request_id=request_id)
        return self.cards(self.view.status(), created)

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

    def named_version(self, ask: Ask) -> int | None:
        """The version ``model`` names (its id), None for the alias or a name this view does
        not list (:meth:`before_bind` refused those it could). What a first turn expects to
        bind to (``Bind.expect_version``)."""
        if ask.model == self.alias:
            return None
        try:
            status = self.view.status()
        except LoraLedgerError:
            return None
        named = next((v for v in status.versions if v.lora_name == ask.model), None)
        return None if named is None else named.version_id

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
