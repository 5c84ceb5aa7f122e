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
- the serial time of an op: its duration with ops run one at a time
  (``profiler.session.serial_config``), each with the whole intra-op pool, as in the chain.
  Ops that Grappler's remapper ran inside their reader cost 0 (their reader's node carries the
  time; ``remat.remapper_fusions`` keeps clones fused the same way).
- ``gap``: the serial step's wall time over the sum of its op times (the executor's time
  between ops, and tracing's: every time is of untraced steps, ``profiler.op_intervals``).

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
from graphfit.profiler.session import serial_config, step_config, user_config
from graphfit.remat.plan import FREE, RematPlan
from graphfit.remat.tf_memory import step_item

__all__ = ["StepTimePrediction", "StepTraces", "predict_step_time", "trace_step"]


@dataclasses.dataclass(frozen=True)
class StepTimePrediction:
    """A predicted step time (µs, untraced) and its parts (module docstring)."""

    user_step_us: float
    predicted_step_us: float
    forward_us: float
    pinned_serial_us: float
    serial_gap: float

    @property
    def vs_user(self) -> float:
        """Predicted step time over the user's."""
        return self.predicted_step_us / self.user_step_us

    def report(self) -> dict[str, float]:
        """JSON-ready fields, ``vs_user`` included."""
        return {**dataclasses.asdict(self), "vs_user": self.vs_user}


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
            planned, run as usual and one op at a time.
        user: intervals of the user's own step, if it is another graph (default
            ``concurrent``).

    Times are of untraced steps: the traced forward part is scaled by the untraced / traced
    wall time of its run, and ``gap`` is the untraced serial step over the traced op times.
    """
    if not (concurrent.traced and serial.traced and concurrent.untraced_wall_us
            and serial.untraced_wall_us):
        raise ValueError("need at least one traced and one untraced step of each kind")
    names = [op_names[e.index] if e.kind != FREE else None for e in plan.events]
    serial_us = {name: statistics.median(step[name][1] - step[name][0]
                                         for step in serial.traced if name in step)
                 for name in set().union(*serial.traced)}
    gap = statistics.median(serial.untraced_wall_us) / max(
        statistics.median(sum(e - s for s, e in step.values()) for step in serial.traced), 1e-9)
    pinned = [name for name in names[pinned_from:] if name is not None]
    before = next((name for name in reversed(names[:pinned_from]) if name), None)

    def chain_start(step: dict) -> float:
        first = next((step[name][0] for name in pinned if name in step), _wall(step))
        return max(first, step[before][1] if before in step else 0.0)

    untraced = statistics.median(concurrent.untraced_wall_us)
    forward = statistics.median(chain_start(step) for step in concurrent.traced) * untraced / \
        statistics.median(_wall(step) for step in concurrent.traced)
    pinned_us = sum(serial_us.get(name, 0.0) for name in pinned)
    return StepTimePrediction(
        user_step_us=statistics.median((user or concurrent).untraced_wall_us),
        predicted_step_us=forward + gap * pinned_us, forward_us=forward,
        pinned_serial_us=pinned_us, serial_gap=gap)


class StepTraces(NamedTuple):
    """What a prediction reads: ``concurrent``, ``serial`` and ``user`` of
    ``predict_step_time``. They depend on the steps only, not on the plan: trace once, predict
    for every plan of the same step."""

    concurrent: StepIntervals
    serial: StepIntervals
    user: StepIntervals | None


def trace_step(original: GraphItem, item: GraphItem, steps: int = 4) -> StepTraces:
    """Trace ``item`` (the step a plan is made for: ``original`` after the graph passes) as it
    runs and one op at a time, and ``original`` as the user runs it (TF's defaults), for
    ``predict_step_time(names, plan, pinned_from, *traces)``."""
    config = step_config(item)
    return StepTraces(
        concurrent=op_intervals(step_item(item), config, steps),
        serial=op_intervals(step_item(item), serial_config(config), steps),
        user=None if original is item else op_intervals(step_item(original), user_config(),
                                                        steps))
