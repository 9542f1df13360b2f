"""The chaos run's fault schedule: a pure function of the seed, printed so a failing run is
rerun from its seed.

``schedule(seed, duration_s, links, processes)`` plans process faults (``sigkill``,
``sigterm``, ``sigstop`` then ``SIGCONT``, ``restart``: the run's executor sends them) and
network faults on the links (``delay``, ``drop``, ``reset_before``, ``reset_after``,
``black_hole``, and a ``partition`` of one process: :mod:`tests.chaos.proxy` applies them).
Each :class:`Planned` fault starts ``at_s`` seconds into the run and is healed
``heal_after_s`` later: a killed or stopped process is started again or continued, a link is
set back to pass. A ``restart`` heals at once (the process is stopped and started again).

The plan never takes the whole fleet down, so the promises stay checkable: at every instant
at least one ``engine`` and one ``gateway`` (by their kind in ``processes``) are unimpaired, at
most one fault touches ``serve`` and the next one waits until it has healed and recovered, and
every fault has healed (recovery included) by ``duration_s``, so the end of a run can ask for
liveness. A process is impaired by a process fault on it, by a partition of it, or by a
cutting fault (anything but ``delay``) on a link at either of whose ends it sits; two faults
never act on one process or one link at once (a heal would otherwise end the other's fault),
and a process fault never meets another fault that impairs the same process (a SIGKILL of an
engine under a black hole of its link would leave neither fault's effect readable), nor is a
gateway (it reads serve before it listens, and exits if it cannot) started again while a fault
keeps serve away. A
``Pace`` may bound how many faults act at once. A process killed or restarted is counted
impaired for ``RECOVERY_S`` more after its heal (it takes that long to listen again); serve for
``SERVE_QUIET_S`` more.

:func:`play` carries a plan out, process and network faults alike, each by the run's own
``act``. A real fault may take longer than planned (a restart waits for the process to listen,
an engine drains on SIGTERM), so a fault also waits for every fault the plan ended before it:
faults that never overlap in the plan never overlap when played, so every set of faults that
acts at once was checked by the planner.

Only ``random.Random(seed)`` draws, and every input is read in sorted order, so the same
arguments give a byte-identical schedule in any process (no hash order, no clock).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Final, Literal

import anyio
import msgspec

from tests.chaos.proxy import Fault, Network, link_ends

PlannedKind = Literal[
    "sigkill",
    "sigterm",
    "sigstop",
    "restart",
    "delay",
    "drop",
    "reset_before",
    "reset_after",
    "black_hole",
    "partition",
]
PROCESS_FAULTS: tuple[PlannedKind, ...] = ("sigkill", "sigterm", "sigstop", "restart")
NETWORK_FAULTS: tuple[PlannedKind, ...] = (
    "delay",
    "drop",
    "reset_before",
    "reset_after",
    "black_hole",
)
PARTITION: Final = "partition"
# Kinds of process of which one must stay unimpaired at every instant (if the fleet has any).
KEEP_ONE = ("engine", "gateway")
SERVE = "serve"
# Kinds of process that read serve before they listen, and exit if they cannot: one is never
# started again while a fault keeps serve away.
NEEDS_SERVE_TO_START = ("gateway",)
RESTARTS: tuple[PlannedKind, ...] = ("sigkill", "sigterm", "restart")
RECOVERY_S = 1.0  # a process started again takes this long to listen (counted impaired)
SERVE_QUIET_S = 2.0  # after a serve fault heals, this long before the next may start
FIRST_FAULT_S = (0.5, 1.5)  # the cluster serves a little before the first fault
GAP_S = (0.2, 1.5)  # between two planned starts
PROCESS_HEAL_S = (0.5, 3.0)
NETWORK_HEAL_S = (0.5, 4.0)
DELAY_S = (0.05, 0.5)
PARTITION_SHARE = 0.15  # of the network faults drawn
ATTEMPTS = 20  # draws tried at one start time before moving on


class Planned(msgspec.Struct, frozen=True):
    """One fault: ``kind`` on ``target`` (a process name, or a link's ``CALLER->SERVER`` name
    for a network fault other than a partition) from ``at_s`` until ``heal_after_s`` later;
    ``delay_s`` is a ``delay``'s added latency per chunk (0 for every other kind)."""

    at_s: float
    target: str
    kind: PlannedKind
    heal_after_s: float
    delay_s: float = 0.0

    @property
    def heals_at_s(self) -> float:
        return round(self.at_s + self.heal_after_s, 3)

    @property
    def network(self) -> bool:
        return self.kind in NETWORK_FAULTS or self.kind == PARTITION


def link_fault(planned: Planned) -> Fault:
    """The proxy's fault for a planned network fault on one link (a partition is applied with
    ``Network.partition`` instead)."""
    if planned.kind == "delay":
        return Fault.delay(planned.delay_s)
    cutting = {
        "drop": Fault.drop(),
        "reset_before": Fault.reset_before(),
        "reset_after": Fault.reset_after(),
        "black_hole": Fault.black_hole(),
    }
    if planned.kind not in cutting:
        raise ValueError(f"{planned.kind} is not a fault of one link")
    return cutting[planned.kind]


def impaired(fault: Planned) -> frozenset[str]:
    """The processes a fault keeps from doing their part while it lasts."""
    if fault.kind == "delay":
        return frozenset()
    if fault.kind in NETWORK_FAULTS:
        return frozenset(link_ends(fault.target))
    return frozenset({fault.target})


def _touched(fault: Planned, links: Sequence[str]) -> frozenset[str]:
    """What the fault's executor sets and later heals: the process, or the link(s)."""
    if fault.kind == PARTITION:
        return frozenset({fault.target, *(n for n in links if fault.target in link_ends(n))})
    return frozenset({fault.target})


def _busy_until(fault: Planned) -> float:
    """Until when the fault counts: its heal, plus the recovery of a process started again
    and serve's quiet time."""
    end = fault.heals_at_s
    if fault.kind in ("sigkill", "sigterm", "restart"):
        end += RECOVERY_S
    if SERVE in impaired(fault):
        end += SERVE_QUIET_S
    return end


class Pace(msgspec.Struct, frozen=True, kw_only=True):
    """How densely faults come. The default overlaps faults about once a second; a run on a
    small machine may want them one at a time (``overlap=False``: the next starts ``gap_s``
    after the previous one healed and recovered). ``long_stop_s``: a ``long_stop_share`` of
    the ``sigstop`` faults are held this long instead, to outlast serve's probe timeout (a
    frozen process must then be suspended and the log must say so). ``at_once``: at most this
    many faults act at any instant (None: as many as the other rules allow)."""

    first_s: tuple[float, float] = FIRST_FAULT_S
    gap_s: tuple[float, float] = GAP_S
    overlap: bool = True
    at_once: int | None = None
    long_stop_s: float | None = None
    long_stop_share: float = 0.25


def schedule(
    seed: int,
    duration_s: float,
    links: Iterable[str],
    processes: Mapping[str, str],
    pace: Pace = Pace(),  # frozen: one shared default is safe
) -> list[Planned]:
    """The faults of a run of ``duration_s`` seconds over ``links`` (``CALLER->SERVER``) and
    ``processes`` (name -> kind: ``serve``, ``gateway``, ``engine``, ``agent``, ``trainer``,
    ``client`` ...), in start order, at ``pace``. Same arguments, same list."""
    link_names = sorted(set(links))
    for name in link_names:
        link_ends(name)
    names = sorted(processes)
    kinds = {name: processes[name] for name in names}
    rng = random.Random(seed)
    plan: list[Planned] = []
    at = round(rng.uniform(*pace.first_s), 3)
    while at < duration_s:
        for _ in range(ATTEMPTS):
            candidate = _draw(rng, at, link_names, names, pace)
            if candidate is not None and _fits(
                candidate, plan, link_names, kinds, duration_s, pace.at_once
            ):
                plan.append(candidate)
                break
        if plan and not pace.overlap:
            at = max(at, _busy_until(plan[-1]))
        at = round(at + rng.uniform(*pace.gap_s), 3)
    return plan


def _draw(
    rng: random.Random, at: float, links: list[str], names: list[str], pace: Pace
) -> Planned | None:
    partitionable = [n for n in names if any(n in link_ends(link) for link in links)]
    if links and (not names or rng.random() < 0.5):
        heal = round(rng.uniform(*NETWORK_HEAL_S), 3)
        if partitionable and rng.random() < PARTITION_SHARE:
            return Planned(at, rng.choice(partitionable), PARTITION, heal)
        kind = rng.choice(NETWORK_FAULTS)
        link = rng.choice(links)
        delay = round(rng.uniform(*DELAY_S), 3) if kind == "delay" else 0.0
        return Planned(at, link, kind, heal, delay)
    if not names:
        return None
    kind = rng.choice(PROCESS_FAULTS)
    name = rng.choice(names)
    heal = 0.0 if kind == "restart" else round(rng.uniform(*PROCESS_HEAL_S), 3)
    if kind == "sigstop" and pace.long_stop_s is not None and rng.random() < pace.long_stop_share:
        heal = pace.long_stop_s
    return Planned(at, name, kind, heal)


def _fits(
    candidate: Planned,
    plan: list[Planned],
    links: list[str],
    kinds: Mapping[str, str],
    duration_s: float,
    at_once: int | None,
) -> bool:
    if _busy_until(candidate) > duration_s:
        return False
    start, end = candidate.at_s, _busy_until(candidate)
    overlapping = [p for p in plan if p.at_s < end and start < _busy_until(p)]
    if any(_touched(candidate, links) & _touched(p, links) for p in overlapping):
        return False
    if any(
        (not candidate.network or not p.network) and impaired(candidate) & impaired(p)
        for p in overlapping
    ):
        return False  # a process fault meets another fault on the same process
    if any(
        _starts_without_serve(a, b, kinds)
        for p in overlapping
        for a, b in ((candidate, p), (p, candidate))
    ):
        return False
    instants = {start, *(p.at_s for p in overlapping if start <= p.at_s < end)}
    for instant in instants:
        active = [candidate, *(p for p in overlapping if p.at_s <= instant < _busy_until(p))]
        if at_once is not None and len(active) > at_once:
            return False
        down: set[str] = set().union(*(impaired(p) for p in active))
        if sum(SERVE in impaired(p) for p in active) > 1:
            return False
        for kind in KEEP_ONE:
            members = [n for n, k in kinds.items() if k == kind]
            if members and all(n in down for n in members):
                return False
    return True


def _starts_without_serve(restarted: Planned, other: Planned, kinds: Mapping[str, str]) -> bool:
    """``restarted`` starts a process that needs serve to start while ``other`` keeps serve
    away."""
    return (
        restarted.kind in RESTARTS
        and kinds.get(restarted.target) in NEEDS_SERVE_TO_START
        and SERVE in impaired(other)
    )


def format_schedule(seed: int, plan: Sequence[Planned]) -> str:
    """The plan as printed by a run: a header with the seed (rerun with it) and the counts by
    kind, then one line per fault."""
    counts = Counter(p.kind for p in plan)
    shown = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
    lines = [f"chaos schedule: seed {seed}, {len(plan)} faults ({shown or 'none'})"]
    for p in plan:
        what = f"{p.kind} {p.delay_s:.3f}s" if p.kind == "delay" else p.kind
        lines.append(f"  +{p.at_s:8.3f}s  {what:<16} {p.target:<16} heal +{p.heal_after_s:.3f}s")
    return "\n".join(lines)


def start_network_fault(net: Network, planned: Planned) -> None:
    """Apply a planned network fault: a partition of its process, or its link's fault."""
    if planned.kind == PARTITION:
        net.partition(planned.target)
    else:
        net.set(planned.target, link_fault(planned))


def heal_network_fault(net: Network, planned: Planned) -> None:
    """End a planned network fault: its link, or every link of its partitioned process."""
    for name in net.links_of(planned.target) if planned.kind == PARTITION else [planned.target]:
        net.heal(name)


async def act_on_network(net: Network, planned: Planned) -> None:
    """A planned network fault from start to heal: applied, held ``heal_after_s``, healed."""
    start_network_fault(net, planned)
    await anyio.sleep(planned.heal_after_s)
    heal_network_fault(net, planned)


async def play(
    plan: Sequence[Planned], started: float, act: Callable[[Planned], Awaitable[None]]
) -> None:
    """Carry ``plan`` out: ``act(planned)`` starts a fault, holds it and heals it (the run's
    executor: signals for a process fault, the proxies for a network one). Each fault begins
    at ``started + at_s`` on the event loop's clock, but never before every fault the plan
    ended (recovery included) before it has really healed and recovered: a slow restart
    delays what the plan put after it rather than overlap it. Faults the plan overlaps run
    side by side, each in a task of its own; return once every one has healed."""
    done = [anyio.Event() for _ in plan]

    async def one(index: int, planned: Planned) -> None:
        for earlier, event in zip(plan[:index], done, strict=False):
            if _busy_until(earlier) <= planned.at_s:
                await event.wait()
        await anyio.sleep_until(started + planned.at_s)
        await act(planned)
        await anyio.sleep(_busy_until(planned) - planned.heals_at_s)  # its recovery
        done[index].set()

    async with anyio.create_task_group() as tg:
        for index, planned in enumerate(plan):
            tg.start_soon(one, index, planned)
