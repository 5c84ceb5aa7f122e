"""The installed distribution lives under one name, `graphfit`, and shadows nothing of a user's.

The repository keeps its packages at the top (models, profiler, remat, baechi, tools); the
pyproject's package mapping installs them as `graphfit.models`, ... . A user's own `models.py`
next to an installed graphfit must still be the `models` they import.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_NOT_SOURCES = shutil.ignore_patterns(".*", "bazel-*", "build", "*.egg-info", "results", "out",
                                     "__pycache__")  # results: bench/results, recorded data


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources (the build writes next to its input)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "src"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = (work / "dist").glob("graphfit-*.whl")
    return built


def test_wheel_holds_only_the_graphfit_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"graphfit", "-".join(wheel.name.split("-")[:2]) + ".dist-info"}
    for package in ("models", "profiler", "remat", "baechi", "pipeline", "tools", "bench"):
        assert f"graphfit/{package}/__init__.py" in names
    assert "graphfit/tools/sweep_configs/ablation.json" in names


def test_users_own_models_module_stays_importable(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    project = tmp_path / "user_project"
    project.mkdir()
    (project / "models.py").write_text("WHOSE = 'the user'\n")
    script = ("import models, graphfit.models\n"
              "print(models.WHOSE, graphfit.models.__name__, graphfit.models.MODEL_NAMES[:2])\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", script], cwd=project, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the user graphfit.models"), result.stdout


def test_make_setup_installs_the_hub_extra_without_its_requirements():
    """keras-hub's requirements would replace tensorflow-cpu: the Makefile installs
    pyproject's ``hub`` pins with ``--no-deps``, the very same pins."""
    import re

    tomllib = pytest.importorskip("tomllib")        # Python 3.11+
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["hub"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^HUB_PINS := (.*)$", makefile, re.M).group(1).split() == pins
    assert "pip install -q --no-deps $(HUB_PINS)" in makefile
