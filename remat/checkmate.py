"""Optimal rematerialization: Checkmate's mixed-integer program, solved with HiGHS.

Checkmate (Jain et al., MLSys 2020) cuts the step into stages; stage ``s`` computes the next
ops of the topological order for the first time (the frontier advances) and may first recompute
earlier ops. Here a stage ends at each op a plan could drop and rebuild (a recomputable op whose
outputs are read); the ops that need no decision (stateful, variables, feeds, ops nobody reads)
join the stage of the next such op, since they are computed once and their outputs live from
their computation to their last reader. Binary variables:

- ``R[s, j]``: decision op ``j`` is recomputed in stage ``s`` (before the stage's own ops);
- ``S[s, x]``: decision tensor ``x`` is resident (checkpointed) entering stage ``s`` (per tensor,
  so the small outputs of a multi-output op can be kept without its big ones);
- ``FREE[s, x, k]``: tensor ``x`` is freed right after op ``k`` runs in stage ``s`` (``x`` an
  input or output of ``k``). It may be 1 only if ``k`` ran, ``x`` is not checkpointed into
  stage ``s + 1`` and no later op of the stage reads ``x``: one upper-bound row each. Memory is
  only bounded from above, so an optimum loses nothing by freeing less, and Checkmate's
  hazard-count linearisation of this product is not needed. (These bounds would be exact for
  a continuous ``FREE`` too, but branching on it lets HiGHS find schedules far sooner: 3 s
  instead of none in 20 s on a 52-op training graph);

and a continuous one, ``U[s, k]``: bytes resident right after op ``k`` runs in stage ``s``.

minimise  Σ R[s, j] · compute_us[j]                       (plus every op once)
subject to
    run(s, k) <= R[s, producer(x)] + S[s, x]       for each decision tensor x that k reads
    S[s + 1, x] <= S[s, x] + R[s, producer(x)]     (checkpoints persist)
    U[s, first] = fixed(s) + Σ_x S[s, x] · bytes[x] + run(s, first) · bytes_out[first]
    U[s, k] = U[s, k'] − Σ_x FREE[s, x, k'] · bytes[x] − fixed(k') + run(s, k) · bytes_out[k]
    U[s, k] + temp[k] · run(s, k) <= budget − persistent bytes

where ``run(s, k)`` is ``R[s, k]`` for a recomputation and 1 for the stage's own ops,
``fixed(s)`` the bytes of non-decision tensors alive across the stage boundary and ``fixed(k')``
those whose last reader ``k'`` just ran (``k'`` the op run before ``k``). Valid
inequalities cut wasteful solutions and tighten the relaxation: a checkpoint or a recomputation
is read in its stage or kept for the next; a single-output op is not recomputed while resident.
A decision op whose fixed inputs (e.g. a variable read) have died may no longer be recomputed.

The solution's order of (re)computations becomes a plan through ``remat.schedule``, which frees
each tensor after its last read, and is replayed by ``remat.validate``: its peak is never above
the model's ``U``.

HiGHS proves optimality on graphs of a few dozen decision ops in seconds; around a hundred it
often stops at the time limit with an incumbent and a weak bound (the relaxation lets
checkpoints be fractional), or with no incumbent at all (``NoScheduleFoundError``).
``candidates`` (e.g. the forward pass only) shrinks the model.

References:
    Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica, Gonzalez, "Checkmate: Breaking the
    Memory Wall with Optimal Tensor Rematerialization", MLSys 2020, Section 4 (the MILP, its
    frontier-advancing stages and the memory accounting with FREE and U).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import scipy.sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from graphfit.errors import GraphfitError
from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import RematPlan
from graphfit.remat.schedule import plan_from_schedule
from graphfit.remat.validate import InfeasibleBudgetError, minimum_budget_bytes, recomputable_ops

__all__ = ["NoScheduleFoundError", "check_budget", "checkmate_milp"]

# Memory rows count in units of budget / 1024 bytes: coefficients stay near 1 (HiGHS's simplex
# slows down badly on wide ranges), and its feasibility tolerance (1e-7 units, 1e-10 of the
# budget) stays below a byte for budgets under 10 GB; the replay checks the plan exactly.
_MEMORY_UNITS_PER_BUDGET = 1024.0


class NoScheduleFoundError(GraphfitError, RuntimeError):
    """HiGHS found no schedule within the budget: the time limit ran out first, or a restricted
    model (``max_stages``, ``candidates``) has none. Neither proves that no plan exists."""


class _Model:
    """Sparse MILP under construction: variables by key, rows as coordinate triplets."""

    def __init__(self):
        self.index: dict[tuple, int] = {}
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.lower: list[float] = []
        self.integral: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    def var(self, key: tuple, cost: float = 0.0, integral: bool = True, lower: float = 0.0,
            upper: float = 1.0) -> int:
        self.index[key] = len(self.cost)
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integral.append(1 if integral else 0)
        return self.index[key]

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(self.row_lower)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.row_lower.append(lower)
        self.row_upper.append(upper)


@dataclasses.dataclass
class Stages:
    """What Checkmate's model (and its LP relaxation) is built on: the stages and, per tensor,
    how long a plan may need it.

    Attributes:
        inputs: per op, the distinct tensors it reads (the last op also "reads" the outputs).
        readers: per tensor, the ops reading it (the last op for outputs).
        decision: per op, whether the model may drop and rebuild its outputs.
        last_read: per tensor, its last reader's position (its producer's if none).
        recompute_until: per op, the last position before which it may be recomputed (its
            fixed inputs, e.g. a variable read, die at their last reader).
        needed_until: per tensor, the last position at which some reader of it may run (a
            first computation, or a recomputation while that reader's own outputs may be
            needed): a checkpoint kept later is wasted.
        stage_ends: the positions at which a stage of one decision op ends.
        blocks: the ops each stage computes for the first time.
        coarsened: ``max_stages`` merged several decision ops into one stage.
    """

    inputs: list[list[int]]
    readers: list[list[int]]
    decision: np.ndarray
    last_read: np.ndarray
    recompute_until: np.ndarray
    needed_until: np.ndarray
    stage_ends: list[int]
    blocks: list[range]
    coarsened: bool

    def grouped(self, max_stages: int | None) -> "Stages":
        """These stages with ⌈decision ops / max_stages⌉ decision ops per stage (all of the
        rest is the same: ``checkmate_lp`` tries several groupings of one graph)."""
        return dataclasses.replace(self, **_blocks(self.stage_ends, len(self.inputs),
                                                   max_stages))


def _blocks(stage_ends: list[int], n: int, max_stages: int | None) -> dict:
    """The ``blocks`` and ``coarsened`` of ``Stages`` for ``max_stages``."""
    ends = list(stage_ends)
    coarsened = max_stages is not None and len(ends) > max_stages
    if coarsened:
        ends = ends[math.ceil(len(ends) / max_stages) - 1::math.ceil(len(ends) / max_stages)]
    if not ends or ends[-1] < n - 1:
        ends.append(n - 1)
    blocks = [range(0 if s == 0 else ends[s - 1] + 1, end + 1) for s, end in enumerate(ends)]
    return {"blocks": blocks, "coarsened": coarsened}


def stages(graph: CostGraph, candidates: np.ndarray | None, outputs: Sequence[int],
           max_stages: int | None) -> Stages:
    """The stages of Checkmate's model (module docstring): one per decision op, or
    ⌈decision ops / max_stages⌉ decision ops per stage."""
    n = graph.num_ops
    producer = graph.tensor_producer
    inputs = [list(dict.fromkeys(graph.op_inputs(k).tolist())) for k in range(n)]
    readers = [graph.tensor_consumers(x).tolist() for x in range(graph.num_tensors)]
    for x in sorted(set(int(x) for x in outputs)):  # in effect, the last op reads outputs
        if producer[x] != n - 1 and n - 1 not in readers[x]:
            readers[x].append(n - 1)
            inputs[n - 1].append(x)
    read = np.array([bool(r) for r in readers], dtype=bool)
    stage_end = recomputable_ops(graph) & np.array(
        [read[list(graph.op_outputs(i))].any() for i in range(n)], dtype=bool)
    decision = stage_end if candidates is None else stage_end & candidates
    # A fixed op's output lives from its computation to its last reader's first computation.
    last_read = np.array([max(readers[x], default=int(producer[x]))
                          for x in range(graph.num_tensors)], dtype=np.int64)
    # An op can be recomputed before position p only while its fixed inputs are still alive.
    recompute_until = np.array([min((last_read[x] for x in inputs[k] if not decision[producer[x]]),
                                    default=n) for k in range(n)], dtype=np.int64)
    # A tensor is needed while a reader may run: its first computation, or a recomputation
    # while that reader may be recomputed and its own outputs are still needed (ids are
    # topological: readers come later, so one backward sweep).
    needed_until = np.full(graph.num_tensors, -1, dtype=np.int64)
    for x in range(graph.num_tensors - 1, -1, -1):
        for k in readers[x]:
            until = k
            if decision[k]:
                later = max(needed_until[list(graph.op_outputs(k))].max(initial=-1), k)
                until = max(k, min(int(recompute_until[k]), int(later)))
            needed_until[x] = max(needed_until[x], until)
    ends = np.flatnonzero(stage_end).tolist()
    return Stages(inputs, readers, decision, last_read, recompute_until, needed_until, ends,
                  **_blocks(ends, n, max_stages))


def fixed_alive(graph: CostGraph, model: Stages, size: np.ndarray) -> np.ndarray:
    """Per position p, the ``size`` of the fixed (non-decision) tensors alive entering p: from
    their producer's computation to their last reader's."""
    alive = np.zeros(graph.num_ops + 1)
    producer = graph.tensor_producer
    for x in np.flatnonzero(~model.decision[producer]).tolist():
        if model.last_read[x] > producer[x]:
            alive[producer[x] + 1] += size[x]
            alive[model.last_read[x] + 1] -= size[x]
    return np.cumsum(alive)


def _build(graph: CostGraph, budget_bytes: int, candidates: np.ndarray | None,
           outputs: Sequence[int], max_stages: int | None
           ) -> tuple[_Model, dict, list[range], bool]:
    """The Checkmate MILP of ``graph`` at ``budget_bytes`` (module docstring).

    Returns the model, the ``R`` variables by (stage, op), the ops each stage computes, and
    whether the stages were coarsened to ``max_stages``.
    """
    n = graph.num_ops
    producer = graph.tensor_producer
    layout = stages(graph, candidates, outputs, max_stages)
    inputs, readers, decision = layout.inputs, layout.readers, layout.decision
    last_read, recompute_until = layout.last_read, layout.recompute_until
    needed_until, blocks, coarsened = layout.needed_until, layout.blocks, layout.coarsened

    unit_bytes = budget_bytes / _MEMORY_UNITS_PER_BUDGET
    size = graph.tensor_bytes / unit_bytes
    op_size = np.array([size[list(graph.op_outputs(i))].sum() for i in range(n)])
    baseline_us = float(graph.compute_us.sum()) or 1.0
    capacity = (budget_bytes - float(graph.persistent_bytes.sum())) / unit_bytes
    fixed_alive_at = fixed_alive(graph, layout, size)

    model = _Model()
    one = model.var(("one",), lower=1.0, upper=1.0, integral=False)
    R, S = {}, {}
    kept_before = []  # per stage: decision tensors that may be checkpointed into it
    for s, block in enumerate(blocks):
        kept_before.append([x for x in range(int(graph.output_offset[block.start]))
                            if decision[producer[x]] and block.start <= needed_until[x]])
        for x in kept_before[s]:
            S[s, x] = model.var(("S", s, x))
        for j in dict.fromkeys(producer[kept_before[s]].tolist()):
            if block.start <= recompute_until[j]:
                R[s, j] = model.var(("R", s, j), graph.compute_us[j] / baseline_us)

    for s, block in enumerate(blocks):
        run = [(j, v) for (t, j), v in sorted(R.items()) if t == s] + [(k, one) for k in block]

        def resident(x: int) -> list[tuple[int, float]]:
            return [(v, -1.0) for v in (R.get((s, int(producer[x]))), S.get((s, x)))
                    if v is not None]

        # Dependencies: an op runs only with the decision tensors it reads made earlier in
        # this stage or checkpointed into it (fixed tensors are alive by construction).
        for k, runs in run:
            for x in inputs[k]:
                if decision[producer[x]] and producer[x] not in block:
                    model.row([(runs, 1.0)] + resident(x), -np.inf, 0.0)
        stage_readers = {}
        for k, runs in run:
            for x in inputs[k]:
                stage_readers.setdefault(x, []).append(runs)
        for x in kept_before[s]:
            j = int(producer[x])
            keep = [(S[s + 1, x], -1.0)] if (s + 1, x) in S else []
            # Checkpoints persist only if resident or computed in this stage.
            if keep:
                model.row([(S[s + 1, x], 1.0)] + resident(x), -np.inf, 0.0)
            # Valid inequalities that cut wasteful solutions (and tighten the relaxation): a
            # checkpoint is read in this stage or kept for the next; a single-output op is not
            # recomputed while resident.
            reads = stage_readers.get(x, [])
            if one not in reads:
                model.row([(S[s, x], 1.0)] + [(r, -1.0) for r in reads] + keep, -np.inf, 0.0)
            if (s, j) in R and len(graph.op_outputs(j)) == 1:
                model.row([(R[s, j], 1.0), (S[s, x], 1.0)], -np.inf, 1.0)
        for (t, j), v in R.items():
            if t != s:
                continue
            uses = []
            for x in graph.op_outputs(j):
                uses += stage_readers.get(x, [])
                uses += [S[s + 1, x]] if (s + 1, x) in S else []
            if one not in uses:  # a recomputation is read in this stage or kept
                model.row([(v, 1.0)] + [(u, -1.0) for u in uses], -np.inf, 0.0)

        # Memory along the stage: U after each op runs, then the frees it allows.
        previous = [(one, -fixed_alive_at[block.start])]
        previous += [(S[s, x], -size[x]) for x in kept_before[s]]
        for p, (k, runs) in enumerate(run):
            u = model.var(("U", s, k), integral=False, upper=np.inf)
            model.row([(u, 1.0), (runs, -op_size[k])] + previous, 0.0, 0.0)
            model.row([(u, 1.0), (runs, float(graph.temp_bytes[k]) / unit_bytes)],
                      -np.inf, capacity)
            previous = [(u, -1.0)]
            for x in inputs[k] + list(graph.op_outputs(k)):
                if size[x] == 0:
                    continue
                if not decision[producer[x]]:
                    if last_read[x] == k and runs == one:
                        previous.append((one, size[x]))  # a fixed tensor's last reader ran
                    continue
                later = [r for kk, r in run[p + 1:] if kk in readers[x]]
                if one in later:
                    continue  # read again by a first computation of this stage
                free = model.var(("FREE", s, x, k))
                for r in later:
                    model.row([(free, 1.0), (r, 1.0)], -np.inf, 1.0)
                if runs != one:
                    model.row([(free, 1.0), (runs, -1.0)], -np.inf, 0.0)
                if (s + 1, x) in S:
                    model.row([(free, 1.0), (S[s + 1, x], 1.0)], -np.inf, 1.0)
                previous.append((free, size[x]))
    return model, R, blocks, coarsened


def check_budget(graph: CostGraph, budget_bytes: int, outputs: Sequence[int]) -> int:
    """``remat.validate.minimum_budget_bytes`` of the graph, once checked against the budget.

    Raises:
        InfeasibleBudgetError: the budget is below it (the message names it).
    """
    minimum = minimum_budget_bytes(graph, outputs=outputs)
    if budget_bytes < minimum:
        raise InfeasibleBudgetError(
            f"a budget of {budget_bytes} bytes is below the minimum of {minimum} bytes "
            "(persistent bytes + the largest working set of one op with the tensors that cannot "
            "be recomputed)", budget_bytes, minimum)
    return minimum


def checkmate_milp(graph: CostGraph, budget_bytes: int, time_limit_s: float = 60.0,
                   mip_rel_gap: float = 1e-4,
                   candidates: np.ndarray | None = None, *,
                   outputs: Sequence[int] = (), max_stages: int | None = None) -> RematPlan:
    """The cheapest rematerialization plan within ``budget_bytes`` (Checkmate's MILP, HiGHS).

    Args:
        graph: the cost graph (a few hundred ops at most: the model has O(n²) variables).
        budget_bytes: the memory budget, persistent bytes included.
        time_limit_s: HiGHS's time limit; when it runs out the best schedule found is used.
        mip_rel_gap: relative gap between incumbent and bound at which HiGHS stops.
        candidates: boolean mask of the ops that may be recomputed (default: every
            recomputable op). Restricting it, e.g. to the forward pass
            (``remat.baselines.forward_ops``), shrinks the model; the result is then optimal
            under that restriction only.
        outputs: tensor ids kept resident until the step ends (fetches).
        max_stages: ``None`` for Checkmate's model (a stage per decision op). Otherwise the
            frontier advances ⌈stage ends / max_stages⌉ decision ops per stage, so
            recomputations happen only at stage starts: a model that many times smaller,
            optimal under that restriction (``stats["num_stages"]`` says how many).

    Returns:
        The plan, replayed by ``remat.validate`` (``peak_bytes`` <= ``budget_bytes``). Its
        ``stats`` hold ``status`` ("optimal" or "time_limit"), ``objective_overhead`` (the
        model's compute / baseline), ``bound_overhead`` (HiGHS's best lower bound, same
        units), ``mip_gap``, ``solve_s``, ``build_s``, ``num_variables``, ``num_constraints``,
        ``num_binaries``, ``nodes``, ``num_stages``, ``coarsened`` (``max_stages`` applied:
        "optimal" then means optimal for the coarsened model).

    Raises:
        InfeasibleBudgetError: the budget is below ``remat.validate.minimum_budget_bytes``
            (named in the message), or HiGHS proved that no schedule fits.
        NoScheduleFoundError: no schedule was found within ``time_limit_s``, or a restricted
            model (``max_stages``, ``candidates``) is infeasible.
    """
    minimum = check_budget(graph, budget_bytes, outputs)
    start = time.perf_counter()
    model, R, blocks, coarsened = _build(graph, budget_bytes, candidates, outputs, max_stages)
    matrix = scipy.sparse.csr_array(
        (model.vals, (model.rows, model.cols)), shape=(len(model.row_lower), len(model.cost)))
    build_s = time.perf_counter() - start
    result = milp(np.array(model.cost), integrality=np.array(model.integral),
                  bounds=Bounds(np.array(model.lower), np.array(model.upper)),
                  constraints=LinearConstraint(matrix, np.array(model.row_lower),
                                               np.array(model.row_upper)),
                  options={"time_limit": float(time_limit_s), "mip_rel_gap": mip_rel_gap})
    solve_s = time.perf_counter() - start - build_s
    restricted = candidates is not None or coarsened
    if result.status == 2 and restricted:
        raise NoScheduleFoundError(
            f"no schedule of the restricted model ({len(blocks)} stages, "
            f"{'all' if candidates is None else int(np.sum(candidates))} candidate ops) fits "
            f"a budget of {budget_bytes} bytes; the full model may have one")
    if result.status == 2:
        raise InfeasibleBudgetError(
            f"no schedule fits a budget of {budget_bytes} bytes (HiGHS proved the MILP "
            f"infeasible); the op-level lower bound is {minimum} bytes: raise the budget",
            budget_bytes, minimum)
    bound = None if result.mip_dual_bound is None else 1.0 + float(result.mip_dual_bound)
    if result.x is None:
        raise NoScheduleFoundError(
            f"HiGHS found no schedule within {budget_bytes} bytes in {time_limit_s:g} s "
            f"({result.message}); raise time_limit_s or the budget, or shrink the model "
            "(max_stages, candidates)")
    x = result.x
    recomputed: dict[int, list[int]] = {}
    for (s, j), v in sorted(R.items()):
        if x[v] > 0.5:
            recomputed.setdefault(s, []).append(j)
    schedule = [k for s, block in enumerate(blocks) for k in recomputed.get(s, []) + list(block)]
    stats = {
        "status": "optimal" if result.status == 0 else "time_limit",
        "objective_overhead": 1.0 + float(result.fun),
        "bound_overhead": bound,
        "mip_gap": float(result.mip_gap) if result.mip_gap is not None else None,
        "build_s": build_s, "solve_s": solve_s, "nodes": result.mip_node_count,
        "num_variables": len(model.cost), "num_constraints": len(model.row_lower),
        "num_binaries": int(sum(model.integral)), "minimum_bytes": minimum,
        "num_stages": len(blocks), "coarsened": coarsened,
    }
    plan = plan_from_schedule(graph, schedule, budget_bytes, "checkmate_milp", stats, outputs)
    if plan.peak_bytes > budget_bytes:
        raise RuntimeError(
            f"internal error: the MILP's schedule replays at {plan.peak_bytes} bytes, above the "
            f"budget of {budget_bytes}: the model and remat.validate disagree")
    return plan
