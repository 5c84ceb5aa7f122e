"""With oneDNN on, TF's CPU allocator counts no buffer below 256 KiB
(``profiler.trace.ONEDNN_UNCOUNTED_BYTES``): a step made of small tensors is measured by its
allocation records, not by the allocator's blind reading.

oneDNN is chosen when TF loads, so the step runs in a fresh process with it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import json
import numpy as np
import tensorflow as tf
from graphfit.models.training import build_training_step
from graphfit.profiler.session import onednn_enabled
from graphfit.profiler.trace import ONEDNN_UNCOUNTED_BYTES
from graphfit.remat.measure import measure_step

def forward(rng):
    # Every tensor below the uncounted size: 48 KiB activations, 144 KiB weight gradients.
    x = tf.compat.v1.placeholder(tf.float32, [64, 192], name="x")
    h = x
    for k in range(8):
        w = tf.compat.v1.get_variable(f"w{k}", [192, 192], use_resource=True,
                                      initializer=tf.compat.v1.random_normal_initializer(0, 0.05))
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h), {"x:0": rng.standard_normal((64, 192), dtype=np.float32)}

item = build_training_step("small", {"optimizer": "sgd", "learning_rate": 1e-2, "seed": 0},
                           forward)
assert 192 * 192 * 4 < ONEDNN_UNCOUNTED_BYTES
m = measure_step(item)
print(json.dumps({"onednn": onednn_enabled(), "ruler": m.ruler, "peak": m.peak_bytes,
                  "records": m.records_peak_bytes, "resident": m.resident_bytes,
                  "allocator_added": m.allocator_added_bytes}))
"""


def test_a_step_of_small_tensors_is_measured_by_its_records_with_onednn_on():
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    print(row)
    assert row["onednn"]
    # The allocator sees a fraction of what the step's ops allocate; the records see it all.
    assert row["allocator_added"] < (row["records"] - row["resident"]) / 2
    assert row["ruler"] == "records" and row["peak"] == row["records"]
