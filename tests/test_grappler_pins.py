"""The rewrite's pins hold in the graph Grappler makes of the step, not only in the GraphDef
the project writes: re-pinning after folded nodes, and Muls kept out of re-association."""

from __future__ import annotations

import tensorflow as tf

from graphfit import models
from graphfit.profiler.session import session_config
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.profiler.graph_def_walk import ancestors
from graphfit.remat.grappler_pins import optimized_graph_def, repin_removed_anchors, stand_ins
from graphfit.remat.rewrite import rewrite
from graphfit.remat.schedule import plan_from_schedule


def _inputs(graph_def: tf.compat.v1.GraphDef, name: str) -> list[str]:
    return list(next(node for node in graph_def.node if node.name == name).input)


def test_a_node_pinned_after_a_folded_node_is_repinned_after_what_that_waited_for():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [4, 4], name="a")
        tf.math.square(a, name="b")
        shape = tf.shape(a, name="s")            # static: Grappler folds it into a constant
        with tf.control_dependencies([shape]):
            tf.reduce_sum(a, name="c")
    graph_def = graph.as_graph_def()
    fetches, config = ["b", "c"], session_config()
    anchors = {"s": ["b"], "c": ["s"]}           # the plan: b, then s, then c
    before = optimized_graph_def(graph_def, fetches, config)
    assert "s" not in {node.name for node in before.node}
    assert "b" not in ancestors(before, ["c"])   # the pin was lost

    assert repin_removed_anchors(graph_def, anchors, fetches, config) == 1
    assert "^b" in _inputs(graph_def, "c")
    assert "b" in ancestors(optimized_graph_def(graph_def, fetches, config), ["c"])


def test_softmax_gradient_muls_stay_after_the_event_before_them_through_grappler():
    # Grappler's constant push-down turns ``Softmax_grad/mul_1 = sub * Softmax`` (pinned by
    # its read of ``sub``) into ``scale * Softmax``; the regrouping guard keeps it after the
    # event before ``sub``.
    item = models.build("transformer", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    plan = plan_from_schedule(graph, list(range(graph.num_ops)), budget_bytes=2**40,
                              method="hand")
    rewritten = rewrite(item, graph, plan)
    optimized = optimized_graph_def(rewritten.graph.as_graph_def(),
                                    [item.train_op, item.loss], session_config())
    muls = [node for node in optimized.node if node.name.endswith("Softmax_grad/mul_1")]
    assert muls
    for node in muls:
        scope = node.name[:-len("mul_1")]
        assert scope + "sub" not in node.input      # Grappler did re-associate it
        assert scope + "Sum" in ancestors(optimized, [node.name])


def test_stand_ins_resolve_long_chains_and_cycles_of_removed_anchors():
    """A serial chain of gnmt_v2 had a thousand removed anchors in a row: past Python's
    recursion limit for a recursive resolution."""
    anchors = {f"n{i}": [f"n{i - 1}"] for i in range(1, 5001)}
    anchors["n2500"].append("side")                # a second kept anchor halfway
    anchors.update({"x": ["y", "n0"], "y": ["x"]})   # a cycle of removed anchors
    resolved = stand_ins(anchors, kept={"n0", "side", "n5000"})
    assert resolved["n4999"] == ["n0", "side"] and resolved["n1"] == ["n0"]
    assert "n0" not in resolved and "n5000" not in resolved     # kept: their own stand-ins
    assert resolved["x"] == ["n0"] and resolved["y"] in (["n0"], [])
