"""Grouping (TF colocation, co-placement) and fusion into acyclic placement units."""

import networkx as nx
import numpy as np
from hypothesis import given, settings, strategies as st

from graphfit.baechi.fusion import fuse
from graphfit.baechi.grouping import coplacement_groups, groups_for, tf_colocation_groups
from graphfit.profiler import synthetic
from graphfit.profiler.cost_graph import CostGraph, OpSpec


def _quotient_is_acyclic(graph: CostGraph, unit_of_op: np.ndarray) -> bool:
    q = nx.DiGraph()
    q.add_nodes_from(set(unit_of_op.tolist()))
    for j in range(graph.num_ops):
        for i in graph.predecessors(j):
            if unit_of_op[i] != unit_of_op[j]:
                q.add_edge(int(unit_of_op[i]), int(unit_of_op[j]))
    return nx.is_directed_acyclic_graph(q)


def test_resource_readers_join_the_variable_group():
    g = synthetic.training_like(40)
    groups = tf_colocation_groups(g)
    for layer in ("layer0", "layer1"):
        same = {groups[g.index[f"{layer}/{op}"]] for op in ("w", "read", "update")}
        assert len(same) == 1
    assert groups[g.index["layer0/w"]] != groups[g.index["layer1/w"]]
    assert groups[g.index["layer0/matmul"]] != groups[g.index["layer0/w"]]


def test_coplacement_is_a_fixpoint():
    # a -> b -> c -> {d, e}: a and b have one consumer each, so a, b, c share a group.
    g = CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[4]), OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[4]),
        OpSpec("c", "X", inputs=[("b", 0)], output_bytes=[4]),
        OpSpec("d", "X", inputs=[("c", 0)]), OpSpec("e", "X", inputs=[("c", 0)])])
    groups = coplacement_groups(g)
    assert groups[0] == groups[1] == groups[2] and len({groups[2], groups[3], groups[4]}) == 3
    for i in range(g.num_ops):  # fixpoint: every single-consumer op shares its consumer's group
        succ = g.successors(i)
        if len(succ) == 1:
            assert groups[i] == groups[succ[0]]
    assert (groups_for(g, "coplace") == groups).all()


def test_coplacement_does_not_chain_colocation_groups():
    g = synthetic.training_like(60)
    tf_groups = tf_colocation_groups(g)
    groups = coplacement_groups(g)
    alone = np.bincount(tf_groups)[tf_groups] == 1
    for i in range(g.num_ops):
        succ = g.successors(i)
        if len(succ) == 1 and alone[i]:
            assert groups[i] == groups[succ[0]]
    # weight_grad (one consumer: the update) joins its variable's group ...
    assert groups[g.index["layer2/weight_grad"]] == groups[g.index["layer2/w"]]
    # ... but variable groups are not merged through the layers
    assert len({groups[g.index[f"layer{k}/w"]] for k in range(5)}) == 5


def test_naive_merge_would_create_a_cycle():
    # a -> b -> c and a -> c with a, c in one group: {a, c} -> b -> {a, c} is a cycle.
    g = CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[4], compute_us=1),
        OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[4], compute_us=1),
        OpSpec("c", "X", inputs=[("b", 0), ("a", 0)], compute_us=1)])
    units = fuse(g, np.array([0, 1, 0]))
    assert units.unit_of_op[0] != units.unit_of_op[2]
    assert units.group[units.unit_of_op[0]] == units.group[units.unit_of_op[2]] == 0
    assert _quotient_is_acyclic(g, units.unit_of_op)


def test_variable_groups_on_training_graph_split_but_stay_acyclic():
    g = synthetic.training_like(300)
    groups = coplacement_groups(g)
    units = fuse(g, groups)
    assert units.num_units < 0.6 * g.num_ops  # fusion shrinks training graphs a lot
    assert _quotient_is_acyclic(g, units.unit_of_op)
    # the mapping back covers every op once and unit costs add up
    assert sorted(np.concatenate([units.ops(u) for u in range(units.num_units)]).tolist()) \
        == list(range(g.num_ops))
    assert np.isclose(units.compute_us.sum(), g.compute_us.sum())
    assert units.persistent_bytes.sum() == g.persistent_bytes.sum()
    u = units.unit_of_op[g.index["layer3/w"]]
    assert units.unit_of_op[g.index["layer3/update"]] != u  # would close w -> ... -> update


def test_fused_unit_memory():
    # a -> b inside one unit, b -> c outside: the unit keeps a's output as temporary bytes.
    g = CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[100], compute_us=1, temp_bytes=5, persistent_bytes=3),
        OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[10], compute_us=2, temp_bytes=7,
               persistent_bytes=4),
        OpSpec("c", "X", inputs=[("b", 0)], compute_us=1)])
    units = fuse(g, np.array([0, 0, 1]))
    assert units.num_units == 2
    assert units.compute_us.tolist() == [3, 1]
    assert units.persistent_bytes.tolist() == [7, 0]
    assert units.temp_bytes.tolist() == [7 + 100, 0]  # temp max + internal tensors
    assert units.output_bytes.tolist() == [10, 0]


@st.composite
def dag_and_groups(draw):
    n = draw(st.integers(2, 40))
    specs = []
    for i in range(n):
        sources = draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else set()
        controls = draw(st.sets(st.integers(0, i - 1), max_size=1)) if i else set()
        specs.append(OpSpec(f"op{i}", "X", inputs=[(f"op{j}", 0) for j in sorted(sources)],
                            control_inputs=[f"op{j}" for j in controls], output_bytes=[4],
                            compute_us=1))
    groups = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    return CostGraph.from_ops(specs), groups


@settings(max_examples=150, deadline=None)
@given(dag_and_groups())
def test_fusion_never_creates_cycles(case):
    g, groups = case
    units = fuse(g, groups)
    assert _quotient_is_acyclic(g, units.unit_of_op)
    assert (units.group[units.unit_of_op] == groups).all()


def test_fusion_scales_to_random_dags():
    g = synthetic.random_dag(3000, seed=3)
    units = fuse(g, coplacement_groups(g))
    assert units.num_units < g.num_ops
    assert _quotient_is_acyclic(g, units.unit_of_op)
