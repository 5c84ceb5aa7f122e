"""The offline Bazel build (DESIGN.md §7): both entry points build and the built `train` runs.

Skipped where Bazel, or Debian's rule repositories the WORKSPACE points at, are not installed
(`make bazel` or `.ci/run` install them). A build from scratch takes a few seconds here; the
generous timeout covers waiting for another Bazel command in the same workspace to finish.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TARGETS = [":train", "//tools:communication_benchmark"]
# The WORKSPACE uses Debian's copies of these (packages bazel-rules-java, bazel-platforms).
DEBIAN_REPOSITORIES = [Path("/usr/share/bazel/rules/java"), Path("/usr/share/bazel/tools/platforms")]
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300

_missing = [str(path) for path in DEBIAN_REPOSITORIES if not path.is_dir()]
pytestmark = [
    pytest.mark.skipif(shutil.which("bazel") is None, reason="bazel is not on PATH (`make bazel` installs it)"),
    pytest.mark.skipif(
        bool(_missing),
        reason=f"Debian's Bazel rule repositories are missing: {_missing} "
        "(apt-get install bazel-rules-java bazel-platforms)",
    ),
]


def _env() -> dict[str, str]:
    """This interpreter's bin directory first on PATH: Bazel's Python stub runs `python3` from PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=REPO,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_bazel_builds_train_and_train_lists_its_flags():
    build = _run(["bazel", "build", "--color=no", "--curses=no", *TARGETS], BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"bazel build {' '.join(TARGETS)} failed:\n{build.stderr[-4000:]}"

    train = REPO / "bazel-bin" / "train"
    assert os.access(train, os.X_OK), f"{train} was not built"
    assert os.access(REPO / "bazel-bin" / "tools" / "communication_benchmark", os.X_OK)

    # absl's --helpfull prints the flags, then exits with status 1 by design.
    helpfull = _run([str(train), "--helpfull"], RUN_TIMEOUT_S)
    crashed = helpfull.returncode not in (0, 1) or "Traceback (most recent call last)" in helpfull.stderr
    assert not crashed, f"bazel-bin/train --helpfull crashed:\n{helpfull.stderr[-4000:]}"
    assert "--model_name" in helpfull.stdout, f"--model_name missing from --helpfull:\n{helpfull.stdout[-4000:]}"
