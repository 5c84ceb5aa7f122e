"""Progress of long work (profiling, planning, sweeps): a bar on a terminal, silence in logs.

A person at a terminal wants to see that a minute-long search is moving; a log file or a CI
transcript wants no carriage-return noise. ``progress_bar`` wraps ``tqdm`` and shows the bar
only when standard error is a terminal (results and one-line summaries go through
``profiler.trace.print_progress`` either way).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

__all__ = ["progress_bar", "on_terminal"]

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
