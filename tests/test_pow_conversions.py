"""A ``Pow`` with a control input makes Grappler's arithmetic optimizer emit an invalid node, and
the session then runs the whole step without Grappler; ``profiler.pow_conversions`` moves such
edges onto a gate, keeping what runs after what."""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from graphfit.profiler.pow_conversions import keep_pow_conversions


def _gelu_like() -> tf.compat.v1.GraphDef:
    """``x -> a = 2x -> Pow(a, 3)`` (GELU's cube) and ``Pow(a, 3 - 1)`` (its gradient's
    square), the cube pinned after ``anchor`` with a control edge (the rewrite's pin), and an
    ``Identity`` Grappler removes when it runs."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
        a = tf.identity(x * 2.0, name="a")
        anchor = tf.reduce_sum(tf.square(x), name="anchor")
        three = tf.constant(3.0, name="three")
        square = tf.pow(a, tf.subtract(three, 1.0, name="two"), name="grad_square")
        with tf.control_dependencies([anchor]):
            cube = tf.pow(a, three, name="cube")
        tf.identity(tf.reduce_sum(cube + square) + anchor, name="result")
    return graph.as_graph_def()


def _ops_by_name(run_optimized, graph_def, x) -> tuple[float, dict]:
    """The result and the graph the session ran (op type by node name)."""
    value, nodes = run_optimized(graph_def, x)
    return value, {n.name: n.op for n in nodes}


def test_a_pinned_pow_turns_grappler_off_and_its_gate_turns_it_back_on(run_optimized):
    x = np.resize(np.linspace(-1.5, 1.5, 97, dtype=np.float32), [64, 64])
    graph_def = _gelu_like()
    value, ran = _ops_by_name(run_optimized, graph_def, x)
    # Grappler's output was refused: the graph ran as written, Identity and all.
    assert ran["cube"] == "Pow" and ran["grad_square"] == "Pow" and "a" in ran

    assert keep_pow_conversions(graph_def) == 1
    nodes = {n.name: n for n in graph_def.node}
    assert not [i for i in nodes["cube"].input if i.startswith("^")]
    assert nodes["cube"].input[0] == "cube/fusion_gate"
    assert list(nodes["cube/fusion_gate"].input) == ["a", "^anchor"]   # still after anchor
    assert list(nodes["cube/fusion_gate"].attr["_class"].list.s) == [b"loc:@cube"]
    gated_value, gated_ran = _ops_by_name(run_optimized, graph_def, x)
    assert "Pow" not in collections.Counter(gated_ran.values())
    assert gated_ran["grad_square"] == "Square" and gated_ran["cube"] == "Mul"
    np.testing.assert_allclose(gated_value, value, rtol=1e-5)


def test_a_second_run_moves_new_edges_onto_the_same_gate():
    graph_def = _gelu_like()
    keep_pow_conversions(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    graph_def.node.add(name="anchor_2", op="NoOp")
    nodes["cube"].input.append("^anchor_2")
    count = len(graph_def.node)
    assert keep_pow_conversions(graph_def) == 1
    nodes = {n.name: n for n in graph_def.node}
    assert len(graph_def.node) == count
    assert list(nodes["cube/fusion_gate"].input) == ["a", "^anchor", "^anchor_2"]
    assert list(nodes["cube"].input) == ["cube/fusion_gate", "three"]


def test_a_pow_without_control_inputs_is_left_alone():
    graph_def = _gelu_like()
    for node in graph_def.node:
        if node.name == "cube":
            del node.input[2:]
    before = graph_def.SerializeToString(deterministic=True)
    assert keep_pow_conversions(graph_def) == 0
    assert graph_def.SerializeToString(deterministic=True) == before
