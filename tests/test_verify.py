"""The structural verifiers (pipeline.verify) on real rewrites and placements, and on broken ones."""

import pytest
import tensorflow as tf

from graphfit import models
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place_and_run import place_item
from graphfit.pipeline.verify import (VerificationError, verify_placement, verify_rewrite,
                                    verify_step)
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.profiler.trace import step_fetches
from graphfit.remat.rewrite import rewrite
from graphfit.remat.schedule import plan_from_schedule

NAMES = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


@pytest.fixture(scope="module")
def item():
    return models.build("mlp", preset="tiny")


@pytest.fixture(scope="module")
def rewritten(item):
    """layer_0's MatMul, BiasAdd and Relu recomputed right before the backward pass needs them."""
    graph = cost_graph_from_graph(item.graph, step_fetches(item))
    chain = [graph.index[f"layer_0/{name}"] for name in ("MatMul", "BiasAdd", "Relu")]
    first_backward = min(int(c) for c in graph.tensor_consumers(graph.output_offset[chain[-1]])
                         if graph.names[c].startswith("gradients/"))
    order = list(range(graph.num_ops))
    plan = plan_from_schedule(graph, order[:first_backward] + chain + order[first_backward:],
                              None, "hand")
    plan.budget_bytes = plan.peak_bytes
    return rewrite(item, graph, plan), plan


def _with_graph_def(item, edit):
    graph_def = item.graph_def()
    edit(graph_def)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return item.with_graph(graph)


def test_a_real_rewrite_verifies(item, rewritten):
    new, plan = rewritten
    verify_step(item)
    verify_rewrite(item, new, plan)
    plan.budget_bytes = plan.peak_bytes - 1
    with pytest.raises(VerificationError, match="exceeds its budget"):
        verify_rewrite(item, new, plan)
    plan.budget_bytes = plan.peak_bytes


def test_a_real_placement_verifies(item):
    devices = DeviceSet.uniform(NAMES, "1GiB", "0.0001754,134")
    placed, placement = place_item(item, devices)
    verify_placement(item, placed, devices, placement.peak_bytes)
    with pytest.raises(VerificationError, match="planned peak above the limit on"):
        verify_placement(item, placed, devices.with_memory(1), placement.peak_bytes)


def test_clone_of_a_random_op_is_refused(item):
    dropout = models.build("cifarnet", preset="tiny", dropout=0.5)
    random_op = next(op for op in dropout.graph.get_operations()
                     if op.type == "RandomUniform" and "dropout" in op.name)

    def add_clone(graph_def):
        node = next(n for n in graph_def.node if n.name == random_op.name)
        clone = graph_def.node.add()
        clone.CopyFrom(node)
        clone.name = f"{node.name}/remat_1"

    with pytest.raises(VerificationError, match="copies the stateful or random op"):
        verify_rewrite(dropout, _with_graph_def(dropout, add_clone))


def test_unknown_new_node_and_lost_node_are_refused(item, rewritten):
    new, _ = rewritten

    def add_node(graph_def):
        graph_def.node.add(name="extra", op="NoOp")

    with pytest.raises(VerificationError, match="added 'extra', which is no clone"):
        verify_rewrite(item, _with_graph_def(new, add_node))
    with pytest.raises(VerificationError, match="removed or changed original nodes"):
        verify_rewrite(new, item)


def test_a_fusion_gate_must_be_an_identity_colocated_with_its_node(item, rewritten):
    new, _ = rewritten
    gate = "layer_0/MatMul/remat_1/fusion_gate"
    assert new.graph.get_operation_by_name(gate).type == "Identity"

    def move_gate(graph_def):
        node = next(n for n in graph_def.node if n.name == gate)
        del node.attr["_class"]

    with pytest.raises(VerificationError, match=f"added '{gate}', which is no clone"):
        verify_rewrite(item, _with_graph_def(new, move_gate))


def test_cycle_is_found(item):
    copy = _with_graph_def(item, lambda graph_def: None)  # TF's importer refuses cycles
    matmul = copy.graph.get_operation_by_name("layer_0/MatMul")
    matmul._add_control_input(copy.graph.get_operation_by_name("loss"))
    with pytest.raises(VerificationError, match="the step has a cycle"):
        verify_step(copy)


def test_split_colocation_group_is_found(item):
    devices = DeviceSet.uniform(NAMES, "1GiB", "0.0001754,134")
    placed, _ = place_item(item, devices)
    handle = next(op for op in placed.graph.get_operations() if op.type == "VarHandleOp")
    reader = next(op for op in handle.outputs[0].consumers() if op.type == "ReadVariableOp")
    other = next(name for name in NAMES
                 if tf.DeviceSpec.from_string(name) != tf.DeviceSpec.from_string(handle.device))

    def move_reader(graph_def):
        next(n for n in graph_def.node if n.name == reader.name).device = other

    with pytest.raises(VerificationError, match="colocation group .* is split over"):
        verify_placement(item, _with_graph_def(placed, move_reader), devices)


def test_placement_that_rewires_is_refused(item):
    devices = DeviceSet.uniform(NAMES, "1GiB", "0.0001754,134")
    placed, _ = place_item(item, devices)

    def rewire(graph_def):
        nodes = {n.name: n for n in graph_def.node}
        nodes["loss"].input.append("^layer_0/MatMul")  # acyclic, but not a device change

    with pytest.raises(VerificationError, match="changed more than devices"):
        verify_placement(item, _with_graph_def(placed, rewire), devices)
