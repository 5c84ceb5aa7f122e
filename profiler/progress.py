"""Progress of long work (profiling, planning, sweeps): a bar on a terminal, silence in logs;
and the time each stage of it took (``StageTimes``).

A person at a terminal wants to see that a minute-long search is moving; a log file or a CI
transcript wants no carriage-return noise. ``progress_bar`` wraps ``tqdm`` and shows the bar
only when standard error is a terminal (results and one-line summaries go through
``profiler.trace.print_progress`` either way).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

__all__ = ["progress_bar", "on_terminal", "StageTimes"]

T = TypeVar("T")


def on_terminal() -> bool:
    """Whether standard error is an interactive terminal."""
    return sys.stderr.isatty()


def progress_bar(iterable: Iterable[T], description: str, total: int | None = None,
                 enabled: bool = True) -> Iterator[T]:
    """``iterable``, with a progress bar on standard error while it is consumed.

    Parameters:
        iterable: the work items.
        description: what the work is, shown before the bar.
        total: number of items when ``iterable`` has no length.
        enabled: ``False`` for silence whatever the terminal.

    Returns:
        An iterator over the same items. The bar is cleared when the work ends, and shown at
        all only when ``enabled`` and standard error is a terminal.
    """
    return iter(tqdm(iterable, desc=description, total=total, leave=False, file=sys.stderr,
                     dynamic_ncols=True, disable=not (enabled and on_terminal())))


class StageTimes:
    """Wall seconds per named stage of a long computation, summed over its rounds: the time
    profile a report carries, so that a slow ``pipeline.optimize`` says where its minutes went
    (measuring, tracing, planning, verifying) without a profiler attached.

    Examples:
        >>> times = StageTimes()
        >>> with times.stage("plan"):
        ...     pass
        >>> list(times.seconds)
        ['plan']
    """

    def __init__(self, announce: Callable[[str, float], None] | None = None):
        """``announce(stage, seconds so far)`` is called as each stage begins: a user waiting
        minutes sees where the work is (``pipeline.optimize`` prints a line per stage)."""
        self.seconds: dict[str, float] = {}
        self._announce = announce
        self._begin = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the ``with`` block and add it to ``name``'s seconds (also when it raises)."""
        begin = time.perf_counter()
        if self._announce is not None:
            self._announce(name, begin - self._begin)
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begin

    def report(self) -> dict[str, float]:
        """JSON-ready: seconds per stage, in the order the stages first ran."""
        return {name: round(seconds, 2) for name, seconds in self.seconds.items()}
