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

``run`` also imports TensorFlow quietly (``quiet_tensorflow``) before the binary's ``main``,
unless the binary never runs TF (``place``) or imports it itself after the checks that need
no TF (``worker``): TF's import takes 5-9 s on these machines.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from absl import app, flags

from graphfit.errors import GraphfitError

__all__ = ["EXIT_USER_ERROR", "fail", "quiet_tensorflow", "run"]

EXIT_USER_ERROR = 2


def _program() -> str:
    return os.path.basename(sys.argv[0]).removesuffix(".py") or "graphfit"


def fail(message: str) -> None:
    """Print ``message`` as one paragraph on stderr and exit with status 2."""
    paragraph = " ".join(str(message).split())
    print(f"{_program()}: error: {paragraph}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


# What TF's C++ logger prints before it reads TF_CPP_MIN_LOG_LEVEL (absl's pre-init notice
# and glog-style "I..."/"W..." lines, e.g. oneDNN's notice, printed once per TF library).
_PRE_INIT_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called"
_LOG_LINE = re.compile(r"^([IWEF])\d{4} ")


def quiet_tensorflow() -> None:
    """Import TensorFlow holding TF's log level to ``TF_CPP_MIN_LOG_LEVEL`` (``tools/__init__``
    sets 2 unless the user chose): TF's C++ logger prints its import-time lines (oneDNN's
    notice) whatever the level, so stderr is captured during the import and replayed without
    the lines below the level. Python's ``tensorflow`` logger gets the same level (2: errors),
    so deprecation notices about TF's own internals stay out of a person's output."""
    import logging
    import tempfile

    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    level = int(level) if level.isdigit() else 0     # TF reads anything else as 0 too
    if level <= 0 or "tensorflow" in sys.modules:
        import tensorflow  # noqa: F401  (already imported, or the user wants every line)
        return
    hidden = {"I": 0, "W": 1, "E": 2, "F": 3}
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                match = _LOG_LINE.match(line)
                if line.startswith(_PRE_INIT_NOTICE) or (match and hidden[match[1]] < level):
                    continue
                sys.stderr.write(line)
            sys.stderr.flush()
    tf.get_logger().setLevel(logging.ERROR if level >= 2 else logging.WARNING)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as error:
        fail(f"{error} (--helpshort lists the flags)")
    if len(rest) > 1:
        fail(f"unexpected argument(s) {' '.join(map(repr, rest[1:]))}: every option is a "
             "--flag=value (a boolean is --flag or --noflag); --helpshort lists the flags")
    return rest


def run(main: Callable[[list[str]], None], tensorflow: bool = True) -> None:
    """Parse flags, import TensorFlow quietly unless ``tensorflow`` is false, run ``main``;
    a user error is one paragraph and exit status 2."""

    def guarded(argv: list[str]) -> None:
        try:
            if tensorflow:
                quiet_tensorflow()
            main(argv)
        except GraphfitError as error:
            fail(str(error))

    app.run(guarded, flags_parser=_parse_flags)
