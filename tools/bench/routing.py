"""Session placement: round robin vs pure rendezvous vs bounded-load rendezvous, on a replayed
long-tail multi-turn workload against a *simulated* engine fleet (BENCHMARKS.md, "Routing").

What is real: the placement function, :func:`publisher.gateway.affinity.place`, the one the
gateway's dispatch executor calls (``eps = inf`` is pure rendezvous), fed the same signal the
gateway has: its own count of requests in flight per engine. What is simulated, in process and
named so: the engines. Each has a prefix cache of ``cache_tokens`` tokens, least recently used
conversations evicted first, and serves at most ``slots`` requests at once from a FIFO queue; a
request's service time is ``uncached prompt tokens x prefill_s + output tokens x decode_s``.
A GPU engine is not available here, and the question is one of placement, not of kernels.

The workload is seeded and replayed identically for every policy: ``sessions`` agent sessions
arrive at random over ``arrival_s``; each has 5-100 turns (a Pareto tail: most are short, a
few are very long), each turn resends the whole conversation plus a new message, waits for the
reply, thinks, and sends the next. Figures: the simulated wall time until the last turn ends
(the makespan) and the prefix-cache hit rate (cached / prompt tokens), for each policy, and
bounded-load rendezvous as a ratio of pure rendezvous from the same run.

Run ``python -m tools.bench.routing`` or ``loraledger bench routing``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import msgspec

from publisher.gateway.affinity import DEFAULT_LOAD_EPS, moved_by_load, place


class Turn(msgspec.Struct, frozen=True):
    new_tokens: int  # the user's (or tool's) message appended to the conversation
    output_tokens: int
    think_s: float  # before the next turn is sent


class Session(msgspec.Struct, frozen=True):
    name: str
    arrives_s: float
    turns: tuple[Turn, ...]


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated engine: prefix cache, queue, service time (module docstring)."""

    engines: int = 12
    slots: int = 8
    cache_tokens: int = 600_000
    prefill_s: float = 0.00005  # per uncached prompt token: 20,000 tokens/s
    decode_s: float = 0.01  # per output token of one request: 100 tokens/s


def workload(sessions: int, *, seed: int, arrival_s: float) -> list[Session]:
    """The replayed sessions: 5-100 turns (Pareto, shape 1.1), a 2,000-8,000 token opening,
    100-3,000 tokens added per turn, 50-500 output tokens, 0-2 s of thought."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        count = min(100, int(5 * rng.paretovariate(1.1)))
        turns = tuple(
            Turn(
                new_tokens=rng.randint(2_000, 8_000) if t == 0 else rng.randint(100, 3_000),
                output_tokens=rng.randint(50, 500),
                think_s=rng.uniform(0.0, 2.0),
            )
            for t in range(count)
        )
        out.append(
            Session(name=f"agent-{seed}-{i:05d}", arrives_s=rng.uniform(0, arrival_s), turns=turns)
        )
    return out


class _Engine:
    def __init__(self) -> None:
        self.cache: OrderedDict[str, int] = OrderedDict()  # session -> cached prefix tokens
        self.cached = 0
        self.running = 0
        self.queue: deque[tuple[str, int, int]] = deque()  # (session, prompt, output) waiting

    def lookup(self, session: str, prompt: int) -> int:
        hit = min(self.cache.get(session, 0), prompt)
        if session in self.cache:
            self.cache.move_to_end(session)
        return hit

    def store(self, session: str, tokens: int, capacity: int) -> None:
        self.cached += tokens - self.cache.pop(session, 0)
        self.cache[session] = tokens
        while self.cached > capacity and self.cache:
            _, evicted = self.cache.popitem(last=False)
            self.cached -= evicted


def simulate(
    sessions: Sequence[Session], model: CostModel, policy: str, eps: float
) -> dict[str, Any]:
    """Replay ``sessions`` under one placement ``policy`` (``round-robin``, ``rendezvous``,
    ``bounded``); every figure is simulated time, not this machine's."""
    names = [f"engine-{i:02d}" for i in range(model.engines)]
    engines = {name: _Engine() for name in names}
    load = dict.fromkeys(names, 0)  # the gateway's signal: requests in flight per engine
    last: dict[str, str] = {}  # session -> the engine the bound moved it to (as the gateway)
    previous: dict[str, str] = {}  # session -> the engine of its last turn (moves counted)
    rotation = itertools.count()
    by_name = {s.name: s for s in sessions}
    events: list[tuple[float, int, str, str, int]] = []  # (time, tie, kind, session, turn)
    tie = itertools.count()
    for s in sessions:
        heapq.heappush(events, (s.arrives_s, next(tie), "send", s.name, 0))
    conversation = dict.fromkeys(by_name, 0)  # tokens so far, per session
    prompt_tokens = cached_tokens = turns = moves = 0
    peak_queue = 0
    now = 0.0
    serving: dict[tuple[str, int], tuple[str, float]] = {}  # (session, turn) -> engine, sent
    latency = 0.0

    def start(engine: str, session: str, prompt: int, output: int, turn: int) -> None:
        nonlocal cached_tokens
        e = engines[engine]
        hit = e.lookup(session, prompt)
        cached_tokens += hit
        e.running += 1
        done = now + (prompt - hit) * model.prefill_s + output * model.decode_s
        heapq.heappush(events, (done, next(tie), "done", session, turn))

    while events:
        now, _, kind, name, turn = heapq.heappop(events)
        session = by_name[name]
        step = session.turns[turn]
        if kind == "send":
            prompt = conversation[name] + step.new_tokens
            if policy == "round-robin":
                engine = names[next(rotation) % len(names)]
            else:
                chosen = place(
                    name,
                    names,
                    load=load,
                    eps=math.inf if policy == "rendezvous" else eps,
                    current=last.get(name),
                )
                assert chosen is not None
                engine = chosen
            moves += previous.get(name, engine) != engine
            previous[name] = engine
            if policy == "bounded" and moved_by_load(name, engine, names):
                last[name] = engine
            else:
                last.pop(name, None)
            serving[(name, turn)] = (engine, now)
            load[engine] += 1
            prompt_tokens += prompt
            turns += 1
            e = engines[engine]
            if e.running < model.slots:
                start(engine, name, prompt, step.output_tokens, turn)
            else:
                e.queue.append((name, prompt, turn))
                peak_queue = max(peak_queue, len(e.queue))
        else:  # done
            engine, sent = serving.pop((name, turn))
            latency += now - sent
            e = engines[engine]
            e.running -= 1
            load[engine] -= 1
            conversation[name] += step.new_tokens + step.output_tokens
            e.store(name, conversation[name], model.cache_tokens)
            if e.queue:
                waiting, prompt, waiting_turn = e.queue.popleft()
                start(
                    engine,
                    waiting,
                    prompt,
                    by_name[waiting].turns[waiting_turn].output_tokens,
                    waiting_turn,
                )
            if turn + 1 < len(session.turns):
                heapq.heappush(events, (now + step.think_s, next(tie), "send", name, turn + 1))
    return {
        "policy": policy,
        "simulated_wall_s": round(now, 1),
        "hit_rate": round(cached_tokens / prompt_tokens, 4),
        "mean_turn_s": round(latency / turns, 2),
        "turns": turns,
        "moved_turns": moves,
        "peak_queue": peak_queue,
    }


def bench_routing(
    sessions: int = 610,
    seeds: Sequence[int] = (1, 2, 3, 4, 5),
    arrival_s: float = 60.0,
    eps: float = DEFAULT_LOAD_EPS,
    model: CostModel | None = None,
) -> dict[str, Any]:
    """Each policy on the same seeded workloads: the wall summed over the seeds, the hit rate
    and the mean turn latency (sent to answered, queueing included) averaged over them."""
    model = model or CostModel()
    began = time.perf_counter()
    totals: dict[str, dict[str, Any]] = {}
    per_seed = []
    for seed in seeds:
        replay = workload(sessions, seed=seed, arrival_s=arrival_s)
        for policy in ("round-robin", "rendezvous", "bounded"):
            row = simulate(replay, model, policy, eps)
            per_seed.append({"seed": seed, **row})
            total = totals.setdefault(
                policy, {"policy": policy, "simulated_wall_s": 0.0, "cached": 0.0, "turn_s": 0.0}
            )
            total["turn_s"] += row["mean_turn_s"]
            total["simulated_wall_s"] += row["simulated_wall_s"]
            total["cached"] += row["hit_rate"]
    reference = totals["rendezvous"]
    rows = []
    for policy, total in totals.items():
        rows.append(
            {
                "policy": policy,
                "simulated_wall_s": round(total["simulated_wall_s"], 1),
                "hit_rate": round(total["cached"] / len(seeds), 4),
                "wall_vs_rendezvous": round(
                    total["simulated_wall_s"] / reference["simulated_wall_s"], 3
                ),
                "hit_vs_rendezvous": round(total["cached"] / reference["cached"], 3),
                "mean_turn_s": round(total["turn_s"] / len(seeds), 2),
            }
        )
    bounded = next(r for r in rows if r["policy"] == "bounded")
    return {
        "workload": {
            "sessions": sessions,
            "seeds": list(seeds),
            "arrival_s": arrival_s,
            "eps": eps,
            **msgspec.structs.asdict(model),
            "engines_simulated": True,
        },
        "policies": rows,
        "runs": per_seed,
        "bounded_vs_rendezvous": {
            "wall_ratio": bounded["wall_vs_rendezvous"],
            "hit_rate_ratio": bounded["hit_vs_rendezvous"],
            "target": "wall_ratio <= 0.90 at hit_rate_ratio >= 0.95",
        },
        "seconds": round(time.perf_counter() - began, 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=610)
    parser.add_argument("--eps", type=float, default=DEFAULT_LOAD_EPS)
    args = parser.parse_args(argv)
    print(json.dumps(bench_routing(args.sessions, eps=args.eps), indent=2))


if __name__ == "__main__":
    main()
