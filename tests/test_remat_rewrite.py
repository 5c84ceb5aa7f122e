"""The rematerialization rewrite on real TF graphs: clones, control edges, same numbers, less
memory, predictions that hold, unsafe clones refused, the sweep tool and the train flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphfit import models
from graphfit.profiler.step_compare import StepMismatchError, compare_steps
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.remat.measure import measure_rewrite, measure_step
from graphfit.remat.pipeline import BudgetError, rematerialize
from graphfit.remat.plan import COMPUTE, RECOMPUTE, Event, RematPlan
from graphfit.remat.rewrite import RematRewriteError, rewrite
from graphfit.remat.schedule import plan_from_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Activations (4 MiB each) dominate. On narrower layers a copy-on-write of a weight the plan
# does not count can add ~2% (README, "Known limits").
SMALL_MLP = dict(batch_size=2048, depth=12, width=512, input_dim=64)


def _step_graph(item):
    return cost_graph_from_graph(item.graph, [item.train_op, item.loss])


def _depends_on(op, name: str) -> bool:
    """Whether TF runs ``op`` after the op ``name``: ``name`` is one of its ancestors."""
    stack, seen = [op], set()
    while stack:
        current = stack.pop()
        for producer in [t.op for t in current.inputs] + list(current.control_inputs):
            if producer.name == name:
                return True
            if producer.name not in seen:
                seen.add(producer.name)
                stack.append(producer)
    return False


def _recompute_layer0_before_backward(graph):
    """Schedule: every op in id order, with layer_0's MatMul/BiasAdd/Relu run again right
    before the first gradient op that reads layer_0/Relu."""
    chain = [graph.index[f"layer_0/{name}"] for name in ("MatMul", "BiasAdd", "Relu")]
    relu_out = graph.output_offset[chain[-1]]
    first_backward = min(int(c) for c in graph.tensor_consumers(relu_out)
                         if graph.names[c].startswith("gradients/"))
    schedule = list(range(graph.num_ops))
    return schedule[:first_backward] + chain + schedule[first_backward:]


def test_hand_plan_clones_rewires_and_keeps_numbers():
    item = models.build("mlp", preset="tiny")
    before = item.graph.as_graph_def().SerializeToString(deterministic=True)
    graph = _step_graph(item)
    plan = plan_from_schedule(graph, _recompute_layer0_before_backward(graph), None, "hand")
    rewritten = rewrite(item, graph, plan)

    assert item.graph.as_graph_def().SerializeToString(deterministic=True) == before
    assert rewritten.graph is not item.graph
    clones = {op.name: op for op in rewritten.graph.get_operations()
              if op.name.rsplit("/", 1)[-1].startswith("remat_")}
    assert set(clones) == {"layer_0/MatMul/remat_1", "layer_0/BiasAdd/remat_1",
                           "layer_0/Relu/remat_1"}
    # The first clone is anchored, through a gate on its input that keeps the remapper's
    # MatMul + BiasAdd + Relu fusion (profiler.remapper_fusions).
    gate = clones["layer_0/MatMul/remat_1"].inputs[0].op
    assert gate.type == "Identity" and gate.control_inputs, "the first clone must be anchored"
    assert [t.op.name for t in clones["layer_0/Relu/remat_1"].inputs] == [
        "layer_0/BiasAdd/remat_1"]
    readers = [op.name for op in rewritten.graph.get_operations()
               if any(t.name == "layer_0/Relu:0" for t in op.inputs)]
    assert readers and all(not name.startswith("gradients/") for name in readers)
    assert rewritten.config["remat"]["clones"] == 3
    compare_steps(item, rewritten).check()


def test_a_clone_of_an_op_that_read_a_clone_reads_the_newest_version():
    """ReluGrad first runs on layer_0/Relu's first recomputation; recomputed itself after a
    second one, its clone must read the second: a copy of the original's inputs names the
    first, which would then stay alive (measured on the mlp ``activations`` step: +1.75 MiB,
    two versions of one activation alive at the peak)."""
    item = models.build("mlp", preset="tiny")
    graph = _step_graph(item)
    relu, relu_grad = (graph.index[name] for name in
                       ("layer_0/Relu", "gradients/layer_0/Relu_grad/ReluGrad"))
    schedule = _recompute_layer0_before_backward(graph) + [relu, relu_grad]
    rewritten = rewrite(item, graph, plan_from_schedule(graph, schedule, None, "hand"))
    reads = [t.op.name for t in rewritten.graph.get_operation_by_name(
        "gradients/layer_0/Relu_grad/ReluGrad/remat_1").inputs]
    assert "layer_0/Relu/remat_2" in reads and "layer_0/Relu/remat_1" not in reads
    compare_steps(item, rewritten).check()


def test_a_mis_wired_clone_fails_the_check_with_kernel_order_noise():
    """The check the pipeline runs (tolerance widened by the original's own kernel-order
    noise) still catches a clone that reads the wrong tensor of the right shape."""
    import tensorflow as tf

    item = models.build("mlp", preset="tiny")
    graph = _step_graph(item)
    plan = plan_from_schedule(graph, _recompute_layer0_before_backward(graph), None, "hand")
    rewritten = rewrite(item, graph, plan)
    compare_steps(item, rewritten, kernel_order_noise=True).check()

    graph_def = rewritten.graph.as_graph_def()
    clone = next(n for n in graph_def.node if n.name == "layer_0/Relu/remat_1")
    clone.input[0] = "layer_1/BiasAdd"          # same shape, another layer's pre-activation
    mis_wired = tf.Graph()
    with mis_wired.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    comparison = compare_steps(item, rewritten.with_graph(mis_wired), kernel_order_noise=True)
    assert comparison.loss_equal and not comparison.gradients_equal
    with pytest.raises(StepMismatchError, match="kernel-order noise"):
        comparison.check()


def test_clones_survive_grappler_under_the_project_config():
    """Grappler runs (session_config) without CSE, which would merge a clone reading its
    original's inputs with the original (after the remapper fused both): the original and the
    clone (the fused node named after the last op of each chain) both run."""
    import tensorflow as tf

    from graphfit.profiler.session import make_session

    item = models.build("mlp", preset="tiny")
    graph = _step_graph(item)
    rewritten = rewrite(item, graph, plan_from_schedule(
        graph, _recompute_layer0_before_backward(graph), None, "hand"))
    # Without its pinning edge the first clone has its original's op and inputs (a plan does
    # this when a clone's previous event is its own input).
    graph_def = rewritten.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    clone = nodes["layer_0/MatMul/remat_1"]
    kept = [nodes[name].input[0] if name.endswith("/fusion_gate") else name
            for name in clone.input if not name.startswith("^")]
    del clone.input[:]
    clone.input.extend(kept)
    unpinned = tf.Graph()
    with unpinned.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    rewritten = rewritten.with_graph(unpinned)
    metadata = tf.compat.v1.RunMetadata()
    with make_session(rewritten.graph) as session:
        rewritten.initialize(session)
        session.run([rewritten.train_op, rewritten.loss], rewritten.feed_dict(),
                    options=tf.compat.v1.RunOptions(trace_level=3), run_metadata=metadata)
    ran = {ns.node_name for d in metadata.step_stats.dev_stats for ns in d.node_stats}
    assert "layer_0/Relu/remat_1" in ran and "layer_0/Relu" in ran


def test_pin_order_clones_adds_one_edge_per_clone():
    item = models.build("mlp", preset="tiny")
    graph = _step_graph(item)
    plan = plan_from_schedule(graph, _recompute_layer0_before_backward(graph), None, "hand")
    rewritten = rewrite(item, graph, plan, pin_order="clones")
    # MatMul's clone gets a control edge; BiasAdd's and Relu's read their anchor's output.
    assert rewritten.config["remat"]["control_edges"] == 1


def test_default_pin_order_chains_the_backward_pass_before_the_first_recompute():
    # The only recompute comes after every other op, the backward pass before it: its weight
    # and input gradients must still run one after the other in plan order (side by side, the
    # slower one keeps the tensor both read alive past its planned free). The forward pass
    # keeps TF's own order.
    item = models.build("mlp", preset="tiny")
    graph = _step_graph(item)
    relu = graph.index["layer_0/Relu"]
    plan = plan_from_schedule(graph, list(range(graph.num_ops)) + [relu], None, "hand")
    rewritten = rewrite(item, graph, plan)
    order = [graph.names[i] for i in range(graph.num_ops)]
    backward = order[order.index(
        "gradients/SparseSoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits_grad"
        "/mul") - 1:]
    assert "gradients/logits/MatMul_grad/MatMul_1" in backward
    for before, after in zip(backward, backward[1:]):
        op = rewritten.graph.get_operation_by_name(after)
        original = item.graph.get_operation_by_name(after)
        if not original.inputs and not original.control_inputs:
            assert not op.control_inputs       # a source node (a constant) is never held back
            continue
        assert _depends_on(op, before)
    assert not rewritten.graph.get_operation_by_name("layer_1/MatMul").control_inputs


@pytest.mark.parametrize("model, op", [("cifarnet", "dropout/random_uniform/RandomUniform"),
                                       ("mlp", "layer_0/MatMul/ReadVariableOp")])
def test_refuses_to_clone_random_or_stateful_ops(model, op):
    item = models.build(model, preset="tiny")
    graph = _step_graph(item)
    assert op in graph.index, sorted(n for n in graph.names if "dropout" in n)
    events = [Event(COMPUTE, i) for i in range(graph.num_ops)]
    events.insert(len(events) - 1, Event(RECOMPUTE, graph.index[op]))
    plan = RematPlan(events, 0, 0, 1.0, 1.0, "hand")
    with pytest.raises(RematRewriteError, match="would not reproduce"):
        rewrite(item, graph, plan)


def test_real_plan_at_tight_budget_saves_measured_memory():
    item = models.build("mlp", preset=None, **SMALL_MLP)
    baseline = measure_step(item, steps=2, warmup=1)
    rewritten, plan = rematerialize(item, baseline.profile, budget_ratio=0.6, heuristic="dtr",
                                    overhead_limit=3.0)
    assert plan.num_recomputes > 0
    report = measure_rewrite(item, rewritten, plan, baseline=baseline, steps=2, warmup=1)
    assert report["peak_ratio"] < 0.75, report
    assert abs(report["prediction_error"]) < 0.10, report
    assert report["loss_match"] and report["gradients_match"]


def test_memory_model_follows_tf_allocations():
    from graphfit.remat.tf_memory import expand_plan, tf_memory_model

    item = models.build("mlp", preset="tiny")
    model = tf_memory_model(item)
    graph, plan_graph = model.cost_graph, model.plan_graph
    # A variable read aliases the variable; feeds are resident; MatMul -> BiasAdd -> Relu is
    # one buffer, hence one planning node.
    assert graph.output_bytes(graph.index["layer_0/MatMul/ReadVariableOp"]).sum() == 0
    assert graph.persistent_bytes[graph.index["inputs"]] == item.feeds["inputs:0"].nbytes
    node = plan_graph.index["layer_0/Relu"]
    assert plan_graph.op_types[node] == "MatMul+BiasAdd+Relu"
    assert [graph.names[i] for i in model.members[node]] == [
        "layer_0/MatMul", "layer_0/BiasAdd", "layer_0/Relu"]
    plan = plan_from_schedule(plan_graph, list(range(plan_graph.num_ops)) + [node], None, "x")
    expanded = expand_plan(model, plan)
    assert [e for e in expanded.events if e.kind == RECOMPUTE] == [
        Event(RECOMPUTE, graph.index[f"layer_0/{name}"]) for name in ("MatMul", "BiasAdd", "Relu")]


def test_budget_below_minimum_names_the_minimum():
    item = models.build("mlp", preset="tiny")
    with pytest.raises(BudgetError, match="the minimum is") as error:
        rematerialize(item, _step_graph(item), budget_bytes=1024)
    assert error.value.minimum_bytes > 1024


def test_sweep_runs_tiny_config(tmp_path):
    from graphfit.tools.sweep import run_sweep

    with open(os.path.join(REPO, "tools/sweep_configs/tiny.json")) as f:
        config = json.load(f)
    results = run_sweep(config, str(tmp_path))
    for name in ("sweep.json", "summary.txt", "overhead_vs_budget.png",
                 "planned_vs_measured.png"):
        assert (tmp_path / name).stat().st_size > 0
    ok = [r for r in results if r["type"] == "dtr" and r["status"] == "ok"]
    assert {r["heuristic"] for r in ok} == {"dtr", "offline"}
    assert all(r["loss_match"] and r["gradients_match"] for r in ok)
    assert [r["status"] for r in results if r.get("kind") == "fixed"] == ["infeasible"]


def test_train_flag_budget_below_minimum_is_a_usage_error():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, "-m", "graphfit.tools.train", "--model_name=mlp", "--preset=tiny", "--steps=1",
         "--memory_budget=1KiB", "--report_path=/dev/null"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "the minimum is" in run.stderr + run.stdout


def test_memory_model_sees_identity_views_and_never_chains_constants():
    """An ``IdentityN`` (Keras 3 passes every gradient through one, each listed twice) is a
    view: 0 bytes, and its readers keep the viewed tensors alive. A step op whose output sits
    at a constant's address aliases the constant and never joins its chain (a chain is cloned
    whole; a constant cannot be), and a plan recomputing a viewed tensor after the view makes
    the view's reader read the recomputed tensor."""
    import numpy as np
    import tensorflow as tf

    from graphfit.models.graph_item import GraphItem
    from graphfit.remat.tf_memory import expand_plan, trace_steps, tf_memory_model

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
        a = tf.multiply(x, 2.0, name="a")
        b = tf.add(x, 1.0, name="b")
        views = tf.identity_n([a, b, a, b], name="views")
        product = tf.multiply(views[0], views[1], name="product")
        ones = tf.constant(np.ones(4, np.float32), name="ones")
        reshaped = tf.reshape(ones, [2, 2], name="reshaped")
        loss = tf.add(tf.reduce_sum(product), tf.reduce_sum(reshaped), name="loss")
        train_op = tf.no_op(name="train_op")
        init_op = tf.no_op(name="init")
    item = GraphItem(graph, train_op.name, loss.name, [], init_op.name,
                     {"x:0": np.ones([64, 64], np.float32)})
    trace = trace_steps(item)[0]
    # What a colleague's trace showed (Grappler, on in the project's session, folds both
    # away): the reshape at the constant's address, allocated.
    for name, allocated in (("ones", False), ("reshaped", True)):
        trace.start_us.setdefault(name, 0)
        trace.address[name] = {0: 4096}
        trace.allocated[name] = {0: allocated}
    model = tf_memory_model(item, trace=trace)
    cost_graph, plan_graph = model.cost_graph, model.plan_graph
    assert cost_graph.output_bytes(cost_graph.index["views"]).tolist() == [0, 0, 0, 0]
    assert "ones" in plan_graph.index and "reshaped" in plan_graph.index
    reads = {plan_graph.names[int(plan_graph.tensor_producer[t])]
             for t in plan_graph.op_inputs(plan_graph.index["product"])}
    assert reads == {"views", "a", "b"}

    # Recompute ``a`` between the view and its reader: the reader must read the clone.
    order = list(range(plan_graph.num_ops))
    order.insert(order.index(plan_graph.index["product"]), plan_graph.index["a"])
    plan = expand_plan(model, plan_from_schedule(plan_graph, order, None, "hand"))
    rewritten = rewrite(item, cost_graph, plan)
    inputs = [t.name for t in rewritten.graph.get_operation_by_name("product").inputs]
    assert inputs == ["a/remat_1:0", "views:1"]
    compare_steps(item, rewritten).check()


def test_an_identity_grappler_pruned_from_the_trace_is_still_a_view():
    """Grappler prunes an ``IdentityN`` (Keras's custom-gradient wrapper over each swish of
    ``keras.applications.EfficientNetB0``) from the traced step; its readers still keep the
    tensors it shows alive, or the plan frees an activation that the backward pass holds
    (EfficientNetB0's plans were 23 MiB under the records, 2026-12-07)."""
    import numpy as np
    import tensorflow as tf

    from graphfit.models.graph_item import GraphItem
    from graphfit.remat.tf_memory import trace_steps, tf_memory_model

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
        a = tf.multiply(x, 2.0, name="a")
        b = tf.add(x, 1.0, name="b")
        views = tf.identity_n([a, b], name="views")
        product = tf.multiply(views[0], views[1], name="product")
        loss = tf.reduce_sum(product, name="loss")
        train_op = tf.no_op(name="train_op")
        init_op = tf.no_op(name="init")
    item = GraphItem(graph, train_op.name, loss.name, [], init_op.name,
                     {"x:0": np.ones([64, 64], np.float32)})
    trace = trace_steps(item)[0]
    for record in (trace.start_us, trace.address, trace.allocated):
        record.pop("views", None)                       # as Grappler's pruning leaves it
    model = tf_memory_model(item, trace=trace)
    plan_graph = model.plan_graph
    assert model.cost_graph.output_bytes(model.cost_graph.index["views"]).tolist() == [0, 0]
    reads = {plan_graph.names[int(plan_graph.tensor_producer[t])]
             for t in plan_graph.op_inputs(plan_graph.index["product"])}
    assert reads == {"views", "a", "b"}
