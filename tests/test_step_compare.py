"""One step of two graphs from identical initial variables (profiler.step_compare)."""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from graphfit import models
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import session_config
from graphfit.profiler.step_compare import (NOISE_FACTOR, StepMismatchError, WeightCheck,
                                            compare_steps, run_reference, tensors_close,
                                            unfused_twin)


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
        item.initialize(session)
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


def test_a_candidate_whose_fed_initial_values_differ_starts_from_the_references():
    """A traced Keras step feeds its weights' initial values to its initialiser
    (``GraphItem.init_feeds``); where the candidate's differ, the reference's are fed, so
    both steps still start from the same weights."""
    import keras

    from graphfit.bench.reach import keras_step_item

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    item = keras_step_item("dense", model, keras.optimizers.SGD(0.1), x, np.arange(16) % 4)
    kernel = [name for name, value in item.init_feeds.items() if value.shape == (8, 4)]
    assert len(kernel) == 1
    other = dataclasses.replace(item, init_feeds={**item.init_feeds,
                                                  kernel[0]: item.init_feeds[kernel[0]] + 1.0})
    comparison = compare_steps(item, other)
    comparison.check()
    assert comparison.max_abs_gradient_diff == 0.0 < comparison.max_abs_gradient


def test_a_candidate_whose_constant_initial_values_differ_starts_from_the_references():
    """A v1 step's initial values may be graph constants (``tf.Variable(array)``), compared
    as constants rather than fetched; where the candidate's constant differs, the reference's
    value is fed."""
    def step(initial):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
            weight = tf.compat.v1.Variable(initial, name="w", use_resource=True)
            loss = tf.reduce_sum(tf.square(tf.matmul(x, weight)), name="loss")
            gradient, = tf.gradients(loss, [weight])
            train = weight.assign_sub(0.1 * gradient).op
            init = tf.compat.v1.global_variables_initializer()
        return GraphItem(graph, train.name, loss.name, [gradient.name], init.name,
                         {"x:0": np.ones((4, 3), np.float32)})

    initial = np.arange(6, dtype=np.float32).reshape(3, 2)
    item = step(initial)
    comparison = compare_steps(item, item.with_graph(step(initial + 1.0).graph))
    comparison.check()
    assert comparison.max_abs_gradient_diff == 0.0 < comparison.max_abs_gradient


def test_a_reference_step_run_ahead_is_the_one_compared():
    """``remat.closed_loop`` runs the user's step ahead (``run_reference``) while it plans."""
    item = models.build("mlp", preset="tiny")
    candidate = unfused_twin(item)[0]
    ahead = run_reference(item)
    comparison = compare_steps(item, candidate, reference_step=ahead)
    comparison.check()
    assert comparison.loss_reference == ahead.values.loss
    with pytest.raises(ValueError, match="read the variables"):
        compare_steps(item, candidate, weights=WeightCheck(), reference_step=ahead)


def test_steps_that_draw_random_numbers_compare_equal_after_pool_sessions_ran_them():
    """A seeded dropout draws the next numbers each run of its session: the reference and the
    candidate must not run in a pool's session that already ran steps (the closed loop's
    measurements run two steps before the reference and four before the rewritten step)."""
    from graphfit.profiler.session import OpenSessions, step_config

    item = models.build("cifarnet", preset="tiny")
    with OpenSessions() as pool:
        session = pool.get(item.graph, step_config(item))
        item.initialize(session)
        for _ in range(2):
            session.run([item.train_op, item.loss], item.feed_dict())
        compare_steps(item, item, sessions=pool).check()
