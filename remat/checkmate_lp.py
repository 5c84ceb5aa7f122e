"""Near-optimal rematerialization at full size: Checkmate's LP relaxation with two-phase
rounding, on HiGHS.

Checkmate (Jain et al., MLSys 2020, §5) relaxes its MILP (``remat.checkmate``) to a linear
program and turns the fractional solution into a schedule in two phases: round the checkpoint
variables ``S`` (here a sweep of thresholds, ``S >= threshold``, and a few randomized roundings,
``S`` with probability its LP value), then recompute exactly what that choice forces. The
MILP's LP relaxation has O(n²) ``R``/``S`` variables and O(n²) memory variables and O(n³)
``FREE`` variables; at 195 ops HiGHS did not solve it in 60 s. This module solves a smaller
relaxation of the same model:

- **Sparse variables.** ``S[s, x]`` exists only while some reader of ``x`` may still run
  (``remat.checkmate.Stages.needed_until``: a first computation, or a recomputation whose own
  outputs are still needed), ``R[s, j]`` only while ``j``'s outputs are needed and its fixed
  inputs are alive; both only after ``j``'s own stage.
- **Memory rows at the stage's own ops only.** Recomputations run before a stage's first
  computations, so at each of those ops ``k`` these are resident in any MILP schedule: the
  fixed tensors alive, ``k``'s outputs and temporary bytes, the decision tensors made before
  ``k`` that ``k`` or a later op of the stage reads, and every checkpoint kept into the next
  stage made before ``k`` (a checkpoint kept into the next stage cannot have been freed). Each
  row is implied by the MILP's ``U`` rows, so ``FREE`` and ``U`` can go: a relaxation. A row is
  kept only where it is not implied by a later op's row of the same stage. It ignores the
  memory of the recomputations themselves; the replay measures that, and the LP is re-solved
  at a lower budget when no rounding fits (Checkmate does the same). Rows for each
  recomputation (its outputs, inputs and temporary bytes over the checkpoints of the stage,
  with a running sum) were tried: at the 4 feasible points of 4 synthetic graphs x 3 budgets
  and on mlp/activations at 0.7 and 0.5 the LP's value did not change (its fractional
  checkpoints, not recomputation memory, are what makes it loose), while the LP grew 40% and
  solved 3-20x slower.
- **Groups, only when the LP would have more than ``MAX_NONZEROS`` nonzeros** (or more than
  ``max_groups`` decision ops, if given). Consecutive decision ops (in topological order)
  form one group: one stage, one ``R`` per (stage, group) and one checkpoint unit for all the
  tensors the group's ops pass to later stages (an ``R`` costs the whole group's compute).
  This coarsens the *nodes* the LP decides on, not only the stages; the number of groups is
  the square root of the excess smaller than the number of decision ops. The rounding still
  works op by op (phase 2 recomputes only the ops of a group whose outputs are needed).

**Solver.** HiGHS's dual simplex (``highspy``: one model, re-solved from its last basis when
only the memory rows' bounds change, as at each lower budget) without presolve. Measured on 2
shared cores (load 4.5-9): resnet/activations' full LP (643k nonzeros) took 70 s with presolve
and 12 s without, same optimum; a warm re-solve at 0.95 of the budget 1.1 s instead of 12.
HiGHS's interior point (with or without crossover) did not finish in 120 s and its PDLP took
87 s on mlp/activations (dual simplex: 0.9 s); Devex pricing instead of steepest edge took 20 s
and 15 s (re-solve) on resnet/activations and over 3 min on transformer/activations (21 s).

Without groups the LP is a relaxation of the MILP on the same stages, so its objective is a
lower bound on the MILP's optimum (``stats["lp_is_bound"]``). With groups it is the relaxation
of a restricted (coarsened) model and bounds nothing: it is reported, but not as a bound.

Phase 2 is per stage: a first computation of the stage reads a decision tensor of an earlier
stage that is not rounded into a checkpoint, so its producer is recomputed before the stage's
ops, after whatever that recomputation reads and is not checkpointed either (recursively). A
producer whose fixed inputs have died cannot be recomputed and keeps its output. Each schedule
is costed by ``remat.schedule.schedule_cost`` (each tensor freed after its last read: the
peak and compute ``remat.validate`` would replay, with array operations); only schedules that
fit the budget are kept. The best rounding is then filled greedily (``_fill``): the
checkpoints whose absence made it recompute are added back, highest LP value (or, second try,
compute saved per byte) first, while the schedule still fits. Phase 1 alone leaves slack
wherever the LP's fractions put it; the fill spends the slack the costing shows (on
mlp/activations at 0.5 it took the plan from 1.196 to 1.067, LP 1.065). When no rounding fits
at any LP budget, the fill starts from no checkpoint at all (every read of an earlier stage
recomputed), if that fits. The chosen schedule becomes a plan through
``remat.schedule.plan_from_schedule`` and is replayed by ``remat.validate``.

References:
    Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica, Gonzalez, "Checkmate: Breaking the
    Memory Wall with Optimal Tensor Rematerialization", MLSys 2020, Section 5 (LP relaxation,
    deterministic and randomized rounding of the checkpoints, then the recomputations they
    need; solving at a reduced budget so that the rounded schedule fits).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import highspy
import scipy.sparse

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.checkmate import (NoScheduleFoundError, Stages, check_budget, fixed_alive,
                                      stages)
from graphfit.remat.plan import RematPlan
from graphfit.remat.schedule import plan_from_schedule, schedule_cost
from graphfit.remat.validate import InfeasibleBudgetError

__all__ = ["MAX_NONZEROS", "checkmate_lp"]

# Phase-1 thresholds tried on each LP solution (a higher one checkpoints less: more
# recomputation, less memory), and randomized roundings per solution.
THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
RANDOM_ROUNDINGS = 2
# The LP is solved at the budget, then, while no rounding fits, at a budget scaled by
# budget / the lowest replayed peak of the roundings (at least SCALE_STEP lower, at most
# MIN_SCALE of the budget).
SCALE_STEP = 0.97
MIN_SCALE = 0.5
# Nonzeros of the LP's matrix (estimated before its rows are built) above which consecutive
# decision ops are grouped (module docstring; the square root of the excess fewer stages).
# Dual simplex without presolve on 2 shared cores (load 3-9): the first solve took 4-8 s at
# 263k nonzeros (resnet/default), 12-20 s at 643k (resnet/activations, but over 59 s at 0.5 of
# the peak, and at 0.9 and 0.7 no rounding fit within 60 s), 19-21 s at 1.15M
# (transformer/activations), 59 s at 2.03M (transformer/default).
MAX_NONZEROS = 600_000
# Seconds per schedule position reserved for turning the chosen schedule into a plan
# (plan_from_schedule replays it): twice the 30 us measured on gnmt_v2 (321k positions, 9.8 s,
# load 5).
REPLAY_S_PER_POSITION = 60e-6
# Memory rows count in units of budget / 1024 bytes (as in remat.checkmate).
_UNITS_PER_BUDGET = 1024.0


@dataclasses.dataclass
class _Relaxation:
    """The LP (``A x <= b``, ``b = capacity(budget) - const``) and how to read its solution."""

    layout: Stages
    stage_of: np.ndarray          # per op: the stage that computes it first
    unit_of: np.ndarray           # per tensor: its checkpoint unit, -1 if none
    S: dict                       # (stage, unit) -> column
    R: dict                       # (stage, group) -> column
    cost: np.ndarray
    matrix: scipy.sparse.csr_array
    b_fixed: np.ndarray           # rows' bounds that do not depend on the budget
    memory_rows: np.ndarray       # row ids of the memory rows
    memory_const: np.ndarray      # their constant bytes (in units)
    unit_bytes: float
    grouped: bool
    first_estimate: int           # estimated nonzeros of the model asked for (before grouping)


def _relaxation(graph: CostGraph, budget_bytes: int, outputs: Sequence[int],
                max_groups: int | None, max_nonzeros: float = math.inf,
                first_estimate: int | None = None, ungrouped: Stages | None = None
                ) -> _Relaxation:
    """Build the sparse relaxation of Checkmate's model (module docstring); with fewer groups
    when its matrix would have more than about ``max_nonzeros`` nonzeros (``first_estimate``:
    the estimated nonzeros of the model asked for, and ``ungrouped`` its stages, when this is
    a regrouping)."""
    producer = graph.tensor_producer
    ungrouped = stages(graph, None, outputs, None) if ungrouped is None else ungrouped
    layout = ungrouped.grouped(max_groups)
    inputs, decision, blocks = layout.inputs, layout.decision, layout.blocks
    num_stages = len(blocks)
    stage_of = np.repeat(np.arange(num_stages), [len(b) for b in blocks])
    starts = np.array([b.start for b in blocks])
    need_stage = stage_of[np.maximum(layout.needed_until, 0)]
    grouped = layout.coarsened

    # Checkpoint units: the tensors a group passes to later stages (one unit per tensor for a
    # group of one op, as in the MILP; one for all of them otherwise).
    unit_of = np.full(graph.num_tensors, -1, dtype=np.int64)
    unit_group, unit_need, unit_tensors = [], [], []
    members = [[j for j in block if decision[j]] for block in blocks]
    for g, ops in enumerate(members):
        crossing = [x for j in ops for x in graph.op_outputs(j) if need_stage[x] > g]
        for part in ([[x] for x in crossing] if len(ops) == 1 else [crossing] if crossing else []):
            for x in part:
                unit_of[x] = len(unit_group)
            unit_group.append(g)
            unit_need.append(max(int(need_stage[x]) for x in part))
            unit_tensors.append(part)
    group_until = [min((int(layout.recompute_until[j]) for j in ops), default=-1)
                   for ops in members]
    units_of_group: list[list[int]] = [[] for _ in blocks]
    for u, g in enumerate(unit_group):
        units_of_group[g].append(u)

    def units_read(ops) -> list[int]:
        return list(dict.fromkeys(int(unit_of[x]) for k in ops for x in inputs[k]
                                  if decision[producer[x]] and stage_of[producer[x]] != stage_of[k]
                                  and unit_of[x] >= 0))

    reads_group = [units_read(ops) for ops in members]
    reads_block = [set(units_read(block)) for block in blocks]
    readers_of_unit: list[list[int]] = [[] for _ in unit_group]
    for g, units in enumerate(reads_group):
        for u in units:
            readers_of_unit[u].append(g)

    # The stages in which each group may be recomputed: after its own, while its outputs are
    # needed and its fixed inputs alive (starts are increasing).
    recompute_last = [min(max((unit_need[u] for u in units_of_group[g]), default=-1),
                          int(np.searchsorted(starts, group_until[g], side="right")) - 1)
                      for g in range(num_stages)]
    # Nonzeros, about (within 10% on mlp, resnet, transformer): the rows a recomputation reads
    # through, and ~7 per checkpoint. Counted before any column exists: the full model of a
    # large graph has tens of millions.
    estimate = sum(max(0, last - g) * (6 + 3 * len(reads_group[g]))
                   for g, last in enumerate(recompute_last))
    estimate += 7 * sum(need - g for g, need in zip(unit_group, unit_need))
    first_estimate = estimate if first_estimate is None else first_estimate
    # Decision ops per group now, and groups: a regrouping has strictly fewer, so it ends.
    step = math.ceil(len(ungrouped.stage_ends) / max_groups) if layout.coarsened else 1
    groups = len(ungrouped.stage_ends) // step
    if estimate > max_nonzeros and groups > 1:
        fewer = min(groups - 1, max(1, int(groups * math.sqrt(max_nonzeros / estimate))))
        return _relaxation(graph, budget_bytes, outputs, fewer, max_nonzeros, first_estimate,
                           ungrouped)

    baseline_us = float(graph.compute_us.sum()) or 1.0
    cost: list[float] = []
    S, R = {}, {}
    for u, g in enumerate(unit_group):
        for s in range(g + 1, unit_need[u] + 1):
            S[s, u] = len(cost)
            cost.append(0.0)
    for g, ops in enumerate(members):
        group_cost = float(graph.compute_us[ops].sum()) / baseline_us
        for s in range(g + 1, recompute_last[g] + 1):
            R[s, g] = len(cost)
            cost.append(group_cost)

    rows, cols, vals, bound = [], [], [], []

    def row(terms, upper: float) -> None:
        for col, val in terms:
            rows.append(len(bound))
            cols.append(col)
            vals.append(val)
        bound.append(upper)

    def available(s: int, u: int) -> list[tuple[int, float]]:
        """-(R + S): the unit is recomputed in stage s or checkpointed into it."""
        return [(v, -1.0) for v in (R.get((s, unit_group[u])), S.get((s, u))) if v is not None]

    def readers_in(s: int, u: int) -> list[tuple[int, float]]:
        return [(R[s, h], -1.0) for h in readers_of_unit[u] if (s, h) in R]

    for s in range(num_stages):
        for u in reads_block[s]:   # first computations read it
            row(available(s, u), -1.0)
    for (s, g), v in R.items():
        for u in reads_group[g]:   # a recomputation reads it
            row([(v, 1.0)] + available(s, u), 0.0)
        # Valid inequalities (as in the MILP): a recomputation is read in its stage or kept.
        if not any(u in reads_block[s] for u in units_of_group[g]):
            uses = [t for u in units_of_group[g] for t in readers_in(s, u)
                    + ([(S[s + 1, u], -1.0)] if (s + 1, u) in S else [])]
            row([(v, 1.0)] + uses, 0.0)
        ops = members[g]
        if len(ops) == 1 and len(graph.op_outputs(ops[0])) == 1 and (s, unit_of[
                graph.output_offset[ops[0]]]) in S:  # not recomputed while resident
            row([(v, 1.0), (S[s, int(unit_of[graph.output_offset[ops[0]]])], 1.0)], 1.0)
    for (s, u), v in S.items():
        g = unit_group[u]
        if s > g + 1:               # checkpoints persist only if resident or recomputed
            row([(v, 1.0), (S[s - 1, u], -1.0)]
                + ([(R[s - 1, g], -1.0)] if (s - 1, g) in R else []), 0.0)
        if u not in reads_block[s]:  # a checkpoint is read in its stage or kept
            row([(v, 1.0)] + readers_in(s, u)
                + ([(S[s + 1, u], -1.0)] if (s + 1, u) in S else []), 0.0)

    unit_bytes = budget_bytes / _UNITS_PER_BUDGET
    size = graph.tensor_bytes / unit_bytes
    alive = fixed_alive(graph, layout, size)
    kept_into: list[list[int]] = [[] for _ in range(num_stages + 1)]
    for s, u in S:
        kept_into[s].append(u)
    memory_rows, memory_const = [], []
    for s, block in enumerate(blocks):
        # Recomputations run before the stage's first computations, so at each of those, k:
        # the fixed tensors alive, k's outputs and temporary bytes, the decision tensors made
        # before k that k or a later op of the stage reads, and the checkpoints kept into the
        # next stage made before k are all resident.
        last_reader: dict[int, int] = {}
        for k in block:
            for x in inputs[k]:
                if decision[producer[x]]:
                    last_reader[x] = k
        read = np.zeros(len(block) + 1)
        for x, last in last_reader.items():
            read[max(int(producer[x]) + 1, block.start) - block.start] += size[x]
            read[last - block.start + 1] -= size[x]
        const = np.cumsum(read)[:-1] + np.array(
            [alive[k] + size[list(graph.op_outputs(k))].sum() + graph.temp_bytes[k] / unit_bytes
             for k in block])
        kept = kept_into[s + 1]   # checkpoints into the next stage, tensor by tensor:
        tensors = np.array([x for u in kept for x in unit_tensors[u]], dtype=np.int64)
        owner = np.repeat(np.arange(len(kept)), [len(unit_tensors[u]) for u in kept])
        kept_size = np.where(need_stage[tensors] >= s + 1, size[tensors], 0.0)
        read_until = np.array([last_reader.get(int(x), -1) for x in tensors], dtype=np.int64)
        # The row of op k implies those of earlier ops of the stage with no larger constant
        # (their checkpoint terms are k's or fewer): keep the ops whose constant is above
        # every later op's.
        highest = -np.inf
        for p in range(len(block) - 1, -1, -1):
            if const[p] <= highest:
                continue
            highest, k = const[p], block.start + p
            counted = (producer[tensors] < k) & (read_until < k)
            coefficients = np.bincount(owner, weights=np.where(counted, kept_size, 0.0),
                                       minlength=len(kept))
            terms = [(S[s + 1, u], float(c)) for u, c in zip(kept, coefficients) if c > 0]
            memory_rows.append(len(bound))
            memory_const.append(highest)
            row(terms, 0.0)
    matrix = scipy.sparse.csr_array((vals, (rows, cols)), shape=(len(bound), len(cost)))
    if matrix.nnz > 1.1 * max_nonzeros and groups > 1:  # the estimate was low (gnmt_v2)
        fewer = min(groups - 1, max(1, int(groups * math.sqrt(max_nonzeros / matrix.nnz))))
        return _relaxation(graph, budget_bytes, outputs, fewer, max_nonzeros, first_estimate,
                           ungrouped)
    return _Relaxation(layout, stage_of, unit_of, S, R, np.array(cost), matrix,
                       np.array(bound, dtype=float), np.array(memory_rows),
                       np.array(memory_const), unit_bytes, grouped, first_estimate)


class _Solver:
    """HiGHS's dual simplex holding the relaxation, re-solved at lower capacities from its last
    basis (only the memory rows' bounds change between solves; module docstring, "Solver")."""

    def __init__(self, relax: _Relaxation):
        self.relax = relax
        matrix = scipy.sparse.csc_array(relax.matrix)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = matrix.shape[1], matrix.shape[0]
        lp.col_cost_ = relax.cost
        lp.col_lower_, lp.col_upper_ = np.zeros(len(relax.cost)), np.ones(len(relax.cost))
        lp.row_lower_ = np.full(matrix.shape[0], -highspy.kHighsInf)
        lp.row_upper_ = relax.b_fixed
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_ = matrix.indptr, matrix.indices
        lp.a_matrix_.value_ = matrix.data
        self.highs = highspy.Highs()
        self.highs.silent()
        for option, value in (("solver", "simplex"), ("simplex_strategy", 1),
                              ("presolve", "off")):
            self.highs.setOptionValue(option, value)
        self.highs.passModel(lp)
        self.rows = relax.memory_rows.astype(np.int32)

    def solve(self, capacity_bytes: float, time_limit_s: float):
        """The LP at ``capacity_bytes`` of non-persistent memory: (solution, objective), or
        (None, None) when infeasible.

        Raises:
            NoScheduleFoundError: HiGHS stopped before solving it (time limit)."""
        relax = self.relax
        upper = capacity_bytes / relax.unit_bytes - relax.memory_const
        if (upper < -1e-9).any():
            return None, None   # some stage's own working set does not fit
        self.highs.changeRowsBounds(len(self.rows), self.rows,
                                    np.full(len(self.rows), -highspy.kHighsInf), upper)
        # HiGHS's time limit counts every run of this object.
        self.highs.setOptionValue("time_limit",
                                  self.highs.getRunTime() + max(float(time_limit_s), 1.0))
        self.highs.run()
        status = self.highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None, None
        if status != highspy.HighsModelStatus.kOptimal:
            raise NoScheduleFoundError(
                f"HiGHS did not solve Checkmate's LP relaxation ({len(relax.cost)} columns, "
                f"{relax.matrix.nnz} nonzeros, {len(relax.layout.blocks)} stages) in the "
                f"{time_limit_s:.0f} s left of the time limit "
                f"({self.highs.modelStatusToString(status)}); raise the time limit, or lower "
                "max_nonzeros to group more")
        x = np.clip(np.asarray(self.highs.getSolution().col_value), 0.0, 1.0)
        return x, float(relax.cost @ x)


def _round(graph: CostGraph, relax: _Relaxation, kept: np.ndarray) -> tuple[list[int], set[int]]:
    """Phase 2 (module docstring): the schedule with checkpoint columns ``kept`` (a boolean
    per LP column) and the recomputations each stage then needs.

    Returns:
        The schedule, and the checkpoint columns not kept that made it recompute (keeping one
        of those would save a recomputation; keeping any other changes nothing)."""
    layout, producer = relax.layout, graph.tensor_producer
    schedule: list[int] = []
    missed: set[int] = set()
    for s, block in enumerate(layout.blocks):
        redo: set[int] = set()
        stack = [x for k in block for x in layout.inputs[k]]
        while stack:
            x = stack.pop()
            j = int(producer[x])
            if (not layout.decision[j] or relax.stage_of[j] == s or j in redo
                    or layout.recompute_until[j] < block.start):
                continue  # fixed, made in this stage, already recomputed, or cannot be
            column = relax.S.get((s, int(relax.unit_of[x])))
            if column is not None:
                if kept[column]:
                    continue
                missed.add(column)
            redo.add(j)
            stack.extend(layout.inputs[j])
        schedule += sorted(redo) + list(block)
    return schedule, missed


def _saved_per_byte(graph: CostGraph, relax: _Relaxation) -> np.ndarray:
    """Per LP column: for a checkpoint, the compute of its unit's producers per byte it holds
    (what keeping it saves, per byte of memory it costs); 0 for the others."""
    tensors = np.flatnonzero(relax.unit_of >= 0)
    units = relax.unit_of[tensors]
    num_units = int(units.max(initial=-1)) + 1
    held = np.bincount(units, weights=graph.tensor_bytes[tensors], minlength=num_units)
    pairs = np.unique(np.stack([units, graph.tensor_producer[tensors]]), axis=1)
    saved = np.bincount(pairs[0], weights=graph.compute_us[pairs[1]], minlength=num_units)
    value = np.zeros(len(relax.cost))
    for (_, u), column in relax.S.items():
        value[column] = saved[u] / max(held[u], 1.0)
    return value


@dataclasses.dataclass
class _Rounded:
    """A rounding: its checkpoint columns, schedule and ``schedule_cost``."""

    kept: np.ndarray
    schedule: list[int]
    peak_bytes: int
    compute_us: float


def _rounded(graph: CostGraph, relax: _Relaxation, kept: np.ndarray,
             outputs: Sequence[int]) -> tuple[_Rounded, set[int]]:
    """Phase 2 for checkpoint columns ``kept``, costed; and the columns ``_round`` missed."""
    schedule, missed = _round(graph, relax, kept)
    return _Rounded(kept, schedule, *schedule_cost(graph, schedule, outputs)), missed


def _fill(graph: CostGraph, relax: _Relaxation, rounded: _Rounded, priority: np.ndarray,
          budget_bytes: int, outputs: Sequence[int], deadline: float, trial_s: float) -> _Rounded:
    """Greedy checkpoint filling after phase 2: keep the checkpoints whose absence makes the
    rounded schedule recompute, highest ``priority`` (per LP column) first, while the schedule
    still fits the budget.

    More checkpoints never mean more recomputation (phase 2 recomputes a subset), so a
    schedule that fits is kept. Runs of candidates are tried at once, doubled on success and
    halved on failure: about (rejected candidates) x log(candidates) trials. Stops before
    ``deadline`` (``time.perf_counter``): no trial starts that would end after it if it took
    1.5 times the last one (``trial_s``, the time of one before the first).
    """
    missed = _round(graph, relax, rounded.kept)[1]
    rejected: set[int] = set()
    run = len(missed)
    while time.perf_counter() + 1.5 * trial_s < deadline:
        candidates = sorted(missed - rejected, key=lambda c: (-priority[c], c))
        if not candidates:
            break
        begin = time.perf_counter()
        trial = rounded.kept.copy()
        trial[candidates[:run]] = True
        candidate, trial_missed = _rounded(graph, relax, trial, outputs)
        trial_s = time.perf_counter() - begin
        if candidate.peak_bytes <= budget_bytes:
            rounded, missed, run = candidate, trial_missed, 2 * run
        elif run > 1:
            run //= 2
        else:
            rejected.add(candidates[0])
    return rounded


def checkmate_lp(graph: CostGraph, budget_bytes: int, *, outputs: Sequence[int] = (),
                 time_limit_s: float = 60.0, max_groups: int | None = None,
                 max_nonzeros: float = MAX_NONZEROS,
                 seed: int = 0) -> RematPlan:
    """A plan within ``budget_bytes`` from Checkmate's LP relaxation and two-phase rounding.

    Args:
        graph: the cost graph (the whole of it).
        budget_bytes: the memory budget, persistent bytes included.
        outputs: tensor ids kept resident until the step ends (fetches).
        time_limit_s: for all LP solves and the greedy fill together; when it runs out, the
            best plan so far.
        max_groups: at most this many stages (and checkpoint units); more decision ops are
            grouped (module docstring). ``None``: one stage per decision op unless the LP
            would have more than ``max_nonzeros`` nonzeros.
        max_nonzeros: the LP size (nonzeros, estimated) above which decision ops are grouped
            into fewer stages (module docstring).
        seed: of the randomized roundings.

    Returns:
        The cheapest rounded plan whose replayed peak fits the budget. ``stats``:
        ``lp_overhead`` (1 + the LP's objective at the full budget), ``lp_is_bound`` (the LP
        relaxes the MILP on the same stages, so ``lp_overhead`` is a lower bound on its
        optimum; False when grouped), ``rounded_overhead`` (the best rounding's, before
        ``_fill``), ``fill_order`` (the greedy order of the better fill), ``rounding``
        ("threshold", "random", or "none": no checkpoint, the fallback), ``threshold``,
        ``budget_scale`` of the chosen rounding, ``lp_solves``, ``lp_s`` (HiGHS time),
        ``build_s``, ``solve_s`` (all of it), ``num_decision_ops``, ``num_stages`` (one per
        decision op unless grouped), ``num_units``, ``num_variables``, ``num_constraints``,
        ``num_nonzeros``, ``requested_nonzeros_estimate`` (of the model asked for, before
        grouping: the full one by default), ``grouped``, ``minimum_bytes``.

    Raises:
        InfeasibleBudgetError: below ``remat.validate.minimum_budget_bytes``, or the ungrouped
            LP at the full budget is infeasible (then so is the MILP on these stages).
        NoScheduleFoundError: no rounding fits the budget (within the time limit), or the
            grouped LP is infeasible (a restricted model: that proves nothing).
    """
    start = time.perf_counter()
    minimum = check_budget(graph, budget_bytes, outputs)
    relax = _relaxation(graph, budget_bytes, outputs, max_groups, max_nonzeros)
    solver = _Solver(relax)
    build_s = time.perf_counter() - start
    persistent = float(graph.persistent_bytes.sum())
    rng = np.random.default_rng(seed)
    s_columns = np.array(sorted(relax.S.values()), dtype=np.int64)
    best, lp_overhead, solves, lp_s, tried, scale = None, None, 0, 0.0, {}, 1.0
    feasible = tried_scale = 1.0  # the lowest scale whose LP is feasible, the last tried
    last_x = None                 # the LP's solution there
    trial_s = 0.0                 # the time of the last rounding's phase 2 and costing
    while best is None and scale >= MIN_SCALE:
        left = time_limit_s - (time.perf_counter() - start)
        if left <= 0:
            break
        begin, tried_scale = time.perf_counter(), scale
        try:
            # A re-solve leaves half of the time for the fallback and the fill.
            x, objective = solver.solve(scale * budget_bytes - persistent,
                                        left if last_x is None else left / 2)
        except NoScheduleFoundError:
            if last_x is None:
                raise
            break   # out of time for a re-solve: fill from the last solution's fallback
        finally:
            lp_s += time.perf_counter() - begin
            solves += 1
        if x is None:
            if scale == 1.0 and relax.grouped:
                raise NoScheduleFoundError(
                    f"the grouped LP ({len(relax.layout.blocks)} stages for "
                    f"{int(relax.layout.decision.sum())} decision ops) has no solution within "
                    f"{budget_bytes} bytes; the full model may have one: raise max_nonzeros "
                    "or use the DTR simulator")
            if scale == 1.0:
                raise InfeasibleBudgetError(
                    f"Checkmate's LP relaxation has no solution within {budget_bytes} bytes, so "
                    "no schedule of its stages fits; raise the budget", budget_bytes, minimum)
            if feasible - scale < 0.02:
                break
            scale = (feasible + scale) / 2  # overshot: halfway back
            continue
        feasible, last_x = scale, x
        if scale == 1.0:
            lp_overhead = 1.0 + objective
        roundings = [("threshold", t, x >= t) for t in THRESHOLDS]
        roundings += [("random", None, rng.random(len(x)) < x) for _ in range(RANDOM_ROUNDINGS)]
        lowest = np.inf
        for kind, threshold, kept in roundings:
            if time.perf_counter() > start + time_limit_s:
                break   # out of time
            key = kept[s_columns].tobytes()
            if key in tried:   # the same checkpoints as an earlier rounding
                lowest = min(lowest, tried[key])
                continue
            begin = time.perf_counter()
            rounded = _rounded(graph, relax, kept, outputs)[0]
            trial_s = time.perf_counter() - begin
            tried[key] = rounded.peak_bytes
            lowest = min(lowest, rounded.peak_bytes)
            if rounded.peak_bytes <= budget_bytes and (best is None
                                                       or rounded.compute_us < best.compute_us):
                best, best_x = rounded, x
                chosen = dict(rounding=kind, threshold=threshold, budget_scale=scale)
        # Persistent bytes are no rounding's to save: scale what the LP decides on.
        scale = min(scale * SCALE_STEP, scale * (budget_bytes - persistent)
                    / max(lowest - persistent, 1.0))
    if (best is None and last_x is not None
            and time.perf_counter() + trial_s < start + time_limit_s):
        # Last resort, a start for the fill: no checkpoint kept, every read of an earlier
        # stage recomputed (less memory than any rounding on mlp/default at 0.9, 7.4x compute).
        rounded = _rounded(graph, relax, np.zeros(len(relax.cost), dtype=bool), outputs)[0]
        if rounded.peak_bytes <= budget_bytes:
            best, best_x = rounded, last_x
            chosen = dict(rounding="none", threshold=None, budget_scale=feasible)
    if best is None:
        raise NoScheduleFoundError(
            f"no rounding of Checkmate's LP fits {budget_bytes} bytes ({solves} LP solves, "
            f"down to {tried_scale:.2f} of the budget, in "
            f"{time.perf_counter() - start:.1f} s); raise the budget or use the DTR simulator")
    # Two greedy orders, the cheaper schedule wins: the LP's values (what the relaxation would
    # keep), and compute saved per byte held (on resnet/default at 0.7 it found 1.085 where
    # the LP's order stopped at 1.098; elsewhere they tie).
    rounded = best
    # The fill leaves time for one plan_from_schedule of its start, the longest schedule.
    deadline = start + time_limit_s - REPLAY_S_PER_POSITION * len(rounded.schedule)
    for order, priority in (("lp", best_x), ("saved_per_byte", _saved_per_byte(graph, relax))):
        filled = _fill(graph, relax, rounded, priority, budget_bytes, outputs, deadline,
                       trial_s)
        if filled.compute_us < best.compute_us or best is rounded:
            best, chosen["fill_order"] = filled, order
    plan = plan_from_schedule(graph, best.schedule, budget_bytes, "checkmate_lp", chosen,
                              outputs)
    if plan.peak_bytes != best.peak_bytes:
        raise RuntimeError(
            f"internal error: remat.schedule.schedule_cost put the schedule's peak at "
            f"{best.peak_bytes} bytes, its replay at {plan.peak_bytes}")
    plan.stats.update(
        lp_overhead=lp_overhead, rounded_overhead=(rounded.compute_us / plan.baseline_compute_us
                                                   if plan.baseline_compute_us else 1.0),
        lp_is_bound=not relax.grouped, grouped=relax.grouped,
        lp_solves=solves, lp_s=lp_s, build_s=build_s, solve_s=time.perf_counter() - start,
        num_stages=len(relax.layout.blocks), num_units=int(relax.unit_of.max(initial=-1)) + 1,
        num_variables=len(relax.cost), num_constraints=relax.matrix.shape[0],
        num_nonzeros=relax.matrix.nnz, num_decision_ops=int(relax.layout.decision.sum()),
        requested_nonzeros_estimate=relax.first_estimate,
        minimum_bytes=minimum)
    return plan
