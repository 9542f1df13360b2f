"""The Ray acceptance scenario, written once and run twice: in process (the reference) and on
a local Ray instance (trainer, ledger, engines and rollout workers each an actor), so the two
runs can be compared result for result.

The script: a trainer publishes versions 1, 2, 3; four rollout workers run waves of
multi-turn sessions between and across the publications (wave A starts on v1, B on v2, C on v2
while the ledger is DOWN, D on v3); sessions of earlier waves keep taking turns after later
publications. In the middle, the ledger goes down: already-bound sessions keep generating
(nothing on their path needs the ledger), sessions starting meanwhile wait for their first
bind, the ledger comes back by replaying its log, and every binding made before is asked
again and must come back unchanged. Then v3, more turns, every session closed, and the
retired versions reclaimed on every engine.

Every turn's prompt depends only on (session, turn) and decoding is greedy, so each turn's
tokens depend only on the adapter that served it: the Ray run must reproduce the in-process
transcript exactly.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
import msgspec
import ray
from ray.exceptions import RayActorError

from engines.contract import SamplingParams
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from evlog.errors import LoraLedgerError
from evlog.sqlite import SQLiteStore
from publisher.core.outcomes import Bound, Released
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.trainer import TrainerClient
from publisher.gateway import Gateway, LocalView
from publisher.ray.client import RayLedger
from publisher.ray.engine import EngineActor, EngineInfo, RayEngine, stop_engine
from publisher.ray.ledger_actor import LedgerConfig, PlaneConfig, start_ledger, stop_ledger
from publisher.ray.rollout import RayRollout
from publisher.ray.trainer import RayTrainerClient
from publisher.sessions import RolloutWorker

WORKERS = 4
ENGINES = 2
WAVES = {"A": 3, "B": 3, "C": 2, "D": 2}  # sessions per worker
EXPECTED_VERSION = {"A": 1, "B": 2, "C": 2, "D": 3}
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LIMITS = ServingLimits(max_lora_rank=64)
TIMEOUTS = EngineTimeouts(probe=10, inventory=20, prepare=30, transfer=60, load=60, unload=60)
PLANE_OPTIONS: dict[str, Any] = {
    "probe_interval_s": 0.2,
    "reclaim_tick_s": 0.1,
    "lease_check_s": 0.5,
    "timeouts": TIMEOUTS,
    "cleanup_timeout": 20.0,
}
CAPACITY = 4


def sessions_of(wave: str, worker: int) -> list[str]:
    return [f"{wave}{worker}-{i}" for i in range(WAVES[wave])]


def owner_of(session: str) -> str:
    return f"w{session[1]}"


# Who asks for the bound sessions again (a resume in another process): an owner of its own, as
# only a worker's own life may act for it; an existing binding is answered to any owner.
REBINDER = "rebinder"


def prompt(session: str, turn: int) -> tuple[int, ...]:
    """Token ids depending only on (session, turn) (crc32: stable across processes)."""
    h = zlib.crc32(session.encode())
    return (10 + h % 400, 20 + turn, 30 + (h >> 9) % 400, 40 + turn, 50 + (h >> 18) % 400)


class Turn(msgspec.Struct, frozen=True, order=True):
    session: str
    turn: int
    version_id: int
    lora_name: str
    token_ids: tuple[int, ...]


class Outcome(msgspec.Struct, frozen=True):
    """One attempted turn: where it was served, or the code it failed with."""

    session: str
    turn: int
    engine: str = ""
    incarnation: str = ""
    version_id: int = 0
    code: str = ""


class SessionRunner:
    """One rollout worker's sessions: a turn for several sessions at once, and closing."""

    def __init__(self, worker: RolloutWorker, ledger: Any = None) -> None:
        self.worker = worker
        self.ledger = ledger

    async def turn(self, sessions: Sequence[str], turn: int) -> list[Turn]:
        done: dict[str, Turn] = {}

        async def one(session: str) -> None:
            served = await self.worker.session(session).generate(
                prompt(session, turn), PARAMS, turn=turn
            )
            done[session] = Turn(
                session=session,
                turn=turn,
                version_id=served.version_id,
                lora_name=served.lora_name,
                token_ids=tuple(served.generation.token_ids),
            )

        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(one, session)
        return [done[s] for s in sessions]

    async def attempt(self, sessions: Sequence[str], turn: int) -> list[Outcome]:
        """A turn for each session, concurrently, each failure kept as its code (for tests
        that count the turns a fault cost)."""
        done: dict[str, Outcome] = {}

        async def one(session: str) -> None:
            try:
                served = await self.worker.session(session).generate(
                    prompt(session, turn), PARAMS, turn=turn
                )
            except LoraLedgerError as exc:
                done[session] = Outcome(session=session, turn=turn, code=exc.code)
            else:
                done[session] = Outcome(
                    session=session,
                    turn=turn,
                    engine=served.engine,
                    incarnation=served.provenance.incarnation,
                    version_id=served.version_id,
                )

        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(one, session)
        return [done[s] for s in sessions]

    async def close(self, sessions: Sequence[str]) -> list[bool]:
        results = await self.worker.close_many([self.worker.session(s) for s in sessions])
        for result in results:
            if isinstance(result, LoraLedgerError):
                raise result
        return [r.released for r in results if isinstance(r, Released)]


class Env(Protocol):
    """Where the scenario runs."""

    async def publish(self, step: int) -> Any: ...
    async def turn(self, worker: int, sessions: Sequence[str], turn: int) -> list[Turn]: ...
    async def close(self, worker: int, sessions: Sequence[str]) -> list[bool]: ...
    async def ledger_down(self) -> None: ...
    async def ledger_up(self) -> None: ...
    async def rebind(self, sessions: Sequence[str]) -> list[Bound]: ...
    async def version_states(self) -> dict[int, str]: ...


class Result(msgspec.Struct, frozen=True):
    turns: list[Turn]
    publications: list[tuple[str, int, str | None, int | None, int | None]]
    rebound: list[tuple[str, int, str, bool]]
    released: int
    versions: dict[int, str]


async def run(env: Env, *, outage_timeout: float = 120.0) -> Result:
    turns: list[Turn] = []
    publications = []

    async def go(worker: int, wave: str, turn: int) -> None:
        turns.extend(await env.turn(worker, sessions_of(wave, worker), turn))

    async def everyone(*steps: tuple[str, int]) -> None:
        async with anyio.create_task_group() as tg:
            for worker in range(WORKERS):
                for wave, turn in steps:
                    tg.start_soon(go, worker, wave, turn)

    async def publish(step: int) -> None:
        p = await env.publish(step)
        publications.append((p.status, p.version_id, p.lora_name, p.revision, p.retired))

    await publish(1)
    await everyone(("A", 0))
    await everyone(("A", 1))
    await publish(2)
    await everyone(("A", 2), ("B", 0))
    await everyone(("B", 1))

    # The outage: A and B keep generating while the ledger is down (if they needed it, they
    # would wait for ledger_up, which only comes after them: fail_after says so); C starts
    # meanwhile and its first binds wait, retried, until the ledger is back.
    await env.ledger_down()
    with anyio.fail_after(outage_timeout):
        async with anyio.create_task_group() as tg:
            for worker in range(WORKERS):
                tg.start_soon(go, worker, "C", 0)
            await everyone(("A", 3), ("B", 2))
            await env.ledger_up()
    bound_before = [s for w in range(WORKERS) for v in "ABC" for s in sessions_of(v, w)]
    rebound = [
        (b.session, b.version_id, b.lora_name, b.new) for b in await env.rebind(bound_before)
    ]

    await publish(3)
    await everyone(("D", 0), ("C", 1))
    await everyone(("A", 4), ("B", 3), ("C", 2), ("D", 1))

    released = 0

    async def close(worker: int) -> None:
        nonlocal released
        mine = [s for wave in WAVES for s in sessions_of(wave, worker)]
        closed = await env.close(worker, mine)
        released += sum(closed)

    async with anyio.create_task_group() as tg:
        for worker in range(WORKERS):
            tg.start_soon(close, worker)

    # every session is closed: the reclaim driver unloads the retired versions everywhere
    with anyio.fail_after(60):
        while True:
            versions = await env.version_states()
            if versions.get(1) == versions.get(2) == "RECLAIMED":
                break
            await anyio.sleep(0.1)
    return Result(sorted(turns), publications, sorted(rebound), released, versions)


# --- in process: the reference run -------------------------------------------------------------


class InProcessEnv:
    def __init__(self, plane: ControlPlane, runners: list[SessionRunner]) -> None:
        self.plane = plane
        self.trainer = TrainerClient(plane)
        self.runners = runners

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, tmp: Path) -> AsyncIterator[InProcessEnv]:
        async with contextlib.AsyncExitStack() as stack:
            engines = [
                await stack.enter_async_context(LocalEngine(f"e{i}", limits=LIMITS))
                for i in range(ENGINES)
            ]
            store = await stack.enter_async_context(SQLiteStore.open(tmp / "inproc.db"))
            plane = await stack.enter_async_context(
                ControlPlane.open(
                    store,
                    Fleet(engines),
                    deployment="dep",
                    prefix="agent",
                    capacity=CAPACITY,
                    artifact_root=tmp / "inproc-artifacts",
                    **PLANE_OPTIONS,
                )
            )
            runners = []
            for k in range(WORKERS):
                owner = f"w{k}"
                gateway = Gateway(plane.fleet, LocalView(plane.ledger), gateway_id=owner)
                plane.add_inflight_source(gateway)
                worker = await stack.enter_async_context(
                    RolloutWorker.open(plane.ledger, gateway, owner=owner)
                )
                runners.append(SessionRunner(worker, plane.ledger))
            yield cls(plane, runners)

    async def publish(self, step: int) -> Any:
        config, tensors = make_adapter(step)
        return await self.trainer.publish(tensors, config, step=step)

    async def turn(self, worker: int, sessions: Sequence[str], turn: int) -> list[Turn]:
        return await self.runners[worker].turn(sessions, turn)

    async def close(self, worker: int, sessions: Sequence[str]) -> list[bool]:
        return await self.runners[worker].close(sessions)

    async def ledger_down(self) -> None:
        """In process the ledger never goes away: the reference run has no outage."""

    async def ledger_up(self) -> None:
        """See :meth:`ledger_down`."""

    async def rebind(self, sessions: Sequence[str]) -> list[Bound]:
        await self.plane.ledger.register_owner(REBINDER)
        return [await self.plane.ledger.bind(s, REBINDER) for s in sessions]

    async def version_states(self) -> dict[int, str]:
        return {v.version_id: str(v.state) for v in self.plane.ledger.status().versions}


# --- on Ray ------------------------------------------------------------------------------------


class TrainerActor:
    """A trainer process: builds step ``n``'s adapter and publishes it through Ray."""

    def __init__(self, ledger_name: str, namespace: str) -> None:
        self.client = RayTrainerClient(ledger_name, namespace=namespace)

    async def publish(self, step: int) -> Any:
        config, tensors = make_adapter(step)
        return await self.client.publish(tensors, config, step=step)

    async def reconnects(self) -> int:
        return self.client.reconnects


async def _turn(worker: RolloutWorker, sessions: list[str], turn: int) -> list[Turn]:
    return await SessionRunner(worker).turn(sessions, turn)


async def _close(worker: RolloutWorker, sessions: list[str]) -> list[bool]:
    return await SessionRunner(worker).close(sessions)


async def _reconnects(worker: RolloutWorker) -> int:
    ledger = worker.ledger
    assert isinstance(ledger, RayLedger)
    return ledger.link.reconnects


async def _attempt(worker: RolloutWorker, sessions: list[str], turn: int) -> list[Outcome]:
    return await SessionRunner(worker).attempt(sessions, turn)


async def _routes_to(worker: RolloutWorker, engine_id: str) -> bool:
    ledger = worker.ledger
    assert isinstance(ledger, RayLedger)
    table = ledger.view.table
    return table is not None and any(engine_id in h for h in table.holders.values())


async def _mirror(worker: RolloutWorker) -> dict[str, str]:
    return {e.engine_id: getattr(e, "actor_id", "") for e in worker.gateway.fleet}


class RolloutActor:
    """A rollout worker process as the README writes one: a RayRollout made in ``__init__``
    (a RayLedger client, a gateway over the ledger's engine actors and a RolloutWorker,
    connected once), used from every method."""

    def __init__(
        self,
        owner: str,
        ledger_name: str,
        namespace: str,
        worker_options: dict[str, Any] | None = None,
    ) -> None:
        # No engines argument: the gateway routes over the ledger's fleet (RayLedger.fleet), so
        # an engine added or replaced later is routed to without a restart of this actor.
        self.rollout = RayRollout(
            owner,
            ledger=ledger_name,
            namespace=namespace,
            connect="eager",
            worker_options=worker_options,
        )

    async def turn(self, sessions: list[str], turn: int) -> list[Turn]:
        return await self.rollout.run(_turn, sessions, turn)

    async def attempt(self, sessions: list[str], turn: int) -> list[Outcome]:
        return await self.rollout.run(_attempt, sessions, turn)

    async def routes_to(self, engine_id: str) -> bool:
        """Whether this actor's routing table has ``engine_id`` routable for some version."""
        return await self.rollout.run(_routes_to, engine_id)

    async def mirror(self) -> dict[str, str]:
        """The engine handles this actor's gateway routes to: id -> Ray actor id."""
        return await self.rollout.run(_mirror)

    async def close(self, sessions: list[str]) -> list[bool]:
        return await self.rollout.run(_close, sessions)

    async def reconnects(self) -> int:
        return await self.rollout.run(_reconnects)

    async def stop(self) -> None:
        await self.rollout.close()  # a clean exit: deregisters


class RayEnv:
    """Trainer, ledger (hosting the control plane), engines and workers as Ray actors."""

    def __init__(self, tmp: Path, namespace: str) -> None:
        self.namespace = namespace
        self.ledger_name = f"ledger-{uuid.uuid4().hex[:8]}"
        self.path = tmp / "ray-ledger.db"
        self.engines: list[RayEngine] = []
        self.workers: list[Any] = []
        self.trainer: Any = None
        self.ledger: Any = None
        self.config: LedgerConfig | None = None
        self.client: RayLedger | None = None
        self._tmp = tmp

    def start(self) -> None:
        actors = [
            ray.remote(EngineActor)
            .options(name=f"{self.ledger_name}-e{i}", max_task_retries=0, num_cpus=0)
            .remote(functools.partial(LocalEngine, f"e{i}", limits=LIMITS))
            for i in range(ENGINES)
        ]
        infos: list[EngineInfo] = ray.get([a.describe.remote() for a in actors], timeout=300)
        self.engines = [
            RayEngine(a, i.engine_id, i.kind, i.transport)  # type: ignore[arg-type]
            for a, i in zip(actors, infos, strict=True)
        ]
        self.config = LedgerConfig(
            path=str(self.path),
            plane=PlaneConfig(
                deployment="dep",
                prefix="agent",
                capacity=CAPACITY,
                artifact_root=str(self._tmp / "ray-artifacts"),
                engines=tuple(self.engines),
                options=PLANE_OPTIONS,
            ),
        )
        self.ledger = start_ledger(self.config, name=self.ledger_name, namespace=self.namespace)
        self.trainer = (
            ray.remote(TrainerActor).options(num_cpus=0).remote(self.ledger_name, self.namespace)
        )
        self.workers = [
            ray.remote(RolloutActor)
            .options(num_cpus=0)
            .remote(f"w{k}", self.ledger_name, self.namespace)
            for k in range(WORKERS)
        ]
        ray.get([w.reconnects.remote() for w in self.workers], timeout=300)

    def stop(self) -> None:
        """Stop everything this env started (workers first: they release and forget)."""
        for worker in self.workers:
            with contextlib.suppress(RayActorError):
                ray.get(worker.stop.remote(), timeout=60)
            ray.kill(worker, no_restart=True)
        if self.trainer is not None:
            ray.kill(self.trainer, no_restart=True)
        if self.ledger is not None:
            stop_ledger(self.ledger_name, namespace=self.namespace)
        for engine in self.engines:
            stop_engine(engine)

    async def publish(self, step: int) -> Any:
        return await self.trainer.publish.remote(step)

    async def turn(self, worker: int, sessions: Sequence[str], turn: int) -> list[Turn]:
        return await self.workers[worker].turn.remote(list(sessions), turn)  # type: ignore[no-any-return]

    async def close(self, worker: int, sessions: Sequence[str]) -> list[bool]:
        return await self.workers[worker].close.remote(list(sessions))  # type: ignore[no-any-return]

    async def ledger_down(self) -> None:
        """Kill the ledger actor for good and wait until it is really dead."""
        handle = self.ledger
        ray.kill(handle, no_restart=True)
        with anyio.fail_after(30):
            while True:
                try:
                    await handle.describe.remote()
                except RayActorError:
                    return
                await anyio.sleep(0.05)

    async def ledger_up(self) -> None:
        """Recreate it under its name: it reopens the same SQLite file and replays it."""
        assert self.config is not None
        config = self.config
        self.ledger = await anyio.to_thread.run_sync(
            lambda: start_ledger(config, name=self.ledger_name, namespace=self.namespace)
        )

    async def rebind(self, sessions: Sequence[str]) -> list[Bound]:
        async with RayLedger.connect(self.ledger_name, namespace=self.namespace) as ledger:
            await ledger.register_owner(REBINDER)
            return [await ledger.bind(s, REBINDER) for s in sessions]

    async def version_states(self) -> dict[int, str]:
        async with RayLedger.connect(self.ledger_name, namespace=self.namespace) as ledger:
            status = await ledger.status()
        return {v.version_id: str(v.state) for v in status.versions}

    async def generate_calls(self) -> int:
        return sum([await e.generate_calls() for e in self.engines])

    async def reconnects(self) -> dict[str, int]:
        counts = {f"w{k}": await w.reconnects.remote() for k, w in enumerate(self.workers)}
        counts["trainer"] = await self.trainer.reconnects.remote()
        return counts
