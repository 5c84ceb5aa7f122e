"""Every module of the package names only what it defines or imports, and imports nothing it
does not use (pyflakes). An unimported name in a function body fails only when that line runs:
the reach and loops benches called ``pipeline.optimize`` without importing ``pipeline`` after
the orchestration moved out of ``baechi`` (2026-12-06), and no test ran those lines."""

import io
import os
import subprocess

from pyflakes import api
from pyflakes.reporter import Reporter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_files() -> list[str]:
    """The repository's Python files: git's list, or a walk without hidden and Bazel trees."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                             text=True, check=False).stdout.split()
    if tracked:
        return [os.path.join(REPO, path) for path in tracked]
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-"))]
        found += [os.path.join(root, name) for name in files if name.endswith(".py")]
    return found


def test_pyflakes_finds_nothing():
    messages = io.StringIO()
    found = sum(api.checkPath(path, Reporter(messages, messages)) for path in _python_files())
    assert found == 0, messages.getvalue()
