"""Grappler's remapper fuses MatMul/Conv2D + BiasAdd + activation (and, with oneDNN,
FusedBatchNorm + Relu) only when no member has a control edge; ``profiler.remapper_fusions``
moves the ordering edges of a rewritten step off such groups, keeping what runs after what."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from graphfit import models
from graphfit.profiler.session import session_config
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.profiler.remapper_fusions import keep_remapper_fusions
from graphfit.remat.rewrite import rewrite
from graphfit.remat.schedule import plan_from_schedule


def _dense(conv: bool, reader_feeds_bias: bool = False) -> tf.compat.v1.GraphDef:
    """x -> contraction -> BiasAdd -> Relu -> sum, every member pinned after ``anchor`` and
    waited for by ``after`` (the rewrite's ordering edges). With ``reader_feeds_bias`` the
    bias is read through ``after``, which waits for the contraction."""
    graph = tf.Graph()
    with graph.as_default():
        shape, kernel = ([2, 5, 5, 3], [3, 3, 3, 4]) if conv else ([2, 8], [8, 4])
        x = tf.compat.v1.placeholder(tf.float32, shape, name="x")
        w = tf.constant(np.linspace(-1, 1, np.prod(kernel), dtype=np.float32).reshape(kernel))
        anchor = tf.square(x, name="anchor")
        with tf.control_dependencies([anchor]):
            c = (tf.nn.conv2d(x, w, 1, "SAME", name="c") if conv else
                 tf.matmul(x, w, name="c"))
        bias = tf.constant([0.5, -0.5, 1.0, -1.0], name="bias")
        if reader_feeds_bias:
            with tf.control_dependencies([c.op]):
                bias = tf.identity(bias, name="after")
        with tf.control_dependencies([anchor]):
            b = tf.nn.bias_add(c, bias, name="b")
        with tf.control_dependencies([anchor]):
            r = tf.nn.relu(b, name="r")
        outputs = [tf.reduce_sum(r, name="out")]
        if not reader_feeds_bias:
            with tf.control_dependencies([c.op, b.op, r.op]):
                outputs.append(tf.reduce_sum(tf.square(x), name="after"))
        tf.identity(tf.add_n(outputs), name="result")
    return graph.as_graph_def()


def _batch_norm_relu() -> tf.compat.v1.GraphDef:
    """x -> FusedBatchNormV3 (training) -> Relu -> sum, both members pinned after ``anchor``
    and waited for by ``after``, as a placement's memory order pins them."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4, 4, 8], name="x")
        anchor = tf.square(x, name="anchor")
        with tf.control_dependencies([anchor]):
            y, mean, _ = tf.compat.v1.nn.fused_batch_norm(
                x, tf.ones([8]), tf.zeros([8]), is_training=True, name="bn")
        with tf.control_dependencies([anchor]):
            r = tf.nn.relu(y, name="r")
        with tf.control_dependencies([y.op, r.op]):
            after = tf.reduce_sum(tf.square(x), name="after")
        tf.identity(tf.reduce_sum(r) + tf.reduce_sum(mean) + after, name="result")
    return graph.as_graph_def()


def _ancestors(graph_def: tf.compat.v1.GraphDef, name: str) -> set[str]:
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    seen, stack = set(), [name]
    while stack:
        for producer in inputs[stack.pop()]:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return seen


def _op_types(run_optimized, graph_def, x) -> tuple[float, collections.Counter]:
    """The result and the op types of the graph the session ran."""
    value, nodes = run_optimized(graph_def, x)
    return value, collections.Counter(n.op for n in nodes)


@pytest.mark.parametrize("conv", [False, True])
def test_edges_move_off_the_group_and_the_remapper_fuses_it(conv, run_optimized):
    graph_def = _dense(conv)
    x = np.linspace(-2, 2, 50 if conv else 16, dtype=np.float32)
    x = np.resize(x, [2, 5, 5, 3] if conv else [2, 8])
    value, ran = _op_types(run_optimized, graph_def, x)
    assert ran["Relu"] == 1 and ran["BiasAdd"] == 1      # the edges keep the group apart

    record = keep_remapper_fusions(graph_def)
    assert record == {"groups": 1, "freed": 1, "blocked": 0}
    nodes = {n.name: n for n in graph_def.node}
    members = {"c", "b", "r"}
    for node in graph_def.node:     # no member has a control input or a control reader
        controls = {i[1:] for i in node.input if i.startswith("^")}
        assert not (node.name in members and controls) and not controls & members, node.name
    # ... and the order holds: each member after ``anchor``, ``after`` after each member.
    assert all("anchor" in _ancestors(graph_def, m) for m in members)
    assert members <= _ancestors(graph_def, "after")
    assert nodes["c"].input[0] == "c/fusion_gate"
    fused_value, fused_ran = _op_types(run_optimized, graph_def, x)
    assert fused_ran["_FusedConv2D" if conv else "_FusedMatMul"] == 1
    assert not {"Relu", "BiasAdd", "MatMul", "Conv2D"} & set(fused_ran)
    np.testing.assert_allclose(fused_value, value, rtol=1e-6)


def test_a_group_whose_reader_feeds_it_keeps_its_edges():
    graph_def = _dense(conv=False, reader_feeds_bias=True)
    before = graph_def.SerializeToString(deterministic=True)
    assert keep_remapper_fusions(graph_def) == {"groups": 1, "freed": 0, "blocked": 1}
    assert graph_def.SerializeToString(deterministic=True) == before


def test_the_rewritten_mlp_runs_its_clones_fused_like_the_users_step():
    """The tiny mlp with layer 0 recomputed before the backward pass: the rewrite pins the
    clones, and the step still runs every MatMul + BiasAdd + Relu as one ``_FusedMatMul``."""
    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    chain = [graph.index[f"layer_0/{name}"] for name in ("MatMul", "BiasAdd", "Relu")]
    first_backward = min(i for i in range(graph.num_ops)
                         if graph.names[i].startswith("gradients/layer_0"))
    schedule = list(range(graph.num_ops))
    schedule = schedule[:first_backward] + chain + schedule[first_backward:]
    rewritten = rewrite(item, graph, plan_from_schedule(graph, schedule, None, "hand"))

    def ran(step):
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=step.graph, config=session_config()) as session:
            step.initialize(session)
            session.run([step.train_op, step.loss], step.feed_dict(), run_metadata=metadata,
                        options=tf.compat.v1.RunOptions(output_partition_graphs=True))
        return collections.Counter(n.op for g in metadata.partition_graphs for n in g.node)

    user, clones = ran(item), ran(rewritten)
    assert rewritten.config["remat"]["remapper_groups_freed"] >= 1
    assert clones["_FusedMatMul"] == user["_FusedMatMul"] + 1
    assert clones["BiasAdd"] == user["BiasAdd"] and clones["Relu"] == user["Relu"]


def test_gates_and_ends_stay_with_their_group():
    """A placer that put a gate or a group's end on another device would copy the tensor it
    views across: both are colocated with their member."""
    graph_def = _dense(conv=False)
    keep_remapper_fusions(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    assert list(nodes["c/fusion_gate"].attr["_class"].list.s) == [b"loc:@c"]
    assert list(nodes["r/fusion_done"].attr["_class"].list.s) == [b"loc:@r"]


def test_a_second_run_reuses_the_helpers_of_the_first(run_optimized):
    """A placement's order adds edges to a step the rewrite already freed: the pass runs again,
    moves the new edges onto the same gate and end, and the group still fuses."""
    graph_def = _dense(conv=False)
    keep_remapper_fusions(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    nodes["c"].input.append("^anchor_2")
    nodes["r"].input.append("^anchor_2")
    graph_def.node.add(name="anchor_2", op="NoOp")
    nodes["out"].input.append("^b")
    count = len(graph_def.node)
    assert keep_remapper_fusions(graph_def) == {"groups": 1, "freed": 1, "blocked": 0}
    nodes = {n.name: n for n in graph_def.node}
    assert len(graph_def.node) == count
    assert {"^anchor", "^anchor_2"} <= set(nodes["c/fusion_gate"].input)
    assert "^anchor_2" in nodes["b/fusion_gate"].input
    assert "^r/fusion_done" in nodes["out"].input and "^b" not in nodes["out"].input
    x = np.resize(np.linspace(-2, 2, 16, dtype=np.float32), [2, 8])
    _, ran = _op_types(run_optimized, graph_def, x)
    assert ran["_FusedMatMul"] == 1


def _batch_norm_kernels() -> list[dict]:
    """Run in a subprocess (oneDNN is chosen when TF loads): the op types of the batch-norm
    graph the session ran, before and after the pass."""
    graph_def = _batch_norm_relu()
    x = np.resize(np.linspace(-2, 2, 50, dtype=np.float32), [2, 4, 4, 8])
    ran = []
    for _ in range(2):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=graph, config=session_config()) as session:
            session.run("result:0", {"x:0": x}, run_metadata=metadata,
                        options=tf.compat.v1.RunOptions(output_partition_graphs=True))
        ran.append(dict(collections.Counter(n.op for g in metadata.partition_graphs
                                            for n in g.node)))
        keep_remapper_fusions(graph_def)
    return ran


def test_a_batch_norm_and_its_relu_are_freed_and_fuse_with_onednn():
    """The placed zoo resnet's memory order left every ``FusedBatchNormV3 + Relu`` apart while
    the plan was calibrated on the fused user step (2026-12-07): the pass frees the pair, in
    order, and with oneDNN the session runs it as one ``_FusedBatchNormEx``."""
    graph_def = _batch_norm_relu()
    assert keep_remapper_fusions(graph_def) == {"groups": 1, "freed": 1, "blocked": 0}
    members = {"bn", "r"}
    for node in graph_def.node:
        controls = {i[1:] for i in node.input if i.startswith("^")}
        assert not (node.name in members and controls) and not controls & members, node.name
    assert all("anchor" in _ancestors(graph_def, m) for m in members)
    assert members <= _ancestors(graph_def, "after")

    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    apart, fused = json.loads(result.stdout.strip().splitlines()[-1])
    assert apart.get("Relu") == 1 and not any("BatchNormEx" in op for op in apart), apart
    assert "Relu" not in fused and any("BatchNormEx" in op for op in fused), fused


if __name__ == "__main__":
    print(json.dumps(_batch_norm_kernels()))
