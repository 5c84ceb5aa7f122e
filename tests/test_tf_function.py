"""The TF2 entry: a Keras 3 ``tf.function`` training step as a GraphItem, and back to a callable
that trains the user's model."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from graphfit.profiler.session import make_session  # noqa: E402
from graphfit.profiler.tf_function import (FunctionItem, FunctionItemError,  # noqa: E402
                                           classifier_train_step, graph_item_from_function,
                                           on_variable_copies, to_callable)
from graphfit.profiler.trace import profile_graph  # noqa: E402

WIDTH, BATCH = 32, 64


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, 16), dtype=np.float32),
            rng.standard_normal((BATCH, 4), dtype=np.float32))


def _keras_step(seed=0, optimizer="adam"):
    """A 3-layer Keras MLP, its optimizer and a ``tf.function`` step returning the loss.

    The step also closes over a constant tensor, so captures that are no variables are
    exercised. Equal seeds give equal initial weights."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(4)])
    opt = keras.optimizers.Adam(1e-2) if optimizer == "adam" else keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.MeanSquaredError()
    scale = tf.constant(0.5)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = scale * loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return model, opt, train_step


def _state(model, opt):
    return [v.numpy() for v in [*model.variables, *opt.variables]]


def _assert_same_state(actual, expected):
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def traced():
    model, opt, train_step = _keras_step()
    x, y = _batch()
    return model, opt, train_step, graph_item_from_function(train_step, x, y, name="keras_mlp")


def test_item_keeps_every_node_name_and_finds_gradients(traced):
    model, _, train_step, item = traced
    x, y = _batch()
    traced_names = {node.name for node in
                    train_step.get_concrete_function(x, y).graph.as_graph_def().node}
    assert traced_names <= {op.name for op in item.graph.get_operations()}
    assert isinstance(item, FunctionItem)
    assert [item.graph.get_tensor_by_name(g).shape.as_list() for g in item.gradients] == \
        [list(v.shape) for v in model.trainable_variables]
    assert all("gradient_tape/" in g for g in item.gradients)
    assert set(item.feeds) == set(item.data_inputs) == {"x:0", "y:0"}


def test_item_runs_in_a_session_from_the_current_weights(traced):
    model, _, _, item = traced
    x, y = _batch()
    with make_session(item.graph) as session:
        item.initialize(session)
        loss, *grads = session.run([item.loss, *item.gradients], item.feed_dict())
    with tf.GradientTape() as tape:
        expected = 0.5 * keras.losses.MeanSquaredError()(y, model(x, training=True))
    expected_grads = tape.gradient(expected, model.trainable_variables)
    np.testing.assert_allclose(loss, expected.numpy(), rtol=1e-6)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_item_profiles_with_full_coverage(traced):
    *_, item = traced
    profile = profile_graph(item, steps=2, warmup=1, trace_every=1, progress=None)
    assert profile.coverage >= 0.95, profile.unmeasured_ops
    assert profile.peak_bytes > 0


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_callable_trains_the_keras_model_like_the_original_step(optimizer):
    model, opt, train_step = _keras_step(optimizer=optimizer)
    reference_model, reference_opt, reference_step = _keras_step(optimizer=optimizer)
    step = to_callable(graph_item_from_function(train_step, *_batch()))
    for seed in range(2):           # two steps: optimizer state (Adam's moments) carries over
        batch = _batch(seed)
        np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch).numpy(),
                                   rtol=1e-6)
    assert int(opt.iterations.numpy()) == 2
    _assert_same_state(_state(model, opt), _state(reference_model, reference_opt))
    # Keras itself sees the trained weights.
    x, _ = _batch(5)
    np.testing.assert_allclose(model.predict_on_batch(x), reference_model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)


def test_a_call_on_variable_copies_trains_the_copies_not_the_users_model():
    """``on_variable_copies`` runs the step as ``to_callable`` does, from the user's current
    weights, on the traced batch, and leaves the user's model and optimizer untouched."""
    model, opt, train_step = _keras_step()
    reference_model, reference_opt, reference_step = _keras_step()
    item = graph_item_from_function(train_step, *_batch())
    train_step(*_batch(1))      # the user trains on after tracing: the copies start from here
    reference_step(*_batch(1))
    before = _state(model, opt)
    call = on_variable_copies(item, item)
    losses = [float(call()) for _ in range(3)]
    _assert_same_state(_state(model, opt), before)
    assert int(opt.iterations.numpy()) == 1
    # The copies trained: each call's loss is the reference's on the same batch and weights.
    expected = [float(reference_step(*_batch())) for _ in range(3)]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert losses[2] < losses[0]


def test_callable_runs_a_step_whose_ops_wait_for_its_data_inputs(traced):
    """Control edges from a data placeholder and from a captured handle (as the rewrite's
    floating events get them) are remapped like the data edges: nothing is left to feed."""
    model, opt, train_step, item = traced
    graph_def = item.graph.as_graph_def()
    x, handle = item.data_inputs[0].split(":")[0], next(iter(item.captures)).split(":")[0]
    loss_op = item.loss.split(":")[0]
    for node in graph_def.node:
        if node.name == loss_op:
            node.input.extend([f"^{x}", f"^{handle}"])
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    before = _state(model, opt)
    loss = to_callable(item.with_graph(graph), item)(*_batch(3))
    assert np.isfinite(loss.numpy())
    assert any(not np.array_equal(a, b) for a, b in zip(_state(model, opt), before))


def test_rematerialized_step_trains_the_keras_model_like_the_original():
    """A hand-made plan recomputes the first layer (MatMul, BiasAdd, Relu) right before the
    backward pass reads it; the rewritten step must train the model to identical weights."""
    rewrite_module = pytest.importorskip("graphfit.remat.rewrite")
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.remat.schedule import plan_from_schedule

    model, opt, train_step = _keras_step(optimizer="sgd")
    reference_model, reference_opt, reference_step = _keras_step(optimizer="sgd")
    batch = _batch()
    item = graph_item_from_function(train_step, *batch)
    cost_graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    relu = list(cost_graph.op_types).index("Relu")          # the first layer's activation
    bias_add = int(cost_graph.tensor_producer[cost_graph.op_inputs(relu)[0]])
    mat_mul = int(cost_graph.tensor_producer[cost_graph.op_inputs(bias_add)[0]])
    layer = [mat_mul, bias_add, relu]
    assert [cost_graph.op_types[i] for i in layer] == ["MatMul", "BiasAdd", "Relu"]
    first_backward_read = min(int(c) for t in cost_graph.op_outputs(relu)
                              for c in cost_graph.tensor_consumers(t)
                              if "gradient_tape/" in cost_graph.names[int(c)])
    schedule = list(range(cost_graph.num_ops))
    schedule[first_backward_read:first_backward_read] = layer
    plan = plan_from_schedule(cost_graph, schedule, None, "first_layer")
    rewritten = rewrite_module.rewrite(item, cost_graph, plan)
    clones = [op.name for op in rewritten.graph.get_operations()
              if op.name.rsplit("/", 1)[-1].startswith("remat_")]
    assert len(clones) == 3
    # The rewritten item still initialises and runs on its own in a session.
    from graphfit.profiler.step_compare import compare_steps
    compare_steps(item, rewritten).check()

    step = to_callable(rewritten, item)
    np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch).numpy(), rtol=1e-6)
    _assert_same_state(_state(model, opt), _state(reference_model, reference_opt))


def test_batch_norm_model_gradients_and_training_match_keras():
    """A conv net with batch normalisation: the tape sums some gradients with ``AddN`` ops
    outside its scope, and the step also updates the moving statistics (non-trainable)."""
    def conv_step():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8, 8, 3)),
                                  keras.layers.Conv2D(8, 3, activation="relu"),
                                  keras.layers.BatchNormalization(),
                                  keras.layers.Flatten(), keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(1e-2)
        return model, opt, classifier_train_step(model, opt, loss_as_dict=True)

    rng = np.random.default_rng(1)
    batch = (rng.random((16, 8, 8, 3), dtype=np.float32),
             rng.integers(0, 10, 16).astype(np.int32))
    model, opt, train_step = conv_step()
    reference_model, reference_opt, reference_step = conv_step()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    item = graph_item_from_function(train_step, *batch)

    with make_session(item.graph) as session:
        item.initialize(session)
        grads = session.run(item.gradients, item.feed_dict())
    with tf.GradientTape() as tape:
        expected = loss_fn(batch[1], model(batch[0], training=True))
    expected_grads = tape.gradient(expected, model.trainable_variables)
    assert len(grads) == len(expected_grads) == 6
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6)

    # The eager forward above moved the moving statistics; start both models level again.
    for variable, reference in zip(model.variables, reference_model.variables):
        variable.assign(reference)
    step = to_callable(item)
    np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch)["loss"].numpy(),
                               rtol=1e-6)
    _assert_same_state(_state(model, opt), _state(reference_model, reference_opt))


def test_step_without_a_loss_is_refused():
    model, opt, _ = _keras_step(optimizer="sgd")

    @tf.function
    def no_loss(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    with pytest.raises(FunctionItemError, match="must return its loss"):
        graph_item_from_function(no_loss, *_batch())


def test_step_without_gradients_is_refused():
    model, _, _ = _keras_step(optimizer="sgd")
    forward = tf.function(lambda x, y: tf.reduce_mean(tf.square(y - model(x))))
    with pytest.raises(FunctionItemError, match="found no gradients"):
        graph_item_from_function(forward, *_batch())


def _nested_step(model, opt):
    """The step through a nested tf.function (a user's helper), whose gradient TF runs as
    another nested call."""
    inner = tf.function(lambda x: model(x))

    @tf.function
    def outer(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - inner(x)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss
    return outer


def test_nested_functions_are_inlined_and_train_like_the_original():
    model, opt, _ = _keras_step(optimizer="sgd")
    reference_model, reference_opt, _ = _keras_step(optimizer="sgd")
    item = graph_item_from_function(_nested_step(model, opt), *_batch())
    assert item.config["inlined_calls"] >= 2          # the forward call and its gradient
    assert not item.graph.as_graph_def().library.function
    assert len(item.gradients) == len(model.trainable_variables)
    step, reference = to_callable(item), _nested_step(reference_model, reference_opt)
    for seed in range(2):
        batch = _batch(seed)
        np.testing.assert_allclose(step(*batch).numpy(), reference(*batch).numpy(), rtol=1e-6)
    _assert_same_state(_state(model, opt), _state(reference_model, reference_opt))


def test_grouped_convolutions_are_inlined_and_rematerialized():
    """Keras runs a grouped Conv2D (``groups == filters``, ConvNeXt's depthwise convolutions)
    as a nested XLA-marked function: inlined, the passes see its convolutions."""
    from graphfit.pipeline import optimize

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 8))
    x = keras.layers.Conv2D(8, 3, padding="same", groups=8)(inputs)
    x = keras.layers.Conv2D(16, 1)(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x)))
    step = classifier_train_step(model, keras.optimizers.SGD(1e-2))
    x_batch = np.random.default_rng(0).standard_normal((4, 16, 16, 8), dtype=np.float32)
    item = graph_item_from_function(step, x_batch, np.arange(4) % 10)
    assert any(op.type == "Conv2DBackpropFilter" for op in item.graph.get_operations())
    remat = optimize(item, memory_ratio=0.8, remat_heuristic="offline",
                     progress=None).report()["remat"]
    assert remat["loss_match"] and remat["gradients_match"]


def test_conditionals_are_refused_as_opaque():
    model, opt, _ = _keras_step(optimizer="sgd")

    @tf.function
    def branchy(x, y):
        with tf.GradientTape() as tape:
            out = model(x)
            loss = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.reduce_mean(tf.square(y - out)),
                           lambda: tf.reduce_mean(tf.abs(y - out)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    with pytest.raises(FunctionItemError, match="opaque"):
        graph_item_from_function(branchy, *_batch())


def test_callable_needs_the_function_item(traced):
    *_, item = traced
    from graphfit.models.graph_item import GraphItem
    plain = GraphItem(item.graph, item.train_op, item.loss, item.gradients, item.init_op,
                      item.feeds)
    with pytest.raises(FunctionItemError, match="FunctionItem"):
        to_callable(plain)


def test_optimize_rematerializes_a_keras_step_within_its_prediction():
    """``pipeline.optimize`` on a Keras 3 step: the calibrated memory model must see through
    the optimizer's ``IdentityN`` over all gradients (a view, not new buffers), so the plan
    fits, the measured peak matches the prediction, and the rewritten step trains the model
    like the original one."""
    from graphfit import pipeline

    def mlp_step():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((256,))]
                                 + [keras.layers.Dense(256, activation="relu")
                                    for _ in range(8)]
                                 + [keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.01)
        return model, opt, classifier_train_step(model, opt)

    rng = np.random.default_rng(3)
    batch = (rng.standard_normal((1024, 256), dtype=np.float32),
             rng.integers(0, 10, 1024).astype(np.int32))
    model, opt, train_step = mlp_step()
    reference_model, reference_opt, reference_step = mlp_step()
    result = pipeline.optimize(graph_item_from_function(train_step, *batch), memory_ratio=0.7,
                             progress=None)
    report = result.report()["remat"]
    assert report["changed"] and report["num_recomputes"] > 0
    assert report["loss_match"] and report["gradients_match"]
    assert report["measured_peak_bytes"] < 0.85 * report["baseline_peak_bytes"]
    assert abs(report["prediction_error"]) < 0.10, report

    step = to_callable(result.item)
    for _ in range(2):              # the second step starts from the updated weights
        np.testing.assert_allclose(step(*batch).numpy(), reference_step(*batch).numpy(),
                                   rtol=1e-5)
    _assert_same_state(_state(model, opt), _state(reference_model, reference_opt))


def test_an_inlined_calls_results_do_not_wait_for_its_whole_body():
    """Inlined as Grappler inlines, each result of a nested call is ready once the body made
    it: the layer before a grouped convolution takes its input gradient without waiting for
    the convolution's filter gradient (ConvNeXtTiny's step waited so at every depthwise
    convolution), while a wait for the call (``^call``) still waits for its whole body."""
    from graphfit.profiler.graph_def_walk import ancestors

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(4, 1)(inputs)
    x = keras.layers.Conv2D(4, 3, padding="same", groups=4)(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    step = classifier_train_step(model, keras.optimizers.SGD(1e-2))
    item = graph_item_from_function(
        step, np.random.default_rng(0).standard_normal((2, 8, 8, 4), dtype=np.float32),
        np.arange(2) % 3)
    graph_def = item.graph.as_graph_def()
    by_op = {n.op: n.name for n in graph_def.node}
    first_filter_gradient = by_op["Conv2DBackpropFilter"]         # of the 1x1 convolution
    upstream = ancestors(graph_def, [first_filter_gradient])
    assert by_op["DepthwiseConv2dNativeBackpropInput"] in upstream
    assert by_op["DepthwiseConv2dNativeBackpropFilter"] not in upstream
    calls = {n.name for n in graph_def.node if n.op == "NoOp" and n.name.endswith("PartitionedCall")}
    assert len(calls) == 2 and not any(i.split(":")[0] in calls for n in graph_def.node
                                       for i in n.input if not i.startswith("^"))
    assert by_op["DepthwiseConv2dNativeBackpropFilter"] in ancestors(graph_def, [item.train_op])
