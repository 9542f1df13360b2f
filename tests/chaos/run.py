"""One seeded chaos run: ``python -m tests.chaos.run --seed N --duration S``.

It starts the cluster (``tests/chaos/cluster.py``: its trainer process publishes a version
every few seconds through the HTTP trainer client), waits for the first publication, then for
``duration`` seconds runs at once: rollout clients driving multi-turn sessions through the two
gateways with the official ``openai`` client (some turns streamed, some streams cancelled after
their first chunk, sessions closed after a few turns, every second one released while its last
turn still streams), and the seed's faults. After the last
fault healed, the liveness phase: a publication acknowledged, and one more turn of every
session still open. Then the processes stop, the log is read, and the checker
(``tests/chaos/checker.py``) judges the history. The summary lists processes, operations,
faults by kind and violations by invariant; the schedule is printed first, so a failing run is
rerun with its seed.

The faults are one plan, a pure function of the seed (:func:`plan`: ``tests/chaos/schedule.py``
over the cluster's processes and links), printed before the run: process faults (SIGKILL,
SIGTERM, SIGSTOP then SIGCONT, restart) on every process kind (engines, the agent, gateways,
``serve``, the trainer) and network faults on every link, played by :meth:`Run.act` (signals,
or the proxies of a :class:`~tests.chaos.proxy.Network`). The plan keeps an engine and a
gateway unimpaired at every instant and at most two faults at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import openai

from tests.chaos.checker import FREEZE_SEEN_S, LIVENESS_BOUND_S, Violation, check
from tests.chaos.cluster import (
    AGENT_ENGINE,
    ENGINES,
    GATEWAYS,
    STORES,
    TOKEN,
    Cluster,
    StoreKind,
    log_store,
)
from tests.chaos.history import ClientOp, Fault, History, read_engine_records, read_log
from tests.chaos.plants import ENGINE_PLANTS, PLANTS, SOURCE_PLANTS, planted_tree
from tests.chaos.proxy import Network
from tests.chaos.schedule import Pace, Planned, act_on_network, format_schedule, play, schedule
from tests.chaos.trainer import OPS_FILE, read_trainer_ops
from tests.support.paths import REPO

# Every process of the cluster, by kind (tests/chaos/cluster.py starts them).
PROCESSES = {
    **{e: "engine" for e in ENGINES},
    **{g: "gateway" for g in GATEWAYS},
    "serve": "serve",
    "agent": "agent",
    "trainer": "trainer",
}
# Every link of the cluster (tests/chaos/cluster.py names them where it makes them).
LINKS = (
    *(f"client->{g}" for g in GATEWAYS),
    *(f"{g}->serve" for g in GATEWAYS),
    *(f"serve->{e}" for e in ENGINES),
    "serve->agent",
    "trainer->serve",
)
# A fault starts every 1.5-4.5 s from 3-5 s on, at most two at once (a small machine restarts
# processes slowly); a quarter of the freezes outlast serve's probe timeout.
PACE = Pace(
    first_s=(3.0, 5.0), gap_s=(1.5, 4.5), overlap=True, at_once=2, long_stop_s=FREEZE_SEEN_S
)
# The history's name of each process fault (the checker's vocabulary).
RECORDED_AS = {"sigkill": "kill", "sigterm": "term", "sigstop": "stop", "restart": "restart"}
SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "restart": signal.SIGTERM}
CLIENTS = 4
FIRST_PUBLICATION_S = 120.0
TURN_TIMEOUT_S = 60.0
CLOSE_RETRY_S = 60.0
CATCH_IN_FLIGHT_S = 5.0
# A long turn (streamed or not) runs long enough that a fault may catch it in flight: a
# dispatch cut before its answer began is the ambiguous case, streamed or not.
LONG_TOKENS = 96
STREAMED = ("stream", "cancel", "abandon")
# Every second session of each client is abandoned (``Run.abandon``), whatever the seed: its
# last turn streams this many tokens while the session is released through the other gateway.
ABANDON_EVERY = 2
ABANDON_TOKENS = 4 * LONG_TOKENS


def plan(seed: int, duration: float) -> list[Planned]:
    """The run's faults: a pure function of the seed, process and network faults in one plan."""
    return schedule(seed, duration, LINKS, PROCESSES, PACE)


class Run:
    """The shared state of one run: the cluster, what the clients saw, the faults."""

    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.cluster, self.seed = cluster, seed
        self.ops: list[ClientOp] = []
        self.faults: list[Fault] = []
        self.stop = anyio.Event()
        self.requests = 0

    def _done(
        self, client: str, kind: str, invoked: float, outcome: str, code: str, **fields: Any
    ) -> ClientOp:
        """Record a close that just ended."""
        op = ClientOp(
            client=client,
            kind=kind,  # type: ignore[arg-type]
            invoked=invoked,
            completed=time.time(),
            outcome=outcome,  # type: ignore[arg-type]
            code=code,
            **fields,
        )
        self.ops.append(op)
        return op

    # --- the trainer ------------------------------------------------------------------------

    def publications(self) -> list[ClientOp]:
        """The trainer process's publications so far, every life of it."""
        return read_trainer_ops(self.cluster.root / OPS_FILE)

    async def acknowledged(self, after: float, deadline: float) -> bool:
        """Wait until the trainer has a publication acknowledged that it asked for at
        ``after`` or later (False: none by ``deadline``)."""
        while time.time() < deadline:
            if any(op.outcome == "ok" and op.invoked >= after for op in self.publications()):
                return True
            await anyio.sleep(0.2)
        return False

    # --- the rollout clients -----------------------------------------------------------------

    async def turn(
        self,
        client: str,
        gateway: str,
        session: str,
        history: list[dict[str, str]],
        mode: str,
        streaming: anyio.Event | None = None,
    ) -> ClientOp:
        """One turn; ``streaming`` is set once its first chunk arrived (or it ended without)."""
        self.requests += 1
        rid = f"{client}-{self.requests}"
        history.append({"role": "user", "content": f"turn {len(history)} of {session}"})
        invoked = time.time()
        fields: dict[str, Any] = {"outcome": "info", "code": ""}
        api = openai.AsyncOpenAI(
            base_url=self.cluster.url(gateway) + "/v1",
            api_key=TOKEN,
            max_retries=0,
            timeout=TURN_TIMEOUT_S,
        )
        try:
            raw = await api.chat.completions.with_raw_response.create(
                model="policy",
                messages=history[-4:],  # type: ignore[arg-type]
                max_tokens={"plain": 4, "abandon": ABANDON_TOKENS}.get(mode, LONG_TOKENS),
                stream=mode in STREAMED,
                extra_body={} if mode == "plain" else {"ignore_eos": True},
                extra_headers={"x-session-id": session, "x-request-id": rid},
            )
            fields["version"] = int(raw.headers["x-loraledger-version"])
            fields["engine"] = raw.headers["x-loraledger-engine"]
            if mode not in STREAMED:
                reply: Any = raw.parse()
                history.append(
                    {"role": "assistant", "content": reply.choices[0].message.content or ""}
                )
                fields["outcome"] = "ok"
            else:
                stream: Any = raw.parse()
                async for _chunk in stream:
                    if streaming is not None:
                        streaming.set()
                    if mode == "cancel":
                        fields["code"] = "cancelled"  # the client went away mid-stream
                        break
                else:
                    fields["outcome"] = "ok"
                await stream.close()
        except openai.APIStatusError as exc:
            fields.update(outcome="fail", code=f"{exc.status_code} {exc.code}")
            fields["engine"] = exc.response.headers.get("x-loraledger-engine", "")
        except (openai.APIConnectionError, httpx.HTTPError) as exc:
            fields["code"] = type(exc).__name__
        except openai.APIError as exc:  # an error event in a stream: the answer's code
            fields.update(outcome="fail", code=str(exc.code or exc.message))
        finally:
            if streaming is not None:
                streaming.set()
            await api.close()
        op = ClientOp(
            client=client,
            kind="turn",
            invoked=invoked,
            completed=time.time(),
            session=session,
            request_id=rid,
            stream=mode in STREAMED,
            via=gateway,
            **fields,
        )
        self.ops.append(op)
        return op

    async def close(self, client: str, gateway: str, session: str) -> ClientOp:
        invoked = time.time()
        outcome, code = "info", ""
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                reply = await http.post(
                    f"{self.cluster.url(gateway)}/v1/sessions/{session}/release",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            ok = reply.status_code == 200
            outcome, code = (
                ("ok", "") if ok else ("fail", f"{reply.status_code} {reply.text[:200]}")
            )
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        return self._done(client, "close", invoked, outcome, code, session=session, via=gateway)

    async def close_for_sure(self, client: str, gateway: str, session: str) -> None:
        """Close a session, asked again (through the other gateway) while the answer is not
        known or says to retry (serve down: 503), as a client that must not leak sessions
        does: a leaked session pins its version, and capacity then refuses publications."""
        deadline = time.time() + CLOSE_RETRY_S
        while True:
            op = await self.close(client, gateway, session)
            retry = op.outcome == "info" or op.code.startswith("5")
            if not retry or time.time() > deadline:
                return
            gateway = GATEWAYS[1 - GATEWAYS.index(gateway)]
            await anyio.sleep(0.5)

    async def abandon(
        self, client: str, gateway: str, session: str, history: list[dict[str, str]]
    ) -> None:
        """Release a session while a long turn of it still streams, as an RL worker abandoning
        an episode does: the turn streams through ``gateway``, and once its first chunk came
        the release goes through the other gateway (which has no turn of it to wait for). The
        ledger then holds a version with no session bound and a request running on it: only
        its in-flight evidence keeps the version from being reclaimed under that request."""
        streaming = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.turn, client, gateway, session, history, "abandon", streaming)
            await streaming.wait()
            other = GATEWAYS[1 - GATEWAYS.index(gateway)]
            await self.close_for_sure(client, other, session)

    async def rollout_client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        name = f"c{index}"
        for k in range(1_000_000):
            if self.stop.is_set():
                return
            session, history = f"{name}-s{k}", list[dict[str, str]]()
            gateway = rng.choice(GATEWAYS)
            for _ in range(rng.randint(2, 5)):
                if self.stop.is_set():
                    return  # left open: the liveness phase serves its next turn
                mode = rng.choices(("plain", "long", "stream", "cancel"), (4, 2, 3, 1))[0]
                op = await self.turn(name, gateway, session, history, mode)
                if op.outcome == "info" and op.code != "cancelled":
                    gateway = GATEWAYS[1 - GATEWAYS.index(gateway)]  # that one is down
                    await anyio.sleep(0.2)
                elif op.outcome == "fail" and "SESSION_CLOSED" in op.code:
                    break
            else:
                if k % ABANDON_EVERY == ABANDON_EVERY - 1:
                    await self.abandon(name, gateway, session, history)
                else:
                    await self.close_for_sure(name, gateway, session)

    # --- the faults -------------------------------------------------------------------------

    async def act(self, net: Network, planned: Planned) -> None:
        """One planned fault from start to heal, recorded once healed. A process fault is sent
        by PID: SIGSTOP then SIGCONT after ``heal_after_s``; otherwise the signal (SIGTERM for
        a restart), the exit awaited, and the process started again on its port after
        ``heal_after_s``. An engine's SIGKILL first waits for a request in flight on it."""
        at = time.time()
        kind: str = planned.kind
        if planned.network:
            await act_on_network(net, planned)
        else:
            member = self.cluster.members[planned.target]
            if planned.kind == "sigkill" and planned.target in ENGINES:
                await self._until_running(planned.target)
                at = time.time()
            if planned.kind == "sigstop":
                member.signal(signal.SIGSTOP)
                await anyio.sleep(planned.heal_after_s)
                member.signal(signal.SIGCONT)
            else:
                await member.stop(SIGNALS[planned.kind])
                await anyio.sleep(planned.heal_after_s)
                await member.start()
            kind = RECORDED_AS[planned.kind]
        self.faults.append(Fault(target=planned.target, kind=kind, at=at, healed=time.time()))
        print(f"  fault {kind} {planned.target}: healed after {time.time() - at:.1f} s", flush=True)

    async def _until_running(self, engine: str) -> None:
        """Wait (at most ``CATCH_IN_FLIGHT_S``) until ``engine`` runs a request: a SIGKILL
        that catches one is the case at most once is about (the answer is ambiguous), and
        an idle moment would waste the fault."""
        records = self.cluster.records / f"{engine}.jsonl"
        life = self.cluster.members[engine].pid
        with anyio.move_on_after(CATCH_IN_FLIGHT_S):
            while True:
                running: set[str] = set()
                for r in read_engine_records([records]):
                    if r.life == life and r.request_id:
                        (running.add if r.kind == "start" else running.discard)(r.request_id)
                if running:
                    return
                await anyio.sleep(0.01)

    # --- liveness ----------------------------------------------------------------------------

    async def last_turns(self, deadline: float) -> None:
        """One served turn of every session its client left open, retried (new request ids)
        while the answer says it was not served, until ``deadline``."""
        closed = {op.session for op in self.ops if op.kind == "close" and op.outcome == "ok"}
        open_sessions = sorted({op.session for op in self.ops if op.kind == "turn"} - closed)

        async def serve_one(session: str) -> None:
            gateway = GATEWAYS[hash(session) % 2]
            while time.time() < deadline:
                op = await self.turn("final", gateway, session, [], "plain")
                if op.outcome == "ok" or "SESSION_CLOSED" in op.code:
                    return
                gateway = GATEWAYS[1 - GATEWAYS.index(gateway)]
                await anyio.sleep(0.5)

        async with anyio.create_task_group() as tg:
            for session in open_sessions:
                tg.start_soon(serve_one, session)


async def run(
    seed: int,
    duration: float,
    root: Path,
    *,
    plant: str | None = None,
    store: StoreKind = "sqlite",
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One run; its summary (``violations``: the checker's, by invariant). ``store``: where
    ``serve`` keeps its log (``tests/chaos/cluster.py``, :func:`log_store`)."""
    faults = plan(seed, duration)
    say(f"chaos seed {seed}, {duration:g} s, plant {plant}, store {store}")
    say(format_schedule(seed, faults))
    engine_plant = plant if plant in ENGINE_PLANTS else None
    tree = planted_tree(root / "tree", plant) if plant in SOURCE_PLANTS else REPO
    async with Network() as net, log_store(root, store) as db:
        cluster = Cluster(root, plant=engine_plant, tree=tree, net=net, db=db)
        state = Run(cluster, seed)
        try:
            await cluster.start()
            # The first default, which the first sessions bind to.
            if not await state.acknowledged(0.0, time.time() + FIRST_PUBLICATION_S):
                raise RuntimeError(f"no first publication in {FIRST_PUBLICATION_S:g} s")
            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for i in range(CLIENTS):
                    tg.start_soon(state.rollout_client, i)
                await play(faults, started, functools.partial(state.act, net))
                await anyio.sleep(max(0.0, started + duration - anyio.current_time()))
                state.stop.set()
            heal = max((f.healed for f in state.faults), default=time.time())
            async with anyio.create_task_group() as tg:
                tg.start_soon(state.acknowledged, heal, heal + LIVENESS_BOUND_S)
                await state.last_turns(heal + LIVENESS_BOUND_S)
        finally:
            await cluster.stop()
        log = await read_log(db)  # before a PostgreSQL server stops with the block
    state.ops += state.publications()
    history = History(
        ops=tuple(state.ops),
        engine=tuple(read_engine_records(cluster.engine_records())),
        faults=tuple(state.faults),
        log=tuple(log),
        heal=heal,
    )
    (root / "history.json").write_bytes(msgspec.json.encode(history))
    found = check(history)
    summary = _summary(seed, duration, cluster, history, found)
    say(json.dumps(summary, indent=1))
    for violations in found.values():
        for v in violations[:5]:
            say(f"VIOLATION {v.invariant}: {v.detail}")
    return summary


def _summary(
    seed: int, duration: float, cluster: Cluster, h: History, found: dict[str, list[Violation]]
) -> dict[str, Any]:
    healed: dict[str, list[float]] = {}
    recovered: dict[str, list[float]] = {}
    for f in h.faults:
        healed.setdefault(f.kind, []).append(f.healed - f.at)
        served = _served_again(h, f)
        if served is not None:
            recovered.setdefault(f"{f.kind}:{PROCESSES[f.target]}", []).append(served - f.at)
    return {
        "seed": seed,
        "duration_s": duration,
        "processes": cluster.started(),
        "operations": dict(Counter(f"{op.kind}:{op.outcome}" for op in h.ops)),
        "engine_records": dict(Counter(r.kind for r in h.engine)),
        "log_events": len(h.log),
        "faults": dict(Counter(f"{f.kind}:{f.target}" for f in h.faults)),
        "faults_by_kind": dict(Counter(f.kind for f in h.faults)),
        "fault_to_healed_s": {k: round(max(v), 2) for k, v in healed.items()},
        "fault_to_served_again_s": {k: round(max(v), 2) for k, v in recovered.items()},
        "violations": {name: len(v) for name, v in found.items()},
    }


def _served_again(h: History, f: Fault) -> float | None:
    """When the faulted process served again after it healed: an engine, the first turn it
    answered; a gateway, the first turn answered through it; serve, the first close or
    publication it acknowledged (a cached binding serves turns without it); the agent, the
    first adapter its engine loaded; the trainer, its first publication acknowledged. None
    for a link's fault, or when it did not serve again in the run."""
    role = PROCESSES.get(f.target)
    if role == "agent":
        loads = [r.at for r in h.engine if r.engine == AGENT_ENGINE and r.kind == "load"]
        return min((at for at in loads if at >= f.healed), default=None)
    times = [
        op.completed
        for op in h.ops
        if op.outcome == "ok"
        and op.completed >= f.healed
        and (
            (role == "engine" and op.kind == "turn" and op.engine == f.target)
            or (role == "gateway" and op.kind == "turn" and op.via == f.target)
            or (role == "serve" and op.kind in ("close", "publish"))
            or (role == "trainer" and op.kind == "publish")
        )
    ]
    return min(times, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--dir", type=Path, default=None, help="keep the run's files here")
    parser.add_argument("--plant", choices=PLANTS, default=None, help="a known bug to plant")
    parser.add_argument(
        "--store", choices=STORES, default="sqlite", help="serve's log (postgres: its own server)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
    root.mkdir(parents=True, exist_ok=True)
    summary = anyio.run(
        lambda: run(args.seed, args.duration, root, plant=args.plant, store=args.store)
    )
    print(f"files: {root}")
    sys.exit(1 if any(summary["violations"].values()) else 0)


if __name__ == "__main__":
    main()
