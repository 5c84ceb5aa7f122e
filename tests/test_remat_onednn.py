"""The rewrite with oneDNN's run-time fusions: TF's ``MklLayoutRewritePass`` merges Conv2D into
its BiasAdd (and Pad into Conv2D, Conv2DBackpropFilter with BiasAddGrad) after the rewrite;
the rewrite must never hand it a pair that the merge turns into a cycle or an abort, and a
Keras ResNet-style step must plan and run rematerialized with oneDNN on and off."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from graphfit.remat.closed_loop import meets_budget, ratio_budget
from graphfit.remat.measure import GRADIENT_ATOL_OF_MAX, GRADIENT_RTOL
from graphfit.remat.rewrite import _protect_fusions

RATIO = 0.5


def _conv_bias_graph(through_another: bool) -> tf.compat.v1.GraphDef:
    """x -> Conv2D -> BiasAdd; with ``through_another``, the bias waits (control edge) for
    an op that waits for the Conv2D: the path Conv2D -> wait -> bias -> BiasAdd."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 4, 4, 2], name="x")
        conv = tf.nn.conv2d(x, tf.ones([1, 1, 2, 2]), 1, "VALID", name="conv")
        bias = tf.constant([1.0, 2.0], name="b")
        if through_another:
            with tf.control_dependencies([conv]):
                wait = tf.no_op(name="wait")
            with tf.control_dependencies([wait]):
                bias = tf.identity(bias, name="bias_read")
        tf.nn.bias_add(conv, bias, name="bias_add")
    return graph.as_graph_def()


def _inputs(graph_def, name):
    return list(next(n for n in graph_def.node if n.name == name).input)


def test_pair_joined_through_another_node_is_kept_apart():
    graph_def = _conv_bias_graph(through_another=True)
    assert _protect_fusions(graph_def) == 1
    assert "^conv" in _inputs(graph_def, "bias_add")


def test_pair_joined_only_by_its_own_edge_stays_fusable():
    graph_def = _conv_bias_graph(through_another=False)
    before = _inputs(graph_def, "bias_add")
    assert _protect_fusions(graph_def) == 0
    assert _inputs(graph_def, "bias_add") == before


def test_pair_with_the_same_control_inputs_is_kept_apart():
    """The merge aborts the process on a pair with control inputs (it checks that each node
    has only its data inputs), so equal non-empty control sets must differ."""
    graph_def = _conv_bias_graph(through_another=False)
    for name in ("conv", "bias_add"):
        next(n for n in graph_def.node if n.name == name).input.append("^x")
    assert _protect_fusions(graph_def) == 1
    assert "^conv" in _inputs(graph_def, "bias_add")


def _fused_kernels(item, config) -> dict[str, int]:
    """The fused kernels (Grappler's ``_Fused...``, oneDNN's ``..WithBias``) a step ran."""
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=item.graph, config=config) as session:
        item.initialize(session)
        session.run([item.train_op, item.loss], item.feed_dict(), run_metadata=metadata,
                    options=tf.compat.v1.RunOptions(output_partition_graphs=True))
    return dict(collections.Counter(n.op for g in metadata.partition_graphs for n in g.node
                                    if "Fused" in n.op or "WithBias" in n.op))


def _update_chains(item) -> dict[str, int]:
    """How many filter gradients (``Conv2DBackpropFilter``) the step has, and how many are in a
    planning node that ends in the SGD update's ``Mul``, which writes into their buffer. A
    filter gradient is the op of its name: ``remat.patch_convs`` computes a strided one over
    space-to-depth blocks, ending in an op of that name (a crop or a reshape)."""
    from graphfit.pipeline.passes import run_graph_passes
    from graphfit.remat.tf_memory import tf_memory_model

    gradients = {op.name for op in item.graph.get_operations()
                 if op.type == "Conv2DBackpropFilter"}
    model = tf_memory_model(run_graph_passes(item)[0])
    names, types = model.cost_graph.names, model.cost_graph.op_types
    return {"filter_gradients": len(gradients),
            "chained_into_update": sum(any(names[i] in gradients for i in m)
                                       and types[m[-1]] == "Mul" for m in model.members)}


def _report() -> list[dict]:
    """Run in a subprocess (oneDNN is chosen when TF loads): the fused kernels of the step and
    of its unfused twin (the gradient check's noise reference), the filter gradients whose
    update writes into their buffer, and optimize at ``RATIO``."""
    from graphfit.pipeline.meta_optimizer import optimize
    from graphfit.profiler.session import session_config
    from graphfit.profiler.step_compare import unfused_twin
    from graphfit.bench.grappler import keras_step

    # keras_step("conv"): ZeroPadding2D, Conv2D with bias, BatchNorm, residual adds; SGD.
    item = keras_step("conv", batch=16)
    kernels = {"original": _fused_kernels(item, session_config()),
               "twin": _fused_kernels(*unfused_twin(item)),
               "update_chains": _update_chains(item)}
    # Costs are measured on a loaded machine: a generous overhead limit keeps DTR from
    # declaring thrashing on noise (the test is about fitting and running, not overhead).
    # With oneDNN off, the eigen_tensor kernels of remat.conv_grad_kernels alone fit this step
    # at 0.5, nothing recomputed (2026-12-05): skipped, so the rewrite meets the fusions.
    report = optimize(item, memory_ratio=RATIO, remat_overhead_limit=4.0,
                      skip=("conv_grad_kernels",), progress=None).report()["remat"]
    return [kernels, {key: value for key, value in report.items()
                      if not isinstance(value, (dict, list))}]


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_keras_resnet_style_step_fits_half_its_peak_with_onednn(onednn):
    result = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=900,
        env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn, "KERAS_BACKEND": "tensorflow"})
    assert result.returncode == 0, result.stderr[-3000:]
    kernels, report = json.loads(result.stdout.strip().splitlines()[-1])
    # The noise reference of the gradient check really runs TF's fusions apart (with oneDNN
    # also the filter gradient that sums the bias gradient in its own order).
    fused = "_MklNativeConv2DBackpropFilterWithBias" if onednn == "1" else "_FusedConv2D"
    assert kernels["original"].get(fused, 0) > 0 and not kernels["twin"], kernels
    # SGD's `lr * gradient` writes into the filter gradient's buffer, with oneDNN too, where
    # the fused filter-and-bias gradient shows a second output in the trace: planned as one
    # node, not as a second buffer (it set keras.applications.ResNet50's lower bound above
    # 0.5 of its peak).
    chains = kernels.pop("update_chains")
    assert chains["chained_into_update"] == chains["filter_gradients"] > 0, chains
    assert report["changed"] and report["num_recomputes"] > 0
    # Against the user's step (TF's defaults), at float32 recomputation's tolerance.
    assert report["loss_match"] and report["gradients_match"], report
    assert report["max_relative_gradient_diff"] <= GRADIENT_RTOL + GRADIENT_ATOL_OF_MAX
    resident = report["measured_resident_bytes"]
    assert meets_budget(report["measured_peak_bytes"], report["budget_bytes"], resident), report
    assert report["budget_bytes"] == ratio_budget(report["baseline_peak_bytes"],
                                                  report["baseline_resident_bytes"], RATIO)


if __name__ == "__main__":
    print(json.dumps(_report()))
