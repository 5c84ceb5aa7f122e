"""Predict the wall time of a rematerialized step, from traces of the step before the rewrite.

A plan's ``overhead`` counts recomputation only: compute with recomputes over compute without,
at the profiled op times (what DTR's paper reports). On a CPU that is not what the user sees.
TF runs independent ops side by side on its inter-op threads (on this 2-core machine the op
times of the zoo's resnet preset sum to 1.7-1.8x its step's wall time), and ``remat.rewrite``
chains the backward pass in plan order from ``pinned_from`` on (its ``"tail"`` pinning), so
those ops run one at a time, but for the events ``remat.side_by_side`` lets float beside the
chain. The prediction replays the rewritten graph itself (``remat.executor_model``):

- each op (a clone: its original) takes its time in the serial chain (``serial_chain``): the
  step with every op chained in its traced order by the rewrite and nothing recomputed, so ops
  run one at a time, each with the whole intra-op pool, in the same runtime and configuration
  as the rewritten step's chain. Ops Grappler's remapper ran inside their reader, or removed,
  cost 0 (``profiler.remapper_fusions`` keeps clones fused the same way);
- the replay's ``sharing`` (how much ops running together slow each other) is fitted once per
  step, so that the step before the rewrite replays in its measured (traced) wall time;
- the replayed rewritten step splits at the chain's start into a forward part, which runs as
  the step before the rewrite does, and the chain. Each part turns from traced into untraced
  time by its own kind of step: tracing costs time per op, more where ops run one at a time
  (a Keras depthwise step traced at 1.39x its untraced wall as it runs and 1.48x as the serial
  chain; the zoo mlp at 1.04x and 1.14x).

Measured on 2026-12-06 on six models (zoo mlp, transformer and resnet ``activations``, Keras
attention, conv and depthwise steps; plans at 0.5 of the peak), the user's step, the step as it
runs, its serial chain and the rewritten step traced side by side in one process: the replay
put the rewritten steps' traced walls within 6% of the measured ones, and measured / predicted
was 0.978-1.045 on these traces. Inside ``pipeline.optimize``, whose traces are taken a minute
before its own measurement, measured / predicted was 0.996-1.052; with the sum of op times per
regime that replaced, 0.915-1.025 in the run before, lowest where many events float (resnet,
depthwise).

Walls come from untraced steps of the three (the step as it runs, one op at a time, the user's)
timed side by side, round by round: on a shared 2-core machine a 30 ms Keras step's wall moved
between 20 and 32 ms from one minute to the next, and a prediction made of walls measured apart
moved with it (1.10-1.46 of the user's step in four runs). The prediction is made per round,
against the user's step of the same round, and the median taken.

The prediction is compared with the measured step by ``pipeline.optimize`` (``verify``) and
``bench.grappler``: planned = measured.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.op_intervals import StepIntervals, op_intervals
from graphfit.profiler.session import OpenSessions, step_config, user_config
from graphfit.profiler.trace import step_fetches
from graphfit.remat.baselines import checkpoint_all
from graphfit.remat.executor_model import fit_sharing, simulate_step
from graphfit.profiler.graph_def_walk import ancestors, split_input
from graphfit.remat.plan import RECOMPUTE, RematPlan
from graphfit.remat.recompute_graph import clone_name, original_name
from graphfit.remat.rewrite import rewrite
from graphfit.remat.tf_memory import MemoryModel, expand_plan, step_item, tf_memory_model

__all__ = ["StepTimePrediction", "StepTraces", "chain_head", "predict_step_time", "serial_chain",
           "step_dependencies", "trace_for_prediction"]


@dataclasses.dataclass(frozen=True)
class StepTimePrediction:
    """A predicted step time (µs, untraced) and its parts (module docstring): the forward part
    and the chain, each turned into untraced time by its kind of step. ``vs_user`` is the
    median over rounds of the prediction over the user's step of the same round (walls
    measured side by side), not ``predicted_step_us / user_step_us`` of the medians."""

    user_step_us: float
    predicted_step_us: float
    forward_us: float
    chain_us: float
    sharing: float
    vs_user: float

    def report(self) -> dict[str, float]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)


class StepTraces(NamedTuple):
    """What a prediction reads: the step that was planned as it runs (``concurrent``) and as
    its ``serial_chain`` (``serial``), the user's step (``user``; ``None``: ``concurrent``),
    and the ``sharing`` that replays ``concurrent`` (``remat.executor_model``). They depend
    on the steps only, not on the plan: trace once, predict for every plan of the same step."""

    concurrent: StepIntervals
    serial: StepIntervals
    user: StepIntervals | None
    sharing: float


def _wall(step: dict[str, tuple[float, float]]) -> float:
    return max(end for _, end in step.values())


def _median_wall(intervals: StepIntervals) -> float:
    return statistics.median(_wall(step) for step in intervals.traced)


def _gap(serial: StepIntervals) -> float:
    """The serial chain's traced wall over its summed op times: the time between ops, which
    the replay does not have."""
    return _median_wall(serial) / max(statistics.median(
        sum(end - start for start, end in step.values()) for step in serial.traced), 1e-9)


def _durations(dependencies: Mapping[str, Sequence[str]], serial: StepIntervals
               ) -> dict[str, float]:
    """Each op's median time in the serial chain; a clone's (and a node the rewrite made for
    it) is its original's."""
    names = set().union(*serial.traced)
    serial_us = {name: statistics.median(step[name][1] - step[name][0]
                                         for step in serial.traced if name in step)
                 for name in names}
    return {op: serial_us.get(original_name(op), 0.0) for op in dependencies}


def _inter_op_threads() -> int:
    """The inter-op threads TF gives a session by default: one per schedulable core."""
    return len(os.sched_getaffinity(0))


def step_dependencies(item: GraphItem) -> dict[str, list[str]]:
    """Op -> the ops it waits for (data and control inputs), for every op one step of
    ``item`` runs, in graph order: the input of ``remat.executor_model``."""
    graph_def = item.graph.as_graph_def()
    runs = ancestors(graph_def, step_fetches(item))
    return {node.name: [split_input(name)[0] for name in node.input]
            for node in graph_def.node if node.name in runs}


def chain_head(op_names: Sequence[str], plan: RematPlan, pinned_from: int) -> str | None:
    """The node of the plan's event at ``pinned_from`` (``config["remat"]["pinned_from"]`` of
    the rewritten step): the op, or its clone if the event recomputes it. The rewrite makes it
    wait for every event before it, so the chain starts there. ``None``: nothing is chained."""
    if pinned_from >= len(plan.events):
        return None
    event = plan.events[pinned_from]
    if event.kind != RECOMPUTE:
        return op_names[event.index]
    version = sum(1 for e in plan.events[:pinned_from + 1]
                  if e.kind == RECOMPUTE and e.index == event.index)
    return clone_name(op_names[event.index], version)


def predict_step_time(dependencies: Mapping[str, Sequence[str]], head: str | None,
                      traces: StepTraces) -> StepTimePrediction:
    """The rewritten step's time (module docstring).

    Parameters:
        dependencies: the rewritten step's (``step_dependencies``).
        head: the node the chain starts at (``chain_head``; ``None``: no chain).
        traces: of the step that was planned and the user's (``trace_for_prediction``).

    Each round of untraced walls (measured side by side, so every round saw one load) turns
    the replayed parts into time: the forward part at the untraced over traced wall of the
    step as it runs, the chain at the serial chain's, over the user's wall of that round.

    Raises:
        ValueError: no traced or untraced step, untraced walls that are not of the same
            rounds, or a ``head`` the step does not run.
    """
    concurrent, serial, user, sharing = traces
    user = user or concurrent
    walls = concurrent.untraced_wall_us, serial.untraced_wall_us, user.untraced_wall_us
    if not (concurrent.traced and serial.traced and walls[0]):
        raise ValueError("need at least one traced and one untraced step of each kind")
    if len({len(w) for w in walls}) != 1:
        raise ValueError(f"untraced walls of {[len(w) for w in walls]} rounds: measure the "
                         f"steps side by side (op_intervals of all of them at once)")
    replay = simulate_step(dependencies, _durations(dependencies, serial),
                           _inter_op_threads(), sharing)
    if head is not None and head not in replay.start_us:
        raise ValueError(f"the chain's head {head!r} is not an op the step runs")
    forward = replay.start_us[head] if head is not None else replay.wall_us
    gap = _gap(serial)
    forward_scale = gap * forward / _median_wall(concurrent)
    chain_scale = gap * (replay.wall_us - forward) / _median_wall(serial)
    predicted = [forward_scale * c + chain_scale * s for c, s in zip(*walls[:2])]
    return StepTimePrediction(
        user_step_us=statistics.median(walls[2]),
        predicted_step_us=statistics.median(predicted),
        forward_us=forward_scale * statistics.median(walls[0]),
        chain_us=chain_scale * statistics.median(walls[1]), sharing=sharing,
        vs_user=statistics.median(p / u for p, u in zip(predicted, walls[2])))


def serial_chain(item: GraphItem, model: MemoryModel | None = None) -> GraphItem:
    """``item`` with every op chained in ``model``'s traced order (default: a new trace of
    ``item``) and nothing recomputed: ``remat.rewrite``'s ``pin_order="all"`` of a
    checkpoint-all plan, so its ops run one at a time as the rewritten step's chain runs them
    (module docstring)."""
    model = model or tf_memory_model(item)
    plan = expand_plan(model, checkpoint_all(model.plan_graph))
    return rewrite(item, model.cost_graph, plan, pin_order="all")


def trace_for_prediction(original: GraphItem, item: GraphItem, model: MemoryModel | None = None,
                         rounds: int = 5, traced: int = 4, min_seconds: float = 3.0,
                         sessions: OpenSessions | None = None) -> StepTraces:
    """Trace ``item`` (the step a plan is made for: ``original`` after the graph passes) as it
    runs and as its ``serial_chain`` (by ``model``'s order, if given), and ``original`` as the
    user runs it (TF's defaults), for ``predict_step_time``: the untraced walls of all three
    side by side, at least ``rounds`` rounds and ``min_seconds`` (``op_intervals``); and fit
    the replay's ``sharing`` to ``item``'s traced wall. ``sessions``: run in the pool's
    sessions (``profiler.session.OpenSessions``)."""
    chain = serial_chain(item, model)
    steps = {"concurrent": (step_item(item), step_config(item)),
             "serial": (step_item(chain), step_config(chain))}
    if original is not item:
        steps["user"] = (step_item(original), user_config())
    intervals = op_intervals(steps, rounds, traced, min_seconds=min_seconds, sessions=sessions)
    dependencies = step_dependencies(step_item(item))
    sharing = fit_sharing(dependencies, _durations(dependencies, intervals["serial"]),
                          _inter_op_threads(),
                          _median_wall(intervals["concurrent"]) / _gap(intervals["serial"]))
    return StepTraces(intervals["concurrent"], intervals["serial"], intervals.get("user"),
                      sharing)
