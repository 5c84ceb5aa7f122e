"""Every fenced ``python`` and ``sh`` block of README.md runs, as a user would copy it.

Each block runs in a fresh temporary directory (so its ``out/...`` files land there, never in
the checkout), with the interpreter running the tests first on ``PATH`` (the README assumes the
project's virtual environment is active). The one input file a README command reads from the
checkout (``tools/examples/...``) is linked into that directory, because the README's commands
are written for the repository's root.

Not run, on purpose: ```` ```console ```` blocks (``make train``, ``make test``: ``make test``
is this suite itself, and ``make train`` is the ``--joint`` quick-start command plus the
Makefile's ``.venv`` setup, which ``test_packaging`` covers) and ```` ```text ```` blocks
(expected output). The blocks use tiny presets or small Keras models with ``--steps=1``;
together they take about two minutes here, most of it TensorFlow starting and tracing.
"""

import os
import re
import subprocess
import sys

import pytest

from test_quiet_output import tensorflow_log_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MAX_LINES = 300
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    with open(README) as f:
        return [(lang, code) for lang, code in _FENCE.findall(f.read())]


def _runnable() -> list[tuple[str, str]]:
    return [(lang, code) for lang, code in _blocks() if lang in ("python", "sh")]


def test_readme_is_a_guide_not_a_notebook():
    with open(README) as f:
        assert len(f.read().splitlines()) <= MAX_LINES
    for path in ("docs/DESIGN.md", "bench/RESULTS.md", "bench/HISTORY.md"):
        assert os.path.exists(os.path.join(ROOT, path)), path
    assert {lang for lang, _ in _blocks()} <= {"python", "sh", "console", "text"}


@pytest.mark.slow
@pytest.mark.parametrize("lang,code", _runnable(),
                         ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(_runnable())])
def test_readme_block_runs(lang, code, tmp_path):
    (tmp_path / "tools").mkdir()
    os.symlink(os.path.join(ROOT, "tools", "examples"), tmp_path / "tools" / "examples")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the binaries quiet TensorFlow themselves
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail",
                                                                      "-c", code]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{lang} block failed:\n{code}\n--- stdout\n{run.stdout}" \
                                f"\n--- stderr\n{run.stderr[-4000:]}"
    for path in re.findall(r"(out/[\w./-]+)", code):
        assert os.path.exists(tmp_path / path), f"the block did not write {path}"
    if lang == "sh":  # the binaries hold TF's own log lines back (test_quiet_output)
        assert len(tensorflow_log_lines(run.stdout + run.stderr)) <= 2, run.stderr[-3000:]
