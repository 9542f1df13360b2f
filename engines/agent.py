"""The engine-host agent: publication to a path-loading engine without a shared filesystem.

SGLang and vLLM load an adapter from a directory *they* can read. Without a filesystem shared
with the trainer, something on the engine's host must write that directory. The agent is that
something: a small process beside the engine that speaks loraledger's staged protocol (the
local engine's ``/loraledger/*`` endpoints, :mod:`engines.local.wire`) and turns it into a
path load:

========================  ===================================================================
step                      what the agent does
========================  ===================================================================
``prepare``               checks the candidate (name, attempt, digest recomputed from the
                          manifest), fences the attempt, opens a staging area
``bucket``                verifies each tensor against the manifest on arrival and writes it,
                          once, at its place in the directory being staged in its **local**
                          artifact store (:class:`~engines.artifacts.StagedWeights`); a
                          mismatch refuses that bucket only and never reaches the file
                          (staging is per attempt: :class:`Agent`)
``load``                  recomputes the digest from the checksums taken on arrival (no
                          re-read), fsyncs the directory once and renames it into place
                          (:class:`~engines.artifacts.ArtifactStore`), then asks its
                          engine to load that path (the engine's own adapter: prepare re-reads
                          and re-hashes the directory, load proves it with ``/v1/models``)
``unload``                its engine's unload (a managed name only with its attempt)
``inventory``             its engine's inventory
========================  ===================================================================

A digest already in the local store needs no buckets (a repair, or a retry after the write):
``load`` re-verifies and reuses the directory. On the control-plane side,
:class:`AgentEngine` makes agent + engine one fleet member: publication steps go to the agent,
while incarnation, inventory and generation go straight to the engine, so a dead agent never
hides what the engine holds. An agent killed between "written" and "loaded" leaves the
control plane an ambiguous reply (the connection drops): the engine's inventory then says
whether the load happened, and the reconciler repairs as after any ambiguous step.

Run it as ``loraledger agent --engine sglang:URL --artifacts DIR`` (or ``python -m
engines.agent``); it prints its port on the first stdout line. It forwards with the engine's
token, so holding one it will not start without its own (:func:`check_configuration`). Like
every engine module it imports nothing from the ledger.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engines import embedded, guard
from engines.artifacts import ArtifactError, ArtifactStore, StagedWeights
from engines.contract import (
    Bucket,
    Candidate,
    CleanRefusal,
    Engine,
    EngineCapabilities,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    Receipt,
    SamplingParams,
    Transport,
    UnloadReceipt,
    attempt_required,
    check_name,
    ends_requests,
)
from engines.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainGuard
from engines.local import wire
from engines.local.client import LocalHTTPEngine
from engines.manifest import (
    ManifestError,
    TensorData,
    compute_digest,
)
from engines.path_engine import AttemptFence

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_BUCKET_BYTES = 256 * 1024 * 1024
# Staging lives on disk, in a temp dir of the local store: every byte received for a prepared
# attempt until its load (memory holds the bucket being received, never the adapter). The cap
# bounds what callers can make the agent stage at once (the largest adapters are ~1-2 GiB); the
# idle bound frees what a publisher gave up on without a cleanup (prepared, never loaded).
DEFAULT_STAGING_BYTES = 4 * 1024 * 1024 * 1024
DEFAULT_STAGING_IDLE_S = 600.0
EXIT_AFTER_WRITE = 71  # the fault mode's exit status
AGENT_TOKEN_ENV = "LORALEDGER_AGENT_TOKEN"
ENGINE_TOKEN_ENV = "LORALEDGER_ENGINE_TOKEN"
T = TypeVar("T")


class UnsafeConfiguration(ValueError):
    """A configuration the agent refuses to start with (the CLI's exit 11)."""


def check_configuration(host: str, token: str | None, engine_token: str | None) -> None:
    """Refuse to start where a caller could act with more than its own rights.

    An agent holding the engine's token forwards every request with it: without a token of its
    own, anyone who reaches its port could unload or replace what the engine serves, which the
    engine itself refuses them (401). Beyond loopback it needs a token in any case."""
    if engine_token and not token:
        raise UnsafeConfiguration(
            f"refusing to start: the agent holds the engine's token (${ENGINE_TOKEN_ENV}) and "
            "would forward any caller's request with it. Give the agent its own token "
            f"(--token-file FILE or ${AGENT_TOKEN_ENV}) and the control plane the same one."
        )
    if not guard.is_loopback(host) and not token:
        raise UnsafeConfiguration(
            f"refusing to listen on {host!r} without a token (--token-file FILE or "
            f"${AGENT_TOKEN_ENV})"
        )


@dataclass(eq=False)
class _Staging:
    """Bytes received for exactly one (name, attempt, digest), each tensor verified against the
    manifest on arrival and written into ``weights`` (created with the first bucket: a digest
    already stored needs none); ``touched``: the clock at its last step (the idle expiry reads
    it)."""

    candidate: Candidate
    touched: float
    weights: StagedWeights | None = None

    def nbytes(self) -> int:
        return 0 if self.weights is None else self.weights.written_bytes

    def received(self) -> frozenset[str]:
        return frozenset() if self.weights is None else self.weights.written

    def discard(self) -> None:
        if self.weights is not None:
            self.weights.discard()


class Agent:
    """The agent's logic, over its engine's adapter and its local store. ``after_write`` runs
    once a directory is written and before the engine is asked to load it (the fault hook that
    kills the process there).

    Staging is per attempt: one area per name, owned by one (attempt, digest). A step of
    another attempt or digest is ``NOT_PREPARED`` and touches nothing; a refused bucket drops
    only its own tensors (everything kept was verified against the manifest, and ``load``
    still needs every tensor and recomputes the digest), so a stray bucket can never wipe a
    publication's staging. All staging together holds at most ``staging_bytes`` (beyond,
    ``STAGING_FULL``), and an area with no step for ``staging_idle_s`` seconds is dropped
    (:meth:`expire_idle`; its attempt's load then answers ``NOT_PREPARED``)."""

    def __init__(
        self,
        engine: Engine,
        store: ArtifactStore,
        *,
        after_write: Callable[[], None] | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_idle_s: float = DEFAULT_STAGING_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.store = store
        self.after_write = after_write
        self.staging_bytes = staging_bytes
        self.staging_idle_s = staging_idle_s
        self._clock = clock
        self._fence = AttemptFence(engine.engine_id)
        self._staging: dict[str, _Staging] = {}
        self._lock = anyio.Lock()

    def staged_bytes(self) -> int:
        """Bytes held in staging now, all attempts together."""
        return sum(s.nbytes() for s in self._staging.values())

    def staged_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._staging))

    def expire_idle(self) -> list[str]:
        """Drop every staging area idle for ``staging_idle_s`` or more; the names dropped."""
        now = self._clock()
        idle = [n for n, s in self._staging.items() if now - s.touched >= self.staging_idle_s]
        for name in idle:
            self._staging.pop(name).discard()
        return idle

    async def expire_idle_forever(self) -> None:
        """Sweep idle staging, a few times per idle bound (the process runs this)."""
        while True:
            await anyio.sleep(max(0.05, min(self.staging_idle_s / 4, 30.0)))
            self.expire_idle()

    async def prepare(self, c: Candidate) -> Receipt:
        check_name(c.lora_name)
        if isinstance(c.attempt, bool) or not isinstance(c.attempt, int) or c.attempt < 1:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, f"attempt {c.attempt!r} must be >= 1")
        try:
            recomputed = compute_digest(c.manifest.config, c.manifest.tensors)
        except ManifestError as exc:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, str(exc)) from exc
        if recomputed != c.digest or c.manifest.digest != c.digest:
            raise CleanRefusal(
                ErrorCode.DIGEST_MISMATCH,
                f"candidate digest {c.digest[:16]} does not match its manifest",
            )
        if c.manifest.total_bytes > self.staging_bytes:
            raise CleanRefusal(
                ErrorCode.STAGING_FULL,
                f"{c.lora_name}: {c.manifest.total_bytes} bytes can never fit this agent's "
                f"staging cap of {self.staging_bytes} bytes (--staging-bytes)",
            )
        incarnation = await self.engine.incarnation()
        async with self._lock:
            self.expire_idle()
            current = self._staging.get(c.lora_name)
            if current is not None and current.candidate.attempt == c.attempt:
                if current.candidate.digest != c.digest:
                    raise CleanRefusal(
                        ErrorCode.BAD_REQUEST,
                        f"{c.lora_name} attempt {c.attempt} is staging digest "
                        f"{current.candidate.digest[:16]}: another digest needs a new attempt",
                    )
                self._fence.stage(c, str(self.store.path_for(c.digest)))
                current.touched = self._clock()  # a retried prepare keeps what arrived
            else:
                self._fence.stage(c, str(self.store.path_for(c.digest)))
                if current is not None:
                    current.discard()
                self._staging[c.lora_name] = _Staging(c, self._clock())
        return _receipt(c, incarnation, "prepared", self.engine.engine_id)

    def _staged(self, name: str, attempt: int, digest: str) -> _Staging:
        staging = self._staging.get(name)
        if staging is None or (staging.candidate.attempt, staging.candidate.digest) != (
            attempt,
            digest,
        ):
            raise CleanRefusal(ErrorCode.NOT_PREPARED, f"{name} attempt {attempt} is not prepared")
        return staging

    async def receive_bucket(self, upload: wire.BucketUpload) -> int:
        self.expire_idle()
        staging = self._staged(upload.lora_name, upload.attempt, upload.digest)
        staging.touched = self._clock()
        arriving = {item.name: item.tensor for item in upload.bucket.tensors}
        self._check_room(upload, staging, arriving)
        if staging.weights is None:
            try:
                begun = await anyio.to_thread.run_sync(self.store.begin, staging.candidate.manifest)
            except ArtifactError as exc:
                raise CleanRefusal(exc.code, exc.message) from exc
            if staging.weights is None:
                staging.weights = begun
            else:  # another bucket of this attempt began it meanwhile
                begun.discard()
        weights = staging.weights
        checked: dict[str, tuple[TensorData, str]] = {}
        for item in upload.bucket.tensors:
            try:
                checksum = await anyio.to_thread.run_sync(weights.check, item.name, item.tensor)
            except ArtifactError as exc:
                raise CleanRefusal(exc.code, exc.message) from exc
            checked[item.name] = (item.tensor, checksum)
        # Only a whole verified bucket is kept, and only into the area it was checked against
        # (a newer attempt may have replaced it during the checksums).
        if self._staging.get(upload.lora_name) is not staging:
            raise CleanRefusal(
                ErrorCode.NOT_PREPARED, f"{upload.lora_name} was prepared again meanwhile"
            )
        self._check_room(upload, staging, arriving)  # again: other buckets arrived meanwhile
        for name, (t, checksum) in checked.items():
            try:
                await anyio.to_thread.run_sync(weights.write, name, t, checksum)
            except FileNotFoundError as exc:  # unloaded or expired while it was written
                raise CleanRefusal(
                    ErrorCode.NOT_PREPARED, f"{upload.lora_name} was dropped meanwhile"
                ) from exc
        staging.touched = self._clock()
        return len(weights.written)

    def _check_room(
        self, upload: wire.BucketUpload, staging: _Staging, arriving: dict[str, TensorData]
    ) -> None:
        """Refuse a bucket whose new tensors would take all staging past the byte cap."""
        received = staging.received()
        growth = sum(t.nbytes for n, t in arriving.items() if n not in received)
        held = self.staged_bytes()
        if held + growth > self.staging_bytes:
            raise CleanRefusal(
                ErrorCode.STAGING_FULL,
                f"{upload.lora_name}: bucket {upload.bucket.index} would make the staged bytes "
                f"{held + growth}, over this agent's cap of {self.staging_bytes} "
                "(--staging-bytes); retry once other publications loaded or expired",
            )

    async def load(self, c: Candidate) -> Receipt:
        self._fence.prepared(c)
        staging = self._staged(c.lora_name, c.attempt, c.digest)
        staging.touched = self._clock()
        if staging.received() or not self.store.contains(c.digest):
            missing = sorted({t.name for t in c.manifest.tensors} - staging.received())
            if missing:
                raise CleanRefusal(
                    ErrorCode.INVALID_ADAPTER,
                    f"{len(missing)} manifest tensors never arrived, e.g. {missing[:3]}",
                )
        try:
            # an existing directory is verified and reused, never overwritten
            path = await anyio.to_thread.run_sync(self._write, c, staging)
        except ArtifactError as exc:
            raise CleanRefusal(exc.code, exc.message) from exc
        if self.after_write is not None:
            self.after_write()
        local = msgspec.structs.replace(c, artifact_path=str(path))
        await self.engine.prepare(local)
        receipt = await self.engine.load(local)
        if self._staging.get(c.lora_name) is staging:
            del self._staging[c.lora_name]
        return receipt

    def _write(self, c: Candidate, staging: _Staging) -> Path:
        """The directory of ``c``: the staged one, its digest recomputed from the checksums
        taken on arrival, fsynced and renamed into place; or the stored one, re-verified."""
        if self.store.contains(c.digest):
            staging.discard()
            self.store.verify(c.digest)
            return self.store.path_for(c.digest)
        if staging.weights is None:
            raise ArtifactError("INVALID_ADAPTER", f"{c.lora_name}: no bytes were staged")
        weights, staging.weights = staging.weights, None
        return weights.commit()  # committed or refused, the temp dir is gone either way

    async def unload(
        self, name: str, attempt: int | None, *, fenced_only: bool = False
    ) -> UnloadReceipt:
        """Unload ``name`` from the engine (cleanup of ``attempt`` when given).

        ``fenced_only`` (the HTTP face, where any caller holding the token may knock): a
        managed name without an attempt is ``ATTEMPT_REQUIRED``, as on the local engine.
        Managed: prepared or cleaned up through this agent, or held by the engine from a
        directory of this agent's store (loaded in an earlier life of the agent)."""
        check_name(name)
        if attempt is None and fenced_only and await self._managed(name):
            raise attempt_required(name)
        if attempt is not None:
            self._fence.check_cleanup(name, attempt)
        receipt = await self.engine.unload(name, attempt=attempt)
        if attempt is not None:
            self._fence.close(name, attempt, refuse_older_cleanups=True)
        dropped = self._staging.pop(name, None)
        if dropped is not None:
            dropped.discard()
        return receipt

    async def _managed(self, name: str) -> bool:
        if self._fence.knows(name) or name in self._staging:
            return True
        inventory = await self.engine.inventory()
        root = str(self.store.root)
        held = [e.path for e in inventory.adapters if e.lora_name == name and e.path]
        if any(os.path.dirname(os.path.normpath(path)) == root for path in held):  # noqa: ASYNC240 (no I/O: string work)
            return True
        return self._fence.knows(name)  # prepared while the inventory was read


def _receipt(c: Candidate, incarnation: str, phase: Any, engine_id: str) -> Receipt:
    return Receipt(
        engine_id=engine_id,
        incarnation=incarnation,
        lora_name=c.lora_name,
        digest=c.digest,
        attempt=c.attempt,
        phase=phase,
    )


# --- HTTP ---------------------------------------------------------------------------------------


_json = msgspec.json.Encoder()


def _reply(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


async def _answer(action: Callable[[], Coroutine[Any, Any, Any]]) -> Response:
    try:
        return _reply(await action())
    except CleanRefusal as exc:
        # The engine's own drain refusal keeps the one spelling callers read as clean (503
        # ENGINE_DRAINING, engines.drain): a 400 with that code would read as unrecognised.
        status = 503 if exc.code == ErrorCode.ENGINE_DRAINING else 400
        return _reply(wire.ErrorBody(wire.ErrorDetail(exc.code, exc.message)), status)
    except EngineError as exc:  # the engine's answer was ambiguous: so is ours
        return _reply(wire.ErrorBody(wire.ErrorDetail(exc.code, exc.message)), 503)


# Publication steps a draining agent refuses (503 ENGINE_DRAINING, engines.drain); unload,
# inventory and server_info stay open (the control plane still cleans up and observes).
DRAIN_REFUSES = frozenset(
    {f"{wire.PREFIX}/prepare", f"{wire.PREFIX}/bucket", f"{wire.PREFIX}/load"}
)


def create_app(agent: Agent, *, token: str | None = None, drain: Drain | None = None) -> Starlette:
    """The agent's routes; ``drain``: the gate a stopping process closes (:mod:`engines.drain`):
    it counts every request, and once draining refuses :data:`DRAIN_REFUSES`."""

    async def decode(request: Request, type_: type[Any]) -> Any:
        try:
            return guard.strict_decode(await request.body(), type_)
        except guard.BadBody as exc:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, str(exc)) from exc

    async def prepare(request: Request) -> Response:
        return await _answer(lambda: _then(decode(request, Candidate), agent.prepare))

    async def load(request: Request) -> Response:
        return await _answer(lambda: _then(decode(request, Candidate), agent.load))

    async def bucket(request: Request) -> Response:
        async def run() -> Any:
            try:
                upload = wire.bucket_decoder.decode(await request.body())
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                raise CleanRefusal(ErrorCode.BAD_REQUEST, f"bad bucket body: {exc}") from exc
            received = await agent.receive_bucket(upload)
            return wire.BucketAck(index=upload.bucket.index, received_tensors=received)

        return await _answer(run)

    async def unload(request: Request) -> Response:
        async def run() -> Any:
            req = await decode(request, wire.UnloadRequest)
            return await agent.unload(req.lora_name, req.attempt, fenced_only=True)

        return await _answer(run)

    async def inventory(request: Request) -> Response:
        async def run() -> Inventory:
            held = await agent.engine.inventory()  # plus what this agent stages
            return msgspec.structs.replace(held, staged=agent.staged_names())

        return await _answer(run)

    async def server_info(request: Request) -> Response:
        try:
            incarnation = await agent.engine.incarnation()
        except EngineError as exc:
            return _reply(wire.ErrorBody(wire.ErrorDetail(exc.code, exc.message)), 503)
        return _reply({"startup_time": 0, "incarnation": incarnation, "agent": True})

    bucket_path = f"{wire.PREFIX}/bucket"
    routes = [
        Route(f"{wire.PREFIX}/prepare", prepare, methods=["POST"]),
        Route(bucket_path, bucket, methods=["POST"]),
        Route(f"{wire.PREFIX}/load", load, methods=["POST"]),
        Route(f"{wire.PREFIX}/unload", unload, methods=["POST"]),
        Route(f"{wire.PREFIX}/inventory", inventory, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
    ]

    def error_body(code: str, message: str) -> Any:
        return wire.ErrorBody(wire.ErrorDetail(code, message))

    draining = (
        []
        if drain is None
        else [Middleware(DrainGuard, drain=drain, refuses=DRAIN_REFUSES.__contains__)]
    )
    return Starlette(
        routes=routes,
        middleware=[
            *draining,
            Middleware(
                guard.Guard,
                token=token,
                protected=lambda path: path.startswith(wire.PREFIX),
                cap=lambda path: MAX_BUCKET_BYTES if path == bucket_path else MAX_BODY_BYTES,
                error_body=error_body,
            ),
        ],
        exception_handlers=guard.exception_handlers(error_body),
    )


async def _then(decoded: Coroutine[Any, Any, Any], action: Callable[[Any], Any]) -> Any:
    return await action(await decoded)


# --- the fleet member on the control-plane side -------------------------------------------------


class AgentEngine:
    """Agent + engine as one fleet member (staged transport). Publication steps go to the agent
    (:class:`LocalHTTPEngine` speaks its protocol); incarnation, inventory and generation go to
    the engine directly through its own adapter (``engine``), so a dead agent hides nothing."""

    transport: Transport = "staged"

    def __init__(self, agent_url: str, engine: Engine, *, api_key: str | None = None) -> None:
        self.engine = engine
        self.agent = LocalHTTPEngine(agent_url, engine.engine_id, api_key=api_key)

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    @property
    def kind(self) -> str:
        return self.engine.kind

    @property
    def capabilities(self) -> EngineCapabilities:
        """The engine's address and whether it confirms a request's end (generation is the
        engine's); no ``extra_body`` (this member forwards the contract only)."""
        inner = self.engine.capabilities
        return EngineCapabilities(endpoint=inner.endpoint, confirms_end=inner.confirms_end)

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        ender = ends_requests(self.engine)
        return False if ender is None else await ender.abort_request(request_id, lora_name)

    async def incarnation(self) -> str:
        return await self.engine.incarnation()

    async def inventory(self) -> Inventory:
        return await self.engine.inventory()

    async def prepare(self, candidate: Candidate) -> Receipt:
        return await self.agent.prepare(candidate)

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        await self.agent.transfer(candidate, buckets)

    async def load(self, candidate: Candidate) -> Receipt:
        return await self.agent.load(candidate)

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        return await self.agent.unload(lora_name, attempt=attempt)

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        return await self.engine.generate(
            prompt, lora_name, params, request_id=request_id, cache_salt=cache_salt
        )

    async def aclose(self) -> None:
        await self.agent.aclose()
        await self.engine.aclose()


class HostedAgentEngine:
    """Agent and engine adapter in one process, as one :class:`~engines.contract.Engine`
    (staged transport): the Ray form. Host it on the engine's node in an engine actor
    (``publisher.ray.engine.start_engine(functools.partial(hosted_agent, ...))``, scheduled
    there by the deployment's node resources): buckets then travel through Ray's object store
    to that node, where the agent writes and its engine loads, with no HTTP agent process and no
    shared filesystem. Incarnation, inventory and generation go to the engine."""

    transport: Transport = "staged"

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    @property
    def engine_id(self) -> str:
        return self.agent.engine.engine_id

    @property
    def kind(self) -> str:
        return self.agent.engine.kind

    @property
    def capabilities(self) -> EngineCapabilities:
        inner = self.agent.engine.capabilities
        return EngineCapabilities(endpoint=inner.endpoint, confirms_end=inner.confirms_end)

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        ender = ends_requests(self.agent.engine)
        return False if ender is None else await ender.abort_request(request_id, lora_name)

    async def incarnation(self) -> str:
        return await self.agent.engine.incarnation()

    async def inventory(self) -> Inventory:
        return await self.agent.engine.inventory()

    async def prepare(self, candidate: Candidate) -> Receipt:
        return await self._tagged(self.agent.prepare(candidate))

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        async for bucket in buckets:
            upload = wire.BucketUpload(
                lora_name=candidate.lora_name,
                attempt=candidate.attempt,
                digest=candidate.digest,
                bucket=bucket,
            )
            await self._tagged(self.agent.receive_bucket(upload))

    async def load(self, candidate: Candidate) -> Receipt:
        return await self._tagged(self.agent.load(candidate))

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        return await self._tagged(self.agent.unload(lora_name, attempt))

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        return await self.agent.engine.generate(
            prompt, lora_name, params, request_id=request_id, cache_salt=cache_salt
        )

    async def _tagged(self, call: Coroutine[Any, Any, T]) -> T:
        try:
            return await call
        except EngineError as exc:
            exc.engine_id = self.engine_id
            raise

    async def aclose(self) -> None:
        await self.agent.engine.aclose()

    async def __aenter__(self) -> HostedAgentEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def hosted_agent(
    engine: str, artifacts: str, engine_id: str, *, served_model: str = "tiny"
) -> HostedAgentEngine:
    """A :class:`HostedAgentEngine` for ``engine`` (``KIND:URL``) writing into ``artifacts``:
    the factory an engine actor takes (it is its own async context manager)."""
    kind, _, url = engine.partition(":")
    adapter = engine_adapter(kind, url, engine_id, served_model=served_model)
    return HostedAgentEngine(Agent(adapter, ArtifactStore(artifacts)))


# --- running it ----------------------------------------------------------------------------------


def engine_adapter(
    kind: str,
    url: str,
    engine_id: str,
    *,
    api_key: str | None = None,
    served_model: str = "tiny",
) -> Any:
    """The path-loading adapter for ``kind`` (``sglang`` or ``vllm``, whose base model is
    served as ``served_model``)."""
    if kind == "sglang":
        from engines.sglang import SGLangEngine

        return SGLangEngine(url, engine_id, api_key=api_key)
    if kind == "vllm":
        from engines.vllm import VLLMEngine

        return VLLMEngine(url, engine_id, api_key=api_key, served_model=served_model)
    raise ValueError(f"an agent serves a path-loading engine (sglang, vllm), not {kind!r}")


@contextlib.asynccontextmanager
async def serve_agent(
    agent: Agent,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    drain: Drain | None = None,
) -> AsyncIterator[str]:
    """Serve ``agent`` and yield its base URL, expiring its idle staging meanwhile; stops on
    exit (tests and the process)."""
    check_configuration(host, token, None)
    app = create_app(agent, token=token, drain=drain)
    async with embedded.serving(app, host=host, port=port) as url, anyio.create_task_group() as tg:
        tg.start_soon(agent.expire_idle_forever)
        try:
            yield url
        finally:
            tg.cancel_scope.cancel()


def _die_after_write() -> None:
    print("engines.agent: exiting after the write (fault mode)", file=sys.stderr, flush=True)
    os._exit(EXIT_AFTER_WRITE)


async def run(
    *,
    engine: str,
    artifacts: str,
    engine_id: str = "agent",
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    engine_token: str | None = None,
    exit_after_write: bool = False,
    served_model: str = "tiny",
    on_ready: Callable[[str], None] | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    staging_idle_s: float = DEFAULT_STAGING_IDLE_S,
) -> None:
    """Run an agent for ``engine`` (``KIND:URL``) until SIGINT/SIGTERM, then drain: new
    publication steps are refused ``503 ENGINE_DRAINING``, the steps already running finish
    (at most ``drain_timeout`` seconds: :mod:`engines.drain`), then it stops. An unsafe
    configuration (:func:`check_configuration`) raises :class:`UnsafeConfiguration` first."""
    check_configuration(host, token, engine_token)
    kind, _, url = engine.partition(":")
    adapter = engine_adapter(kind, url, engine_id, api_key=engine_token, served_model=served_model)
    store = ArtifactStore(artifacts)
    agent = Agent(
        adapter,
        store,
        after_write=_die_after_write if exit_after_write else None,
        staging_bytes=staging_bytes,
        staging_idle_s=staging_idle_s,
    )
    drain = Drain(engine_id)
    try:
        async with serve_agent(agent, host=host, port=port, token=token, drain=drain) as base:
            if on_ready is not None:
                on_ready(base)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            drain.begin()
            left = await drain.wait(drain_timeout)
            if left:
                print(
                    f"engines.agent: drain timed out after {drain_timeout:g}s with {left} "
                    "step(s) still running: they are cut",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        await adapter.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engines.agent", description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, help="KIND:URL, e.g. sglang:http://127.0.0.1:30000")
    p.add_argument("--artifacts", required=True, help="this host's artifact directory")
    p.add_argument("--id", default="agent", help="the fleet member's engine id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--served-model", default="tiny", help="vLLM's --served-model-name")
    p.add_argument("--exit-after-write", action="store_true", help="fault mode (tests)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long the steps already running may take (seconds)",
    )
    p.add_argument("--staging-bytes", type=int, default=DEFAULT_STAGING_BYTES)
    p.add_argument("--staging-idle", type=float, default=DEFAULT_STAGING_IDLE_S)
    args = p.parse_args(argv)
    token = guard.read_token(AGENT_TOKEN_ENV, None)
    engine_token = guard.read_token(ENGINE_TOKEN_ENV, None)

    def ready(url: str) -> None:
        print(url.rsplit(":", 1)[1], flush=True)

    try:
        check_configuration(args.host, token, engine_token)
    except UnsafeConfiguration as exc:
        print(f"engines.agent: {exc}", file=sys.stderr, flush=True)
        sys.exit(11)  # the CLI's unsafe-configuration code (tools.exitcodes.Exit.UNSAFE)
    anyio.run(
        lambda: run(
            engine=args.engine,
            artifacts=args.artifacts,
            engine_id=args.id,
            host=args.host,
            port=args.port,
            token=token,
            engine_token=engine_token,
            exit_after_write=args.exit_after_write,
            served_model=args.served_model,
            on_ready=ready,
            drain_timeout=args.drain_timeout,
            staging_bytes=args.staging_bytes,
            staging_idle_s=args.staging_idle,
        )
    )


if __name__ == "__main__":
    main()
