"""The pipeline entry point: ``pipeline.optimize(item, ...)`` runs every pass over one step.

Like Grappler's meta optimizer, a list of named, independent passes transforms one
``GraphItem``; each can be skipped, says whether it changed anything, and checks what it
promises:

- ``patch_convs``, ``conv_grad_kernels``, ``flat_matmuls``, ``grad_accumulation``,
  ``early_updates`` (``pipeline.passes.GRAPH_PASSES``): free memory no recomputation can,
  before profiling: compute strided convolutions' gradients over space-to-depth blocks
  (``remat.patch_convs``), run stride-1 convolution gradients with TF's kernels that need no
  scratch buffer (``remat.conv_grad_kernels``), batch products against one shared matrix and their weight
  gradients as one matrix product (``remat.flat_matmuls``), sum gradient contributions as they arrive
  (``remat.grad_accumulation``), apply each optimizer update as soon as its gradient exists
  (``remat.early_updates``). Run when there is a memory budget.
- ``remat``: fit a memory budget (``remat.rematerialize``: profile, DTR plan, rewrite).
  Requires a budget; ensures the plan's predicted peak is within it and that the rewritten step
  runs (one step, even without verifying). When verifying, it is a closed loop: the rewritten
  step must compute the same loss, gradients and (after the early-update pass) weights, and
  its measured peak must be within 5% of the budget; if it is not, the pass plans again for a
  budget lowered by the measured excess (``MAX_PLAN_ROUNDS`` rounds at most) and reports every
  round, or fails with the numbers. Its record has the seconds of each stage
  (``stage_seconds``: measuring, tracing, planning, verifying), also printed as progress, so a
  slow run says where its time went. Only a verified pass lets backward events float beside the
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
from graphfit.baechi.schedule import PlacementError, Schedule
from graphfit.errors import ArgumentError, check_number
from graphfit.models.graph_item import GraphItem
from graphfit.pipeline.joint import JointSpace, build_option, joint_search
from graphfit.pipeline.passes import GRAPH_PASS_NAMES, PASSES, check_skip, run_graph_passes
from graphfit.pipeline.verify import verify_placement, verify_rewrite
from graphfit.profiler.profile import Profile
from graphfit.profiler.session import run_once
from graphfit.profiler.sizes import format_bytes, parse_bytes
from graphfit.profiler.trace import print_progress, profile_graph
from graphfit.remat.closed_loop import PEAK_TOLERANCE, fit_budget
from graphfit.remat.pipeline import PLANNERS, BudgetError
from graphfit.remat.plan import RematPlan

__all__ = ["PASSES", "SMALLEST", "OptimizeResult", "PassRecord", "optimize"]

# Joint mode: how many of the search's fitting options, fastest first, are built and measured
# before giving up (each costs a rewrite, a placement and two measured runs).
JOINT_TRIES = 4
# ``memory_ratio=SMALLEST``: fit the smallest budget the planner finds a plan for (searched
# again on the orders of each fit, SMALLEST_TRIES fits at most).
SMALLEST = "min"
SMALLEST_TRIES = 3
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
        """Write the report a person reads into ``directory`` (``pipeline.report``): the JSON,
        memory per device planned against measured, the placement as a Gantt chart, the remat
        plan, the schedule as a Chrome trace, and ``summary.md``. ``extra`` joins the JSON.
        Returns the paths written."""
        from graphfit.pipeline.report import write_report

        return write_report(self, directory, extra)



def optimize(item: GraphItem, *,
             memory_budget: int | str | None = None, memory_ratio: float | str | None = None,
             joint: JointSpace | None = None,
             remat_heuristic: str = "offline", remat_overhead_limit: float = 2.0,
             target: RunTarget | None = None, devices: DeviceSet | None = None,
             profile: Profile | None = None, place_options: dict[str, Any] | None = None,
             verify: bool = True, verify_structure: bool = False, skip: Iterable[str] = (),
             predict_step_time: bool = False,
             progress: Callable[[str], None] | None = print_progress) -> OptimizeResult:
    """Rematerialize ``item`` to a memory budget, then place it on several devices.

    Parameters:
        item: the training step (``models.build``, or ``profiler.tf_function`` for Keras).
        memory_budget: bytes the step may use at its peak (resident variables and feeds
            included), an int or a size such as ``"300MiB"``; or ``memory_ratio``, a fraction
            of what the user's step adds above its resident bytes (``remat.closed_loop.
            ratio_budget``), or ``"min"``: the smallest budget the planner finds a plan for
            within ``remat_overhead_limit``. Peaks are TF's allocator's where it keeps
            statistics, else its records' (``remat.measure``; the report's ``ruler``). Neither:
            no remat.
        joint: search the remat budget and the placer together (``pipeline.joint.JointSpace``:
            the ratios and placers to try) instead of taking a budget: the fastest simulated
            option that fits every device of ``devices`` is rewritten and placed by the same
            passes, and measured; one whose measured peaks miss the limits gives way to the next
            (``JOINT_TRIES`` at most).
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
            (``pipeline.verify``: acyclic, every read version exists, no stateful clone,
            colocation and limits kept); a debugging aid, cheap next to a TF run.
        skip: pass names (``pipeline.passes.PASSES``) not to run.
        predict_step_time: when verifying, also predict the rewritten step's time against
            the user's from traced runs before measuring it (``remat.step_time``; the
            report's ``planned_step_vs_user``), for benches that check the prediction.
        progress: called with a line per pass; ``None`` for silence.

    Returns:
        An ``OptimizeResult``: the final item, the remat plan, the placement report, and one
        ``PassRecord`` per pass (skipped passes record why; joint mode adds a ``joint`` record
        with the search and every option tried).

    Raises:
        errors.ArgumentError: an unknown pass name, both budgets given, a budget with
            ``joint``, or a budget, ratio, overhead limit or planner that is not valid (checked
            before any work); ``devices`` not matching ``target``.
        remat.pipeline.BudgetError: no plan fits the budget (``smallest_bytes``: the
            smallest budget that plans, ``cause``: why this one does not), or, when
            verifying, the measured peak stays above it after every round.
        profiler.session.StepFailedError: the rewritten or placed step does not run on TF.
        baechi.schedule.PlacementError: the step cannot fit the devices (says how much is
            missing); in joint mode, no option fits (says what was tried).
        profiler.step_compare.StepMismatchError: a placed step computes different values.
        pipeline.verify.VerificationError: with ``verify_structure``, a pass broke an invariant.

    Examples:
        >>> from graphfit import models                              # doctest: +SKIP
        >>> from graphfit.baechi.run import local_target             # doctest: +SKIP
        >>> result = optimize(models.build("resnet", preset="activations"),
        ...                   memory_ratio=0.5, target=local_target(2))  # doctest: +SKIP
        >>> result.report()["remat"]["measured_peak_bytes"]          # doctest: +SKIP
    """
    skip = check_skip(skip)
    if memory_budget is not None and memory_ratio is not None:
        raise ArgumentError("give one of memory_budget and memory_ratio, not both")
    # Checked before any profiling: a bad argument must not cost a measured run first.
    if memory_budget is not None:
        memory_budget = parse_bytes(memory_budget, "memory_budget")
    if memory_ratio is not None and memory_ratio != SMALLEST:
        check_number(memory_ratio, "memory_ratio", above=0)
    check_number(remat_overhead_limit, "remat_overhead_limit", minimum=1, allow_inf=True)
    if remat_heuristic not in PLANNERS:
        raise ArgumentError(f"remat_heuristic={remat_heuristic!r} is not one of "
                            f"{', '.join(PLANNERS)}")
    placing = target is not None and len(target.devices) > 1 and "place" not in skip
    if placing and (devices is None or list(devices.names) != list(target.devices)):
        raise ArgumentError(f"placing needs a DeviceSet of the target's devices "
                            f"{list(target.devices)}; got "
                            f"{None if devices is None else list(devices.names)}")
    budgeted = memory_budget is not None or memory_ratio is not None
    if joint is not None and (budgeted or not placing):
        raise ArgumentError("joint mode searches the remat budget itself over several devices: "
                            "give a target of more than one device and its DeviceSet, and "
                            "no memory_budget or memory_ratio")
    say = progress or (lambda _: None)
    remat = _RematSettings(remat_heuristic, remat_overhead_limit, verify, verify_structure,
                           target.num_cpu_devices if target is not None else 1,
                           predict_step_time)

    records: list[PassRecord] = []
    original = item
    if budgeted or joint is not None:
        item = _graph_passes(item, skip, verify_structure, records, say)
    else:
        records.extend(PassRecord(name, False, 0.0, {"skipped": "no memory budget"})
                       for name in GRAPH_PASS_NAMES)
    if joint is not None:
        return _joint(original, item, joint, remat, target, devices, place_options, skip,
                      records, say)

    plan = None
    if "remat" in skip or not budgeted:
        records.append(PassRecord("remat", False, 0.0, {"skipped": "no memory budget"
                                                        if "remat" not in skip else "skip"}))
    else:
        item, plan = _remat_pass(original, item, memory_budget, memory_ratio, remat, records,
                                 say)
        profile = None          # measured on the step before the rewrite
    if not placing:
        records.append(PassRecord("place", False, 0.0, {"skipped": "one device"
                                                        if "place" not in skip else "skip"}))
        return OptimizeResult(item, plan, None, records)
    item, placement, schedule = _place_pass(item, target, devices, profile,
                                            place_options or {}, remat, records, say)
    return OptimizeResult(item, plan, placement, records, schedule)


@dataclasses.dataclass(frozen=True)
class _RematSettings:
    heuristic: str
    overhead_limit: float
    verify: bool
    verify_structure: bool
    num_cpu_devices: int
    predict_step_time: bool = False


def _graph_passes(item: GraphItem, skip: frozenset[str], verify_structure: bool,
                  records: list[PassRecord], say: Callable[[str], None]) -> GraphItem:
    item, graph_records = run_graph_passes(item, skip, verify_structure)
    for name, record in graph_records.items():
        records.append(PassRecord(name, record["changed"], record.pop("seconds", 0.0), record))
        if record["changed"]:
            say(f"{name}: " + ", ".join(f"{k} {v}" for k, v in record.items()
                                        if k != "changed"))
    return item


def _remat_pass(original: GraphItem, item: GraphItem, budget_bytes: int | None,
                budget_ratio: float | None, remat: _RematSettings, records: list[PassRecord],
                say: Callable[[str], None]) -> tuple[GraphItem, RematPlan]:
    """The remat closed loop (``remat.closed_loop.fit_budget``) on the step after the graph
    passes, or on the user's step when no plan fits after them."""
    begin = time.perf_counter()
    say(f"remat: planning with {remat.heuristic}")
    args = (budget_bytes, budget_ratio, remat.heuristic, remat.overhead_limit, remat.verify,
            remat.num_cpu_devices)
    early = any(r.name == "early_updates" and r.changed for r in records)
    smallest = budget_ratio == SMALLEST
    if smallest:
        budget_bytes = _smallest_budget(original, item, remat, early)
        args = (budget_bytes, None, *args[2:])
    before = item
    try:
        for attempt in range(SMALLEST_TRIES if smallest else 1):
            if smallest:
                say(f"remat: the smallest budget with a plan is {format_bytes(args[0])}")
            try:
                item, plan, details = fit_budget(original, before, *args, order_updates=early,
                                                 predict_step_time=remat.predict_step_time,
                                                 progress=say)
                break
            except BudgetError as error:
                # Each fit traces the step's orders anew, and a budget that planned on one
                # set can miss on the next by a few percent: take the new set's smallest.
                if not smallest or error.smallest_bytes is None or attempt == SMALLEST_TRIES - 1:
                    raise
                args = (error.smallest_bytes, None, *args[2:])
    except BudgetError as error:
        if item is original:
            raise
        # The graph passes free memory but add ordering constraints; on some steps a
        # planner then finds no plan where it finds one without them: plan that step.
        say("remat: no plan after the graph passes; planning the step without them")
        try:
            before = original
            item, plan, details = fit_budget(original, original, *args, order_updates=False,
                                             predict_step_time=remat.predict_step_time,
                                             progress=say)
        except BudgetError:
            raise error from None
        for record in records:
            if record.name in GRAPH_PASS_NAMES and record.changed:
                record.changed = False
                record.details["reverted"] = f"no remat plan with it: {error}"
    if remat.verify_structure:
        verify_rewrite(before, item, plan)
    records.append(PassRecord("remat", plan.num_recomputes > 0, time.perf_counter() - begin,
                              details))
    say(f"remat: {plan.num_recomputes} recomputations, planned peak "
        f"{format_bytes(plan.peak_bytes)} (budget {format_bytes(plan.budget_bytes)}), "
        f"planned overhead {plan.overhead:.2f}x")
    say("remat: seconds by stage: " + ", ".join(
        f"{stage} {seconds:.1f}" for stage, seconds in details["stage_seconds"].items()))
    return item, plan


def _smallest_budget(original: GraphItem, item: GraphItem, remat: _RematSettings,
                     early: bool) -> int:
    """``memory_ratio="min"``: the smallest budget in bytes that plans
    (``remat.pipeline.with_smallest_budget``, searched from a budget no step meets), so the
    closed loop then fits those bytes, not a ratio of a peak measured again, which moves
    between runs."""
    try:
        fit_budget(original, item, 1, None, remat.heuristic, remat.overhead_limit, False,
                   remat.num_cpu_devices, order_updates=early)
    except BudgetError as error:
        if error.smallest_bytes is None:
            raise
        return error.smallest_bytes
    raise AssertionError("a budget of one byte has a plan")


def _place_pass(item: GraphItem, target: RunTarget, devices: DeviceSet, profile: Profile | None,
                place_options: dict[str, Any], remat: _RematSettings,
                records: list[PassRecord], say: Callable[[str], None]
                ) -> tuple[GraphItem, dict[str, Any], Schedule]:
    """Place ``item`` (``baechi.place_and_run``), run it and, when verifying, check it against
    the single-device step and measure each device's peak."""
    begin = time.perf_counter()
    say(f"place: {len(target.devices)} devices ({target.kind})")
    if profile is None:
        profile = profile_graph(item, steps=2, warmup=1, trace_every=1, progress=None)
    placed_item, placed = place_item(item, devices, profile, **place_options)
    if remat.verify:
        placement = check_placement(item, placed_item, placed, target)
    else:
        placement = {"plan": placed.summary()}
        run_once(placed_item, "placed", target.session)
    if remat.verify_structure:
        verify_placement(item, placed_item, devices, placement["plan"]["peak_bytes"])
    records.append(PassRecord("place", True, time.perf_counter() - begin, placement))
    say(f"place: planned makespan {placement['plan']['makespan_us'] / 1000:.2f} ms")
    return placed_item, placement, placed.schedule


def _over_limits(placement: dict[str, Any]) -> dict[str, int]:
    """Per device, bytes measured above its limit beyond ``PEAK_TOLERANCE`` (empty: fits)."""
    measured = placement.get("measured_peak_bytes", {})
    return {name: int(measured[name] - limit) for name, limit in placement["limit_bytes"].items()
            if measured.get(name, 0) > limit * (1 + PEAK_TOLERANCE)}


def _joint(original: GraphItem, item: GraphItem, space: JointSpace, remat: _RematSettings,
           target: RunTarget, devices: DeviceSet, place_options: dict[str, Any] | None,
           skip: frozenset[str], records: list[PassRecord], say: Callable[[str], None]
           ) -> OptimizeResult:
    """Joint mode: search the options on the IR (``pipeline.joint.search``), build the fastest
    (``pipeline.joint.build_option``: rewrite, apply the search's placement), check it against
    the user's step and measure each device; an option whose measured peaks miss the limits
    gives way to the next fastest, ``JOINT_TRIES`` at most."""
    from graphfit.pipeline.verify import verify_step
    from graphfit.remat.early_updates import order_updates_after_reads

    begin = time.perf_counter()
    # Virtual CPU devices read each other's tensors in place: plan memory as it is measured.
    place_options = {"memory_model": "shared" if target.kind == "virtual_cpu" else "liveness",
                     **(place_options or {})}
    # A variable update that runs while a read of the old value is pending (a layer's input
    # gradient reads its kernel too) makes TF copy the variable. The measured step calibrates
    # the copies of its order into the plan; the placed order copies others: +-144 KiB on a
    # device of the zoo resnet (2026-12-07). Ordered first, neither step copies.
    item, update_order = order_updates_after_reads(item)
    found = joint_search(item, devices, space, remat.heuristic, remat.overhead_limit,
                         place_options, remat.num_cpu_devices, say)
    details: dict[str, Any] = {"update_order": update_order, "search": found.to_json(),
                               "searched_s": round(time.perf_counter() - begin, 3), "tried": []}
    ranked = [o for o in found.ranked() if o.plan is None or "remat" not in skip]
    for option in ranked[:JOINT_TRIES]:
        say(f"joint: building {option.label()}")
        placed, plan, edges = build_option(item, option, found.baseline_peak_bytes)
        if remat.verify_structure:
            verify_step(placed)
        if remat.verify:
            placement = check_placement(original, placed, option.placement, target,
                                        fetch_gradients=False)
        else:
            placement = {"plan": option.placement.summary()}
            run_once(placed, "placed", target.session)
        placement["memory_order_edges"] = edges
        over = _over_limits(placement) if remat.verify else {}
        details["tried"].append({"option": option.label(), "over_limit_bytes": over})
        if over:
            say("joint: measured over the limits by " + ", ".join(
                f"{format_bytes(b)} on {d}" for d, b in over.items()))
            continue
        details["built"] = option.to_json()
        remat_details = ({"skipped": "the winner recomputes nothing"} if plan is None else
                         {"budget_bytes": option.budget_bytes, "planned_peak_bytes":
                          int(plan.peak_bytes), "planned_overhead": plan.overhead,
                          "num_recomputes": plan.num_recomputes,
                          "recomputed_ops": plan.stats["recomputed_ops"],
                          "baseline_peak_bytes": found.baseline_peak_bytes})
        seconds = time.perf_counter() - begin
        return OptimizeResult(placed, plan, placement, [
            *records, PassRecord("joint", True, seconds, details),
            PassRecord("remat", plan is not None and plan.num_recomputes > 0, 0.0,
                       remat_details),
            PassRecord("place", True, 0.0, placement)], option.placement.schedule)
    raise PlacementError("no remat budget and placement fit the devices: "
                         + (found.explanation() if not ranked else
                            f"the {min(len(ranked), JOINT_TRIES)} fastest options were measured "
                            f"over the limits: {details['tried']}"))
