"""Near-optimal rematerialization where the MILP cannot solve: Checkmate's LP relaxation with
two-phase rounding, on HiGHS.

Checkmate (Jain et al., MLSys 2020, §5) relaxes its MILP (``remat.checkmate``: a stage per
decision op, binary checkpoint ``S`` and recompute ``R`` variables) to a linear program, which
HiGHS solves in polynomial time, and turns the fractional solution into a schedule in two
phases:

1. round the checkpoint matrix: ``S[s, x] = 1`` when the LP's value is at least a threshold;
2. given those checkpoints, recompute exactly what each stage needs: an op of the stage reads
   a decision tensor that is not checkpointed into the stage, so its producer is recomputed
   first (and, recursively, what that recomputation reads and is not checkpointed either).

The schedule (recomputations of a stage before its own ops) becomes a plan through
``remat.schedule`` (each tensor freed after its last read) and is replayed by
``remat.validate``. Rounding can break the budget, so the plan is kept only if its replayed
peak fits; as in the paper, the LP is also solved at budgets scaled down (the rounding then
has slack) and the cheapest plan that fits is returned.

Unlike the MILP, which proves optimality only on a few dozen decision ops, this runs on the
full graph (no coarsened stages); the LP's objective is a lower bound on the optimum of the
same model (``stats["lp_bound_overhead"]``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import scipy.sparse
from scipy.optimize import linprog

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.checkmate import NoScheduleFoundError, _build, check_budget
from graphfit.remat.plan import RematPlan
from graphfit.remat.schedule import plan_from_schedule
from graphfit.remat.validate import InfeasibleBudgetError

__all__ = ["checkmate_lp"]

# Phase-1 thresholds tried on each LP solution (a higher one checkpoints less: more
# recomputation, less memory).
THRESHOLDS = (0.5, 0.75, 0.9, 0.99)
# Fractions of the budget the LP is solved at, in order, until a rounded plan fits.
BUDGET_SCALES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def _solve_lp(graph: CostGraph, budget_bytes: float, outputs: Sequence[int],
              time_limit_s: float):
    """The relaxed Checkmate model at ``budget_bytes``: (solution, LP objective, R variables,
    S variables by (stage, tensor), stage blocks); solution None when infeasible.

    Raises:
        NoScheduleFoundError: HiGHS stopped before solving it (time limit)."""
    model, R, blocks, _ = _build(graph, int(budget_bytes), None, outputs, None)
    matrix = scipy.sparse.csr_array(
        (model.vals, (model.rows, model.cols)), shape=(len(model.row_lower), len(model.cost)))
    lower, upper = np.array(model.row_lower), np.array(model.row_upper)
    eq = lower == upper
    below, above = ~eq & np.isfinite(upper), ~eq & np.isfinite(lower)
    a_ub = scipy.sparse.vstack([matrix[below], -matrix[above]]).tocsr()
    b_ub = np.concatenate([upper[below], -lower[above]])
    # Interior point: on these wide, sparse LPs several times faster than the simplex.
    result = linprog(np.array(model.cost), A_ub=a_ub, b_ub=b_ub, A_eq=matrix[eq],
                     b_eq=lower[eq], bounds=np.column_stack([model.lower, model.upper]),
                     method="highs-ipm", options={"time_limit": max(float(time_limit_s), 1.0)})
    S = {(key[1], key[2]): v for key, v in model.index.items() if key[0] == "S"}
    if result.status == 2:
        return None, None, R, S, blocks
    if result.status != 0:
        raise NoScheduleFoundError(f"HiGHS did not solve Checkmate's LP relaxation within "
                                   f"{time_limit_s:.0f} s ({result.message})")
    return result.x, float(result.fun), R, S, blocks


def _round(graph: CostGraph, x: np.ndarray, R: dict, S: dict, blocks: list[range],
           threshold: float) -> list[int]:
    """Two-phase rounding: the schedule with the checkpoints ``S >= threshold`` and the
    recomputations each stage then needs."""
    producer = graph.tensor_producer
    inputs = [list(dict.fromkeys(graph.op_inputs(k).tolist())) for k in range(graph.num_ops)]
    stage_of = np.empty(graph.num_ops, dtype=np.int64)
    for s, block in enumerate(blocks):
        stage_of[block.start:block.stop] = s
    schedule = []
    for s, block in enumerate(blocks):
        redo: set[int] = set()

        def need(t: int) -> None:
            """Make ``t`` available in stage s: checkpointed, made in the stage, or recomputed."""
            j = int(producer[t])
            if stage_of[j] == s or j in redo or (s, j) not in R:
                return  # made in this stage, already recomputed, or kept (no choice)
            if (s, t) in S and x[S[s, t]] >= threshold:
                return
            redo.add(j)
            for u in inputs[j]:
                need(u)

        for k in block:
            for t in inputs[k]:
                need(t)
        schedule += sorted(redo) + list(block)
    return schedule


def checkmate_lp(graph: CostGraph, budget_bytes: int, *, outputs: Sequence[int] = (),
                 time_limit_s: float = 60.0) -> RematPlan:
    """A plan within ``budget_bytes`` from Checkmate's LP relaxation and two-phase rounding.

    Args:
        graph: the cost graph (the whole of it: a stage per decision op).
        budget_bytes: the memory budget, persistent bytes included.
        outputs: tensor ids kept resident until the step ends (fetches).
        time_limit_s: for all LP solves together; when it runs out, the best plan so far.

    Returns:
        The cheapest rounded plan whose replayed peak fits the budget. ``stats``:
        ``lp_bound_overhead`` (the relaxation at the full budget: a lower bound on the
        optimum of Checkmate's model), ``budget_scale`` and ``threshold`` of the chosen
        rounding, ``lp_solves``, ``solve_s``, ``num_stages``, ``minimum_bytes``.

    Raises:
        InfeasibleBudgetError: below ``remat.validate.minimum_budget_bytes``, or the LP at the
            full budget is infeasible (then so is the MILP).
        NoScheduleFoundError: no rounding fits the budget (within the time limit).
    """
    minimum = check_budget(graph, budget_bytes, outputs)
    start = time.perf_counter()
    best, bound, solves, num_stages = None, None, 0, 0
    for scale in BUDGET_SCALES:
        left = time_limit_s - (time.perf_counter() - start)
        if left <= 0 or (scale < 1.0 and best is not None):
            break
        x, objective, R, S, blocks = _solve_lp(graph, scale * budget_bytes, outputs, left)
        solves += 1
        num_stages = len(blocks)
        if x is None:
            if scale == 1.0:
                raise InfeasibleBudgetError(
                    f"Checkmate's LP relaxation has no solution within {budget_bytes} bytes, so "
                    "no schedule fits; raise the budget", budget_bytes, minimum)
            break
        if scale == 1.0:
            bound = 1.0 + objective
        for threshold in THRESHOLDS:
            plan = plan_from_schedule(graph, _round(graph, x, R, S, blocks, threshold),
                                      budget_bytes, "checkmate_lp", {}, outputs)
            if plan.peak_bytes <= budget_bytes and (best is None
                                                    or plan.compute_us < best.compute_us):
                best = plan
                best.stats.update(budget_scale=scale, threshold=threshold)
    if best is None:
        raise NoScheduleFoundError(
            f"no rounding of Checkmate's LP fits {budget_bytes} bytes (budget scales "
            f"{BUDGET_SCALES[:solves]} tried in {time.perf_counter() - start:.1f} s); raise the "
            "budget or use the DTR simulator")
    best.stats.update(lp_bound_overhead=bound, lp_solves=solves, num_stages=num_stages,
                      solve_s=time.perf_counter() - start, minimum_bytes=minimum)
    return best
