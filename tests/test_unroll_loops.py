"""Loops in a traced step: Keras RNN layers (``unroll=False``) and ``tf.while_loop`` with a trip
count known when the step is traced are unrolled into the step; other loops are refused with
what to change."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from graphfit.profiler.tf_function import (FunctionItemError, classifier_train_step,  # noqa: E402
                                           graph_item_from_function, to_callable)
from graphfit.profiler.tf_import import step_operations  # noqa: E402
from graphfit.profiler.unroll_loops import unroll_loops  # noqa: E402

SEQUENCE, FEATURES, BATCH, UNITS, CLASSES = 8, 5, 4, 16, 3


def _batch(seed=0, batch=BATCH, sequence=SEQUENCE):
    rng = np.random.default_rng(seed)
    return (rng.random((batch, sequence, FEATURES), dtype=np.float32),
            rng.integers(0, CLASSES, batch))


def _rnn_step(layer, optimizer, stacked=False, sequence=SEQUENCE, units=UNITS):
    """A Keras RNN classifier (``unroll=False``), its optimizer and a ``tf.function`` step;
    equal arguments give equal initial weights."""
    keras.utils.set_random_seed(0)
    rnn = getattr(keras.layers, layer)
    layers = [rnn(units, return_sequences=True)] if stacked else []
    model = keras.Sequential([keras.Input((sequence, FEATURES)), *layers, rnn(units),
                              keras.layers.Dense(CLASSES)])
    opt = keras.optimizers.Adam(1e-2) if optimizer == "adam" else keras.optimizers.SGD(0.1)
    return model, opt, classifier_train_step(model, opt)


def _assert_trains_like(step, reference_step, state, reference_state):
    for seed in range(2):            # two steps: optimizer state carries over
        batch = _batch(seed)
        np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch).numpy(),
                                   rtol=1e-5)
    for got, want in zip(state(), reference_state()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layer,optimizer,stacked", [("LSTM", "sgd", False),
                                                     ("GRU", "adam", False),
                                                     ("LSTM", "adam", True)])
def test_unrolled_rnn_step_trains_like_the_keras_step(layer, optimizer, stacked):
    model, opt, train_step = _rnn_step(layer, optimizer, stacked)
    reference_model, reference_opt, reference_step = _rnn_step(layer, optimizer, stacked)
    item = graph_item_from_function(train_step, *_batch())
    _assert_trains_like(to_callable(item), reference_step,
                        lambda: [v.numpy() for v in [*model.variables, *opt.variables]],
                        lambda: [v.numpy() for v in [*reference_model.variables,
                                                     *reference_opt.variables]])


@pytest.mark.slow
def test_unrolled_lstm_step_is_straight_line_ops():
    """Forward and gradient loops of each layer run SEQUENCE times; no loop, no TensorList
    and no function is left in the step, and the per-step intermediates are plain tensors
    read by the gradient copies."""
    _, _, train_step = _rnn_step("LSTM", "sgd")
    item = graph_item_from_function(train_step, *_batch())
    loops = item.config["unrolled_loops"]
    assert sorted(loops.values()) == [SEQUENCE, SEQUENCE]
    assert any("while_grad" in name for name in loops)
    ops = step_operations(item.graph, [item.train_op, item.loss])
    types = [op.type for op in ops]
    assert not [t for t in types if t in ("While", "StatelessWhile") or "TensorList" in t]
    assert not item.graph.as_graph_def().library.function
    forward = next(name for name in loops if "while_grad" not in name)
    # Two MatMuls per forward step; the weight reads are hoisted out of the loop.
    assert sum(op.name.startswith(f"{forward}/iteration_") and op.type == "MatMul"
               for op in ops) == 2 * SEQUENCE
    assert sum(op.name.startswith(f"{forward}/") and op.type == "ReadVariableOp"
               for op in ops) == 3
    # The gradient copy of the last step reads the forward copy's Sigmoid directly.
    last_sigmoids = [op for op in ops if op.type == "Sigmoid"
                     and op.name.startswith(f"{forward}/iteration_{SEQUENCE - 1}/")]
    assert len(last_sigmoids) == 3
    for sigmoid in last_sigmoids:
        assert any("while_grad/iteration_0/" in consumer.name
                   for consumer in sigmoid.outputs[0].consumers())
    # Every gradient still comes from the backward pass, one per trainable variable.
    assert len(item.gradients) == 5


def _while_step(bound):
    """A step with a tf.while_loop multiplying by a weight ``bound(x)`` times."""
    weight = tf.Variable(tf.fill([FEATURES, FEATURES], 0.5))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            _, h = tf.while_loop(lambda i, h: i < bound(x),
                                 lambda i, h: (i + 1, tf.tanh(h @ weight)),
                                 [tf.constant(0), x[:, 0, :]])
            loss = tf.reduce_sum(h)
        weight.assign_sub(0.1 * tape.gradient(loss, weight))
        return loss

    return weight, train_step


def test_while_loop_with_a_static_bound_is_unrolled():
    weight, train_step = _while_step(lambda x: 3)
    reference_weight, reference_step = _while_step(lambda x: 3)
    item = graph_item_from_function(train_step, _batch()[0])
    assert sorted(item.config["unrolled_loops"].values()) == [3, 3]
    # The gradient loop's running sum starts at zeros: the first add is the contribution.
    ops = step_operations(item.graph, [item.train_op, item.loss])
    assert not [op for op in ops if op.type == "AddN" and any(
        t.op.type in ("Fill", "ZerosLike") for t in op.inputs)]
    _assert_trains_like(lambda x, y: to_callable(item)(x), lambda x, y: reference_step(x),
                        lambda: [weight.numpy()], lambda: [reference_weight.numpy()])


def test_data_dependent_trip_count_is_refused_with_what_to_change():
    _, train_step = _while_step(lambda x: tf.cast(tf.reduce_sum(x), tf.int32))
    with pytest.raises(FunctionItemError) as error:
        graph_item_from_function(train_step, _batch()[0])
    message = str(error.value)
    assert "trip count is not known when the step is traced" in message
    assert "while" in message and "(Sum)" in message
    assert "unroll=True" in message and "fixed sequence length" in message


def test_stateful_op_in_a_loop_body_is_refused():
    weight = tf.Variable(tf.fill([FEATURES, FEATURES], 0.5))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            _, h = tf.while_loop(
                lambda i, h: i < 3,
                lambda i, h: (i + 1, tf.tanh(h @ weight) * tf.random.uniform([FEATURES])),
                [tf.constant(0), x[:, 0, :]])
            loss = tf.reduce_sum(h)
        weight.assign_sub(0.1 * tape.gradient(loss, weight))
        return loss

    with pytest.raises(FunctionItemError, match="stateful op .*RandomUniform"):
        graph_item_from_function(train_step, _batch()[0])


def test_graph_without_loops_is_returned_as_is():
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.add(name="c", op="Const").attr["dtype"].type = tf.float32.as_datatype_enum
    result, report = unroll_loops(graph_def)
    assert result is graph_def and report.trip_counts == {}


@pytest.mark.slow
def test_unrolled_lstm_is_rematerialized_and_trains_like_the_keras_step():
    """The whole path: a Keras LSTM (unroll=False) is unrolled, planned under half its
    measured peak, rewritten with recomputations, measured within 5% of the budget, and the
    rewritten step trains the Keras model to the weights of the original step. Shapes where
    activations dominate the peak (sequence 16, batch 64, 32 units)."""
    from graphfit import pipeline

    batch = _batch(batch=64, sequence=16)
    model, _, train_step = _rnn_step("LSTM", "sgd", sequence=16, units=32)
    reference_model, _, reference_step = _rnn_step("LSTM", "sgd", sequence=16, units=32)
    item = graph_item_from_function(train_step, *batch)
    result = pipeline.optimize(item, memory_ratio=0.5, remat_heuristic="offline", progress=None)
    report = result.report()["remat"]
    assert report["num_recomputes"] > 0
    assert report["gradients_match"] and report["loss_match"]
    assert report["measured_peak_bytes"] <= 1.05 * report["budget_bytes"]
    step = to_callable(result.item, item)
    np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch).numpy(), rtol=1e-5)
    for got, want in zip(model.variables, reference_model.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
