"""``loraledger serve`` over HTTP, as its clients reach it: one service client
(:class:`ServiceClient`: base URL, token, the wire's types, failures classified once), the
remote ledger's HTTP transport, and :class:`HttpLedger`, the remote ledger a gateway process
runs on (``loraledger gateway``, docs/openai.md)::

    async with (
        HttpLedger.connect(url, token=token) as ledger,
        ProvenanceRecorder(ledger.provenance_sink()) as recorder,  # rows to the ledger's store
    ):
        gateway = Gateway(Fleet(), ledger.view, gateway_id="gw-1", recorder=recorder,
                          on_engine_trouble=ledger.engine_failed)
        async with RolloutWorker.open(ledger, gateway, owner="gw-1") as worker:
            face = OpenAIGateway(worker, routes, options)

How a reply is read, once for every call (``loraledger status`` and ``fleet`` included):

* no reply (refused, reset, timed out) -> :class:`LedgerUnreachable`, a ``ConnectionError``: the
  call may or may not have been decided; every ledger call is idempotent, so it is asked again;
* a refusal of the ledger (``{"code", "message", "details"}`` with one of its codes) -> the
  ledger's own error, same class and code, as in process;
* anything else (a bad token, a body the guard refused, a proxy's page) -> a
  :class:`RemoteLedgerError` ``LEDGER_ANSWER``: asking again is pointless until the
  configuration changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import httpx
import msgspec

from engines.contract import EngineError
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, Refused
from evlog.locations import redacted
from projections.status import LedgerStatus
from publisher.core import commands as c
from publisher.core.outcomes import Deregistered, Done, Outcome
from publisher.gateway.provenance import ProvenanceRow
from publisher.remote import wire
from publisher.remote.client import Answered, RemoteLedger, Renewed
from publisher.remote.renewals import Counts, Life
from publisher.remote.routing import Mark, RoutingTable
from publisher.remote.service import TroubleBatch

T = TypeVar("T")


class RemoteLedgerError(LoraLedgerError):
    """A reply of the remote service that is not one of the ledger's refusals."""


class RemoteRefused(RemoteLedgerError, Refused, codes=[wire.WireCode.LEDGER_ANSWER]):
    """Serve refused the call itself (token, body limits, unknown route): asking again is
    pointless until the configuration changes."""


class LedgerUnreachable(ConnectionError):
    """No reply from serve (refused, reset, timed out): the call may or may not have been
    decided; every call sent to the ledger is idempotent, so it is asked again."""


def segment(text: str) -> str:
    """A path segment (session and owner ids may hold characters a URL path may not: any
    printable text). ``/`` is escaped, and so is ``.``: a segment ``.`` or ``..`` would be
    resolved away by the URL's normalisation. The server decodes the path before it routes,
    so its routes take these ids with a ``path`` converter (``tools/http_app.py``)."""
    return quote(text, safe="").replace(".", "%2E")


class ServiceClient:
    """An HTTP client of ``loraledger serve`` at ``url``, bearing ``token``."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout_s: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.shown = redacted(self.url)  # what messages name: never a password
        self.timeout_s = timeout_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: a proxy from the environment must never see loopback traffic.
        self._http = client or httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get(self, path: str, kind: type[T]) -> T:
        return self._read(await self._request("GET", path, None), path, kind)

    async def get_optional(self, path: str, kind: type[T]) -> T | None:
        """``get``, where 204 (nothing new) answers None."""
        reply = await self._request("GET", path, None)
        return None if reply.status_code == 204 else self._read(reply, path, kind)

    async def post(
        self, path: str, body: wire.Body | None, kind: type[T], *, timeout_s: float | None = None
    ) -> T:
        """``timeout_s``: this call's own limit (a publication waits for engines), else the
        client's."""
        return self._read(await self._request("POST", path, body, timeout_s=timeout_s), path, kind)

    async def put_bytes(
        self, path: str, content: AsyncIterable[bytes], length: int, kind: type[T]
    ) -> T:
        """A body of ``length`` bytes streamed from ``content`` (an upload: never whole in
        memory), answered like every call."""
        headers = {"content-type": "application/octet-stream", "content-length": str(length)}
        return self._read(await self._send("PUT", path, content, headers, None), path, kind)

    async def _request(
        self, method: str, path: str, body: wire.Body | None, *, timeout_s: float | None = None
    ) -> httpx.Response:
        content = b"" if body is None else msgspec.json.encode(body)
        headers = {"content-type": "application/json"} if body is not None else None
        return await self._send(method, path, content, headers, timeout_s)

    async def _send(
        self,
        method: str,
        path: str,
        content: bytes | AsyncIterable[bytes],
        headers: dict[str, str] | None,
        timeout_s: float | None,
    ) -> httpx.Response:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            return await self._http.request(
                method, path, content=content, headers=headers, timeout=timeout
            )
        except httpx.TransportError as exc:
            raise LedgerUnreachable(
                f"no reply from the ledger at {self.shown}{path}: {exc!r}"
            ) from exc

    def _read(self, reply: httpx.Response, path: str, kind: type[T]) -> T:
        if reply.status_code != 200:
            raise self._refusal(reply, path)
        try:
            return msgspec.json.decode(reply.content, type=kind)
        except msgspec.DecodeError as exc:
            raise RemoteLedgerError(
                wire.WireCode.LEDGER_ANSWER,
                f"{self.shown}{path} answered {reply.text[:200]!r}: {exc}",
                status=reply.status_code,
            ) from None

    def _refusal(self, reply: httpx.Response, path: str) -> LoraLedgerError:
        """The ledger's error, rebuilt from serve's error body (module docstring)."""
        try:
            body = msgspec.json.decode(reply.content, type=wire.Refusal)
        except msgspec.DecodeError:
            return RemoteLedgerError(
                wire.WireCode.LEDGER_ANSWER,
                f"{self.shown}{path} answered HTTP {reply.status_code}: {reply.text[:200]!r}",
                status=reply.status_code,
            )
        error = wire.error_of(body.code, body.message, body.details)
        if error is not None:
            return error
        return RemoteLedgerError(
            wire.WireCode.LEDGER_ANSWER,
            f"{self.shown}{path} answered HTTP {reply.status_code} {body.code}: {body.message}",
            status=reply.status_code,
            answered=body.code,
        )


# The largest body a batch of session commands is sent in: under serve's cap on its ledger
# routes (1 MiB, tools/http_app.py), with room for the envelope. A larger group of calls is sent
# in several bodies, in order (each command is idempotent, and the ledger decides them in order).
MAX_BATCH_BYTES = 768 * 1024


class HttpTransport:
    """The remote ledger's calls as ``serve``'s routes."""

    def __init__(self, service: ServiceClient, *, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.service = service
        self.max_batch_bytes = max_batch_bytes

    async def execute(self, commands: Sequence[c.Command], mark: Mark | None) -> Answered:
        """Session commands in as few bodies as ``max_batch_bytes`` allows, in order; any
        other command is refused in place (a gateway sends only binds, releases and forgets)."""
        results: list[Outcome | LoraLedgerError | None] = [None] * len(commands)
        batches: list[list[tuple[int, wire.SessionCommand]]] = [[]]
        size = 0
        for index, command in enumerate(commands):
            if not isinstance(command, c.Bind | c.Release | c.Forget):
                results[index] = InvalidInput(
                    INVALID_INPUT,
                    f"a gateway sends only Bind, Release and Forget, not {type(command).__name__}",
                )
                continue
            length = len(_encode(command)) + 1
            if batches[-1] and size + length > self.max_batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append((index, command))
            size += length
        routing: RoutingTable | None = None
        for batch in batches:
            if not batch:
                continue
            body = wire.ExecuteSessions(commands=[command for _, command in batch], mark=mark)
            answered = await self.service.post("/sessions/commands", body, wire.SessionsAnswered)
            for (index, _), result in zip(batch, answered.results, strict=True):
                results[index] = _error(result) if isinstance(result, wire.Refusal) else result
            routing = answered.routing or routing
        decided = [r for r in results if r is not None]
        assert len(decided) == len(commands), "every command is answered in place"
        return Answered(decided, routing)

    async def register_owner(
        self,
        owner: str,
        ttl_s: float,
        incarnation: str,
        sessions_idle_s: float | None,
        secret: str,
    ) -> Done:
        body = wire.RegisterOwner(
            owner=owner,
            ttl_s=ttl_s,
            incarnation=incarnation,
            sessions_idle_s=sessions_idle_s,
            secret=secret,
        )
        return await self.service.post("/owners", body, Done)

    async def deregister_owner(self, owner: str, incarnation: str, secret: str) -> Deregistered:
        path = f"/owners/{segment(owner)}/deregister"
        body = wire.DeregisterOwner(incarnation=incarnation, secret=secret)
        return await self.service.post(path, body, Deregistered)

    async def renew(
        self,
        lives: Mapping[Life, Counts],
        mark: Mark | None,
        sessions: Mapping[Life, Sequence[str]],
        secrets: Mapping[Life, str],
    ) -> Renewed:
        """Every life in one body, unless the sessions they name would pass serve's cap on a
        body: then the rest of the sessions follow in more bodies, each life with its counts
        again (a renewal is idempotent: the newest counts)."""
        lost: dict[Life, LoraLedgerError] = {}
        routing: RoutingTable | None = None
        for part in _session_parts(sessions, self.max_batch_bytes):
            body = wire.RenewLeases(
                lives=[
                    wire.LifeRenewal(
                        owner=owner,
                        incarnation=incarnation,
                        inflight=wire.inflight(n),
                        sessions=part.get((owner, incarnation), []),
                        secret=secrets.get((owner, incarnation), ""),
                    )
                    for (owner, incarnation), n in lives.items()
                ],
                mark=mark,
            )
            renewed = await self.service.post("/leases/renew", body, wire.LeasesRenewed)
            lost.update({(x.owner, x.incarnation): _error(x.refusal) for x in renewed.lost})
            routing = renewed.routing or routing
        return Renewed(lost, routing)

    async def routing(self) -> RoutingTable:
        return await self.service.get("/routing", RoutingTable)

    async def wait_routing(self, mark: Mark | None, wait_s: float) -> RoutingTable | None:
        """``GET /routing?epoch=E&serial=S&wait=W``: answered as soon as the routing is not
        the table ``(E, S)``, or after ``W`` seconds with 204 (unchanged). ``W`` is kept under
        half the request timeout, so an idle poll never times out as a lost ledger would."""
        wait_s = min(wait_s, self.service.timeout_s / 2)
        query = f"wait={wait_s:g}" + ("" if mark is None else f"&epoch={mark[0]}&serial={mark[1]}")
        return await self.service.get_optional(f"/routing?{query}", RoutingTable)

    async def status(self) -> LedgerStatus:
        return await self.service.get("/status", LedgerStatus)

    async def report_trouble(self, engine_id: str, error: EngineError, batch: TroubleBatch) -> None:
        body = wire.TroubleReport(
            code=error.code[:64],
            clean=error.clean,
            message=error.message[:1024],
            dispatched=error.dispatched,
            incarnation=batch.incarnation[:256],
            age_s=batch.age_s,
            failures=batch.failures[:4096],
            reporter=batch.reporter[:200],
        )
        await self.service.post(f"/engines/{segment(engine_id)}/trouble", body, wire.Heard)

    async def store_provenance(self, rows: Sequence[ProvenanceRow]) -> int:
        """Rows in as few bodies as ``max_batch_bytes`` allows; how many were new. A failure
        part way is raised: the caller sends them all again, and those stored are kept once."""
        stored = 0
        body: list[ProvenanceRow] = []
        size = 0
        for row in rows:
            length = len(_encode(row)) + 1
            if body and size + length > self.max_batch_bytes:
                stored += await self._store(body)
                body, size = [], 0
            body.append(row)
            size += length
        if body:
            stored += await self._store(body)
        return stored

    async def _store(self, rows: list[ProvenanceRow]) -> int:
        body = wire.StoreProvenance(rows=rows)
        return (await self.service.post("/provenance", body, wire.ProvenanceStored)).stored


_encode = msgspec.json.Encoder().encode


def _session_parts(
    sessions: Mapping[Life, Sequence[str]], max_bytes: int
) -> list[dict[Life, list[str]]]:
    """The sessions of a renewal in parts of at most ``max_bytes`` of ids (at least one part,
    empty when there are none), so no renewal body passes serve's cap however many sessions
    a busy relay touched in one interval."""
    parts: list[dict[Life, list[str]]] = [{}]
    size = 0
    for life, names in sessions.items():
        for name in names:
            length = len(_encode(name)) + 1
            if size and size + length > max_bytes:
                parts.append({})
                size = 0
            parts[-1].setdefault(life, []).append(name)
            size += length
    return parts


def _error(refusal: wire.Refusal) -> LoraLedgerError:
    return wire.error_of(refusal.code, refusal.message, refusal.details) or RemoteLedgerError(
        wire.WireCode.LEDGER_ANSWER, f"{refusal.code}: {refusal.message}"
    )


class HttpLedger(RemoteLedger):
    """The remote ledger over ``serve``'s HTTP routes. Open with :meth:`connect`."""

    transport: HttpTransport

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
        **options: Any,
    ) -> AsyncIterator[HttpLedger]:
        """Read the view once (a wrong URL or token fails here), then run the client for the
        life of the block (:meth:`RemoteLedger.running`)."""
        if not refresh_interval > 0:
            raise InvalidInput(INVALID_INPUT, "refresh_interval must be a finite number > 0")
        service = ServiceClient(url, token=token, timeout_s=timeout_s)
        try:
            ledger = cls(
                HttpTransport(service),
                renew_interval=renew_interval,
                refresh_interval=refresh_interval,
                **options,
            )
            async with ledger.running(deregister_on_exit=deregister_on_exit):
                yield ledger
        finally:
            with anyio.CancelScope(shield=True):
                await service.aclose()

    @property
    def url(self) -> str:
        return self.transport.service.url
