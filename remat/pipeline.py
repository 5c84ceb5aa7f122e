"""The rematerialization pass as one call: cost graph -> plan under a budget -> rewritten step.

``rematerialize`` chains the pieces of ``remat``: a cost graph calibrated to what TF's executor
allocates, with forwarding chains as planning nodes (``remat.tf_memory``), a planner (a DTR heuristic of ``remat.simulator``, or a
baseline: ``checkpoint_all``, ``chen_sqrt_n``, ``chen_greedy``, ``checkmate``), and the graph
rewrite (``remat.rewrite``). ``plan_for_budget`` is the planning step alone, for sweeps. The
graph passes that free memory before profiling are listed in ``pipeline.passes``;
``remat.closed_loop`` holds a plan to the measured peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from graphfit.errors import ArgumentError, GraphfitError, check_number
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.cost_graph import CostGraph
from graphfit.profiler.profile import Profile
from graphfit.remat.plan import RematPlan

if TYPE_CHECKING:   # annotations only (the first two import TF)
    from graphfit.remat.step_time import StepTraces
    from graphfit.remat.tf_memory import MemoryModel
    from graphfit.remat.validate import InfeasibleBudgetError

__all__ = ["PLANNERS", "BASELINE_PLANNERS", "BudgetError", "CAUSES", "HINT_ROOM",
           "ORDER_SEARCH_SLACK", "FIRST_MODEL_SLACK", "cheapest_plan", "plan_for_budget",
           "planning_orders",
           "rematerialize", "lower_plan", "resident_outputs", "with_smallest_budget"]

BASELINE_PLANNERS = ("checkpoint_all", "chen_sqrt_n", "chen_greedy", "checkmate")


def _simulated_planners() -> tuple[str, ...]:
    from graphfit.remat.simulator import PLANNERS as simulated
    return tuple(simulated)


PLANNERS = _simulated_planners() + BASELINE_PLANNERS


class BudgetError(GraphfitError, ValueError):
    """No plan fits the budget. ``minimum_bytes`` is the smallest budget the planner could
    meet (or a lower bound of it), ``budget_bytes`` the one asked for; ``cause`` says why in a
    few words (``CAUSES``). Where the remat pass searched for it (``with_smallest_budget``),
    ``smallest_bytes`` is a budget that does plan (``None``: not even the baseline peak),
    ``baseline_bytes`` the measured peak it was searched below and ``resident_bytes`` the
    step's resident bytes (``memory_ratio`` is a fraction of what the step adds above them)."""

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, cause: str = ""):
        super().__init__(message)
        self.budget_bytes, self.minimum_bytes = int(budget_bytes), int(minimum_bytes)
        self.cause = cause
        self.smallest_bytes: int | None = None
        self.baseline_bytes: int | None = None
        self.resident_bytes = 0

    def ratio_of(self, budget_bytes: int) -> float:
        """``budget_bytes`` as a ``memory_ratio``: a fraction of what the step adds above its
        resident bytes (``remat.closed_loop.ratio_budget``), where the smallest budget was
        searched (``baseline_bytes`` set)."""
        added = max(self.baseline_bytes - self.resident_bytes, 1)
        return (budget_bytes - self.resident_bytes) / added


# Why a budget has no plan, as ``BudgetError.cause`` says it.
CAUSES = {
    "floor": "the budget is below what the step holds at once whatever is recomputed (its "
             "weights, inputs and optimizer state, the tensors that cannot be recomputed, and "
             "the largest op's working set)",
    "evictable": "the planner ran out of evictable memory: everything still resident at some "
                 "op is needed there or cannot be recomputed",
    "overhead": "the plan would recompute more than the overhead limit allows",
    "solver": "the solver found no schedule within its time limit",
}


def resident_outputs(cost_graph: CostGraph, loss: str | None = None) -> list[int]:
    """Tensors the simulator must keep until the step ends: the loss, and every 0-byte output of
    an op that may not be recomputed (variable reads: aliases of the variable's buffer).

    Keeping a free alias costs nothing, while letting it die would forbid recomputing every op
    that reads it (DTR's banishing) although TF could read it again at no cost.
    """
    from graphfit.remat.simulator import recomputable_ops

    pinned = ~recomputable_ops(cost_graph)[cost_graph.tensor_producer]
    outputs = np.flatnonzero(pinned & (cost_graph.tensor_bytes == 0)).tolist()
    if loss is not None and loss.split(":")[0] in cost_graph.index:
        outputs.append(int(cost_graph.output_offset[cost_graph.index[loss.split(":")[0]]]))
    return sorted(set(outputs))


def _infeasible(error: "InfeasibleBudgetError", heuristic: str, budget_bytes: int
                ) -> BudgetError:
    """The ``BudgetError`` of a planner that found no plan (``error`` names the minimum)."""
    minimum = f"{error.minimum_bytes:,} bytes ({error.minimum_bytes / 2**20:.1f} MiB)"
    floor = budget_bytes < error.minimum_bytes
    summary = (f"the minimum is {minimum}" if floor else
               f"{heuristic} ran out of evictable memory although the lower bound is "
               f"{minimum}; raise the budget or try another heuristic")
    return BudgetError(f"{heuristic}: no plan fits a budget of {budget_bytes:,} bytes; "
                       f"{summary}. {error}", budget_bytes, error.minimum_bytes,
                       "floor" if floor else "evictable")


def _checkmate_plan(cost_graph: CostGraph, budget_bytes: int) -> RematPlan:
    """``plan_for_budget``'s Checkmate MILP. Imported only when asked for: its module imports
    ``scipy.optimize``, 0.6 s of every DTR planning call's process otherwise."""
    from graphfit.remat import checkmate
    from graphfit.remat.validate import InfeasibleBudgetError

    try:
        return checkmate.checkmate_milp(cost_graph, budget_bytes)
    except InfeasibleBudgetError as error:
        raise _infeasible(error, "checkmate", budget_bytes) from error
    except checkmate.NoScheduleFoundError as error:
        raise BudgetError(
            f"checkmate: HiGHS found no schedule for a budget of {budget_bytes:,} bytes within "
            f"its time limit (which proves nothing); try a DTR heuristic such as 'offline'. "
            f"{error}", budget_bytes, budget_bytes, "solver") from error


def plan_for_budget(cost_graph: CostGraph, budget_bytes: int | None, heuristic: str = "dtr",
                    overhead_limit: float = 2.0, loss: str | None = None) -> RematPlan:
    """A plan of ``cost_graph`` under ``budget_bytes`` by planner ``heuristic``.

    Parameters:
        cost_graph: the step (ideally ``remat.tf_memory.tf_memory_cost_graph``).
        budget_bytes: memory budget including resident bytes; ``None``: no limit.
        heuristic: a name of ``PLANNERS``.
        overhead_limit: DTR heuristics fail as thrashing beyond this compute multiple.
        loss: the loss tensor name, kept resident to the end.

    Returns:
        The plan. A DTR plan's frees are re-derived from its (re)compute order: each tensor
        version is freed right after its last reader, as TF's executor does, so ``peak_bytes``
        is what TF will show (DTR's own, lazily evicting peak is ``stats
        ["simulated_peak_bytes"]``, an upper bound).

    Raises:
        BudgetError: the budget is below what the planner can reach (names the minimum).
        ValueError: unknown planner.
    """
    from graphfit.remat import baselines, simulator, validate
    from graphfit.remat.plan import FREE
    from graphfit.remat.schedule import plan_from_schedule

    if heuristic not in PLANNERS:
        raise ValueError(f"unknown planner {heuristic!r}; valid: {', '.join(PLANNERS)}")
    if heuristic == "checkmate":
        return _checkmate_plan(cost_graph, budget_bytes)
    try:
        if heuristic == "checkpoint_all":
            return baselines.checkpoint_all(cost_graph)
        if heuristic == "chen_sqrt_n":
            return baselines.chen_sqrt_n(cost_graph, loss)
        if heuristic == "chen_greedy":
            return baselines.chen_greedy(cost_graph, budget_bytes, loss)
        simulated = simulator.simulate(cost_graph, budget_bytes, heuristic,
                                       outputs=resident_outputs(cost_graph, loss),
                                       overhead_limit=overhead_limit)
    except (simulator.OutOfMemoryError, validate.InfeasibleBudgetError) as error:
        raise _infeasible(error, heuristic, budget_bytes) from error
    except simulator.ThrashError as error:
        raise BudgetError(
            f"{heuristic}: a budget of {budget_bytes:,} bytes needs more than "
            f"{error.limit}x the step's compute (thrashing); raise the budget or "
            f"--remat_overhead_limit. {error}", budget_bytes, budget_bytes, "overhead") from error
    # DTR evicts lazily, when the budget is hit; TF frees a tensor as soon as its last reader
    # (of that version) finished. Re-deriving the frees from the simulated schedule gives the
    # peak TF will show, and re-checks the plan.
    schedule = [index for kind, index in simulated.events if kind != FREE]
    plan = plan_from_schedule(cost_graph, schedule, budget_bytes, simulated.method,
                              {**simulated.stats, "simulated_peak_bytes": simulated.peak_bytes})
    return plan


# Rounds of ``_plan_filling_budget`` after its first plan, and the room below the budget
# (a fraction of it) worth another round.
FILL_ROUNDS = 3
FILL_ROOM = 0.01


def _plan_filling_budget(model: "MemoryModel", budget_bytes: int, heuristic: str,
                         overhead_limit: float, loss: str) -> RematPlan:
    """The cheapest of the plans of ``model`` for ``budget_bytes`` and for planning budgets
    scaled, round by round, by the budget over the last plan's peak in TF's accounting
    (``remat.tf_memory.tf_peak_bytes``), among those whose peak fits ``budget_bytes``;
    returned with that peak as its ``peak_bytes`` (the replay's in
    ``stats["replay_peak_bytes"]``).

    A planner holds its own accounting to the budget: a DTR simulation frees lazily and counts
    every output as a new buffer. TF frees a tensor after its last reader and writes some
    outputs into a buffer their input frees, so the plan's peak can fall well below the budget
    (a Keras attention step with Adam at 0.5 of its peak: 0.885 of it in one bench, at 1.19x
    compute), and the room left is recomputation the plan need not pay. A planner is not
    monotone in its budget, so each plan is checked and the cheapest that fits is kept. Most
    plans reach 0.95-1.0 of the budget already (Keras attention, ResNet-, MobileNet- and
    DenseNet-style steps, 2026-12-05), where this changes nothing.
    """
    from graphfit.remat.tf_memory import tf_peak_bytes

    best = plan_for_budget(model.plan_graph, budget_bytes, heuristic, overhead_limit, loss)
    planning, peak = budget_bytes, tf_peak_bytes(model, best)
    best_peak = peak
    for _ in range(FILL_ROUNDS):
        if budget_bytes * (1 - FILL_ROOM) <= peak <= budget_bytes:
            break
        planning = int(planning * budget_bytes / peak)
        try:
            plan = plan_for_budget(model.plan_graph, planning, heuristic, overhead_limit, loss)
        except BudgetError:
            break
        peak = tf_peak_bytes(model, plan)
        if peak <= budget_bytes and plan.overhead < best.overhead:
            best, best_peak = dataclasses.replace(plan, budget_bytes=budget_bytes, stats={
                **plan.stats, "planner_budget_bytes": planning}), peak
    return dataclasses.replace(best, peak_bytes=best_peak,
                               stats={**best.stats, "replay_peak_bytes": best.peak_bytes})


# ``cheapest_plan`` stops trying orders once a plan's overhead is within this of 1.0 (no
# recomputation at all), a bound no other order can beat by more: ``keras.applications.
# ResNet50`` at 0.5 plans 1.003-1.007 on its first order, and its twelve orders took 19 s of
# the 118 s ``optimize`` spent on it (2026-12-06, idle VM).
ORDER_SEARCH_SLACK = 0.01
# ... and once the first model's two plans (as traced and reordered) are done, at a plan
# within this: further orders are traced (1.5-2 s each on keras-hub GPT-2) for at most about
# 1% less recomputation there. At 0.5 the cheapest of those two plans against the cheapest of
# six (three traced orders): zoo ``transformer/default`` 1.0348 against 1.0219, keras-hub
# GPT-2 1.0415 against 1.0317 and 1.0483 against 1.0483, zoo ``resnet/default``, the Keras
# ResNet-style and MobileNet-style steps equal (2026-12-06/07). Above it, where recomputation
# costs more, every order is still tried.
FIRST_MODEL_SLACK = 0.05


def cheapest_plan(models: "Iterable[MemoryModel]", budget_bytes: int, heuristic: str,
                  overhead_limit: float, loss: str) -> "tuple[MemoryModel, RematPlan]":
    """The model whose plan (``_plan_filling_budget``) recomputes least, and that plan;
    ``stats["orders"]`` records the overhead of each model tried (``None``: no plan). The
    search stops at a plan within ``ORDER_SEARCH_SLACK`` of no recomputation.

    Plans follow the op order of their model's planning graph: the traced step's, which TF's
    executor runs differently each time (on a Keras attention step with Adam at 0.5 of its
    peak six models of one process planned 1.208, 1.219, 1.261, 1.346 and 1.379, and one
    found no plan), or that order with the backward pass reordered
    (``remat.backward_order``). Planning takes well under a second; a model, one traced step.
    The search stops at a plan within ``ORDER_SEARCH_SLACK`` of no recomputation, or after the
    first two models (``planning_orders``: the first traced order as run and reordered) at one
    within ``FIRST_MODEL_SLACK``.

    Raises:
        BudgetError: no model has a plan; the error naming the lowest minimum.
    """
    best, errors, overheads = None, [], []
    for model in models:
        try:
            plan = _plan_filling_budget(model, budget_bytes, heuristic, overhead_limit, loss)
        except BudgetError as error:
            errors.append(error)
            overheads.append(None)
            continue
        overheads.append(round(plan.overhead, 4))
        if best is None or plan.overhead < best[1].overhead:
            best = (model, plan)
        slack = ORDER_SEARCH_SLACK if len(overheads) < 2 else FIRST_MODEL_SLACK
        if best[1].overhead <= 1 + slack:
            break
    if best is None:
        raise min(errors, key=lambda error: error.minimum_bytes)
    best[1].stats["orders"] = overheads
    return best


# Room a suggested budget leaves above the smallest one with a plan: a new run traces the
# step's orders again, and on a Keras mlp the smallest moved by 2.2% between calls.
HINT_ROOM = 0.05
# Bisections of ``with_smallest_budget``: the budget it names is within 2^-6 of the
# baseline peak above the smallest that plans (each bisection plans every order once).
SMALLEST_BUDGET_STEPS = 6


def with_smallest_budget(error: BudgetError, item: GraphItem, models: "list[MemoryModel]",
                         heuristic: str, overhead_limit: float, baseline_bytes: int,
                         resident_bytes: int = 0) -> BudgetError:
    """``error`` (no plan for its budget) with the smallest budget that does plan: bisected
    between the planner's lower bound and the measured baseline peak on the first traced
    order of the same step (as traced and reordered), so the answer is a budget a plan was
    found for, not an estimate, and it plans on every set of orders that contains that one.
    One order, not all: each bisection plans every order searched, and on a keras-hub GPT-2
    step twelve orders took three minutes. Planners are not monotone in their budget; a
    budget that plans is returned, never one that did not.

    Returns:
        ``error`` with ``smallest_bytes`` (``None``: not even the baseline plans),
        ``baseline_bytes`` and ``resident_bytes`` set.
    """
    orders = list(planning_orders(item, models[:1]))

    def plans(budget: int) -> bool:
        try:
            cheapest_plan(orders, budget, heuristic, overhead_limit, item.loss)
        except BudgetError:
            return False
        return True

    low, high = max(error.minimum_bytes, error.budget_bytes), int(baseline_bytes)
    if low >= high or not plans(high):
        high = None
    elif low > error.budget_bytes and plans(low):    # the asked budget itself did not plan
        high = low
    else:
        for _ in range(SMALLEST_BUDGET_STEPS):
            middle = (low + high) // 2
            low, high = (low, middle) if plans(middle) else (middle, high)
    error.smallest_bytes, error.baseline_bytes = high, int(baseline_bytes)
    error.resident_bytes = int(resident_bytes)
    return error


def planning_orders(item: GraphItem, models: "list[MemoryModel]") -> "Iterator[MemoryModel]":
    """Each traced order of ``models`` as it ran and with its backward pass reordered
    (``remat.backward_order``), alternately: the candidates ``cheapest_plan`` chooses from.
    Lazily: a reordering takes a third of a second on ``keras.applications.ResNet50``, and a
    search that stops early (``ORDER_SEARCH_SLACK``) needs few of them."""
    from graphfit.remat.backward_order import reorder_backward

    for model in models:
        yield model
        yield reorder_backward(item, model)


def rematerialize(item: GraphItem,
                  profile_or_cost_graph:
                  "Profile | CostGraph | MemoryModel | Sequence[MemoryModel]",
                  budget_bytes: int | None = None, budget_ratio: float | None = None,
                  heuristic: str = "dtr", overhead_limit: float = 2.0,
                  side_by_side: bool = False, step_traces: "StepTraces | None" = None
                  ) -> tuple[GraphItem, RematPlan]:
    """Rewrite ``item`` so that its step fits a memory budget, recomputing what it must.

    Parameters:
        item: the training step.
        profile_or_cost_graph: a ``Profile`` of the step ``remat.tf_memory.step_item(item)``
            (a ``remat.tf_memory.MemoryModel`` is made from it with one more traced step), a
            ready ``MemoryModel`` of ``item`` or a sequence of them (each of its own traced order:
            ``remat.tf_memory.TracedOrders``),
            or a plain ``CostGraph`` of ``item``
            (planned op by op, without TF's calibration).
        budget_bytes: the budget, resident variables and feeds included.
        budget_ratio: alternatively, a fraction of the baseline peak: the profile's measured
            peak, or the checkpoint-all peak of the given model or cost graph.
        heuristic: a planner of ``PLANNERS`` (default DTR's h_DTR). It plans every model
            as it is and with its backward pass reordered (``remat.backward_order``), and the
            cheapest of those plans is lowered.
        overhead_limit: compute multiple beyond which DTR heuristics give up (thrash).
        side_by_side: let events of the backward pass float, running as soon as their
            inputs exist, wherever a bound on the memory stays within the plan's peak
            (``remat.side_by_side``), so TF's inter-op threads are not all lost to the chain.
            Off by default: the bound rests on the plan's op sizes, which a run can miss
            (the earlier two-event window measured 1.04-1.19 of the plan on a Keras
            attention step in 4 of 11 runs), so ``pipeline.optimize`` uses it only when it
            measures the step. ``False`` chains the backward pass strictly in plan order.
        step_traces: traces of the step and of the user's
            (``remat.step_time.trace_for_prediction``):
            predict the rewritten step's wall time against the user's, into
            ``plan.stats["step_time"]`` (the rewritten graph replayed:
            ``remat.step_time``).

    Returns:
        ``(rewritten item, plan)``; the plan's ``peak_bytes`` (``remat.tf_memory.
        tf_peak_bytes``: the shared replay plus TF's buffer reuse by last readers; the
        replay's own peak is ``stats["replay_peak_bytes"]``) and ``overhead`` are the
        predictions ``remat.measure.measure_rewrite`` checks.

    Raises:
        ValueError: both or neither of ``budget_bytes`` / ``budget_ratio``.
        BudgetError: no plan fits (the message names the minimum budget).
        remat.rewrite.RematRewriteError: the plan cannot be lowered.

    References:
        Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021.
    """
    from graphfit.remat import baselines
    from graphfit.remat.tf_memory import MemoryModel, tf_memory_model

    if (budget_bytes is None) == (budget_ratio is None):
        raise ArgumentError("give exactly one of budget_bytes and budget_ratio")
    if budget_ratio is not None:
        check_number(budget_ratio, "budget_ratio", above=0)
    if isinstance(profile_or_cost_graph, Profile):
        models = [tf_memory_model(item, profile_or_cost_graph)]
        baseline_bytes = profile_or_cost_graph.peak_bytes
    else:
        models = (profile_or_cost_graph if isinstance(profile_or_cost_graph, Sequence) else
                  [profile_or_cost_graph] if isinstance(profile_or_cost_graph, MemoryModel) else
                  [MemoryModel(profile_or_cost_graph, profile_or_cost_graph,
                               [[i] for i in range(profile_or_cost_graph.num_ops)])])
        if not models:
            raise ArgumentError("an empty list of memory models: give at least one")
        baseline_bytes = baselines.checkpoint_all(models[0].plan_graph).peak_bytes
    if budget_bytes is None:
        budget_bytes = int(budget_ratio * baseline_bytes)
    model, planned = cheapest_plan(planning_orders(item, models), budget_bytes, heuristic,
                                   overhead_limit, item.loss)
    return lower_plan(item, model, planned, baseline_bytes, side_by_side, step_traces)


def lower_plan(item: GraphItem, model: "MemoryModel", planned: RematPlan, baseline_bytes: int,
               side_by_side: bool = False, step_traces: "StepTraces | None" = None,
               updates_ordered: bool = False) -> tuple[GraphItem, RematPlan]:
    """``rematerialize``'s second half: ``planned`` (a plan of ``model``'s planning graph,
    ``cheapest_plan``) expanded to ``model``'s ops and rewritten into ``item``, the backward
    pass a strict chain or, with ``side_by_side``, with floating events (as
    ``rematerialize``). Apart, so that one plan can be lowered both ways: the closed loop
    (``remat.closed_loop``) takes a measured step's floating events back without planning
    again. ``updates_ordered``: the caller orders each variable's writes after the reads of
    its old value (``remat.early_updates.order_updates_after_reads``) once lowered, so variable
    reads and writes may float too."""
    from graphfit.remat.early_updates import VARIABLE_ACCESS_OP_TYPES
    from graphfit.remat.rewrite import rewrite
    from graphfit.remat.side_by_side import (Unpinned, expanded_joins, expanded_positions,
                                             unpinned_events)
    from graphfit.remat.step_time import chain_head, predict_step_time, step_dependencies
    from graphfit.remat.tf_memory import expand_plan, step_item

    # Events float only where the bound stays within the predicted peak (TF's accounting,
    # below the replay's wherever TF reuses a buffer).
    unpinned = (unpinned_events(model.plan_graph, planned, planned.peak_bytes,
                                VARIABLE_ACCESS_OP_TYPES if updates_ordered else frozenset())
                if side_by_side else Unpinned(set(), {}))
    plan = expand_plan(model, planned)
    plan.stats["baseline_peak_bytes"] = int(baseline_bytes)
    plan.stats["recomputed_ops"] = plan.recomputed_ops(model.cost_graph)
    plan.stats["side_by_side_events"] = len(unpinned.floating)
    plan.stats["late_joins"] = unpinned.late_joins
    rewritten = rewrite(item, model.cost_graph, plan,
                        floating=expanded_positions(model.members, planned, unpinned.floating),
                        joins=expanded_joins(model.members, planned, unpinned.joins),
                        float_updates=side_by_side)
    if step_traces is not None:
        head = chain_head(model.cost_graph.names, plan, rewritten.config["remat"]["pinned_from"])
        plan.stats["step_time"] = predict_step_time(
            step_dependencies(step_item(rewritten)), head, step_traces).report()
    return rewritten, plan
