"""The report's peaks against TF's own allocator, and the rewritten step against the user's
own step (``bench/reconcile.py``), one fresh process per model: a zoo convnet, a Keras
ResNet-style net with BatchNorm, a Keras transformer, at small shapes.

Each process runs with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (read when TF creates its CPU
allocator, so only a fresh process can set it), so the allocator keeps statistics with oneDNN
off as the suite runs it, and the report's ruler is the allocator, as on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphfit.remat.measure import GRADIENT_ATOL_OF_MAX, GRADIENT_RTOL, LOSS_RTOL

pytestmark = pytest.mark.slow


def _row(model: str, ratio: float) -> dict:
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-m", "graphfit.bench.reconcile", "--model", model,
                          "--ratio", str(ratio)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# The Keras ResNet-style step at 0.5: 64 MiB of the 68 MB its user's step adds are TF's
# column buffers of convolution gradients (oneDNN off), which the graph passes remove
# (``remat.patch_convs``, ``remat.conv_grad_kernels``), so the rewritten step is theirs and
# nothing is recomputed. A ratio low enough to recompute (0.02) sits between the passes'
# 1.5-1.8 MB and the planner's floor: of four runs one recomputed and fitted, one fitted
# without recomputing at 1.19 of the budget by the allocator, two were refused after three
# rounds (2026-12-06). The zoo resnet and the Keras transformer run in ``bench.reconcile`` only:
# their baselines vary between fresh processes more than a test can bound (the zoo resnet's
# by 12%: at 0.6 it recomputed 2-6 ops in four runs and none in a fifth; the transformer's
# baseline read 1.064 of the allocator around the user's step in one run of the full suite,
# 1.00 alone, 2026-12-06).
@pytest.mark.parametrize("model,ratio", [("keras_resnet_small", 0.5)])
def test_report_peaks_are_the_allocators_and_the_step_is_the_users(model, ratio):
    row = _row(model, ratio)
    print(row)
    assert row["ruler"] == "allocator"
    # The baseline is what the allocator reads around the user's own step.
    assert row["baseline_over_user"] == pytest.approx(1.0, abs=0.05)
    # The report read the rewritten step called as the user calls it too (``remat.measure``),
    # and its measured peak holds that reading.
    assert row["report_called_added_bytes"] is not None
    assert row["report_measured_bytes"] >= (row["report_measured_resident_bytes"]
                                            + row["report_called_added_bytes"])
    # The rewritten step, called as the user calls it, fits the budget.
    assert row["rewritten_added_over_budget_added"] <= 1.05
    assert row["rewritten_over_budget"] <= 1.05
    assert row["report_gradients_match"]
    assert row["report_max_relative_gradient_diff"] <= GRADIENT_RTOL + GRADIENT_ATOL_OF_MAX
    if "loss_user" in row:
        assert row["loss_relative_diff"] <= LOSS_RTOL
        assert row["max_update_diff_over_max_update"] <= GRADIENT_RTOL + GRADIENT_ATOL_OF_MAX
