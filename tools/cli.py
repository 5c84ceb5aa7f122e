"""What the binaries share: flags checked before any work, user errors read first.

``run(main)`` is ``absl.app.run`` with two differences:

- A bad flag (absl's own checks, a stray positional argument) and any ``GraphfitError`` raised
  by ``main`` (the binary's flag checks, or the library: a budget below the minimum, a
  malformed profile, devices too small) print ``<binary>: error: <message>`` on stderr as one
  paragraph and exit with status 2. No traceback and no page of flag help in front of the line
  that matters; the message points at ``--helpshort`` for the flags.
- Anything else keeps its traceback: it is a bug, not bad input.

So each binary checks every flag at the start of ``main`` (raising ``errors.ArgumentError``
naming the flag) and lets library errors pass through.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags

from graphfit.errors import GraphfitError

__all__ = ["EXIT_USER_ERROR", "fail", "run"]

EXIT_USER_ERROR = 2


def _program() -> str:
    return os.path.basename(sys.argv[0]).removesuffix(".py") or "graphfit"


def fail(message: str) -> None:
    """Print ``message`` as one paragraph on stderr and exit with status 2."""
    paragraph = " ".join(str(message).split())
    print(f"{_program()}: error: {paragraph}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as error:
        fail(f"{error} (--helpshort lists the flags)")
    if len(rest) > 1:
        fail(f"unexpected argument(s) {' '.join(map(repr, rest[1:]))}: every option is a "
             "--flag=value (a boolean is --flag or --noflag); --helpshort lists the flags")
    return rest


def run(main: Callable[[list[str]], None]) -> None:
    """Parse flags, run ``main`` and map user errors to one paragraph and exit status 2."""

    def guarded(argv: list[str]) -> None:
        try:
            main(argv)
        except GraphfitError as error:
            fail(str(error))

    app.run(guarded, flags_parser=_parse_flags)
