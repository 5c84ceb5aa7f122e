"""Memory sizes as people write them (``300MiB``, ``1.5GB``), for budgets and device limits.

``--memory_budget`` (``remat``), ``--device_memory`` (``baechi``) and the sweep configs all take a
size in this one form.
"""

from __future__ import annotations

import re

import numpy as np

from graphfit.errors import ArgumentError

__all__ = ["SizeError", "format_bytes", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 10**6, "MB": 10**6, "G": 10**9,
               "GB": 10**9, "T": 10**12, "TB": 10**12, "KI": 2**10, "KIB": 2**10, "MI": 2**20,
               "MIB": 2**20, "GI": 2**30, "GIB": 2**30, "TI": 2**40, "TIB": 2**40}


class SizeError(ArgumentError):
    """A memory size cannot be parsed or is negative."""


def format_bytes(num_bytes: float) -> str:
    """A size as a person reads it, in the unit that keeps it short: ``812 KiB``, ``25.68 MiB``,
    ``8.00 GiB`` (``B`` below a KiB). Every line a person reads uses this one form, so one
    number never shows as two (25.7 and 25.68 MiB).

    Examples:
        >>> format_bytes(512), format_bytes(831_488), format_bytes(26_927_923), format_bytes(2**33)
        ('512 B', '812 KiB', '25.68 MiB', '8.00 GiB')
    """
    size = float(num_bytes)
    if abs(size) < 2**10:
        return f"{size:.0f} B"
    if abs(size) < 2**20:
        return f"{size / 2**10:.0f} KiB"
    if abs(size) < 2**30:
        return f"{size / 2**20:.2f} MiB"
    return f"{size / 2**30:.2f} GiB"


def parse_bytes(text: str | int, name: str | None = None) -> int:
    """Parse a memory size: ``2GiB``, ``512MiB``, ``1.5GB``, ``4096`` (bytes).

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000; case and spaces between number and unit do not matter. An integer is a
    number of bytes already. ``name`` (the flag or parameter) starts an error message.

    Raises:
        SizeError: if the text is not a non-negative size.

    Examples:
        >>> parse_bytes("2GiB"), parse_bytes("1.5MB"), parse_bytes(64)
        (2147483648, 1500000, 64)
    """
    prefix = f"{name}: " if name else ""
    if isinstance(text, (int, np.integer)):
        value = int(text)
        if value < 0:
            raise SizeError(f"{prefix}memory size {value} is negative")
        return value
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNIT_BYTES:
        raise SizeError(
            f"{prefix}cannot parse memory size {text!r}: use a number of bytes or a number "
            "with a suffix such as 512MiB, 2GiB, 1.5GB")
    return int(float(match.group(1)) * _UNIT_BYTES[unit])
