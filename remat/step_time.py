"""Predict the wall time of a rematerialized step, from traces of the step before the rewrite.

A plan's ``overhead`` counts recomputation only: compute with recomputes over compute without,
at the profiled op times (what DTR's paper reports). On a CPU that is not what the user sees.
TF runs independent ops side by side on its inter-op threads (on this 2-core machine the op
times of the zoo's resnet preset sum to 1.7-1.8x its step's wall time), and ``remat.rewrite``
chains the backward pass in plan order from ``pinned_from`` on (its ``"tail"`` pinning), so
those ops run one at a time. The rewritten step then costs::

    forward + gap * sum(serial time of each pinned event's op, recomputes included)

- ``forward``: when the chain can start in the original step as the user runs it (ops side
  by side): the start of the first pinned event's op, or the end of the event before it if
  that is later. The rewrite leaves everything before it unpinned.
- the serial time of an op: its duration in the serial chain (``serial_chain``): the step
  with every op chained in its traced order by the rewrite itself and nothing recomputed, so
  ops run one at a time, each with the whole intra-op pool, in the same runtime (TF's global
  thread pools) and under the same configuration as the rewritten step's chain. Ops that
  Grappler's remapper ran inside their reader cost 0 (their reader's node carries the time;
  ``remat.remapper_fusions`` keeps clones fused the same way).
- ``gap``: the serial chain's wall time over the sum of its op times (the executor's time
  between ops, and tracing's: every time is of untraced steps, ``profiler.op_intervals``).

A session of its own with one inter-op thread (``profiler.session.serial_config``) runs ops
one at a time too, but not as the chain runs: its untraced walls on the zoo's resnet preset
jumped between two levels, 120-180 and 240-350 ms, within one call and from process to
process, while the chained step's stayed at 114-167 ms (2026-12-05), and the prediction moved
with them (resnet 1.63 and 1.78 of the user's step against 1.13-1.17 measured).

Where the rewrite lets events float beside the chain (``remat.side_by_side``; in
``baechi.optimize`` when it verifies), the prediction still counts them in the chain, one after
the other, so it over-predicts a step where floating gains much (``tools.bench_side_by_side``,
2026-12-05: the DenseNet-style step predicted 1.30 of the user's step, measured 1.10; Keras
attention 1.54 and 1.40; the five other steps measured 0.89-1.11 of their prediction).
Crediting the earlier two-event window's overlap with the op times of the step as it runs
(the ops that overlapped there) was tried and predicted 14-18% too little or too much on three
of six models. Crediting floating events at the user's backward pace (the user's backward
wall over the serial chain's, 0.76-0.93) was tried with the serial chain (``tools.
bench_grappler --quick``, 2026-12-05 07:15): within 10% on 4 of 6 models (attention measured
1.16 of it, depthwise 1.11), against 5 of 6 for the same plans without it.

Walls come from untraced steps of the three (the step as it runs, one op at a time, the user's)
timed side by side, round by round: on a shared 2-core machine a 30 ms Keras step's wall moved
between 20 and 32 ms from one minute to the next, and a prediction made of walls measured apart
moved with it (1.10-1.46 of the user's step in four runs). The prediction is made per round,
against the user's step of the same round, and the median taken.

The prediction is compared with the measured step by ``baechi.pipeline`` (``verify``) and
``tools.bench_grappler``: planned = measured.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.op_intervals import StepIntervals, op_intervals
from graphfit.profiler.session import step_config, user_config
from graphfit.remat.baselines import checkpoint_all
from graphfit.remat.plan import FREE, RematPlan
from graphfit.remat.rewrite import rewrite
from graphfit.remat.tf_memory import MemoryModel, expand_plan, step_item, tf_memory_model

__all__ = ["StepTimePrediction", "StepTraces", "predict_step_time", "serial_chain",
           "trace_for_prediction"]


@dataclasses.dataclass(frozen=True)
class StepTimePrediction:
    """A predicted step time (µs, untraced) and its parts (module docstring). ``vs_user`` is
    the median over rounds of the prediction over the user's step of the same round (walls
    measured side by side), not ``predicted_step_us / user_step_us`` of the medians."""

    user_step_us: float
    predicted_step_us: float
    forward_us: float
    pinned_serial_us: float
    serial_gap: float
    vs_user: float

    def report(self) -> dict[str, float]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)


def _wall(step: dict[str, tuple[float, float]]) -> float:
    return max(end for _, end in step.values())


def predict_step_time(op_names: Sequence[str], plan: RematPlan, pinned_from: int,
                      concurrent: StepIntervals, serial: StepIntervals,
                      user: StepIntervals | None = None) -> StepTimePrediction:
    """The rewritten step's time (module docstring).

    Parameters:
        op_names: the names of the ops ``plan``'s events index (its cost graph's ``names``).
        plan: the plan the rewrite lowered; ``pinned_from``: the position of its first
            chained event (``config["remat"]["pinned_from"]`` of the rewritten step).
        concurrent, serial: op intervals (``profiler.op_intervals``) of the step that was
            planned, run as usual and one op at a time (``serial_chain``).
        user: intervals of the user's own step, if it is another graph (default
            ``concurrent``).

    The traces give shares: the forward part's of the concurrent step's wall, the pinned ops'
    of the serial step's summed op times. Each round of untraced walls (measured side by side,
    so every round saw one load) turns them into a time: ``share * wall`` of its kind, over the
    user's wall of that round.

    Raises:
        ValueError: no traced or untraced step, or untraced walls that are not of the same
            rounds.
    """
    user = user or concurrent
    walls = concurrent.untraced_wall_us, serial.untraced_wall_us, user.untraced_wall_us
    if not (concurrent.traced and serial.traced and walls[0]):
        raise ValueError("need at least one traced and one untraced step of each kind")
    if len({len(w) for w in walls}) != 1:
        raise ValueError(f"untraced walls of {[len(w) for w in walls]} rounds: measure the "
                         f"steps side by side (op_intervals of all of them at once)")
    names = [op_names[e.index] if e.kind != FREE else None for e in plan.events]
    serial_us = {name: statistics.median(step[name][1] - step[name][0]
                                         for step in serial.traced if name in step)
                 for name in set().union(*serial.traced)}
    op_sum = max(statistics.median(sum(e - s for s, e in step.values())
                                   for step in serial.traced), 1e-9)
    pinned = [name for name in names[pinned_from:] if name is not None]
    before = next((name for name in reversed(names[:pinned_from]) if name), None)

    def chain_start(step: dict) -> float:
        first = next((step[name][0] for name in pinned if name in step), _wall(step))
        return max(first, step[before][1] if before in step else 0.0)

    forward_share = (statistics.median(chain_start(step) for step in concurrent.traced) /
                     statistics.median(_wall(step) for step in concurrent.traced))
    pinned_us = sum(serial_us.get(name, 0.0) for name in pinned)
    predicted = [forward_share * c + pinned_us / op_sum * s for c, s in zip(*walls[:2])]
    return StepTimePrediction(
        user_step_us=statistics.median(walls[2]),
        predicted_step_us=statistics.median(predicted),
        forward_us=forward_share * statistics.median(walls[0]),
        pinned_serial_us=pinned_us, serial_gap=statistics.median(walls[1]) / op_sum,
        vs_user=statistics.median(p / u for p, u in zip(predicted, walls[2])))


class StepTraces(NamedTuple):
    """What a prediction reads: ``concurrent``, ``serial`` and ``user`` of
    ``predict_step_time``. They depend on the steps only, not on the plan: trace once, predict
    for every plan of the same step."""

    concurrent: StepIntervals
    serial: StepIntervals
    user: StepIntervals | None


def serial_chain(item: GraphItem, model: MemoryModel | None = None) -> GraphItem:
    """``item`` with every op chained in ``model``'s traced order (default: a new trace of
    ``item``) and nothing recomputed: ``remat.rewrite``'s ``pin_order="all"`` of a
    checkpoint-all plan, so its ops run one at a time as the rewritten step's chain runs them
    (module docstring)."""
    model = model or tf_memory_model(item)
    plan = expand_plan(model, checkpoint_all(model.plan_graph))
    return rewrite(item, model.cost_graph, plan, pin_order="all")


def trace_for_prediction(original: GraphItem, item: GraphItem, model: MemoryModel | None = None,
                         rounds: int = 5, traced: int = 4, min_seconds: float = 3.0
                         ) -> StepTraces:
    """Trace ``item`` (the step a plan is made for: ``original`` after the graph passes) as it
    runs and as its ``serial_chain`` (by ``model``'s order, if given), and ``original`` as the
    user runs it (TF's defaults), for ``predict_step_time(names, plan, pinned_from,
    *traces)``: the untraced walls of all three side by side, at least ``rounds`` rounds and
    ``min_seconds`` (``op_intervals``)."""
    chain = serial_chain(item, model)
    steps = {"concurrent": (step_item(item), step_config(item)),
             "serial": (step_item(chain), step_config(chain))}
    if original is not item:
        steps["user"] = (step_item(original), user_config())
    intervals = op_intervals(steps, rounds, traced, min_seconds=min_seconds)
    return StepTraces(intervals["concurrent"], intervals["serial"], intervals.get("user"))
