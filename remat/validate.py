"""Replay a rematerialization plan: check it is executable and measure its peak and compute.

This module is the one memory accounting every planner shares (checkpoint-all, Chen's
baselines, the Checkmate MILP, the DTR simulator's plans), so their peaks are comparable:

- resident bytes = the persistent bytes of every op (variables' buffers, held for the whole
  step) + the bytes of every resident tensor + the temporary bytes of the op running now;
- an op's (re)computation allocates all its outputs while its inputs are resident: the peak
  is sampled at every (re)compute event, after the allocation and before any ``free`` that
  follows it. An output that was still resident keeps its version; its duplicate counts as
  transient memory of the op (DTR's simulator does the same, ``remat.simulator``);
- a ``free`` event releases one tensor.

A valid plan computes every op exactly once, first computations respecting data and control
dependencies; (re)computes an op only when every tensor it reads is resident; recomputes only
ops that are safe to run twice (``recomputable_ops``, the simulator's rule: not stateful,
random, a variable, a resource read, nor an op without data inputs); frees only resident
tensors; leaves the step's ``outputs`` resident at the end.
``minimum_budget_bytes`` (also the simulator's) is the lower bound every planner names when a
budget is infeasible.

References:
    Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021 (the memory model).
    Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020 (resident memory = checkpoints + live values + the op).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from graphfit.errors import GraphfitError
from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, RematPlan
from graphfit.remat.simulator import minimum_budget_bytes, recomputable_ops

__all__ = [
    "InfeasibleBudgetError",
    "PlanError",
    "Replay",
    "minimum_budget_bytes",
    "recomputable_ops",
    "replay_plan",
]

class PlanError(GraphfitError, ValueError):
    """A plan cannot be executed as written (use after free, missing compute, ...)."""


class InfeasibleBudgetError(GraphfitError, ValueError):
    """No plan of this planner fits the memory budget.

    Attributes:
        budget_bytes: the budget asked for.
        minimum_bytes: the smallest budget the planner can meet, or a lower bound of it.
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int):
        super().__init__(message)
        self.budget_bytes = int(budget_bytes)
        self.minimum_bytes = int(minimum_bytes)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What a replay measured.

    Attributes:
        peak_bytes: the highest resident bytes (persistent bytes included).
        peak_event: index into the plan's events of the (re)compute where the peak occurs.
        compute_us: total compute time, recomputations included.
        baseline_compute_us: compute time of every op once.
        num_recomputes: recompute events.
    """

    peak_bytes: int
    peak_event: int
    compute_us: float
    baseline_compute_us: float
    num_recomputes: int

    @property
    def overhead(self) -> float:
        """compute_us / baseline_compute_us (1.0 = no recomputation)."""
        return self.compute_us / self.baseline_compute_us if self.baseline_compute_us else 1.0


def replay_plan(graph: CostGraph, plan: RematPlan | list,
                outputs: Sequence[int] = ()) -> Replay:
    """Execute a plan's events on paper: check them and measure peak memory and compute.

    Args:
        graph: the cost graph the plan was made for.
        plan: a ``RematPlan`` or its list of events.
        outputs: tensor ids that must be resident when the step ends (fetches).

    Returns:
        The measured ``Replay`` (peak_bytes, compute_us, ...).

    Raises:
        PlanError: naming the first offending event: an op computed twice or never, computed
            before a (data or control) predecessor, a recompute of an op never computed or not
            recomputable, a read of a tensor that is not resident (use after free), a free of a
            tensor that is not resident, an unknown event kind, or a step output not resident
            at the end.
    """
    events = plan.events if isinstance(plan, RematPlan) else plan
    n = graph.num_ops
    recomputable = recomputable_ops(graph)
    computed = np.zeros(n, dtype=bool)
    resident = np.zeros(graph.num_tensors, dtype=bool)
    persistent = int(graph.persistent_bytes.sum())
    live_bytes, peak_bytes, peak_event = 0, persistent, -1
    recompute_us, recomputes = 0.0, 0
    for position, (kind, index) in enumerate(events):
        where = f"event {position} ({kind} {index})"
        if kind == FREE:
            if not 0 <= index < graph.num_tensors or not resident[index]:
                raise PlanError(f"{where}: frees tensor {index}, which is not resident")
            resident[index] = False
            live_bytes -= int(graph.tensor_bytes[index])
            continue
        if kind not in (COMPUTE, RECOMPUTE):
            raise PlanError(f"{where}: unknown event kind {kind!r}")
        if not 0 <= index < n:
            raise PlanError(f"{where}: no op {index} in a graph of {n} ops")
        name = graph.names[index]
        if kind == COMPUTE:
            if computed[index]:
                raise PlanError(f"{where}: op {name!r} is computed twice; later runs must be "
                                "recompute events")
            missing = [p for p in graph.predecessors(index) if not computed[p]]
            if missing:
                raise PlanError(f"{where}: op {name!r} runs before its predecessor "
                                f"{graph.names[missing[0]]!r}")
        else:
            if not computed[index]:
                raise PlanError(f"{where}: op {name!r} is recomputed before it is computed")
            if not recomputable[index]:
                raise PlanError(f"{where}: op {name!r} ({graph.op_types[index]}) is stateful, "
                                "random, a variable, a resource read or a feed: it may not be "
                                "recomputed")
            recomputes += 1
            recompute_us += float(graph.compute_us[index])
        for t in graph.op_inputs(index):
            if not resident[t]:
                raise PlanError(f"{where}: op {name!r} reads {graph.tensor_name(int(t))}, which "
                                "is not resident (freed or never made)")
        computed[index] = True
        duplicate_bytes = 0
        for t in graph.op_outputs(index):
            if resident[t]:
                duplicate_bytes += int(graph.tensor_bytes[t])
            else:
                resident[t] = True
                live_bytes += int(graph.tensor_bytes[t])
        resident_bytes = persistent + live_bytes + duplicate_bytes + int(graph.temp_bytes[index])
        if resident_bytes > peak_bytes:
            peak_bytes, peak_event = resident_bytes, position
    if not computed.all():
        first = int(np.flatnonzero(~computed)[0])
        raise PlanError(f"op {graph.names[first]!r} and {int((~computed).sum()) - 1} others are "
                        "never computed")
    lost = [int(t) for t in outputs if not resident[t]]
    if lost:
        raise PlanError(f"step output {graph.tensor_name(lost[0])} is not resident at the end")
    baseline_us = float(graph.compute_us.sum())
    return Replay(peak_bytes=int(peak_bytes), peak_event=peak_event,
                  compute_us=baseline_us + recompute_us, baseline_compute_us=baseline_us,
                  num_recomputes=recomputes)
