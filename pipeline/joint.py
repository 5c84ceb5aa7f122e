"""Joint rematerialization and placement: how much to recompute and where each op goes, together.

``pipeline.optimize`` runs its passes one after the other: rematerialize to one budget, then place.
The user's question is another one: "here are N devices of M bytes each; make my step fit and
run fast". Recomputing more lowers every device's memory but lengthens the step; recomputing
less leaves more for the placer to spread, at the price of transfers or of not fitting at all.
``search`` explores that trade-off on the IR alone:

1. for each remat budget (a fraction of the measured single-device peak, from no
   rematerialization down to the planner's minimum), plan with a DTR planner on the
   calibrated planning graph (``remat.tf_memory.MemoryModel.plan_graph``) of the traced order
   and of that order with its backward pass reordered, each plan filled into the room TF's
   peak leaves below the budget, and keep the cheaper (``remat.pipeline.cheapest_plan``, as
   ``remat.rematerialize`` plans);
2. unroll the plan into the graph the rewritten step will run (``remat.recompute_graph``, with
   the buffers TF hands to a sole reader written in: ``take_over_buffers``);
3. place it with each placer (``baechi.place``: m-ETF, m-TOPO, ...) under every device's limit;
   the placer's liveness model replays each device's memory over the simulated step;
4. keep the option with the shortest simulated makespan that fits every device; then bisect
   the budget between the winner and the next larger budget that did not fit, since the
   largest budget that still places usually recomputes least.

Two one-pass options are simulated beside it for comparison: **place only** (the step as it is,
on the devices) and **remat only** (rematerialized to the smallest device's memory, run on that
one device). ``joint_search`` measures the step once and runs the search; the search only
ranks. ``pipeline.optimize(joint=JointSpace(...))`` then builds the fastest option through the
same passes as every other way in (the remat closed loop, the placement with the plain path's
colocation grouping, the verifiers) and measures each device's peak against its limit; an
option that misses gives way to the next.

References:
    Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021 (the remat planners);
    Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020 (the
    memory-constrained placers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place import Placement, place, place_feeds_first
from graphfit.baechi.schedule import PlacementError
from graphfit.profiler.progress import progress_bar
from graphfit.profiler.sizes import format_bytes
from graphfit.remat.pipeline import BudgetError, cheapest_plan, planning_orders
from graphfit.remat.plan import RematPlan
from graphfit.remat.recompute_graph import (RecomputeGraph, clone_name, recompute_graph,
                                            take_over_buffers)

__all__ = ["DEFAULT_RATIOS", "DEFAULT_METHODS", "Option", "JointSearch", "JointSpace", "search",
           "joint_search", "build_option"]

# Remat budgets tried, as fractions of the measured single-device peak (1.0: no remat).
DEFAULT_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15)
DEFAULT_METHODS = ("m_etf", "m_topo")
REFINE_STEPS = 3


@dataclasses.dataclass
class Option:
    """One simulated option: a remat budget (or none) and a placement (or one device).

    Attributes:
        kind: ``"joint"`` (searched), ``"place_only"`` or ``"remat_only"``.
        ratio: the remat budget as a fraction of the single-device peak (``None``: no remat).
        budget_bytes: the remat budget.
        method: the placer (``None``: one device, no placement).
        fits: every device holds its part of the step.
        reason: why it does not fit (empty when it does).
        makespan_us: the simulated step time (``None`` when it does not fit).
        peak_bytes: simulated peak per device.
        remat_peak_bytes, overhead, num_recomputes: the remat plan's single-device peak
            (TF-calibrated), compute multiple and recomputations.
        model, plan, unrolled, placement: the objects behind the numbers (not serialized):
            the memory model of the order planned (or placed), its plan, the plan unrolled.
    """

    kind: str
    ratio: float | None
    budget_bytes: int | None
    method: str | None
    fits: bool = False
    reason: str = ""
    makespan_us: float | None = None
    peak_bytes: list[int] | None = None
    remat_peak_bytes: int | None = None
    overhead: float = 1.0
    num_recomputes: int = 0
    model: Any = dataclasses.field(default=None, repr=False)
    plan: RematPlan | None = dataclasses.field(default=None, repr=False)
    unrolled: RecomputeGraph | None = dataclasses.field(default=None, repr=False)
    placement: Placement | None = dataclasses.field(default=None, repr=False)

    def label(self) -> str:
        budget = "no remat" if self.ratio is None else f"remat to {self.ratio:.3g} of the peak"
        where = f"{self.method} over the devices" if self.method else "one device"
        return f"{budget}, {where}"

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("model", "plan", "unrolled", "placement")}


@dataclasses.dataclass
class JointSearch:
    """What the search tried and what won.

    Attributes:
        options: every joint option simulated, in the order tried.
        winner: the fitting option with the shortest makespan (``None``: nothing fits).
        place_only: the best placement of the step without remat.
        remat_only: the step rematerialized to the smallest device, on that device.
        baseline_peak_bytes: the measured single-device peak the ratios refer to.
        devices: the devices searched over.
    """

    options: list[Option]
    winner: Option | None
    place_only: Option
    remat_only: Option
    baseline_peak_bytes: int
    devices: DeviceSet

    def ranked(self) -> list[Option]:
        """The options that fit, fastest simulated step first (fewer recomputations on a
        tie): the order in which ``pipeline.optimize`` builds and measures them."""
        fitting = [o for o in [*self.options, self.place_only] if o.fits]
        unique = {(o.ratio, o.method): o for o in reversed(fitting)}     # refinements repeat
        return sorted(unique.values(), key=_rank)

    def explanation(self) -> str:
        """Why the winner won, in one paragraph."""
        if self.winner is None:
            closest = min(self.options, key=lambda o: o.ratio or 1.0)
            return (f"nothing fits: {len(self.options)} remat budgets x placers tried; the "
                    f"smallest budget, {closest.ratio:.3g} of the peak, failed because "
                    f"{closest.reason}; placing without remat failed because "
                    f"{self.place_only.reason}")
        w = self.winner
        fitting = sorted((o for o in [*self.options, self.place_only] if o.fits),
                         key=lambda o: o.makespan_us)
        runner_up = next((o for o in fitting if o is not w), None)
        larger = [o for o in self.options if not o.fits and (o.ratio or 1.0) > (w.ratio or 1.0)]
        text = [f"{w.label()} fits every device (simulated peaks "
                f"{', '.join(f'{b / 2**20:.2f}' for b in w.peak_bytes)} MiB of "
                f"{', '.join(f'{b / 2**20:.2f}' for b in self.devices.memory_bytes)} MiB) with "
                f"the shortest simulated step, {w.makespan_us / 1000:.2f} ms "
                f"({w.num_recomputes} recomputations, compute x{w.overhead:.2f})."]
        if runner_up is not None:
            text.append(f"Next best: {runner_up.label()}, {runner_up.makespan_us / 1000:.2f} ms.")
        if larger:
            text.append(f"{len(larger)} option(s) with less rematerialization did not fit, "
                        f"e.g. {larger[-1].label()}: {larger[-1].reason}.")
        text.append(f"{len(fitting)} of {len(self.options) + 1} options fit.")
        return " ".join(text)

    def to_json(self) -> dict[str, Any]:
        return {"baseline_peak_bytes": self.baseline_peak_bytes,
                "devices": list(self.devices.names),
                "limit_bytes": self.devices.memory_bytes.tolist(),
                "options": [o.to_json() for o in self.options],
                "winner": None if self.winner is None else self.winner.to_json(),
                "place_only": self.place_only.to_json(),
                "remat_only": self.remat_only.to_json(),
                "explanation": self.explanation()}


def _short(error: Exception) -> str:
    return str(error).split(". ")[0]


def _plan(models, budget_bytes: int | None, heuristic: str, overhead_limit: float,
          loss: str | None, option: Option) -> bool:
    """Fill ``option``'s model, plan (the cheapest of ``models``' orders; its peak in TF's
    accounting) and remat numbers; ``False`` (with a reason) when none fits."""
    from graphfit.remat.tf_memory import expand_plan

    try:
        option.model, plan = cheapest_plan(models, budget_bytes, heuristic, overhead_limit,
                                           loss)
    except BudgetError as error:
        option.reason = _short(error)
        return False
    option.plan, option.remat_peak_bytes = plan, int(plan.peak_bytes)
    option.overhead = plan.overhead
    # Counted in TF ops, as the built step's plan (remat_plan.md) counts them: a recomputed
    # chain of the planning graph is several ops.
    option.num_recomputes = expand_plan(option.model, plan).num_recomputes
    return True


def _place(graph, devices: DeviceSet, option: Option, place_options: dict) -> None:
    try:
        placer = place_feeds_first if place_options.get("memory_model") == "shared" else place
        placement = placer(graph, devices, method=option.method, **place_options)
    except PlacementError as error:
        option.reason = _short(error)
        return
    option.placement, option.fits = placement, True
    option.makespan_us = float(placement.makespan_us)
    option.peak_bytes = placement.peak_bytes.tolist()


def _joint_options(models, devices, baseline_peak_bytes, ratio, methods, heuristic,
                   overhead_limit, loss, place_options) -> list[Option]:
    budget = int(ratio * baseline_peak_bytes)
    options = [Option("joint", ratio, budget, method) for method in methods]
    if not _plan(models, budget, heuristic, overhead_limit, loss, options[0]):
        for option in options[1:]:
            option.reason = options[0].reason
        return options
    model = options[0].model
    unrolled = take_over_buffers(recompute_graph(model.plan_graph, options[0].plan, loss),
                                 model.plan_graph, model.reuses)
    for option in options:
        option.model, option.plan, option.unrolled = model, options[0].plan, unrolled
        option.remat_peak_bytes, option.overhead = options[0].remat_peak_bytes, options[0].overhead
        option.num_recomputes = options[0].num_recomputes
        _place(unrolled.graph, devices, option, place_options)
    return options


def _rank(option: Option) -> tuple:
    """Fastest simulated step first; on a tie fewer recomputations, then the larger budget, so
    the winner the search names is the option ``pipeline.optimize`` builds first."""
    return option.makespan_us, option.num_recomputes, -(option.ratio or 1.0)


def _best(options: Sequence[Option]) -> Option | None:
    return min((o for o in options if o.fits), key=_rank, default=None)


def search(models, devices: DeviceSet, baseline_peak_bytes: int, loss: str | None = None,
           ratios: Sequence[float] = DEFAULT_RATIOS, methods: Sequence[str] = DEFAULT_METHODS,
           heuristic: str = "offline", overhead_limit: float = 2.0,
           place_options: dict[str, Any] | None = None, refine_steps: int = REFINE_STEPS,
           progress: bool = True) -> JointSearch:
    """Search remat budgets and placers together for the fastest step that fits every device.

    Parameters:
        models: the step's ``remat.tf_memory.MemoryModel`` (calibrated cost graphs), or a
            list of them, one per order to plan (``remat.pipeline.planning_orders``; the
            first is placed as it is for the place-only option).
        devices: the devices, their memory limits and link costs.
        baseline_peak_bytes: the step's measured single-device peak (ratios refer to it).
        loss: the loss tensor's name (kept resident; where the forward pass ends).
        ratios: remat budgets to try, as fractions of ``baseline_peak_bytes``, largest first;
            1.0 plans without recomputation.
        methods: placers of ``baechi.place.METHODS`` to try at each budget.
        heuristic: the remat planner (``remat.pipeline.PLANNERS``).
        overhead_limit: compute multiple beyond which a DTR planner gives up.
        place_options: more keywords for ``baechi.place.place`` (not ``method``).
        refine_steps: bisections of the budget above the best grid option.
        progress: show a progress bar on a terminal.

    Returns:
        The ``JointSearch`` (every option, the winner, the two one-pass alternatives).

    Raises:
        ValueError: no ratio in (0, 1], or no method.
    """
    ratios = sorted({float(r) for r in ratios}, reverse=True)
    if not ratios or ratios[0] > 1.0 or ratios[-1] <= 0.0 or not methods:
        raise ValueError(f"ratios must lie in (0, 1] and methods be given; got ratios "
                         f"{ratios} and methods {list(methods)}")
    place_options = {k: v for k, v in (place_options or {}).items() if k != "method"}
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    args = (models, devices, baseline_peak_bytes)
    rest = (methods, heuristic, overhead_limit, loss, place_options)
    options: list[Option] = []
    for ratio in progress_bar(ratios, "joint search", enabled=progress):
        tried = _joint_options(*args, ratio, *rest)
        options += tried
        if tried[0].plan is None and tried[0].reason:
            break                       # below the planner's minimum: smaller ones fail too
    best = _best(options)
    if best is not None:
        above = [o.ratio for o in options if o.ratio > best.ratio and not any(
            p.fits for p in options if p.ratio == o.ratio)]
        low, high = best.ratio, min(above, default=None)
        for _ in range(refine_steps if high is not None else 0):
            middle = round((low + high) / 2, 4)
            tried = _joint_options(*args, middle, (best.method,), *rest[1:])
            options += tried
            low, high = (middle, high) if tried[0].fits else (low, middle)
        best = _best(options)

    alone = [Option("place_only", None, None, method, model=models[0]) for method in methods]
    for option in alone:
        _place(models[0].plan_graph, devices, option, place_options)
    place_only = _best(alone) or alone[0]
    # Placing the step as it is needs no rewrite, hence none of its ordering edges (which
    # serialise the backward pass across devices): it competes with the searched options.
    best = _best([o for o in (best, place_only) if o is not None])

    smallest = int(devices.memory_bytes.min())
    remat_only = Option("remat_only", smallest / baseline_peak_bytes, smallest, None)
    if _plan(models, smallest, heuristic, overhead_limit, loss, remat_only):
        remat_only.fits = remat_only.remat_peak_bytes <= smallest
        remat_only.makespan_us = float(remat_only.plan.compute_us)
        remat_only.peak_bytes = [remat_only.remat_peak_bytes]
        remat_only.reason = "" if remat_only.fits else "the plan's TF peak exceeds the device"
    return JointSearch(options, best, place_only, remat_only, int(baseline_peak_bytes), devices)


@dataclasses.dataclass(frozen=True)
class JointSpace:
    """What joint mode searches: remat budgets as fractions of the measured single-device peak
    (1.0: no recomputation) and placers of ``baechi.place.METHODS``."""

    ratios: Sequence[float] = DEFAULT_RATIOS
    methods: Sequence[str] = DEFAULT_METHODS


def joint_search(item, devices: DeviceSet, space: JointSpace, heuristic: str,
                 overhead_limit: float, place_options: dict[str, Any], num_cpu_devices: int,
                 say: Callable[[str], None]) -> JointSearch:
    """Measure ``item`` (the step after the graph passes) on one device and ``search`` its
    traced orders; ``pipeline.optimize`` builds the options it ranks."""
    from graphfit.remat.measure import measure_step
    from graphfit.remat.tf_memory import tf_memory_model

    say("joint: measuring the step on one device")
    baseline = measure_step(item, steps=3, warmup=1, num_cpu_devices=num_cpu_devices)
    model = tf_memory_model(item, baseline.profile)
    say(f"joint: single-device peak {format_bytes(baseline.peak_bytes)}; searching "
        f"{len(space.ratios)} remat budgets x {len(space.methods)} placers over "
        f"{len(devices)} devices")
    found = search(list(planning_orders(item, [model])), devices, baseline.peak_bytes, item.loss,
                   space.ratios, space.methods, heuristic, overhead_limit, place_options,
                   progress=True)
    say(f"joint: {found.explanation()}")
    return found


def _node_ops(option: Option) -> list[list[str]]:
    """Per node of the winner's placed graph, its TF ops in execution order: the node's
    planning-graph chain (of the winner's model), named as ``remat.rewrite`` names the
    clones."""
    model = option.model
    cost_names = model.cost_graph.names
    source = (option.unrolled.source if option.unrolled is not None else
              [(op, 0) for op in range(model.plan_graph.num_ops)])
    return [[clone_name(cost_names[m], version) if version else cost_names[m]
             for m in model.members[op]] for op, version in source]


def _op_devices(option: Option) -> dict[str, str]:
    """TF op name -> device of the winner."""
    names = option.placement.devices.names
    return {name: names[int(option.placement.device_index[node])]
            for node, ops in enumerate(_node_ops(option)) for name in ops}


def _op_ordering(option: Option) -> list[tuple[str, str]]:
    """The winner's ``Placement.memory_order()`` over TF ops: a node ends with its last op
    and starts with its first."""
    nodes = _node_ops(option)
    index = {name: k for k, name in enumerate(option.placement.graph.names)}
    return [(nodes[index[a]][-1], nodes[index[b]][0])
            for a, b in option.placement.memory_order()]


def build_option(item, option: Option, baseline_peak_bytes: int):
    """The step ``option`` simulated, in TensorFlow: ``item`` rewritten by its plan
    (``remat.rewrite``) and placed as the search placed it, each device running its ops in the
    planned memory order (``Placement.memory_order``).

    The search's placement is applied, not placed again: it was found on the calibrated
    planning graph, whose forwarding chains and measured peaks are what TF allocates; the
    rewritten step's own cost graph counts forwarded buffers twice and missed 10.5 MiB devices
    by 11-277 KiB where the search fit (the demo mlp, 2026-12-06). The planning graph carries
    TF's colocation groups (``remat.tf_memory``), so the placement keeps them.

    Returns:
        ``(placed item, expanded plan or None, recomputed ops, memory-order edges)``.
    """
    from graphfit.baechi.apply import apply_placement
    from graphfit.remat.early_updates import order_updates_after_reads
    from graphfit.remat.rewrite import rewrite
    from graphfit.remat.tf_memory import expand_plan

    expanded, rewritten = None, item
    if option.plan is not None:
        expanded = expand_plan(option.model, option.plan)
        expanded.stats["baseline_peak_bytes"] = int(baseline_peak_bytes)
        expanded.stats["recomputed_ops"] = expanded.recomputed_ops(option.model.cost_graph)
        # As the remat pass does: a clone the plan reads a variable with before its update
        # must run before it, or TF copies the variable for it, bytes the plan does not hold
        # (74-147 KiB a kernel, 7.7% of a device's peak in the joint zoo resnet, 2026-12-07).
        rewritten, _ = order_updates_after_reads(rewrite(item, option.model.cost_graph,
                                                         expanded))
    ordering = _op_ordering(option)
    placed = apply_placement(rewritten, _op_devices(option), ordering=ordering)
    return placed, expanded, len(ordering)
