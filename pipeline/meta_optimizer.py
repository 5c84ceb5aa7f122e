"""The pipeline entry point: ``baechi.optimize(item, ...)`` runs every pass over one step.

Like Grappler's meta optimizer, a list of named, independent passes transforms one
``GraphItem``; each can be skipped, says whether it changed anything, and checks what it
promises:

- ``conv_grad_kernels``, ``flat_matmuls``, ``grad_accumulation``, ``early_updates``
  (``remat.pipeline.GRAPH_PASSES``): free memory no recomputation can, before profiling: run
  stride-1 convolution gradients with TF's kernels that need no scratch buffer
  (``remat.conv_grad_kernels``), batch products against one shared matrix and their weight
  gradients as one matrix product (``remat.flat_matmuls``), sum gradient contributions as they arrive
  (``remat.grad_accumulation``), apply each optimizer update as soon as its gradient exists
  (``remat.early_updates``). Run when there is a memory budget.
- ``remat``: fit a memory budget (``remat.rematerialize``: profile, DTR plan, rewrite).
  Requires a budget; ensures the plan's predicted peak is within it and that the rewritten step
  runs (one step, even without verifying). When verifying, it is a closed loop: the rewritten
  step must compute the same loss, gradients and (after the early-update pass) weights, and
  its measured peak must be within 5% of the budget; if it is not, the pass plans again for a
  budget lowered by the measured excess (``MAX_PLAN_ROUNDS`` rounds at most) and reports every
  round, or fails with the numbers. Only a verified pass lets backward events float beside the
  chain (``remat.side_by_side``): a peak measured above the budget, or above that plan's by
  more than ``PEAK_TOLERANCE``, sends it back to the strict chain, for the same budget, first.
- ``place``: place the step on the target's devices (``baechi.place_and_run``: group, fuse,
  m-TOPO / m-ETF / m-SCT under each device's limit, apply). Requires more than one device;
  ensures every op is placed within its device's memory and, when verifying, that the placed
  step equals the single-device step and stays under each limit when measured.

The result carries the final item, the plan, the placement report and one record per pass.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place_and_run import check_placement, place_item
from graphfit.baechi.run import RunTarget
from graphfit.baechi.schedule import Schedule
from graphfit.baechi.verify import verify_placement, verify_rewrite
from graphfit.errors import ArgumentError, GraphfitError, check_number
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.profile import Profile
from graphfit.profiler.sizes import parse_bytes
from graphfit.profiler.trace import print_progress, profile_graph
from graphfit.remat.pipeline import GRAPH_PASSES, PLANNERS, BudgetError, prepare_step
from graphfit.remat.plan import RematPlan

__all__ = ["PASSES", "MAX_PLAN_ROUNDS", "PEAK_TOLERANCE", "OptimizeResult",
           "PassRecord", "StepFailedError", "optimize"]

PASSES = ("conv_grad_kernels", "flat_matmuls", "grad_accumulation", "early_updates", "remat",
          "place")
# A measured peak above budget x (1 + PEAK_TOLERANCE) is a miss; the remat pass then plans
# again, at most MAX_PLAN_ROUNDS times in all.
PEAK_TOLERANCE = 0.05
MAX_PLAN_ROUNDS = 3
# Memory models (traced orders of the step, built once; every round plans on them all)
# whose cheapest plan is kept (``remat.pipeline.cheapest_plan``): eight orders of a Keras
# attention step planned 1.19-1.52 at 0.5 of its peak (2026-12-05).
PLAN_ORDERS = 6


class StepFailedError(GraphfitError):
    """An optimized step does not run on TensorFlow, or misses its budget after every round;
    the message has TF's error or the numbers of each round."""


@dataclasses.dataclass
class PassRecord:
    """What one pass did: whether it ran and changed the step, how long it took, its report."""

    name: str
    changed: bool
    seconds: float
    details: dict[str, Any]


@dataclasses.dataclass
class OptimizeResult:
    """The optimized step and what each pass reported."""

    item: GraphItem
    plan: RematPlan | None
    placement: dict[str, Any] | None
    passes: list[PassRecord]
    schedule: Schedule | None = None     # the planned step on the devices (placement)

    def report(self) -> dict[str, Any]:
        """JSON-ready: one entry per pass."""
        return {p.name: {"changed": p.changed, "seconds": round(p.seconds, 3), **p.details}
                for p in self.passes}

    def save(self, directory: str, extra: dict[str, Any] | None = None) -> list[str]:
        """Write the report a person reads into ``directory`` (``baechi.report``): the JSON,
        memory per device planned against measured, the placement as a Gantt chart, the remat
        plan, the schedule as a Chrome trace, and ``summary.md``. ``extra`` joins the JSON.
        Returns the paths written."""
        from graphfit.baechi.report import write_report

        return write_report(self, directory, extra)


def _run_once(item: GraphItem, what: str, session: Callable[[Any], Any]) -> None:
    """Initialise and run one step of ``item`` in ``session(graph)``: a step that cannot run
    is never returned."""
    import tensorflow as tf

    try:
        with session(item.graph) as session:
            session.run(item.init_op)
            session.run([item.train_op, item.loss], item.feed_dict())
    except tf.errors.OpError as error:
        raise StepFailedError(f"the {what} step does not run on TensorFlow "
                              f"({type(error).__name__}): {error.message}") from error


def _missed(budget: int, rounds: list[dict]) -> str:
    """What each round planned and measured, for the error of a missed budget."""
    summary = "; ".join(f"planned for {r['planning_budget_bytes'] / 2**20:.1f} MiB, measured "
                        f"{r['measured_peak_bytes'] / 2**20:.1f} MiB" for r in rounds)
    return (f"the rematerialized step's measured peak stays above the budget of "
            f"{budget / 2**20:.1f} MiB (+{PEAK_TOLERANCE:.0%}) after {len(rounds)} rounds: "
            f"{summary}")


def _floating_kept(measured_bytes: int, planned_bytes: int, budget_bytes: int) -> bool:
    """Whether a step with floating events may stay as measured: within the user's budget
    (not its tolerance: the strict chain is there to fall back on) and within
    ``PEAK_TOLERANCE`` of its plan. The floating bound itself is not sound on every run (the
    mlp ``activations`` step measured 0.25-1 MiB over its plan in 12 of 32 traced runs), but
    where the plan leaves room below the budget the step still fits; a miss of 1% sent Keras
    attention back to its strict chain at 0.97 of its budget (2026-12-05), 6% slower."""
    return measured_bytes <= min(budget_bytes, planned_bytes * (1 + PEAK_TOLERANCE))


def _remat_pass(original: GraphItem, item: GraphItem, budget_bytes: int | None,
                budget_ratio: float | None, heuristic: str, overhead_limit: float, verify: bool,
                num_cpu_devices: int, order_updates: bool) -> tuple[GraphItem, RematPlan, dict]:
    """Plan ``item`` (``original`` after the graph passes) for the budget, rewrite, run; when
    verifying, measure and re-plan while the measured peak misses the budget."""
    from graphfit.profiler.session import make_session
    from graphfit.profiler.step_compare import compare_weights
    from graphfit.remat.early_updates import order_updates_after_reads
    from graphfit.remat.measure import measure_rewrite, measure_step
    from graphfit.remat.pipeline import rematerialize
    from graphfit.remat.step_time import trace_for_prediction
    from graphfit.remat.tf_memory import tf_memory_model

    baseline = measure_step(original, steps=3, warmup=1, num_cpu_devices=num_cpu_devices)
    budget = int(budget_bytes if budget_bytes is not None
                 else budget_ratio * baseline.peak_bytes)
    profile = (baseline.profile if item is original else
               measure_step(item, steps=3, warmup=1, num_cpu_devices=num_cpu_devices).profile)
    planning_budget, rounds, side_by_side = budget, [], verify
    models = [tf_memory_model(item, profile) for _ in range(PLAN_ORDERS)]
    # The same for every round of planning.
    traces = trace_for_prediction(original, item, models[0]) if verify else None
    for _ in range(MAX_PLAN_ROUNDS):
        try:
            rewritten, plan = rematerialize(item, models, budget_bytes=planning_budget,
                                            heuristic=heuristic, overhead_limit=overhead_limit,
                                            side_by_side=side_by_side, step_traces=traces)
        except BudgetError as error:
            if not rounds:
                raise
            raise BudgetError(f"{_missed(budget, rounds)}; planning again for "
                              f"{planning_budget / 2**20:.1f} MiB failed: {error}",
                              budget, error.minimum_bytes) from error
        if plan.peak_bytes > plan.budget_bytes:
            raise AssertionError(f"remat postcondition: planned peak {plan.peak_bytes:,} bytes "
                                 f"exceeds the budget {plan.budget_bytes:,}")
        if order_updates:
            rewritten, order = order_updates_after_reads(rewritten)
        _run_once(rewritten, "rematerialized",
                  lambda graph: make_session(graph, num_cpu_devices))
        details = {"method": plan.method, "budget_bytes": budget,
                   "planning_budget_bytes": plan.budget_bytes,
                   "planned_peak_bytes": plan.peak_bytes, "planned_overhead": plan.overhead,
                   "num_recomputes": plan.num_recomputes,
                   "overhead_by_order": plan.stats["orders"],
                   "side_by_side_events": plan.stats["side_by_side_events"],
                   "late_variable_readers": order["late_readers"] if order_updates else 0}
        if not verify:
            return rewritten, plan, details
        details.update(measure_rewrite(original, rewritten, plan, baseline=baseline),
                       budget_bytes=budget, planning_budget_bytes=plan.budget_bytes,
                       planned_step_vs_user=plan.stats["step_time"]["vs_user"],
                       planned_step_time=plan.stats["step_time"])
        if order_updates:
            details["weights_match"], details["max_abs_weight_diff"] = compare_weights(
                original, rewritten, kernel_order_noise=True)
        details["measured_peak_over_budget"] = details["measured_peak_bytes"] / budget
        rounds.append(details)
        if side_by_side and plan.stats["side_by_side_events"] and not _floating_kept(
                details["measured_peak_bytes"], plan.peak_bytes, budget):
            side_by_side = False
            continue
        if details["measured_peak_bytes"] <= budget * (1 + PEAK_TOLERANCE):
            return rewritten, plan, {**details, "rounds": rounds}
        planning_budget = int(planning_budget * budget / details["measured_peak_bytes"])
    raise BudgetError(f"{_missed(budget, rounds)}. Raise the budget or try another planner.",
                      budget, min(r["measured_peak_bytes"] for r in rounds))


def optimize(item: GraphItem, *,
             memory_budget: int | None = None, memory_ratio: float | None = None,
             remat_heuristic: str = "dtr", remat_overhead_limit: float = 2.0,
             target: RunTarget | None = None, devices: DeviceSet | None = None,
             profile: Profile | None = None, place_options: dict[str, Any] | None = None,
             verify: bool = True, verify_structure: bool = False, skip: Iterable[str] = (),
             progress: Callable[[str], None] | None = print_progress) -> OptimizeResult:
    """Rematerialize ``item`` to a memory budget, then place it on several devices.

    Parameters:
        item: the training step (``models.build``, or ``profiler.tf_function`` for Keras).
        memory_budget: bytes the step may use at its peak (resident variables and feeds
            included), an int or a size such as ``"300MiB"``; or ``memory_ratio``, a fraction of its measured peak. Neither: no remat.
        remat_heuristic: a planner of ``remat.pipeline.PLANNERS``.
        remat_overhead_limit: compute multiple beyond which DTR gives up (thrash).
        target: where the placed step runs (``baechi.run.local_target(n)`` or a
            ``LocalCluster``'s ``run_target``); ``None`` or one device: no placement.
        devices: the placer's devices (names must be the target's), limits and link costs.
        profile: measured costs of ``item`` for the placer (else two traced steps of the step
            to place are run; a profile never outlives the remat rewrite, which changes the
            graph).
        place_options: passed to ``baechi.place.place`` (method, placer_type, grouper, ...).
        verify: run the checks that compare plans with real TF runs (slower).
        verify_structure: after each pass, run its structural verifier
            (``baechi.verify``: acyclic, every read version exists, no stateful clone,
            colocation and limits kept); a debugging aid, cheap next to a TF run.
        skip: pass names (``PASSES``) not to run.
        progress: called with a line per pass; ``None`` for silence.

    Returns:
        An ``OptimizeResult``: the final item, the remat plan, the placement report, and one
        ``PassRecord`` per pass (skipped passes record why).

    Raises:
        ValueError: an unknown pass name, or devices not matching target.
        errors.ArgumentError: both budgets given, or a budget, ratio, overhead limit or
            planner that is not valid (checked before any work).
        remat.pipeline.BudgetError: no plan fits the budget (names the minimum), or, when
            verifying, the measured peak stays above it after ``MAX_PLAN_ROUNDS`` rounds.
        StepFailedError: the rewritten or placed step does not run on TensorFlow.
        baechi.schedule.PlacementError: the step cannot fit the devices (says how much is
            missing).
        profiler.step_compare.StepMismatchError: a placed step computes different values.
        baechi.verify.VerificationError: with ``verify_structure``, a pass broke an invariant.

    Examples:
        >>> from graphfit import models                              # doctest: +SKIP
        >>> from graphfit.baechi.run import local_target             # doctest: +SKIP
        >>> result = optimize(models.build("resnet", preset="activations"),
        ...                   memory_ratio=0.5, target=local_target(2))  # doctest: +SKIP
        >>> result.report()["remat"]["measured_peak_bytes"]          # doctest: +SKIP
    """
    skip = set(skip)
    unknown = skip - set(PASSES)
    if unknown:
        raise ValueError(f"unknown pass(es) {sorted(unknown)}; passes are {list(PASSES)}")
    if memory_budget is not None and memory_ratio is not None:
        raise ArgumentError("give one of memory_budget and memory_ratio, not both")
    # Checked before any profiling: a bad argument must not cost a measured run first.
    if memory_budget is not None:
        memory_budget = parse_bytes(memory_budget, "memory_budget")
    if memory_ratio is not None:
        check_number(memory_ratio, "memory_ratio", above=0)
    check_number(remat_overhead_limit, "remat_overhead_limit", minimum=1, allow_inf=True)
    if remat_heuristic not in PLANNERS:
        raise ArgumentError(f"remat_heuristic={remat_heuristic!r} is not one of "
                            f"{', '.join(PLANNERS)}")
    say = progress or (lambda _: None)
    records, plan, placement, schedule = [], None, None, None
    num_cpu_devices = target.num_cpu_devices if target is not None else 1

    original = item
    if memory_budget is None and memory_ratio is None:
        records.extend(PassRecord(name, False, 0.0, {"skipped": "no memory budget"})
                       for name in GRAPH_PASSES)
    else:
        item, graph_records = prepare_step(item, skip)
        for name, record in graph_records.items():
            records.append(PassRecord(name, record["changed"], record.pop("seconds", 0.0),
                                      record))
            if record["changed"]:
                say(f"{name}: " + ", ".join(f"{k} {v}" for k, v in record.items()
                                            if k != "changed"))

    begin = time.perf_counter()
    if "remat" in skip or (memory_budget is None and memory_ratio is None):
        records.append(PassRecord("remat", False, 0.0, {"skipped": "no memory budget"
                                                        if "remat" not in skip else "skip"}))
    else:
        say(f"remat: planning with {remat_heuristic}")
        remat_args = (memory_budget, memory_ratio, remat_heuristic, remat_overhead_limit, verify,
                      num_cpu_devices)
        try:
            before = item
            item, plan, details = _remat_pass(
                original, item, *remat_args,
                order_updates=any(r.name == "early_updates" and r.changed for r in records))
        except BudgetError as error:
            if item is original:
                raise
            # The graph passes free memory but add ordering constraints; on some steps a
            # planner then finds no plan where it finds one without them: plan that step.
            say("remat: no plan after the graph passes; planning the step without them")
            try:
                before = item = original
                item, plan, details = _remat_pass(original, original, *remat_args,
                                                  order_updates=False)
            except BudgetError:
                raise error from None
            for record in records:
                if record.name in GRAPH_PASSES and record.changed:
                    record.changed = False
                    record.details["reverted"] = f"no remat plan with it: {error}"
        if verify_structure:
            verify_rewrite(before, item, plan)
        profile = None
        records.append(PassRecord("remat", plan.num_recomputes > 0,
                                  time.perf_counter() - begin, details))
        say(f"remat: {plan.num_recomputes} recomputations, planned peak "
            f"{plan.peak_bytes / 2**20:.1f} MiB (budget {plan.budget_bytes / 2**20:.1f} MiB), "
            f"planned overhead {plan.overhead:.2f}x")

    begin = time.perf_counter()
    if "place" in skip or target is None or len(target.devices) < 2:
        records.append(PassRecord("place", False, 0.0, {"skipped": "one device"
                                                        if "place" not in skip else "skip"}))
    else:
        if devices is None:
            raise ValueError("placing needs a DeviceSet (memory limits and link costs)")
        say(f"place: {len(target.devices)} devices ({target.kind})")
        if profile is None:
            profile = profile_graph(item, steps=2, warmup=1, trace_every=1, progress=None)
        placed_item, placed = place_item(item, devices, profile, **(place_options or {}))
        if verify:
            placement = check_placement(item, placed_item, placed, target)
        else:
            placement = {"plan": placed.summary()}
            _run_once(placed_item, "placed", target.session)
        if verify_structure:
            verify_placement(item, placed_item, devices, placement["plan"]["peak_bytes"])
        item, schedule = placed_item, placed.schedule
        records.append(PassRecord("place", True, time.perf_counter() - begin, placement))
        say(f"place: planned makespan {placement['plan']['makespan_us'] / 1000:.2f} ms")
    return OptimizeResult(item, plan, placement, records, schedule)
