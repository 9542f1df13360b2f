"""``replay --plot``: versions' lifetimes and bound sessions over time, as one PNG.

Top panel: one row per version, a coloured band per state it was in (the same colours as the
tables), so a version stuck RETIRED or RECLAIMING is visible at a glance. Bottom panel: the
sessions bound to each version over time (steps), so it is clear *who* kept an old version
alive. Engine restarts and repairs are vertical markers on both. Time is in seconds from the
first record shown.

matplotlib is optional (``pip install loraledger[plot]``) and imported only here, with the
non-interactive Agg backend (no display needed, safe in threads and CI).
"""

from __future__ import annotations

import os

from projections.lifetimes import Lifetimes
from tools.exitcodes import Exit, ToolError

STATE_COLOURS = {
    "LOADING": "#f2c14e",
    "PUBLISHED": "#3a9d23",
    "RETIRED": "#4aa3c7",
    "RECLAIMING": "#b05fc4",
    "RECLAIMED": "#c8c8c8",
    "FAILED_RETRYABLE": "#e07a5f",
    "FAILED_FATAL": "#b00020",
}
SIZE_INCHES = (11.0, 6.5)
DPI = 100


def plot_lifetimes(life: Lifetimes, path: str | os.PathLike[str], *, title: str = "") -> str:
    """Draw ``life`` to ``path`` (PNG); returns the path written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ToolError(
            Exit.FAILED, "--plot needs matplotlib: pip install 'loraledger[plot]'"
        ) from None

    t0 = life.start
    versions = sorted({b.version_id for b in life.bands})
    row = {vid: i for i, vid in enumerate(versions)}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=SIZE_INCHES, dpi=DPI, sharex=True, height_ratios=(3, 2)
    )
    try:
        # A zero-length band (a state left in the same batch) still gets a sliver to be seen.
        sliver = max((life.end - t0) / 400.0, 1e-3)
        for band in life.bands:
            width = max(band.end - band.start, sliver)
            top.broken_barh(
                [(band.start - t0, width)],
                (row[band.version_id] - 0.4, 0.8),
                facecolors=STATE_COLOURS.get(band.state, "#888888"),
                edgecolors="white",
                linewidth=0.5,
            )
        top.set_yticks(range(len(versions)), [f"v{v}" for v in versions])
        top.set_ylim(-0.6, max(len(versions), 1) - 0.4)
        top.invert_yaxis()
        top.set_ylabel("version")
        top.set_title(title or "version lifetimes (state bands) and bound sessions")
        states = [s for s in STATE_COLOURS if any(b.state == s for b in life.bands)]
        if states:
            top.legend(
                handles=[Patch(color=STATE_COLOURS[s], label=s) for s in states],
                loc="upper left",
                bbox_to_anchor=(1.0, 1.0),
                fontsize="small",
            )
        end = life.end - t0
        for vid, steps in life.bound.items():
            xs = [at - t0 for at, _ in steps]
            ys = [n for _, n in steps]
            if xs and xs[-1] < end:
                xs.append(end)
                ys.append(ys[-1])
            bottom.step(xs, ys, where="post", label=f"v{vid}")
        if life.bound:
            bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        bottom.set_ylabel("sessions bound")
        bottom.set_xlabel("seconds since the first record")
        bottom.set_ylim(bottom=0)
        bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
        for at, label in _merged_markers(life, close=sliver * 8):
            for axis in (top, bottom):
                axis.axvline(at - t0, color="#555555", linestyle=":", linewidth=1)
            top.annotate(
                label,
                (at - t0, 0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize="x-small",
                va="bottom",
                ha="right",
            )
        bottom.set_xlim(0, max(end, 1e-3))
        fig.tight_layout()
        try:
            fig.savefig(path, format="png")
        except OSError as exc:  # a directory, no permission, a full disk: one line, not a bug
            raise ToolError(
                Exit.FAILED, f"--plot {os.fspath(path)}: cannot write: {exc.strerror or exc}"
            ) from None
    finally:
        plt.close(fig)
    return os.fspath(path)


def _merged_markers(life: Lifetimes, *, close: float) -> list[tuple[float, str]]:
    """Markers closer than ``close`` seconds share one line and one label (a restart repaired
    within milliseconds would otherwise print two labels on top of each other)."""
    merged: list[tuple[float, str]] = []
    for marker in life.markers:
        if merged and marker.at - merged[-1][0] <= close:
            at, label = merged[-1]
            merged[-1] = (at, f"{label} / {marker.label}")
        else:
            merged.append((marker.at, marker.label))
    return merged
