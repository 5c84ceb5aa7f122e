"""The train binary as a user runs it: a real process, flags in, report and profile out."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*flags, cwd):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-m", "graphfit.tools.train", *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)


def test_costgen_writes_profile_and_report(tmp_path):
    result = _train("--model_name=mlp", "--preset=tiny", "--steps=3", "--costgen",
                    f"--cost_path={tmp_path}/costs.json",
                    f"--report_path={tmp_path}/report.json", cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step time" in result.stdout
    assert "profile: 100.0% of" in result.stderr         # the profile's summary line
    assert "profile mlp" not in result.stderr            # no progress bar in a log
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["model"] == "mlp" and len(report["run"]["losses"]) == 3
    assert report["profile"]["coverage"] >= 0.95
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert costs["format_version"] == 1 and costs["ops"]


def test_unknown_model_is_a_usage_error_without_traceback(tmp_path):
    result = _train("--model_name=alexnet", f"--report_path={tmp_path}/r.json", cwd=REPO)
    assert result.returncode != 0
    assert "alexnet" in result.stderr and "mlp" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r.json").exists()


def test_bad_model_arg_is_a_usage_error(tmp_path):
    result = _train("--model_name=mlp", "--model_arg=depth", f"--report_path={tmp_path}/r.json",
                    cwd=REPO)
    assert result.returncode != 0
    assert "not key=value" in result.stderr and "Traceback" not in result.stderr
