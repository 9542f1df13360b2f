"""HttpLedger: a ledger served by ``loraledger serve``, as a gateway process sees it.

It is a :class:`~publisher.sessions.LedgerPort` (``register_owner``, ``deregister_owner``,
``renew_lease``, ``execute_many``) over serve's routes (``POST /owners``, ``/owners/{o}/renew``,
``/owners/{o}/deregister``, ``/sessions/{s}/bind``, ``/sessions/{s}/release``,
``/sessions/forget``) and a :class:`~publisher.openai_gateway.GatewayView` (holders, default
revision, incarnations, status) read from ``GET /status``. So a
:class:`~publisher.sessions.RolloutWorker` and an
:class:`~publisher.openai_gateway.OpenAIGateway` run unchanged in a separate process
(``loraledger gateway``, docs/openai.md)::

    async with HttpLedger.connect(url, token=token) as ledger:
        gateway = Gateway(Fleet(), ledger, gateway_id="gw-1", recorder=recorder)
        async with RolloutWorker.open(ledger, gateway, owner="gw-1") as worker:
            face = OpenAIGateway(worker, ledger, routes, options)

What differs from in process, and why:

* **Binds are shared per session by the worker** (``SessionBinder``: concurrent first turns of
  one session wait on ONE bind), so a burst of first turns costs one round trip per session.
  The ledger decides: every gateway process gets the same binding for a session.
* **Lease renewals are local and forwarded** (as ``RayLedger`` does): ``renew_lease`` must be
  synchronous (a worker checks its lease right before it counts a request in flight), so it
  records the newest in-flight counts per life ``(owner, incarnation)`` and raises only what
  is already known of that life (it expired, was replaced); a background task forwards them,
  at most one round trip at a time and at most every ``renew_interval`` seconds.
  The counts are what serve's reclaim waits for.
* **A clean exit ends the owners it registered** (as ``RayLedger`` does): leaving
  :meth:`HttpLedger.connect` normally deregisters the owners registered through it that did not
  deregister yet (``deregister_on_exit=False`` keeps them for a later process).
* **Routing is a snapshot**, refreshed every ``refresh_interval`` seconds and on demand
  (:meth:`refresh`, which the OpenAI face awaits before answering ``NO_ROUTE``: a bind may
  name a version published after the last snapshot). Concurrent refreshes share one read.
* **Engine trouble is forwarded** (as ``RayLedger`` does): the gateway's ``on_engine_trouble``
  hook is :meth:`engine_failed`, which posts the error to ``/engines/{e}/trouble`` in the
  background; serve's reconciler reads it (a missing adapter: that engine's inventory at once;
  anything else: a probe at once), so what one gateway process saw is acted on within moments,
  not at the next full pass.
* **Lost replies**: a transport failure is raised as :class:`LedgerUnreachable`, a
  ``ConnectionError``, which the worker's retry policy retries (every command sent here is
  idempotent in the ledger: a bind answers the same binding, a release ``released=False``).

Refusals come back as the ledger's own errors (same class and code), rebuilt from serve's
``{"code", "message", "details"}`` bodies; an answer that is not the ledger's (a bad token, a
body the guard refused) is :class:`RemoteLedgerError` with ``LEDGER_ANSWER``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import msgspec
from anyio.abc import TaskGroup

from engines.contract import EngineError
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, Refused, StoreError
from projections.status import LedgerStatus
from publisher import commands as c
from publisher.errors import Code, LedgerError
from publisher.gateway import lacks_adapter
from publisher.logs import get_logger
from publisher.outcomes import Bound, Deregistered, Done, Forgotten, Outcome, Released
from publisher.renewals import PendingRenewals

log = get_logger("loraledger.remote")

_json = msgspec.json.Encoder()
OWNER_LOST = frozenset(
    {Code.LEASE_EXPIRED, Code.UNKNOWN_OWNER, Code.OWNER_RESTARTED, Code.OWNER_DEREGISTERED}
)


class RemoteCode:
    LEDGER_ANSWER = "LEDGER_ANSWER"  # serve answered something that is not a ledger decision


class RemoteLedgerError(LoraLedgerError):
    """A reply of the remote service that is not one of the ledger's refusals."""


class RemoteRefused(RemoteLedgerError, Refused, codes=[RemoteCode.LEDGER_ANSWER]):
    """Serve refused the call itself (token, body limits, unknown route): asking again is
    pointless until the configuration changes."""


class LedgerUnreachable(ConnectionError):
    """No reply from serve (refused, reset, timed out): the call may or may not have been
    decided; every call sent here is idempotent, so it is asked again."""


def _refusal(reply: httpx.Response, url: str) -> LoraLedgerError:
    """The ledger's error, rebuilt from serve's error body."""
    try:
        body = msgspec.json.decode(reply.content)
    except msgspec.DecodeError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("code"), str):
        return RemoteLedgerError(
            RemoteCode.LEDGER_ANSWER, f"{url} answered HTTP {reply.status_code}: {reply.text!r}"
        )
    code, message = body["code"], str(body.get("message", ""))
    given = body.get("details")
    details: dict[str, Any] = given if isinstance(given, dict) else {}
    for owner in (LedgerError, StoreError):
        try:
            return owner(code, message, **details)
        except (ValueError, TypeError):
            continue
    return RemoteLedgerError(
        RemoteCode.LEDGER_ANSWER, f"{url} answered HTTP {reply.status_code} {code}: {message}"
    )


class _Snapshot:
    """Routing as of one ``GET /status``: routable holders per adapter name."""

    __slots__ = ("holders", "incarnations", "status")

    def __init__(self, status: LedgerStatus) -> None:
        routable = {e.engine for e in status.engines if e.routable}
        self.status = status
        self.holders = {
            v.lora_name: tuple(h for h in v.holders if h in routable) for v in status.versions
        }
        self.incarnations = {e.engine: e.incarnation for e in status.engines}


class HttpLedger:
    """Client of ``loraledger serve`` at ``url``. Open with :meth:`connect`; safe to use from
    many tasks of one event loop."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        renew_interval: float = 0.5,
        refresh_interval: float = 1.0,
        timeout_s: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        for name, value in (
            ("renew_interval", renew_interval),
            ("refresh_interval", refresh_interval),
        ):
            if not (math.isfinite(value) and value > 0):
                raise InvalidInput(INVALID_INPUT, f"{name} must be a finite number > 0")
        self.url = url.rstrip("/")
        self.renew_interval = renew_interval
        self.refresh_interval = refresh_interval
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = client or httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False
        )
        self._snapshot: _Snapshot | None = None
        self._refreshing: anyio.Event | None = None
        self._renewals = PendingRenewals()
        self._registered: dict[str, str] = {}  # owner -> incarnation, until it deregisters
        self._tg: TaskGroup | None = None
        self._reporting: set[tuple[str, bool]] = set()  # (engine, lacks the adapter) in flight
        self.refreshes = 0
        self.renewals_sent = 0

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        url: str,
        *,
        token: str | None,
        renew_interval: float = 0.5,
        refresh_interval: float = 1.0,
        timeout_s: float = 10.0,
        deregister_on_exit: bool = True,
    ) -> AsyncIterator[HttpLedger]:
        """Read the status once (a wrong URL or token fails here, not on the first turn), then
        run the renewal and refresh tasks for the life of the block. A normal exit deregisters
        the owners registered here (see the module docstring)."""
        ledger = cls(
            url,
            token=token,
            renew_interval=renew_interval,
            refresh_interval=refresh_interval,
            timeout_s=timeout_s,
        )
        try:
            await ledger.refresh()
            async with anyio.create_task_group() as tg:
                ledger._tg = tg
                tg.start_soon(ledger._renewer)
                tg.start_soon(ledger._refresher)
                try:
                    yield ledger
                    if deregister_on_exit:
                        await ledger._deregister_remaining()
                finally:
                    ledger._tg = None
                    with anyio.CancelScope(shield=True):
                        await ledger._flush_renewals()  # the last counts (usually all zero)
                    tg.cancel_scope.cancel()
        finally:
            await ledger._http.aclose()

    # --- calls -----------------------------------------------------------------------------

    async def _post(self, path: str, body: Any) -> httpx.Response:
        try:
            return await self._http.post(
                path, content=_json.encode(body), headers={"content-type": "application/json"}
            )
        except httpx.TransportError as exc:
            raise LedgerUnreachable(
                f"no reply from the ledger at {self.url}{path}: {exc!r}"
            ) from exc

    async def _call(self, path: str, body: Any, kind: type[Outcome]) -> Outcome:
        reply = await self._post(path, body)
        if reply.status_code != 200:
            raise _refusal(reply, self.url + path)
        try:
            return msgspec.json.decode(reply.content, type=kind)
        except msgspec.ValidationError as exc:
            raise RemoteLedgerError(
                RemoteCode.LEDGER_ANSWER, f"{self.url}{path} answered {reply.text!r}: {exc}"
            ) from None

    async def register_owner(
        self, owner: str, *, ttl_s: float = 30.0, incarnation: str = ""
    ) -> Done:
        body = {"owner": owner, "ttl_s": ttl_s, "incarnation": incarnation}
        done = await self._call("/owners", body, Done)
        self._renewals.registered((owner, incarnation))
        self._registered[owner] = incarnation
        assert isinstance(done, Done)
        return done

    async def deregister_owner(self, owner: str, *, incarnation: str = "") -> Deregistered:
        """A clean exit (``POST /owners/{owner}/deregister``): its sessions still bound are
        released (``owner_exited``) and no renewal of it is forwarded any more."""
        path = f"/owners/{_segment(owner)}/deregister"
        outcome = await self._call(path, {"incarnation": incarnation}, Deregistered)
        assert isinstance(outcome, Deregistered)
        self._renewals.ended((owner, incarnation))
        if self._registered.get(owner) == incarnation:
            del self._registered[owner]
        return outcome

    async def _deregister_remaining(self) -> None:
        """End every life registered here that did not end yet (best effort, as RayLedger)."""
        for owner, incarnation in list(self._registered.items()):
            try:
                await self.deregister_owner(owner, incarnation=incarnation)
            except (LoraLedgerError, LedgerUnreachable) as exc:
                self._registered.pop(owner, None)
                if not isinstance(exc, LoraLedgerError) or exc.code not in OWNER_LOST:
                    log.warning("remote.deregister_failed", owner=owner, error=str(exc))

    async def execute_many(self, commands: Sequence[c.Command]) -> list[Outcome | LoraLedgerError]:
        """Each command as its own route, all at once; refusals come back in place. A
        transport failure of any of them is raised (the caller asks the group again)."""
        results: list[Outcome | LoraLedgerError | None] = [None] * len(commands)
        failures: list[LedgerUnreachable] = []

        async def one(index: int, command: c.Command) -> None:
            try:
                results[index] = await self._command(command)
            except LoraLedgerError as refusal:
                results[index] = refusal
            except LedgerUnreachable as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            for index, command in enumerate(commands):
                tg.start_soon(one, index, command)
        if failures:
            raise failures[0]
        return results  # type: ignore[return-value]

    async def _command(self, command: c.Command) -> Outcome:
        if isinstance(command, c.Bind):
            path = f"/sessions/{_segment(command.session)}/bind"
            body = {"owner": command.owner, "incarnation": command.incarnation}
            return await self._call(path, body, Bound)
        if isinstance(command, c.Release):
            path = f"/sessions/{_segment(command.session)}/release"
            body = {
                "owner": command.owner,
                "cause": command.cause,
                "incarnation": command.incarnation,
            }
            return await self._call(path, body, Released)
        if isinstance(command, c.Forget):
            return await self._call("/sessions/forget", {"sessions": command.sessions}, Forgotten)
        raise InvalidInput(
            INVALID_INPUT,
            f"a gateway sends only Bind, Release and Forget, not {type(command).__name__}",
        )

    # --- leases ----------------------------------------------------------------------------

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
    ) -> None:
        """Record a renewal of ``owner`` (its life ``incarnation``) with its in-flight counts
        and have it forwarded. Raises the refusal (``LEASE_EXPIRED``, ``OWNER_RESTARTED``,
        ...) once the ledger refused this life (see publisher/renewals.py)."""
        self._renewals.record(owner, incarnation, inflight)

    async def _renewer(self) -> None:
        while True:
            await self._renewals.wanted.wait()
            await self._flush_renewals()
            await anyio.sleep(self.renew_interval)

    async def _flush_renewals(self) -> None:
        for (owner, incarnation), counts in self._renewals.take().items():
            body = {
                "inflight": [
                    {"engine": engine, "version_id": version, "count": n}
                    for (engine, version), n in sorted(counts.items())
                ],
                "incarnation": incarnation,
            }
            try:
                reply = await self._post(f"/owners/{_segment(owner)}/renew", body)
            except LedgerUnreachable as exc:
                log.warning("remote.renew_failed", owner=owner, error=str(exc))
                self._renewals.keep((owner, incarnation), counts)  # the newest goes next time
                continue
            self.renewals_sent += 1
            if reply.status_code != 200:
                refusal = _refusal(reply, self.url)
                if refusal.code in OWNER_LOST:
                    self._renewals.refused((owner, incarnation), refusal)
                else:
                    log.warning("remote.renew_refused", owner=owner, code=refusal.code)

    # --- engine trouble ----------------------------------------------------------------------

    def engine_failed(self, engine_id: str, error: EngineError) -> None:
        """A generation on ``engine_id`` failed in a way that says something about the engine
        (the gateway's ``on_engine_trouble`` hook): tell serve, whose reconciler reads it.

        Synchronous and never raising: the gateway calls it on the path of a failing request,
        which must not wait for, or fail because of, a hint. At most one report per engine
        and kind (lacks the adapter or not) is in flight, so a flood of failures is one round
        trip at a time and a report of one kind never hides one of the other. A report that
        is lost or refused is logged: serve's own probes and full passes find what it said."""
        key = (engine_id, lacks_adapter(error))
        if self._tg is None or key in self._reporting:
            return
        self._reporting.add(key)
        self._tg.start_soon(self._report, key, error)

    async def _report(self, key: tuple[str, bool], error: EngineError) -> None:
        engine_id = key[0]
        body = {"code": error.code[:64], "clean": error.clean, "message": error.message[:1024]}
        try:
            reply = await self._post(f"/engines/{_segment(engine_id)}/trouble", body)
        except LedgerUnreachable as exc:
            log.warning("remote.trouble_report_failed", engine=engine_id, error=str(exc))
            return
        finally:
            self._reporting.discard(key)
        if reply.status_code != 200:
            refused = _refusal(reply, self.url)
            log.warning("remote.trouble_report_refused", engine=engine_id, code=refused.code)

    # --- the view --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read ``GET /status`` now; callers during a read wait for that one."""
        if self._refreshing is not None:
            await self._refreshing.wait()
            return
        self._refreshing = done = anyio.Event()
        try:
            try:
                reply = await self._http.get("/status")
            except httpx.TransportError as exc:
                raise LedgerUnreachable(f"no reply from the ledger at {self.url}: {exc!r}") from exc
            if reply.status_code != 200:
                raise _refusal(reply, self.url + "/status")
            status = msgspec.json.decode(reply.content, type=LedgerStatus)
            self._snapshot = _Snapshot(status)
            self.refreshes += 1
        finally:
            self._refreshing = None
            done.set()

    async def _refresher(self) -> None:
        while True:
            await anyio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except (LedgerUnreachable, LoraLedgerError) as exc:
                log.warning("remote.refresh_failed", error=str(exc))

    @property
    def _now(self) -> _Snapshot:
        if self._snapshot is None:
            raise LedgerError(Code.LEDGER_CLOSED, f"no status read from {self.url} yet")
        return self._snapshot

    def holders(self, lora_name: str) -> tuple[str, ...]:
        return self._now.holders.get(lora_name, ())

    @property
    def default_revision(self) -> int:
        return self._now.status.default_revision

    @property
    def max_staleness(self) -> int | None:
        return self._now.status.max_staleness

    def incarnation(self, engine: str) -> str:
        return self._now.incarnations.get(engine, "")

    def status(self) -> LedgerStatus:
        return self._now.status

    def knows_unbound(self, session: str) -> bool:
        """Never: the status lists no sessions (another process may have bound any of them),
        so the OpenAI face lets the bind answer (docs/openai.md, "Sessions and model")."""
        return False


def _segment(text: str) -> str:
    """A path segment (session and owner ids may hold characters a URL path may not: any
    printable text). ``/`` is escaped, and so is ``.``: a segment ``.`` or ``..`` would be
    resolved away by the URL's normalisation. The server decodes the path before it routes,
    so its routes take these ids with a ``path`` converter (``tools/http_app.py``)."""
    return quote(text, safe="").replace(".", "%2E")
