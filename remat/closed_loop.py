"""The remat pass as a closed loop: plan, rewrite, run, measure, and plan again while the
measured peak misses the budget.

A plan's peak is a prediction of TF's allocator; this loop holds it to the measurement (the
allocator's own reading where TF keeps statistics, ``remat.measure``). The rewritten step runs
once before it is returned (a step that cannot run is never handed on; when verifying, that
run is the measurement's). The details carry the seconds of each stage (``stage_seconds``:
measuring the user's step, profiling, tracing the orders (and, if asked, for the step-time
prediction), planning and rewriting, measuring each round's peak, verifying the step returned),
summed over the rounds. When verifying, what the rewritten step adds above its resident bytes
must be within ``PEAK_TOLERANCE`` of what the budget leaves it (``meets_budget``); if it is
not, the planning budget is lowered by the measured excess (``replanning_budgets``),
``MAX_PLAN_ROUNDS`` rounds at most. The step returned must compute the user's loss and
gradients (``remat.measure``): compared once, on that step alone, since a comparison runs
three steps in fresh sessions (15 s of ``keras.applications.ResNet50``'s 73 s, 2026-12-06).
Backward events may float beside the chain (``remat.side_by_side``) only in a verified step
whose allocation records stay within ``PEAK_TOLERANCE`` of its plan; otherwise the strict
chain is lowered from the same plan first, or, where the step read more above its plan than
floating explains (``FLOATING_EXCESS``), planned for a lower budget at once. A floating step
whose records keep its plan but whose measured peak misses the budget is planned again for
a lower budget, still floating, as a strict chain would be (``_records_as_planned``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import run_once
from graphfit.remat.baselines import checkpoint_all
from graphfit.remat.pipeline import (BudgetError, cheapest_plan, lower_plan, planning_orders,
                                     with_smallest_budget)
from graphfit.remat.plan import RematPlan

if TYPE_CHECKING:   # imports TF; annotations only
    from graphfit.remat.measure import StepMeasurement

__all__ = ["PEAK_TOLERANCE", "MAX_PLAN_ROUNDS", "FLOATING_EXCESS", "PLAN_ORDERS",
           "STAGE_TITLES", "fit_budget", "ratio_budget", "meets_budget", "records_budget",
           "replanning_budgets"]

# A step that adds more than (budget - resident) x (1 + PEAK_TOLERANCE) above its resident
# bytes misses the budget; the remat pass then plans again, MAX_PLAN_ROUNDS times in all.
# Four, not three: ``keras.applications.EfficientNetB0`` (96², batch 8) at 0.5 measures 30-40%
# above its plans with oneDNN on, and before ``FLOATING_EXCESS`` spent its second round on a
# strict chain for the same budget: it missed after three rounds in two runs of three; with a
# fourth it fitted (1.037 of the budget, 75 s; 2026-12-07). It still takes four in some runs.
PEAK_TOLERANCE = 0.05
MAX_PLAN_ROUNDS = 4
# How far above its planning budget a step with floating events may read before the plan
# itself, not the floating, is taken to be off (``_plan_missed``).
FLOATING_EXCESS = 0.25
# Memory models (traced orders of the step, each traced once, when the search first needs it;
# every round plans on them, each as traced and with its backward pass reordered) whose
# cheapest plan is kept (``remat.pipeline.cheapest_plan``): eight orders of a Keras attention
# step planned 1.19-1.52 at 0.5 of its peak as traced (2026-12-05), while reordered their
# plans are within 1% of each other. Three, not six: at 0.5 the cheapest of the first six
# plans was the cheapest of twelve on the zoo resnet and mlp and the Keras ResNet-style step,
# and 0.4% above it on the zoo transformer (1.0219 against 1.0176), while twelve plans took
# twice the planning (2026-12-06).
PLAN_ORDERS = 3
# What each stage of ``fit_budget`` does, as its progress line says it.
STAGE_TITLES = {
    "measure_user_step": "measuring your step",
    "profile": "profiling the step to plan",
    "trace_orders": "tracing its op order",
    "trace_for_prediction": "tracing the steps the step-time prediction replays",
    "plan_and_rewrite": "planning (each traced order as run and reordered) and rewriting",
    "order_updates": "ordering the updates after their variables' reads",
    "run_once": "running the rewritten step once",
    "measure_peak": "measuring the rewritten step's peak",
    "verify": "comparing its loss, gradients and weights with your step, timing both",
}



def ratio_budget(peak_bytes: int, resident_bytes: int, ratio: float) -> int:
    """The budget ``memory_ratio`` asks for: the resident bytes (variables, optimizer slots,
    the batch: no recomputation frees them) plus ``ratio`` of what the step adds above them.
    A ratio of the whole peak could ask for less than the weights: ``keras.applications.
    ResNet50`` at 64x64, batch 8, SGD holds 95 MB of weights and adds 79-87 MB (allocator,
    2026-12-06), so half its peak is below its weights."""
    return int(resident_bytes + ratio * (peak_bytes - resident_bytes))


def meets_budget(measured_bytes: int, budget_bytes: int, resident_bytes: int) -> bool:
    """Whether a measured peak meets the budget: what the step adds above its resident bytes
    is within ``PEAK_TOLERANCE`` of what the budget leaves it (so the whole peak is within
    ``PEAK_TOLERANCE`` of the budget too)."""
    return (measured_bytes - resident_bytes
            <= (budget_bytes - resident_bytes) * (1 + PEAK_TOLERANCE))


def records_budget(budget_bytes: int, measured: "StepMeasurement") -> int:
    """The budget to plan for so that a step measured as ``measured`` was meets
    ``budget_bytes``: a plan predicts the allocation records' peak, and where the ruler
    (``remat.measure``) reads the step adding more than the records do (oneDNN's own buffers,
    which the records miss: 13% more on a Keras attention step, whose first plans then
    measured 12-23% over them, 2026-12-06), the budget is lowered by the records' share, as
    the closed loop lowers it after a miss. Never raised."""
    added = measured.peak_bytes - measured.resident_bytes
    recorded = measured.records_peak_bytes - measured.resident_bytes
    if added <= 0 or recorded >= added:
        return budget_bytes
    resident = measured.resident_bytes
    return int(resident + (budget_bytes - resident) * recorded / added)


def replanning_budgets(budget_bytes: int, planning_budget_bytes: int,
                       points: list[tuple[int, int]]) -> list[int]:
    """The budgets to plan for after a measured miss, the lowest first (the next is planned
    for only if no plan fits the one before), where ``points`` are the rounds' (planned,
    measured) bytes above the resident bytes, oldest first, and ``budget_bytes`` and
    ``planning_budget_bytes`` are on the same basis.

    What the allocator reads beyond the plan is in part a share of it and in part a fixed sum:
    BFC hands a request a free chunk of up to twice its size whole, and counts the chunk
    (``docs/DESIGN.md`` §12), whatever the plan. Scaling the last planning budget by the miss
    removes only the share: on ``keras.applications.EfficientNetB0`` (96², batch 8, oneDNN
    on) plans of 83.5 and 65.1 MiB measured 110.7 and 89.9 MiB against a budget of 85.7 (a
    miss by 0.8% beyond the 5% tolerance), the line through them is measured = 1.13 x planned
    + 18 MiB above the resident 16.4, and the plan it asked for next fitted (59.9 planned,
    85.6 measured; 2026-12-07). So a line measured = slope x planned + fixed is drawn through
    the last point and the newest one before it planned at least 1% apart, and the first
    budget is where the line meets the budget, when it is below the scaled one; the scaled one
    is always last. No line where the points give none (one point, or a slope outside
    [0.25, 4]).

    Examples:
        >>> replanning_budgets(60, 60, [(120, 150), (60, 90)])   # a fixed 30 on top
        [30, 40]
        >>> replanning_budgets(60, 60, [(60, 90)])               # scaled by the miss
        [40]
    """
    planned, measured = points[-1]
    scaled = int(planning_budget_bytes * budget_bytes / max(measured, 1))
    earlier = [p for p in points[:-1] if abs(p[0] - planned) > 0.01 * max(planned, 1)]
    if earlier:
        slope = (measured - earlier[-1][1]) / (planned - earlier[-1][0])
        line = int((budget_bytes - (measured - slope * planned)) / slope) if slope else -1
        if 0.25 <= slope <= 4 and 0 < line < scaled:
            return [line, scaled]
    return [scaled]


def _missed(budget: int, rounds: list[dict]) -> str:
    """What each round planned and measured, for the error of a missed budget."""
    summary = "; ".join(f"planned for {r['planning_budget_bytes'] / 2**20:.1f} MiB, measured "
                        f"{r['measured_peak_bytes'] / 2**20:.1f} MiB" for r in rounds)
    return (f"the rematerialized step's measured peak stays above the budget of "
            f"{budget / 2**20:.1f} MiB (+{PEAK_TOLERANCE:.0%}) after {len(rounds)} rounds: "
            f"{summary}")


def _records_as_planned(measured: "StepMeasurement", planned_bytes: int) -> bool:
    """Whether the step's allocation records, which are what a plan predicts, are within
    ``PEAK_TOLERANCE`` of its plan: whether a step with floating events kept the plan's
    memory. If it did and still misses the budget, the allocator's chunks above the records
    (DESIGN.md §12) are to blame, not the floating, and its strict chain reads the same:
    ``keras.applications.EfficientNetB0``'s floating step read 86.2 MiB by the allocator and
    81.8 by the records against a plan of 81.8, and its strict chain read the same (a round of
    9 s for nothing); keras-hub BERT's 130.3 against a budget of 125.5, its strict chain 128.6
    and kept, 1.15-1.34x the user's step where floating steps run 1.14 (2026-12-07). So such a
    step is planned again for a lower budget, still floating. A step whose records miss its
    plan falls back to the strict chain: the floating bound is proven only for the order
    the rewrite's edges enforce (the mlp ``activations`` step measured 0.25-1 MiB over its plan
    in 12 of 32 traced runs while recomputed chains lost those edges, until 2026-12-07)."""
    return measured.records_peak_bytes <= planned_bytes * (1 + PEAK_TOLERANCE)


def _plan_missed(measured_bytes: int, planning_budget_bytes: int, resident_bytes: int) -> bool:
    """Whether a step with floating events read more above its resident bytes than floating
    can explain, ``FLOATING_EXCESS`` over what the budget it was planned for leaves: then the
    plan itself is off, and the strict chain is planned for a lower budget at once rather than
    lowered from the same plan first (which is what happens if no lower budget plans). On
    ``keras.applications.EfficientNetB0`` at 0.5 the strict chain of the same plan measured
    what the floating step had (110.7 and 110.7, 112.9 and 113.8, 107.2 and 107.2 MiB, 39-44%
    over the plan's bytes above the resident) in every run, one round of 12-20 s each
    (2026-12-07); floating itself was measured 0.25-1 MiB (the mlp ``activations`` step) and
    4-19% (a Keras attention step's two-event window) over its plans."""
    return (measured_bytes - resident_bytes
            > (planning_budget_bytes - resident_bytes) * (1 + FLOATING_EXCESS))


def fit_budget(original: GraphItem, item: GraphItem, budget_bytes: int | None,
               budget_ratio: float | None, heuristic: str, overhead_limit: float, verify: bool,
               num_cpu_devices: int, order_updates: bool, predict_step_time: bool = False,
               progress: Callable[[str], None] | None = None
               ) -> tuple[GraphItem, RematPlan, dict]:
    """Plan ``item`` (``original`` after the graph passes) for the budget, rewrite, run; when
    verifying, measure and re-plan while the measured peak misses the budget.

    Parameters:
        original: the user's step (the reference of every comparison and of ``budget_ratio``).
        item: the step to plan (``original`` after ``pipeline.passes``' graph passes).
        budget_bytes, budget_ratio: the budget in bytes, or as a fraction of what
            ``original``'s step adds above its resident bytes (``ratio_budget``; one of them
            is ``None``).
        heuristic, overhead_limit: the planner (``remat.pipeline.PLANNERS``) and its limit.
        verify: measure the rewritten step and close the loop (else plan once and run once).
        num_cpu_devices: virtual CPU devices of the session.
        order_updates: the early-update pass ran: order each update after its variable's
            last read (``remat.early_updates.order_updates_after_reads``).
        predict_step_time: when verifying, also predict the rewritten step's time against
            the user's before measuring it (``remat.step_time``; ``planned_step_vs_user``),
            for benches that check the prediction. Off by default: the measurement itself is
            reported (``overhead_vs_user``), and the prediction's traced rounds took 18 of
            the 73 s on ``keras.applications.ResNet50`` (2026-12-06).
        progress: called with a line as each stage begins (``STAGE_TITLES``).

    Returns:
        ``(rewritten step, plan, JSON-ready details)``; with ``verify``, ``details["rounds"]``
        has every round's plan and measurement; ``details["stage_seconds"]`` the time profile.

    Raises:
        remat.pipeline.BudgetError: no plan fits, or the measured peak stays above the budget
            after ``MAX_PLAN_ROUNDS`` rounds (the message has every round's numbers).
        profiler.session.StepFailedError: the rewritten step does not run.
    """
    from graphfit.profiler.progress import StageTimes
    from graphfit.profiler.session import (OpenSessions, failing_step, make_session,
                                           session_config)
    from graphfit.profiler.step_compare import WeightCheck, run_reference
    from graphfit.profiler.tf_function import FunctionItem
    from graphfit.profiler.trace import CPU_ALLOCATOR, PEAK_READINGS, default_allocator
    from graphfit.remat.early_updates import order_updates_after_reads
    from graphfit.remat.measure import compare_rewrite, measure_step, read_calls, warmed_call
    from graphfit.remat.step_time import trace_for_prediction
    from graphfit.remat.tf_memory import StepTrace, TracedOrders, step_trace

    # One session per step and configuration for every stage (``OpenSessions``): the user's
    # step, the planned step, its serial chain, each rewritten step.
    # ``ahead`` runs the user's step for the comparison while the first plan is lowered; it
    # is shut down (waited for) before the sessions close.
    with OpenSessions() as sessions, concurrent.futures.ThreadPoolExecutor(1) as ahead:
        times = StageTimes(None if progress is None else lambda stage, seconds: progress(
            f"remat: {STAGE_TITLES[stage]} ({seconds:.0f} s)"))
        with times.stage("measure_user_step"):
            # Over ``PEAK_READINGS`` steps, called as the user calls a ``tf.function`` step:
            # one step's reading moves by more than the budget's tolerance from one step to
            # the next (``profiler.trace``). Two session steps: the traced one (records,
            # resident bytes) and one timed.
            baseline = measure_step(original, steps=2, warmup=1,
                                    num_cpu_devices=num_cpu_devices, sessions=sessions,
                                    traced_from=original, readings=PEAK_READINGS)
        budget = int(budget_bytes if budget_bytes is not None
                     else ratio_budget(baseline.peak_bytes, baseline.resident_bytes,
                                       budget_ratio))
        # Plans are made for, and rewritten steps run under, the project's configuration.
        traced: list[StepTrace] = []     # the profile's traced step: the first order
        with times.stage("profile"):
            profiled = measure_step(item, steps=3, warmup=1, num_cpu_devices=num_cpu_devices,
                                    config=session_config(num_cpu_devices), sessions=sessions,
                                    on_traced_step=lambda run: traced.append(step_trace(run)))
        profile = profiled.profile
        planning_budget, rounds, side_by_side = records_budget(budget, profiled), [], verify
        # Milder budgets, each planned for in turn when no plan fits the one before: the
        # records' share (and after a miss, the measured line) may aim below every plan.
        milder = [budget] if planning_budget < budget else []
        # Each round's (planned, measured) above the resident bytes, for re-planning after a
        # miss. Not the profiled step's (its records are its plan): on ``keras.applications.
        # EfficientNetB0`` the line through it and a plan of half its size aimed below every
        # plan (2026-12-07); the allocator's excess is not linear over that range.
        points = []
        # Orders are traced as the search asks for them (``TracedOrders``); the first is the
        # profile's traced step, calibrated here.
        models = TracedOrders(item, profile, PLAN_ORDERS, sessions, first=traced[0],
                              num_cpu_devices=num_cpu_devices)
        with times.stage("trace_orders"):
            models[0]                             # the first order every round plans
        # The same for every round of planning.
        traces = None
        if verify and predict_step_time:
            with times.stage("trace_for_prediction"):
                traces = trace_for_prediction(original, item, models[0], sessions=sessions)
        # The planned step runs again only to trace more orders.
        sessions.keep_only([original.graph, item.graph])
        baseline_bytes = checkpoint_all(models[0].plan_graph).peak_bytes   # as rematerialize's
        # The order planned last and its plan, with the budget it was planned for: a step whose
        # floating events are taken back is the same plan lowered again, and after a measured
        # miss only that order is planned again, since the line ``replanning_budgets`` draws
        # is through its points (each round plans every order searched: 19 s a round on
        # ``keras.applications.EfficientNetB0``, 2026-12-07).
        model, planned, planned_for = None, None, None
        # The user's step the rewritten one is compared with runs ahead, while the first
        # plan is lowered (its Grappler pass and the step: 2-3 s of ``keras.applications.
        # ResNet50``'s verification, on the second core), after the orders are traced; every
        # measurement waits for it, so nothing it runs is measured.
        reference_step = None
        while len(rounds) < MAX_PLAN_ROUNDS:
            try:
                with times.stage("plan_and_rewrite"):
                    if planned_for != planning_budget:
                        orders = planning_orders(item, models) if model is None else [model]
                        model, planned = cheapest_plan(orders, planning_budget, heuristic,
                                                       overhead_limit, item.loss)
                        planned_for = planning_budget
                    if verify and reference_step is None:
                        reference_step = ahead.submit(run_reference, original, order_updates,
                                                      sessions)
                    rewritten, plan = lower_plan(item, model, planned, baseline_bytes,
                                                 side_by_side, traces, order_updates)
            except BudgetError as error:
                if milder:
                    planning_budget = milder.pop(0)
                    continue
                if not rounds:  # name the smallest budget that plans, on these same orders
                    raise with_smallest_budget(error, item, models, heuristic, overhead_limit,
                                               baseline.peak_bytes, baseline.resident_bytes)
                raise BudgetError(f"{_missed(budget, rounds)}; planning again for "
                                  f"{planning_budget / 2**20:.1f} MiB failed: {error}",
                                  budget, error.minimum_bytes) from error
            if plan.peak_bytes > plan.budget_bytes:
                raise AssertionError(f"remat postcondition: planned peak {plan.peak_bytes:,} bytes "
                                     f"exceeds the budget {plan.budget_bytes:,}")
            if order_updates:
                with times.stage("order_updates"):
                    rewritten, order = order_updates_after_reads(rewritten)
            details = {"method": plan.method, "budget_bytes": budget,
                       "planning_budget_bytes": plan.budget_bytes,
                       "planned_peak_bytes": plan.peak_bytes, "planned_overhead": plan.overhead,
                       "num_recomputes": plan.num_recomputes,
                       "recomputed_ops": plan.stats.get("recomputed_ops", []),
                       "overhead_by_order": plan.stats["orders"],
                       "side_by_side_events": plan.stats["side_by_side_events"],
                       "late_joins": plan.stats["late_joins"],
                       "late_variable_readers": order["late_readers"] if order_updates else 0}
            if not verify:
                with times.stage("run_once"):
                    run_once(rewritten, "rematerialized",
                             lambda graph: make_session(graph, num_cpu_devices))
                return rewritten, plan, {**details, "stage_seconds": times.report()}
            # The measurement's first step is the rewritten step's first run (the graph is not
            # placed yet: one device runs it as several would). A step of an earlier round
            # is not run again.
            sessions.keep_only([original.graph, item.graph])
            with times.stage("measure_peak"), failing_step("rematerialized"):
                if reference_step is not None:
                    reference_step.result()                      # done before measuring
                # The call read below is built and warmed up beside the session's first step
                # (it goes unused when the session's steps miss), in host memory only: on a
                # GPU the two first steps at once would need twice the step's memory.
                call = (ahead.submit(warmed_call, rewritten, original)
                        if isinstance(original, FunctionItem)
                        and baseline.allocator_added_bytes is not None
                        and default_allocator() == CPU_ALLOCATOR else None)
                measured = measure_step(rewritten, sessions=sessions, beside=call)
                floating = side_by_side and plan.stats["side_by_side_events"]
                if meets_budget(measured.peak_bytes, budget, measured.resident_bytes) and (
                        not floating or _records_as_planned(measured, plan.peak_bytes)):
                    # Read as the user calls it only a step that fits by its session steps,
                    # and that is kept if it still fits by both (4-6 s a round on
                    # ``keras.applications.ResNet50`` with 2 calls read, 2026-12-07; its
                    # rewritten step's calls agree, so 6 are read, ``profiler.trace.
                    # added_by_calls``).
                    measured = read_calls(measured, rewritten, original,
                                          call=None if call is None else call.result())
            details.update(measured_peak_bytes=measured.peak_bytes,
                           measured_records_peak_bytes=measured.records_peak_bytes,
                           measured_resident_bytes=measured.resident_bytes,
                           measured_peak_over_budget=measured.peak_bytes / budget)
            rounds.append(details)
            points.append((plan.peak_bytes - measured.resident_bytes,
                           measured.peak_bytes - measured.resident_bytes))
            fits = meets_budget(measured.peak_bytes, budget, measured.resident_bytes)
            same_plan: list[int] = []   # its budget, if no lower one plans
            if floating and not _records_as_planned(measured, plan.peak_bytes):
                side_by_side = False
                if fits or not _plan_missed(measured.peak_bytes, planning_budget,
                                            measured.resident_bytes):
                    continue        # the same plan again, its backward pass a strict chain
                same_plan = [planning_budget]   # if no lower budget plans
            elif fits:
                # Only the step returned is compared and timed. Moved updates must leave the
                # same weights (``WeightCheck``), checked on the runs that compare the loss
                # and gradients.
                # No warm-up step before the timing: each of the three steps timed already
                # ran in its open session (measured, profiled), as timed.
                with times.stage("verify"), failing_step("rematerialized"):
                    report = compare_rewrite(
                        original, rewritten, plan, baseline, measured,
                        weights=WeightCheck(kernel_order_noise=True) if order_updates else None,
                        sessions=sessions, warmup=0, planned=item,
                        reference_step=reference_step.result())
                if traces is not None:
                    report.update(planned_step_vs_user=plan.stats["step_time"]["vs_user"],
                                  planned_step_time=plan.stats["step_time"])
                return rewritten, plan, {**report, **details, "rounds": rounds,
                                         "stage_seconds": times.report()}
            resident = measured.resident_bytes
            planning_budget, *milder = [resident + b for b in replanning_budgets(
                budget - resident, planning_budget - resident, points)] + same_plan
        raise BudgetError(f"{_missed(budget, rounds)}. Raise the budget or try another planner.",
                          budget, min(r["measured_peak_bytes"] for r in rounds))
