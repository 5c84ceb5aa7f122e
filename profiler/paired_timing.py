"""Step times of several steps measured side by side, for ratios that survive a shared machine.

On a machine other jobs share, one step's time moves by tens of percent from one second to
the next. A ratio of two steps is only meaningful when both saw the same load: every step
runs once per round, the rounds follow each other, and the order within a round alternates
(forward, then reversed), so no step always runs right after the same other step (a step
that follows a memory-hungry one finds the allocator's caches cold). The ratio of a round is
taken within the round; the summary is the median ratio over rounds with its quartiles (the
spread says whether a difference is real).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["paired_step_times", "ratio_summary"]


def paired_step_times(steps: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 2,
                      min_seconds: float = 0.0) -> dict[str, list[float]]:
    """Seconds of each step in each round (module docstring).

    Parameters:
        steps: name -> a callable running one step (e.g. ``session.run`` of its fetches).
        rounds: rounds timed at least; every step runs once per round.
        warmup: untimed runs of each step first (kernels, allocator, Grappler's cache).
        min_seconds: keep adding rounds until the timed rounds took this long. A step of a
            few milliseconds needs hundreds of rounds before the median ratio stops moving
            with the machine's load; a fixed count fit for a 200 ms step is too few for it.

    Returns:
        name -> durations in seconds, round by round (``rounds`` or more).
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    round_, elapsed = 0, 0.0
    while round_ < rounds or elapsed < min_seconds:
        for name in (names if round_ % 2 == 0 else names[::-1]):
            begin = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - begin)
            elapsed += times[name][-1]
        round_ += 1
    return times


def ratio_summary(times: Mapping[str, list[float]], reference: str) -> dict[str, dict]:
    """Per step, its time over ``reference``'s round by round: ``median``, quartiles
    ``q1`` / ``q3``, and its own median step time ``median_ms``."""
    summary = {}
    for name, seconds in times.items():
        ratios = [t / r for t, r in zip(seconds, times[reference])]
        quartiles = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                     else [ratios[0]] * 3)
        summary[name] = {"median": statistics.median(ratios), "q1": quartiles[0],
                         "q3": quartiles[2], "median_ms": statistics.median(seconds) * 1e3,
                         "rounds": len(ratios)}
    return summary
