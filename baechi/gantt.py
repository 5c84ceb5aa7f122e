"""One colour legend for every Gantt chart of a schedule (``tools/place``'s ``gantt.png`` and
the report's ``placement_gantt.png``), so a colour means the same thing in both."""

from __future__ import annotations

__all__ = ["COLOURS", "add_legend"]

COLOURS = {"compute": "tab:blue", "recompute": "tab:orange", "incoming transfer": "tab:green"}


def add_legend(axis, kinds=tuple(COLOURS)) -> None:
    """A legend of ``kinds`` (keys of ``COLOURS``) on a matplotlib ``axis``."""
    from matplotlib.patches import Patch

    axis.legend([Patch(color=COLOURS[kind]) for kind in kinds], list(kinds), fontsize=8,
                loc="upper right")
