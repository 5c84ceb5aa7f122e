"""The favourite-child LP of SCT, built sparse, solved by HiGHS, cvxopt or MOSEK, and rounded.

Small Communication Time scheduling (Hanen & Munier, "An approximation algorithm for scheduling
dependent tasks on m processors with small communication delays", Discrete Applied Math. 108,
2001) relaxes the choice of a "favourite child" per task — the child that runs right after it
on the same processor, so their edge costs no communication. With ``x_ij`` in [0, 1] per edge
(0: ``j`` is ``i``'s favourite child), start times ``s`` and makespan ``w``::

    minimise   w
    subject to s_i + p_i + c_ij * x_ij <= s_j           for every edge i -> j
               sum_j x_ij >= outdeg(i) - 1               (at most one favourite child)
               sum_i x_ij >= indeg(j) - 1                (at most one favourite parent)
               s_i + p_i <= w                            for every sink i
               0 <= x <= 1,  s >= 0

Baechi's m-SCT (Jeon et al., SoCC 2020, §3.4) solved it with MOSEK (a licence) or cvxopt (which
reported a feasible 20k-op instance infeasible) and rounded each ``x`` independently against a
threshold, which can give a parent two favourite children. ``round_favourites`` instead takes
edges below the threshold in increasing ``x`` and accepts one only if its parent has no
favourite child and its child no favourite parent yet (a greedy matching), so the rounded
solution always satisfies both constraints.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import scipy.sparse as sp

from graphfit.baechi.devices import LinkCost
from graphfit.baechi.units import CONTROL_EDGE_BYTES, UnitGraph
from graphfit.errors import GraphfitError

__all__ = ["LP_SOLVERS", "LPSolverError", "LPSolution", "edge_comm_us", "lp_window_units",
           "solve_favourite_lp", "round_favourites"]

LP_SOLVERS = ("highs", "cvxopt", "mosek")
# Window sizes of the LP (``lp_window_units``): chains per window times the graph's width
# in chains.
LP_WIDTH_BUDGET = 31_250
MIN_LP_WINDOW, MAX_LP_WINDOW = 500, 10_000


class LPSolverError(GraphfitError, RuntimeError):
    """The LP solver is unavailable, unknown, or failed on the favourite-child LP."""


@dataclasses.dataclass
class LPSolution:
    """Solved favourite-child LP: ``x`` per edge of ``edges`` (2 x m: parent, child units),
    the LP makespan, the LP's size, the solver's wall time and the window size."""

    edges: np.ndarray
    comm_us: np.ndarray
    x: np.ndarray
    makespan_us: float
    num_rows: int
    num_cols: int
    nnz: int
    solve_s: float
    solver: str
    window_units: int


def edge_comm_us(units: UnitGraph, link: LinkCost) -> np.ndarray:
    """Communication µs of each edge of ``units.edges``: the link cost of the summed distinct
    tensors the edge carries (a control-only edge, or an empty tensor, costs 4 bytes)."""
    pair_t, pair_u = units.consumer_pairs()
    src = units.tensor_producer[pair_t]
    nbytes = np.maximum(units.tensor_bytes[pair_t], CONTROL_EDGE_BYTES)
    n = units.num_units
    edge_key = units.edges[0] * n + units.edges[1]  # sorted: edges come from np.unique
    per_edge = np.bincount(np.searchsorted(edge_key, src * n + pair_u), weights=nbytes,
                           minlength=len(edge_key))
    return link.a_us_per_byte * per_edge + link.b_us


def _build(src: np.ndarray, dst: np.ndarray, p: np.ndarray, comm_us: np.ndarray,
           s_lower: np.ndarray):
    """(c, A_ub, b_ub, lower, upper) over local units 0..n-1 with columns x (m), s (n), w.
    Every unit without a successor among the edges counts as a sink."""
    m, n = len(src), len(p)
    xs, ss, w = np.arange(m), m + np.arange(n), m + n
    rows, cols, vals, rhs = [], [], [], []

    def block(r, c, v):
        rows.append(r), cols.append(c), vals.append(v)

    edge_rows = np.arange(m)
    block(edge_rows, ss[src], np.ones(m))
    block(edge_rows, ss[dst], -np.ones(m))
    block(edge_rows, xs, comm_us)
    rhs.append(-p[src])
    next_row = m
    for ends in (src, dst):  # one favourite child per parent, one favourite parent per child
        degree = np.bincount(ends, minlength=n)
        multi = np.flatnonzero(degree >= 2)
        row_of = np.full(n, -1)
        row_of[multi] = next_row + np.arange(len(multi))
        on = degree[ends] >= 2
        block(row_of[ends[on]], xs[on], -np.ones(on.sum()))
        rhs.append(-(degree[multi] - 1.0))
        next_row += len(multi)
    sinks = np.flatnonzero(np.bincount(src, minlength=n) == 0)
    sink_rows = next_row + np.arange(len(sinks))
    block(sink_rows, ss[sinks], np.ones(len(sinks)))
    block(sink_rows, np.full(len(sinks), w), -np.ones(len(sinks)))
    rhs.append(-p[sinks])
    num_rows = next_row + len(sinks)
    a_ub = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                         shape=(num_rows, m + n + 1))
    c = np.zeros(m + n + 1)
    c[w] = 1.0
    lower = np.zeros(m + n + 1)
    lower[m:m + n] = s_lower
    upper = np.full(m + n + 1, np.inf)
    upper[:m] = 1.0
    return c, a_ub, np.concatenate(rhs), lower, upper


def _solve_highs(c, a_ub, b_ub, lower, upper) -> np.ndarray:
    # highspy directly, not scipy.optimize.linprog: importing scipy.optimize took 0.15-0.6 s,
    # more than the whole placement of a 1,000-op graph
    import highspy
    a = a_ub.tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
    lp.col_cost_, lp.col_lower_ = c, lower
    lp.col_upper_ = np.where(np.isfinite(upper), upper, highspy.kHighsInf)
    lp.row_lower_, lp.row_upper_ = np.full(a.shape[0], -highspy.kHighsInf), b_ub
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
    h = highspy.Highs()
    h.silent()
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise LPSolverError("HiGHS did not solve the favourite-child LP: "
                            f"{h.modelStatusToString(status)}")
    return np.asarray(h.getSolution().col_value)


def _solve_cvxopt(c, a_ub, b_ub, lower, upper) -> np.ndarray:
    import cvxopt
    from cvxopt import solvers
    num_cols = len(c)
    finite = np.flatnonzero(np.isfinite(upper))
    g = sp.vstack([a_ub, -sp.identity(num_cols, format="csr"),
                   sp.identity(num_cols, format="csr")[finite]]).tocoo()
    h = np.concatenate([b_ub, -lower, upper[finite]])
    result = solvers.lp(cvxopt.matrix(c), cvxopt.spmatrix(g.data, g.row, g.col, g.shape),
                        cvxopt.matrix(h), options={"show_progress": False})
    if result["status"] != "optimal":
        raise LPSolverError(f"cvxopt did not solve the favourite-child LP (status "
                            f"{result['status']!r}); use lp_solver='highs'")
    return np.array(result["x"]).ravel()


def _solve_mosek(c, a_ub, b_ub, lower, upper) -> np.ndarray:
    try:
        import mosek
    except ImportError:
        raise LPSolverError(
            "lp_solver='mosek' needs the MOSEK Python package and a licence, and the package "
            "is not installed; use lp_solver='highs' (default, highspy) or "
            "lp_solver='cvxopt'") from None
    a = a_ub.tocoo()
    try:
        with mosek.Env() as env, env.Task(0, 0) as task:
            num_rows, num_cols = a_ub.shape
            task.appendvars(num_cols)
            task.appendcons(num_rows)
            task.putclist(list(range(num_cols)), c.tolist())
            keys = [mosek.boundkey.ra if np.isfinite(u) else mosek.boundkey.lo for u in upper]
            task.putvarboundslice(0, num_cols, keys, lower.tolist(),
                                  np.where(np.isfinite(upper), upper, 0.0).tolist())
            task.putaijlist(a.row.tolist(), a.col.tolist(), a.data.tolist())
            task.putconboundslice(0, num_rows, [mosek.boundkey.up] * num_rows,
                                  [0.0] * num_rows, b_ub.tolist())
            task.putobjsense(mosek.objsense.minimize)
            task.optimize()
            return np.array(task.getxx(mosek.soltype.itr))
    except mosek.Error as e:
        raise LPSolverError(
            f"MOSEK failed ({e}); without a valid licence use lp_solver='highs' (default) or "
            "lp_solver='cvxopt'") from None


_SOLVERS = {"highs": _solve_highs, "cvxopt": _solve_cvxopt, "mosek": _solve_mosek}


def lp_window_units(units: UnitGraph) -> int:
    """How many units one LP window may hold: ``LP_WIDTH_BUDGET`` / the graph's mean width
    chains, in units at the graph's mean chain length, within [``MIN_LP_WINDOW``,
    ``MAX_LP_WINDOW``]. The width is counted in chains per level of the longest path, a chain
    (units joined by edges whose parent has no other child and whose child no other parent)
    being one unit and one level: such an edge is favourite in an optimal solution, HiGHS's
    presolve removes it, and it costs the simplex nothing.

    The dual simplex's time grows with the window's size times its width: on the layered 2k
    graph with 64-unit layers (2026-12-07, load 5.8) one 2,000-unit window took 1.4-3.6 s,
    four windows of 544 units 0.17-0.30 s in all; the 8,223-unit fork-join graph (29 units or
    18 chains a level) takes 0.15 s in one. Smaller windows fix more edges as not favourite;
    on the random and layered graphs of 2k-8k ops the placements stayed 0.88-0.94 of Baechi's
    makespan in Baechi's simulator. On narrow graphs (training steps, width about 2) a window
    of 10,000 costs a second, and smaller windows would cut the long forward-to-backward edges
    the LP should see (training-like 10k: makespan 1.011 of the lower bound with 10,000-unit
    windows, 1.04 with 1,000)."""
    n = units.num_units
    if n == 0:
        return MAX_LP_WINDOW
    src, dst = units.edges
    in_chain = (np.bincount(src, minlength=n)[src] == 1) & \
        (np.bincount(dst, minlength=n)[dst] == 1)
    step = (~in_chain).astype(np.int64).tolist()   # a chain's edges add no level
    dst_l = dst.tolist()
    level = [0] * n
    succ_offset = np.searchsorted(src, np.arange(n + 1)).tolist()
    for u in units.topological_order.tolist():
        for k in range(succ_offset[u], succ_offset[u + 1]):
            if level[dst_l[k]] < level[u] + step[k]:
                level[dst_l[k]] = level[u] + step[k]
    chains = n - int(in_chain.sum())
    width = chains / (max(level) + 1)
    chains_per_window = LP_WIDTH_BUDGET / width
    return int(min(MAX_LP_WINDOW, max(MIN_LP_WINDOW, chains_per_window * n / chains)))


def solve_favourite_lp(units: UnitGraph, link: LinkCost, solver: str = "highs",
                       max_units_per_lp: int | None = None) -> LPSolution:
    """Build and solve the favourite-child LP of a unit graph.

    Graphs larger than ``max_units_per_lp`` (default ``lp_window_units``: smaller windows on
    wider graphs) are solved window by window along the topological order (the simplex time
    grows faster than linearly): an edge between windows is fixed as "not favourite" (x = 1)
    and turns into a lower bound on its child's start time, taken from the earliest start times
    implied by the earlier windows' solutions. Each window's LP minimises that window's
    completion time. A single window is the exact LP.

    Parameters:
        units: the unit graph (its ``edges`` are the LP's edges).
        link: the link cost charged for a non-favourite edge (e.g. ``DeviceSet.mean_link()``).
        solver: ``"highs"`` (HiGHS through ``highspy``, default), ``"cvxopt"`` or ``"mosek"``.
        max_units_per_lp: window size (default: ``lp_window_units(units)``).

    Returns:
        ``LPSolution`` with ``x`` per edge; size (rows, columns, non-zeros) and solve time
        summed over windows; ``makespan_us`` the last finish implied by the solution.

    Raises:
        LPSolverError: unknown solver, solver not installed or unlicensed (the message names
            the alternatives), or the solver failed.

    References:
        Hanen & Munier, Discrete Applied Mathematics 108(3), 2001; Jeon et al., SoCC 2020.
    """
    if solver not in _SOLVERS:
        raise LPSolverError(f"unknown lp_solver {solver!r}; choose one of {LP_SOLVERS}")
    if max_units_per_lp is None:
        max_units_per_lp = lp_window_units(units)
    comm = edge_comm_us(units, link)
    src, dst = units.edges
    n = units.num_units
    p = units.compute_us
    order = units.topological_order
    size = max(1, max_units_per_lp)
    window_of = np.empty(n, dtype=np.int64)
    window_of[order] = np.arange(n) // size
    local = np.empty(n, dtype=np.int64)
    x = np.ones(len(src))
    # Each window touches only the edges into its units (ascending, as the LP is built from
    # them) and their delays: a window costs its own size, not the graph's (with 100 windows a
    # pass over all edges per window took seconds on 100k units).
    src_window, dst_window = window_of[src], window_of[dst]
    into_window = np.argsort(dst_window, kind="stable")
    window_offset = np.zeros(int(window_of.max(initial=-1)) + 2, dtype=np.int64)
    np.cumsum(np.bincount(dst_window, minlength=len(window_offset) - 1), out=window_offset[1:])
    by_dst = np.argsort(dst, kind="stable").tolist()
    in_offset = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=in_offset[1:])
    in_offset = in_offset.tolist()
    src_l = src.tolist()
    delay = (p[src] + comm * x).tolist()   # finish-to-start delay per edge under x
    start_l = [0.0] * n                    # earliest starts implied by the solutions so far
    num_rows = num_cols = nnz = 0
    elapsed = 0.0
    for k in range(len(window_offset) - 1):
        members = order[k * size:(k + 1) * size]
        local[members] = np.arange(len(members))
        into = into_window[window_offset[k]:window_offset[k + 1]]
        inside = into[src_window[into] == k]
        incoming = into[src_window[into] < k]
        s_lower = np.zeros(len(members))
        np.maximum.at(s_lower, local[dst[incoming]],
                      np.array([start_l[u] for u in src[incoming].tolist()])
                      + p[src[incoming]] + comm[incoming])
        # Times in units of the largest cost keep the solvers well conditioned (cvxopt's
        # interior point stalls on raw microseconds).
        scale = max(float(p[members].max(initial=0.0)), float(comm[inside].max(initial=0.0)),
                    1.0)
        c, a_ub, b_ub, lower, upper = _build(local[src[inside]], local[dst[inside]],
                                             p[members] / scale, comm[inside] / scale,
                                             s_lower / scale)
        began = time.perf_counter()
        solution = _SOLVERS[solver](c, a_ub, b_ub, lower, upper)
        elapsed += time.perf_counter() - began
        x[inside] = np.clip(solution[:len(inside)], 0.0, 1.0)
        num_rows, num_cols, nnz = num_rows + a_ub.shape[0], num_cols + a_ub.shape[1], \
            nnz + a_ub.nnz
        for e, value in zip(inside.tolist(),
                            (p[src[inside]] + comm[inside] * x[inside]).tolist()):
            delay[e] = value
        # Earliest starts implied by the solution, for the next windows' bounds.
        for u in members.tolist():
            start_l[u] = max((start_l[src_l[by_dst[j]]] + delay[by_dst[j]]
                              for j in range(in_offset[u], in_offset[u + 1])), default=0.0)
    start_us = np.array(start_l)
    return LPSolution(edges=units.edges, comm_us=comm, x=x,
                      makespan_us=float((start_us + p).max()) if n else 0.0,
                      num_rows=num_rows, num_cols=num_cols, nnz=nnz, solve_s=elapsed,
                      solver=solver, window_units=max_units_per_lp)


def round_favourites(edges: np.ndarray, x: np.ndarray, num_units: int, threshold: float = 0.5,
                     comm_us: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Round an LP solution to favourite children/parents, one at most per unit each way.

    Edges with ``x < threshold`` are candidates, taken in increasing ``x`` (ties: larger
    ``comm_us`` first, the transfer most worth saving); an edge is accepted when its parent has
    no favourite child and its child no favourite parent yet.

    Parameters:
        edges: 2 x m array (parent unit, child unit).
        x: LP value per edge (0: favourite).
        num_units: number of units.
        threshold: largest ``x`` that may still become a favourite.
        comm_us: optional edge communication cost for tie-breaking.

    Returns:
        ``(favourite_child, favourite_parent)``: int64 arrays per unit, -1 for none, with
        ``favourite_parent[favourite_child[i]] == i`` wherever a child is set.

    Examples:
        >>> import numpy as np
        >>> edges = np.array([[0, 0, 1], [1, 2, 2]])  # 0->1, 0->2, 1->2
        >>> child, parent = round_favourites(edges, np.array([0.0, 0.1, 0.2]), 3)
        >>> child.tolist(), parent.tolist()
        ([1, 2, -1], [-1, 0, 1])
    """
    x = np.asarray(x, dtype=np.float64)
    ties = -np.asarray(comm_us) if comm_us is not None else np.zeros(len(x))
    candidates = np.flatnonzero(x < threshold)
    candidates = candidates[np.lexsort((ties[candidates], x[candidates]))]
    child = np.full(num_units, -1, dtype=np.int64)
    parent = np.full(num_units, -1, dtype=np.int64)
    child_l, parent_l = child.tolist(), parent.tolist()
    for i, j in edges[:, candidates].T.tolist():
        if child_l[i] == -1 and parent_l[j] == -1:
            child_l[i], parent_l[j] = j, i
    return np.array(child_l, dtype=np.int64), np.array(parent_l, dtype=np.int64)
