"""A chaos run as one picture: ``python -m tests.chaos.picture HISTORY.json OUT.png``.

Top panel: one row per faulted target (a process, or a link ``CALLER->SERVER``), a band from
each fault's start to its heal, coloured by kind. Bottom panel: the turns the clients saw end
each second, by outcome (``ok``, ``fail``: a coded refusal, ``info``: the outcome unknown to
the client, a cancelled stream or a lost connection). Time is in seconds from the first
operation. It reads the ``history.json`` a run writes (``tests/chaos/run.py``), so any run, a
failing one above all, can be drawn afterwards.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import msgspec

from tests.chaos.history import History

KIND_COLOURS = {
    "kill": "#b00020",
    "term": "#e07a5f",
    "restart": "#f2c14e",
    "stop": "#4aa3c7",
    "partition": "#6a3d9a",
    "black_hole": "#333333",
    "drop": "#b05fc4",
    "reset_before": "#8c564b",
    "reset_after": "#d62728",
    "delay": "#9ecae1",
}
OUTCOME_COLOURS = {"ok": "#3a9d23", "fail": "#b00020", "info": "#f2c14e"}


def draw(history: History, out: Path, *, title: str = "") -> Path:
    """Draw ``history`` into the PNG ``out`` (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    turns = [op for op in history.ops if op.kind == "turn"]
    t0 = min((op.invoked for op in history.ops), default=0.0)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]}
    )
    targets = sorted({f.target for f in history.faults})
    for row, target in enumerate(targets):
        for f in (f for f in history.faults if f.target == target):
            width = max(f.healed - f.at, 0.2)
            colour = KIND_COLOURS.get(f.kind, "#777777")
            top.broken_barh([(f.at - t0, width)], (row - 0.4, 0.8), color=colour)
    top.set_yticks(range(len(targets)), targets)
    top.set_ylabel("faulted")
    kinds = sorted({f.kind for f in history.faults})
    top.legend(
        handles=[Patch(color=KIND_COLOURS.get(k, "#777777"), label=k) for k in kinds],
        loc="upper right",
        fontsize=8,
        ncol=min(len(kinds), 5),
    )
    seconds = int(max((op.completed for op in turns), default=t0) - t0) + 1
    by_second = {
        o: Counter(int(op.completed - t0) for op in turns if op.outcome == o)
        for o in OUTCOME_COLOURS
    }
    below = [0] * seconds
    for outcome, counts in by_second.items():
        heights = [counts.get(s, 0) for s in range(seconds)]
        bottom.bar(
            range(seconds),
            heights,
            bottom=below,
            width=1.0,
            align="edge",
            color=OUTCOME_COLOURS[outcome],
            label=outcome,
        )
        below = [b + h for b, h in zip(below, heights, strict=True)]
    bottom.set_ylabel("turns ended per second")
    bottom.set_xlabel("seconds from the first operation")
    bottom.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.chaos.picture HISTORY.json OUT.png", file=sys.stderr)
        return 2
    history = msgspec.json.decode(Path(argv[0]).read_bytes(), type=History)
    print(draw(history, Path(argv[1]), title=f"chaos run: {Path(argv[0]).parent.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
