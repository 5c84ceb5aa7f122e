"""A step's allocator reading is a high quantile of many steps' (``profiler.trace.
added_by_calls``, ``PEAK_READINGS``, ``peak_reading``), fewer where the readings do not
spread; the report's baseline is read so (``remat.measure.measure_step``'s ``readings``).

The allocator keeps statistics only with oneDNN or ``TF_CPU_ALLOCATOR_USE_BFC=true``, read when
TF loads, so those readings are made in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from graphfit.profiler.trace import PEAK_READINGS, STEADY_READINGS, added_by_calls, peak_reading

_SCRIPT = """
import json
import tensorflow as tf
from graphfit import models
from graphfit.profiler.trace import PEAK_READINGS, added_by_calls
from graphfit.remat.measure import measure_step

calls = []
def held(sizes):
    def call():
        size = sizes[len(calls) % len(sizes)]
        calls.append(size)
        return tf.reduce_sum(tf.fill([size], 1.0) * 2.0).numpy()
    return call

steady = added_by_calls(held([2**20]), warmup=1)
steady_calls = len(calls)
calls.clear()
# One step in four holds 16 MiB instead of 4: a spread no few readings are sure to catch.
spread = added_by_calls(held([2**20, 2**20, 2**20, 2**22]), warmup=1)

item = models.build("mlp", preset="tiny")
default = measure_step(item, steps=2)
read = measure_step(item, steps=2, readings=PEAK_READINGS)
print(json.dumps({"steady": steady, "steady_calls": steady_calls, "spread": spread,
                  "default_readings": len(default.allocator_readings),
                  "readings": len(read.allocator_readings),
                  "added": read.allocator_added_bytes}))
"""


def test_a_step_is_read_until_its_readings_settle_or_many_are_read():
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    print(row)
    # The same 4 MiB every call: the readings agree, so the first few are enough.
    assert len(row["steady"]) == STEADY_READINGS and row["steady_calls"] == STEADY_READINGS + 1
    assert min(row["steady"]) >= 2**22
    # A larger step one time in four: every reading is made, and the step's reading (a high
    # quantile) holds the 16 MiB.
    assert len(row["spread"]) == PEAK_READINGS
    assert peak_reading(row["spread"]) >= 2**24 > min(row["spread"])
    # The session's own steps by default; more for the report's baseline, fewer if they agree.
    assert row["default_readings"] == 2
    assert STEADY_READINGS <= row["readings"] <= PEAK_READINGS
    assert row["added"] >= 32 * 64 * 4        # a hidden activation: batch 32, width 64


def test_without_statistics_one_call_says_so():
    calls = []

    def call():
        calls.append(tf.reduce_sum(tf.constant(np.ones(1024, np.float32))).numpy())

    # The suite's default CPU allocator keeps none (tests/conftest.py: oneDNN off).
    assert added_by_calls(call, warmup=1) == [None]
    assert len(calls) == 2
