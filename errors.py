"""The errors a user can cause and fix, and the argument checks that raise them at the edge.

Every layer's user-facing errors derive from ``GraphfitError`` (the IR's ``CostGraphError``,
the profiler's ``ProfileError`` and ``SizeError``, remat's ``RematError`` and ``BudgetError``,
baechi's ``DeviceError`` and ``PlacementError``, the step comparison's ``StepMismatchError``,
...). The binaries (``tools.cli``) print such an error as one paragraph and exit with status 2;
anything else is a bug and keeps its traceback.

The checks here run where arguments enter (flags, ``pipeline.optimize``, the planners), before
any work, so a NaN limit or a negative size never turns into a plausible-looking result.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile

__all__ = ["ArgumentError", "GraphfitError", "OutputError", "check_number", "check_writable_path",
           "read_json", "short_repr"]


class GraphfitError(Exception):
    """Bad input, or a request that cannot be met, that the user can fix: the message names
    the problem and what to do."""


class ArgumentError(GraphfitError, ValueError):
    """An argument (a flag, a library parameter, a field of an input file) has the wrong type,
    is not finite, or is out of range."""


class OutputError(GraphfitError, OSError):
    """Results cannot be written (a full disk, a directory that became read-only); the
    message says what was left as it was."""


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message quotes what it refuses,
    not a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def check_number(value, name: str, *, minimum: float | None = None,
                 maximum: float | None = None, above: float | None = None,
                 integer: bool = False, allow_inf: bool = False):
    """Return ``value`` if it is a real number (an integer if ``integer``) that is finite
    (or +inf with ``allow_inf``) and within ``[minimum, maximum]`` and ``> above``.

    Raises:
        ArgumentError: naming ``name``, the value and the allowed range.

    Examples:
        >>> check_number(3, "--steps", minimum=1, integer=True)
        3
        >>> check_number(float("nan"), "memory_ratio", above=0)
        Traceback (most recent call last):
        ...
        graphfit.errors.ArgumentError: memory_ratio=nan: must be a finite number > 0
    """
    kind = "an integer" if integer else "a finite number"
    wanted = [f">= {minimum:g}" if minimum is not None else "",
              f"> {above:g}" if above is not None else "",
              f"<= {maximum:g}" if maximum is not None else ""]
    wanted = " and ".join(w for w in wanted if w)
    message = f"{name}={short_repr(value)}: must be {kind}{' ' + wanted if wanted else ''}"
    if allow_inf:
        message += " (or inf: no limit)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(message)
    if integer and not isinstance(value, numbers.Integral):
        raise ArgumentError(message)
    if not isinstance(value, numbers.Integral) and (  # an int is finite (and may exceed floats)
            math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0))):
        raise ArgumentError(message)
    if ((minimum is not None and value < minimum) or (maximum is not None and value > maximum)
            or (above is not None and value <= above)):
        raise ArgumentError(message)
    return value


def check_writable_path(path: str, name: str) -> str:
    """Return ``path`` if a file can be written there: not empty, not a directory, and its
    directory exists and is writable or can be created under a writable ancestor.

    Checked before a run, so hours of work are not lost to a typo or a read-only directory.
    (A full disk still shows only when writing.)

    Raises:
        ArgumentError: naming ``name``, the path and what is wrong.
    """
    if not path or not path.strip():
        raise ArgumentError(f"{name} is empty: give the file to write, e.g. out/report.json")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ArgumentError(f"{name}={path}: is a directory; give a file name inside it")
    ancestor = os.path.dirname(full)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ArgumentError(f"{name}={path}: {ancestor} is a file, not a directory")
    try:  # a real attempt: permission bits say nothing for root or a read-only mount
        fd, probe = tempfile.mkstemp(dir=ancestor, suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ArgumentError(f"{name}={path}: cannot write in {ancestor} ({error.strerror}); "
                            "choose another path") from None
    return path


def read_json(path: str, what: str, remedy: str, error: type[GraphfitError] = ArgumentError):
    """The parsed JSON file at ``path``, or ``error`` saying ``what`` could not be read or
    parsed (naming the file) and ``remedy``, what to do about it."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as failure:
        raise error(f"{what}: cannot read it ({failure.strerror})") from None
    except ValueError as failure:  # also binary content (UnicodeDecodeError)
        raise error(f"{what}: not valid JSON ({failure}); {remedy}") from None
    except RecursionError:
        raise error(f"{what}: not usable JSON (nested deeper than the parser can follow); "
                    f"{remedy}") from None
