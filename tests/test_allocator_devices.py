"""Which of TF's allocators a step is measured by: the one of each device it is placed on (a
GPU's BFC allocator for a step on ``/GPU:i``; the process's CPU allocator, shared by every CPU
device), and whether its statistics count small buffers. This machine has no GPU: the
selection is tested on device names, the reading on the CPU."""

import doctest

import numpy as np
import tensorflow as tf

from graphfit.models.training import build_training_step
from graphfit.profiler import trace
from graphfit.profiler.session import onednn_enabled
from graphfit.profiler.trace import (CPU_ALLOCATOR, ONEDNN_UNCOUNTED_BYTES, AllocatorPeak,
                                     allocator_devices, profile_graph, uncounted_below_bytes)
from graphfit.remat.measure import step_peak


def test_a_step_is_read_by_the_allocators_of_the_devices_it_is_placed_on():
    assert doctest.testmod(trace, verbose=False).failed == 0
    # Virtual CPU devices share the process's allocator.
    assert allocator_devices(["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:3",
                              ""]) == [CPU_ALLOCATOR]
    # Placed on GPUs: read by theirs only, whatever the host holds.
    assert allocator_devices(["/device:GPU:1", "/device:GPU:0", "/device:CPU:0"]) == [
        "GPU:0", "GPU:1"]
    assert allocator_devices(["/gpu:2"]) == ["GPU:2"]
    # Placed by TF: on the first GPU where the process sees one.
    assert allocator_devices(["", "/device:CPU:0"], default="GPU:0") == ["GPU:0"]
    assert allocator_devices([]) == [CPU_ALLOCATOR]


def test_only_the_cpu_allocator_with_onednn_leaves_small_buffers_out():
    assert uncounted_below_bytes(["GPU:0"]) == 0
    assert uncounted_below_bytes([CPU_ALLOCATOR]) == (ONEDNN_UNCOUNTED_BYTES if onednn_enabled()
                                                      else 0)
    # A GPU's reading rules even below the records (its BFC allocator counts every buffer);
    # without statistics the records do.
    assert step_peak(100, 50, 180, ["GPU:0"]) == (150, "allocator")
    assert step_peak(100, None, 180, ["GPU:0"]) == (180, "records")
    assert step_peak(100, 50, 180, [CPU_ALLOCATOR]) == (
        (180, "records") if onednn_enabled() else (150, "allocator"))


def _small_step():
    def forward(rng):
        x = tf.compat.v1.placeholder(tf.float32, [64, 256], name="x")
        w = tf.compat.v1.get_variable("w", [256, 256], use_resource=True,
                                      initializer=tf.compat.v1.random_normal_initializer(0, .05))
        return tf.reduce_sum(tf.tanh(x @ w)), {
            "x:0": rng.standard_normal((64, 256), dtype=np.float32)}

    return build_training_step("small", {"optimizer": "sgd", "learning_rate": 1e-2, "seed": 0},
                               forward)


def test_a_cpu_step_is_profiled_with_the_cpu_allocator():
    profile = profile_graph(_small_step(), steps=2, warmup=1, trace_every=2, progress=None)
    assert profile.metadata["allocator_devices"] == [CPU_ALLOCATOR]
    with AllocatorPeak() as allocator:
        tf.constant(np.ones(2**20, np.float32)) + 1.0
    assert allocator.devices == [CPU_ALLOCATOR]
    # With statistics (oneDNN on, or TF_CPU_ALLOCATOR_USE_BFC=true) the block added at least
    # the 4 MiB sum; the suite's default allocator keeps none.
    assert (allocator.added_bytes is None) == (profile.metadata["allocator_added_bytes"] == [])
    assert allocator.added_bytes is None or allocator.added_bytes >= 2**22
