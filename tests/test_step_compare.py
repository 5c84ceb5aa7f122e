"""One step of two graphs from identical initial variables (profiler.step_compare)."""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from graphfit import models
from graphfit.profiler.session import session_config
from graphfit.profiler.step_compare import (NOISE_FACTOR, StepMismatchError, compare_steps,
                                            tensors_close, unfused_twin)


def test_other_seed_starts_from_the_reference_variables():
    item = models.build("mlp", preset="tiny", seed=0)
    other = dataclasses.replace(models.build("mlp", preset="tiny", seed=1), feeds=item.feeds)
    comparison = compare_steps(item, other)
    comparison.check()
    assert comparison.max_abs_gradient_diff == 0.0 < comparison.max_abs_gradient


def test_different_batch_is_a_mismatch():
    item = models.build("mlp", preset="tiny")
    other = dataclasses.replace(item, feeds={**item.feeds,
                                             "inputs:0": item.feeds["inputs:0"] + 1.0})
    comparison = compare_steps(item, other)
    assert not comparison.equal and comparison.loss_candidate != comparison.loss_reference
    with pytest.raises(StepMismatchError, match="max \\|gradient difference\\|"):
        comparison.check()


def test_tolerance_is_relative_to_the_tensors_largest_magnitude():
    # A sum summed in another order: large terms cancelling to ~0 keep the large terms' rounding.
    reference = np.array([113.0, 1e-7])
    assert tensors_close(reference + [0.0, 6.4e-5], reference, rtol=1e-5, atol=1e-6)
    assert not np.allclose(reference + [0.0, 6.4e-5], reference, rtol=1e-5, atol=1e-6)
    # A real error (a wrong value, a wrong shape) is still one.
    assert not tensors_close(reference + [0.0, 0.01], reference, rtol=1e-5, atol=1e-6)
    assert not tensors_close(reference[:1], reference, rtol=1e-5, atol=1e-6)


def test_kernel_order_noise_widens_the_tolerance_by_the_references_own_difference():
    reference = np.array([1.0, 1e-3])
    moved = reference + [0.0, 3.4e-4]
    assert not tensors_close(moved, reference, rtol=1e-5, atol=1e-6)
    assert tensors_close(moved, reference, rtol=1e-5, atol=1e-6, noise=3.4e-4 / NOISE_FACTOR)
    assert not tensors_close(moved, reference, rtol=1e-5, atol=1e-6, noise=1e-5)


def _fused_op_types(item, config) -> collections.Counter:
    """The fused kernels (``_FusedMatMul``, oneDNN's ``_Mkl...Fused...``) the session ran."""
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=item.graph, config=config) as session:
        session.run(item.init_op)
        session.run([item.train_op, item.loss], item.feed_dict(), run_metadata=metadata,
                    options=tf.compat.v1.RunOptions(output_partition_graphs=True))
    return collections.Counter(n.op for g in metadata.partition_graphs for n in g.node
                               if "Fused" in n.op)


def test_unfused_twin_runs_the_same_step_without_fusions():
    item = models.build("mlp", preset="tiny")
    assert _fused_op_types(item, session_config())
    assert not _fused_op_types(*unfused_twin(item))
    comparison = compare_steps(item, unfused_twin(item)[0], kernel_order_noise=True)
    comparison.check()
    assert comparison.max_kernel_noise is not None


def test_a_candidate_whose_constant_initial_values_differ_starts_from_the_references():
    """A traced Keras step holds its weights' initial values as constants, which are compared
    as graph constants rather than fetched; where the candidate's constant differs, the
    reference's value is fed, so both steps still start from the same weights."""
    import keras

    from graphfit.bench.reach import keras_step_item

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    item = keras_step_item("dense", model, keras.optimizers.SGD(0.1), x, np.arange(16) % 4)
    graph_def = item.graph.as_graph_def()
    changed = 0
    for node in graph_def.node:
        if node.op == "Const" and node.attr["value"].tensor.tensor_shape.dim and not changed:
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.shape == (8, 4):                    # the kernel's initial value
                node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value + 1.0))
                changed += 1
    assert changed == 1
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    comparison = compare_steps(item, item.with_graph(graph))
    comparison.check()
    assert comparison.max_abs_gradient_diff == 0.0 < comparison.max_abs_gradient
