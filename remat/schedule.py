"""From an execution order to a plan: free every tensor right after its last read.

Static planners (checkpoint-all, Chen's segment checkpointing, the Checkmate MILP) decide
*which* ops run and in what order; when memory is released then follows from liveness. Each
(re)computation of an op makes a new version of its outputs; a version is freed right after the
last op that reads it before its producer runs again (a version no op reads is freed right
after it is made); variables' handles and the step's outputs are never freed. No free can come
later without wasting memory, so this is the least memory the order can run in. The plan's peak
and compute are measured by ``remat.validate.replay_plan``, the accounting every planner
shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, Event, RematPlan
from graphfit.remat.validate import replay_plan

__all__ = ["plan_from_schedule"]


def plan_from_schedule(graph: CostGraph, schedule: Sequence[int], budget_bytes: int | None,
                       method: str, stats: dict[str, Any] | None = None,
                       outputs: Sequence[int] = ()) -> RematPlan:
    """The plan that runs ``schedule`` and frees each tensor version after its last read.

    Args:
        graph: the cost graph.
        schedule: op ids in execution order; an op's first occurrence is its computation, later
            ones are recomputations.
        budget_bytes: the budget the plan was made for (``None``: its own peak).
        method: the planner's name, recorded in the plan.
        stats: planner-specific numbers to record.
        outputs: tensor ids that must stay resident when the step ends (fetches).

    Returns:
        A ``RematPlan`` whose ``peak_bytes`` and ``compute_us`` come from replaying it.

    Raises:
        remat.validate.PlanError: the schedule is not executable (an op reads a tensor whose
            producer has not run, a dependency runs late, a non-recomputable op runs twice).
    """
    schedule = [int(i) for i in schedule]
    # ends[p]: tensors whose current version is last read (or, unread, made) at position p.
    last_read = np.full(graph.num_tensors, -1, dtype=np.int64)
    ends: dict[int, list[int]] = {}
    made_at = np.full(graph.num_tensors, -1, dtype=np.int64)

    # The runtime holds variables' handles for the whole step (as remat.simulator does), and
    # the step's outputs must be resident when it ends.
    kept = graph.is_variable[graph.tensor_producer].copy()
    kept[list(outputs)] = True

    def close(t: int, final: bool) -> None:
        if made_at[t] >= 0 and not (final and kept[t]):
            ends.setdefault(int(max(last_read[t], made_at[t])), []).append(t)

    for position, op in enumerate(schedule):
        for t in graph.op_inputs(op):
            last_read[t] = position
        for t in graph.op_outputs(op):
            close(t, final=False)
            made_at[t], last_read[t] = position, -1
    for t in range(graph.num_tensors):
        close(t, final=True)

    seen = np.zeros(graph.num_ops, dtype=bool)
    events = []
    for position, op in enumerate(schedule):
        events.append(Event(RECOMPUTE if seen[op] else COMPUTE, op))
        seen[op] = True
        events.extend(Event(FREE, t) for t in sorted(ends.get(position, ())))
    replay = replay_plan(graph, events, outputs)
    return RematPlan(
        events=events,
        budget_bytes=int(replay.peak_bytes if budget_bytes is None else budget_bytes),
        peak_bytes=replay.peak_bytes, baseline_compute_us=replay.baseline_compute_us,
        compute_us=replay.compute_us, method=method, stats=dict(stats or {}))
