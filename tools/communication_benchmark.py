"""Communication benchmark: measures device-to-device transfer cost for the placer.

Placeholder: another developer replaces this module (issue #3). It already parses its flags
so that `bazel build //tools:communication_benchmark` and `--helpfull` work.
"""

from __future__ import annotations

from absl import app, flags

_OUTPUT = flags.DEFINE_string(
    "output", None, "Where to write the measured communication costs (JSON)."
)


def main(argv: list[str]) -> None:
    """Entry point: reports that the benchmark is not implemented yet."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    print("communication benchmark: not implemented yet (issue #3)")


if __name__ == "__main__":
    app.run(main)
