"""``profiler.sum_groups``: a traced step sums each tree of adds as Grappler sums it in the
user's ``tf.function``, so that no control edge a later pass adds can change what it computes."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from graphfit.models.graph_item import GraphItem  # noqa: E402
from graphfit.profiler.graph_def_walk import split_input  # noqa: E402
from graphfit.profiler.session import EXACT_GRAPH  # noqa: E402
from graphfit.profiler.tf_function import (classifier_train_step,  # noqa: E402
                                           graph_item_from_function, to_callable)
from graphfit.profiler.sum_groups import REGROUPED_TAG, regroup_sums  # noqa: E402


def _residual_step():
    """Two residual blocks (the ResNet-style step of ``bench.reach`` at its smallest): each
    ``Add`` is the root of a tree of two adds, as Keras 3's batch norm ends in ``x * s + b``."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, padding="same")(inputs)
    for width, stride in ((16, 1), (32, 2)):
        y = layers.ReLU()(layers.BatchNormalization()(
            layers.Conv2D(width, 3, strides=stride, padding="same")(x)))
        y = layers.BatchNormalization()(layers.Conv2D(width, 3, padding="same")(y))
        shortcut = x if stride == 1 else layers.Conv2D(width, 1, strides=stride)(x)
        x = layers.ReLU()(layers.Add()([y, shortcut]))
    model = keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    optimizer = keras.optimizers.SGD(1e-2)
    batch = (np.random.default_rng(0).standard_normal((8, 16, 16, 3), dtype=np.float32),
             np.arange(8) % 10)
    train_step = classifier_train_step(model, optimizer)
    item = graph_item_from_function(train_step, *batch, name="residual")
    traced = train_step.get_concrete_function(*batch).graph.as_graph_def()
    return item, train_step, traced, list(model.variables) + list(optimizer.variables), batch


def _as_traced(item, traced):
    """``item`` with each tree of adds back as traced (``traced``: the function's GraphDef,
    whose node names the item keeps)."""
    traced_nodes = {node.name: node for node in traced.node}
    graph_def = item.graph.as_graph_def()
    made = {node.name for node in graph_def.node if REGROUPED_TAG in node.attr}
    nodes = {node.name: node for node in graph_def.node if node.name not in made}
    pending = [name for name in made if name in traced_nodes]
    while pending:
        name = pending.pop()
        if name not in nodes:
            nodes[name] = traced_nodes[name]
            pending.extend(split_input(n)[0] for n in traced_nodes[name].input)
    del graph_def.node[:]
    graph_def.node.extend(nodes.values())
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return item.with_graph(graph)


def _as_rewritten(step, pinned: bool):
    """``step`` as a rewritten step runs (``EXACT_GRAPH``: without Grappler's dependency
    optimizer, which would drop the edges below); ``pinned``: with a control edge into every
    add of the forward pass, from a node that is already its ancestor through data, so the
    order stays as it was, as where the remat rewrite pins the forward pass."""
    graph_def = step.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    for node in graph_def.node:
        if (pinned and node.op in ("Add", "AddV2", "AddN")
                and not node.name.startswith("gradient_tape")):
            grandparent = nodes[split_input(node.input[0])[0]].input[0]
            node.input.append("^" + split_input(grandparent)[0])
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    rewritten = step.with_graph(graph)
    rewritten.config = {**step.config, EXACT_GRAPH: True}
    return rewritten


def _one_step(step, item, variables, saved, batch):
    """The loss and the variables after one call of ``step`` (an item, called as the user
    calls it, or the user's own step when ``item`` is ``None``), from ``saved``."""
    for variable, value in zip(variables, saved):
        variable.assign(value)
    loss = float((step if item is None else to_callable(step, item))(*batch))
    return loss, [variable.numpy() for variable in variables]


def test_edges_into_a_traced_steps_trees_of_adds_change_no_value():
    regrouped, train_step, traced, variables, batch = _residual_step()
    saved = [variable.numpy() for variable in variables]
    assert regrouped.config["sum_groups"] == {"changed": True, "trees": 2, "adds_removed": 2}
    item = _as_traced(regrouped, traced)
    assert regroup_sums(item)[1] == regrouped.config["sum_groups"]
    made = [node for node in regrouped.graph.as_graph_def().node if REGROUPED_TAG in node.attr]
    # Per block: one AddN of the batch norm's scaled input and the shortcut, and the root
    # adding the batch norm's shift (another shape) to it.
    assert sorted(node.op for node in made) == ["AddN", "AddN", "AddV2", "AddV2"]

    def pinned_changes_values(step) -> bool:
        loss, after = _one_step(_as_rewritten(step, False), item, variables, saved, batch)
        pinned_loss, pinned_after = _one_step(_as_rewritten(step, True), item, variables,
                                              saved, batch)
        return loss != pinned_loss or any(not np.array_equal(a, b)
                                          for a, b in zip(after, pinned_after))

    # Traced as it is, the pins keep Grappler from regrouping the trees: other sums.
    assert pinned_changes_values(item)
    assert not pinned_changes_values(regrouped)
    # And the traced step, called as the user calls it, is the user's own bit for bit: the
    # same sums Grappler makes in it.
    user_loss, user_after = _one_step(train_step, None, variables, saved, batch)
    loss, after = _one_step(regrouped, item, variables, saved, batch)
    assert loss == user_loss
    assert all(np.array_equal(a, b) for a, b in zip(after, user_after))


def test_a_tree_with_a_control_edge_or_a_second_reader_is_left_to_grappler():
    graph = tf.Graph()
    with graph.as_default():
        weight = tf.Variable(1.0)
        a, b, c = (tf.multiply(tf.constant(np.full((2, 3), k, np.float32)), weight, name=name)
                   for k, name in ((1, "a"), (2, "b"), (3, "c")))
        inner = tf.add(a, b, name="inner")
        with tf.control_dependencies([tf.no_op(name="gate")]):
            pinned = tf.add(inner, c, name="pinned")
        shared = tf.add(a, c, name="shared")
        read_twice = tf.add(shared, tf.add(shared, b, name="shared_plus_b"), name="read_twice")
        total = tf.add(pinned, read_twice, name="total")
        loss = tf.reduce_sum(total, name="loss")
        init = tf.compat.v1.global_variables_initializer()
    item = GraphItem(graph=graph, train_op=loss.op.name, loss=loss.name, gradients=[],
                     init_op=init.name, feeds={})
    regrouped, record = regroup_sums(item)
    kept = {node.name: node for node in regrouped.graph.as_graph_def().node}
    # A control edge keeps an add out of every tree (and "inner", its only reader's input,
    # is a root of nothing but its two leaves); an add read twice is a leaf.
    assert kept["pinned"].op == "AddV2" and REGROUPED_TAG not in kept["pinned"].attr
    assert "inner" in kept and "shared" in kept
    assert record == {"changed": True, "trees": 1, "adds_removed": 2}
    assert kept["total"].op == "AddN" and "read_twice" not in kept
    assert list(kept["total"].input) == ["pinned", "shared", "shared", "b"]
    with tf.compat.v1.Session(graph=regrouped.graph) as session:
        session.run(regrouped.init_op)
        # pinned = a + b + c, shared = a + c, over six elements
        assert session.run(regrouped.loss) == 6 * (6 + 4 + 4 + 2)


def test_a_tree_of_four_shapes_is_summed_bit_for_bit_as_in_the_users_step():
    rng = np.random.default_rng(1)
    shapes = [(4, 3, 5), (3, 5), (5,), (4, 3, 5), (4, 3, 5), (3, 1)]
    weights = [tf.Variable(rng.standard_normal(shape).astype(np.float32)
                           * np.float32(10 ** rng.uniform(-3, 3))) for shape in shapes]
    x = rng.standard_normal(3).astype(np.float32)

    def body(x):
        with tf.GradientTape() as tape:
            a, b, c, d, e, f = (w * x[0] for w in weights)
            total = tf.add_n([a * x[1], ((a + b) + (c + d)) + (e + f), d * x[2]])
            loss = tf.reduce_sum(total * total)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(1e-6 * g)
        return loss

    step = tf.function(body)
    saved = [w.numpy() for w in weights]
    item = graph_item_from_function(step, x)
    # One AddN of the five [4, 3, 5] leaves, depth first, and the sums from the smallest shape
    # up: [3, 1], [5], [3, 5], then the AddN.
    assert item.config["sum_groups"] == {"changed": True, "trees": 1, "adds_removed": 5}
    nodes = {node.name: node for node in item.graph.as_graph_def().node}
    assert [nodes["AddN"].op, nodes["AddN/sum_groups/leaf_3"].op] == ["AddV2", "AddN"]

    def one_step(call):
        for w, value in zip(weights, saved):
            w.assign(value)
        return float(call(x)), [w.numpy() for w in weights]

    user_loss, user_weights = one_step(step)
    loss, after = one_step(to_callable(item))
    assert loss == user_loss and all(np.array_equal(a, b) for a, b in zip(after, user_weights))
    # The test can fail: summed in the traced order, the step computes other values.
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        traced_order = one_step(tf.function(body))
    finally:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": True})
    assert traced_order[0] != user_loss or not all(
        np.array_equal(a, b) for a, b in zip(traced_order[1], user_weights))
