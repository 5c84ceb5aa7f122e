"""m-SCT's favourite-child LP: solvers, windows, and the rounding property."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from graphfit.baechi.devices import LinkCost
from graphfit.baechi.lp import (LPSolverError, lp_window_units, round_favourites,
                                solve_favourite_lp)
from graphfit.baechi.units import UnitGraph
from graphfit.profiler import synthetic
from graphfit.profiler.cost_graph import CostGraph, OpSpec

LINK = LinkCost(0.0001754, 134.0)


def _units(graph):
    return UnitGraph.singletons(graph, np.arange(graph.num_ops))


def _check_rounding(edges, child, parent):
    for i, j in enumerate(child.tolist()):
        if j != -1:
            assert parent[j] == i
    for j, i in enumerate(parent.tolist()):
        if i != -1:
            assert child[i] == j
    chosen = {(i, j) for i, j in enumerate(child.tolist()) if j != -1}
    assert chosen <= set(map(tuple, edges.T.tolist()))
    # at most one favourite child per parent and one favourite parent per child
    assert len({i for i, _ in chosen}) == len(chosen) == len({j for _, j in chosen})


@st.composite
def edges_and_values(draw):
    n = draw(st.integers(2, 30))
    pairs = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                         .filter(lambda e: e[0] < e[1]), min_size=1, max_size=80))
    edges = np.array(sorted(pairs)).T
    x = np.array(draw(st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.5, 0.7, 1.0]),
                               min_size=edges.shape[1], max_size=edges.shape[1])))
    return n, edges, x


@settings(max_examples=300, deadline=None)
@given(edges_and_values(), st.sampled_from([0.2, 0.5, 0.9]))
def test_rounding_respects_one_favourite_each_way(case, threshold):
    n, edges, x = case
    child, parent = round_favourites(edges, x, n, threshold)
    _check_rounding(edges, child, parent)
    # greedy matching is maximal: every candidate edge has an endpoint already matched
    for (i, j), value in zip(edges.T.tolist(), x.tolist()):
        if value < threshold:
            assert child[i] != -1 or parent[j] != -1


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(20, 200))
def test_lp_rounding_on_random_graphs(seed, num_ops):
    units = _units(synthetic.random_dag(num_ops, seed=seed, window=8))
    lp = solve_favourite_lp(units, LINK)
    assert ((lp.x >= 0) & (lp.x <= 1)).all()
    child, parent = round_favourites(lp.edges, lp.x, units.num_units, 0.5, lp.comm_us)
    _check_rounding(lp.edges, child, parent)


def test_lp_value_matches_between_solvers_and_windows():
    units = _units(synthetic.training_like(150, seed=1))
    highs = solve_favourite_lp(units, LINK, "highs")
    cvx = solve_favourite_lp(units, LINK, "cvxopt")
    assert highs.makespan_us == pytest.approx(cvx.makespan_us, rel=1e-4)
    # the LP makespan is at least the critical path and at most the all-transfers path
    assert highs.makespan_us >= units.bottom_level_us().max() - 1e-6
    windows = solve_favourite_lp(units, LINK, "highs", max_units_per_lp=40)
    assert windows.makespan_us >= highs.makespan_us - 1e-6
    assert windows.num_rows > 0 and ((windows.x >= 0) & (windows.x <= 1)).all()


def test_lp_size_is_reported():
    g = CostGraph.from_ops([OpSpec("a", "X", output_bytes=[4], compute_us=1),
                            OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[4], compute_us=1),
                            OpSpec("c", "X", inputs=[("a", 0)], compute_us=1),
                            OpSpec("d", "X", inputs=[("b", 0)], compute_us=1)])
    lp = solve_favourite_lp(_units(g), LinkCost(0, 10))
    # 3 edge rows + 1 out-degree row (a) + 2 sink rows; 3 x + 4 s + w columns
    assert (lp.num_rows, lp.num_cols) == (6, 8)
    # a's two edges share one favourite: 3 + 10 x_ab = 2 + 10 (1 - x_ab) at x_ab = 0.45
    assert lp.makespan_us == pytest.approx(7.5)
    child, parent = round_favourites(lp.edges, lp.x, 4)
    assert child.tolist() == [1, 3, -1, -1] and parent.tolist() == [-1, 0, -1, 1]


def test_mosek_without_package_names_alternatives():
    units = _units(synthetic.random_dag(20))
    with pytest.raises(LPSolverError, match="highs.*cvxopt"):
        solve_favourite_lp(units, LINK, "mosek")
    with pytest.raises(LPSolverError, match="unknown lp_solver"):
        solve_favourite_lp(units, LINK, "gurobi")


def test_wide_graphs_get_smaller_lp_windows():
    # 64 units a level: about 530 units a window; a training step (width about 2): 10,000; a
    # fork-join graph, about 29 units but 18 chains a level, one window for its 3,202 units
    wide = _units(synthetic.layered(3000, seed=0, width=64))
    narrow = _units(synthetic.training_like(3000, seed=0))
    chains = _units(synthetic.fork_join(3000, seed=0))
    assert 500 <= lp_window_units(wide) <= 600
    assert lp_window_units(narrow) == 10_000
    assert lp_window_units(chains) >= chains.num_units
    lp = solve_favourite_lp(wide, LINK)
    assert lp.window_units == lp_window_units(wide) and ((lp.x >= 0) & (lp.x <= 1)).all()
    # edges between windows are fixed as not favourite
    window = np.empty(wide.num_units, dtype=np.int64)
    window[wide.topological_order] = np.arange(wide.num_units) // lp.window_units
    across = window[wide.edges[0]] != window[wide.edges[1]]
    assert across.any() and (lp.x[across] == 1).all()
