"""The cost-graph IR: construction, ordering, adjacency and its errors."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphfit.profiler.cost_graph import CostGraph, CostGraphError, OpSpec
from graphfit.profiler.synthetic import random_dag, training_like


def _diamond():
    # Given out of order on purpose: the IR sorts topologically.
    return CostGraph.from_ops([
        OpSpec("d", "AddV2", inputs=[("b", 0), ("c", 1)], output_bytes=[8], compute_us=4),
        OpSpec("b", "Relu", inputs=[("a", 0)], output_bytes=[8], compute_us=2),
        OpSpec("c", "Split", inputs=[("a", 0), ("a", 0)], output_bytes=[4, 4], compute_us=3,
               control_inputs=["b"]),
        OpSpec("a", "Placeholder", output_bytes=[8]),
    ])


def test_ops_are_topologically_numbered_and_tensors_contiguous():
    g = _diamond()
    assert g.names == ["a", "b", "c", "d"]
    assert g.num_tensors == 5
    assert list(g.op_outputs(2)) == [2, 3]
    assert [g.tensor_name(t) for t in g.op_inputs(3)] == ["b:0", "c:1"]
    assert g.tensor_bytes.tolist() == [8, 8, 4, 4, 8]


def test_adjacency():
    g = _diamond()
    assert g.tensor_consumers(0).tolist() == [1, 2]      # c reads a:0 twice, listed once
    assert g.op_inputs(2).tolist() == [0, 0]             # ... but its inputs keep the repeat
    assert g.control_inputs(2).tolist() == [1]
    assert g.predecessors(3) == [1, 2]
    assert g.successors(0) == [1, 2] and g.successors(1) == [2, 3]


def test_networkx_view_sums_distinct_tensors_per_edge():
    nxg = _diamond().to_networkx()
    assert nxg.edges[0, 2]["bytes"] == 8                 # a:0 read twice counts once
    assert nxg.edges[1, 2]["bytes"] == 0                 # control edge
    assert nx.is_directed_acyclic_graph(nxg)


def test_specs_round_trip():
    g = _diamond()
    again = CostGraph.from_ops(g.to_specs())
    assert again.names == g.names
    assert again.tensor_bytes.tolist() == g.tensor_bytes.tolist()
    assert again.compute_us.tolist() == g.compute_us.tolist()


def test_cycle_is_a_clear_error():
    with pytest.raises(CostGraphError, match="cycle through op"):
        CostGraph.from_ops([
            OpSpec("x", "Relu", inputs=[("y", 0)], output_bytes=[4]),
            OpSpec("y", "Relu", inputs=[("x", 0)], output_bytes=[4]),
        ])


def test_dangling_input_is_a_clear_error():
    with pytest.raises(CostGraphError, match="'ghost', which is not an op"):
        CostGraph.from_ops([OpSpec("x", "Relu", inputs=[("ghost", 0)], output_bytes=[4])])


def test_bad_port_and_duplicate_names():
    with pytest.raises(CostGraphError, match="reads output 1 of 'a', which has 1 outputs"):
        CostGraph.from_ops([OpSpec("a", "Const", output_bytes=[4]),
                            OpSpec("b", "Relu", inputs=[("a", 1)])])
    with pytest.raises(CostGraphError, match="two ops are named 'a'"):
        CostGraph.from_ops([OpSpec("a", "Const"), OpSpec("a", "Const")])


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 300), st.integers(0, 10_000))
def test_random_graphs_are_in_dependency_order(num_ops, seed):
    g = random_dag(num_ops, seed)
    for j in range(g.num_ops):
        assert all(i < j for i in g.predecessors(j))
        for t in g.op_inputs(j):
            assert j in g.tensor_consumers(int(t)).tolist()


def test_training_like_graph_has_forward_and_backward():
    g = training_like(200, seed=1)
    loss = g.index["loss"]
    assert g.names[-1].endswith("/update")
    # Every forward relu is read again after the loss, by its gradient.
    relus = [i for i, n in enumerate(g.names) if n.endswith("/relu")]
    assert relus and all(max(g.successors(i)) > loss for i in relus)
    assert g.persistent_bytes.sum() > 0 and g.is_variable.sum() == len(relus)
