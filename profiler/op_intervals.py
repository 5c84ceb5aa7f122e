"""When each op of a training step ran: start and end, per traced step.

A ``Profile`` keeps each op's median duration, which is enough to plan memory and compute; a
prediction of a step's wall time (``remat.step_time``) needs more: where the ops sat in time,
so what overlapped and what waited. This runs steps in open sessions, times untraced steps and
reads the ``FULL_TRACE`` step stats of a few more. Tracing costs time per op (on the zoo's
resnet preset a traced step took 1.3-1.4x an untraced one, on a 30 ms Keras step up to 2x), so
a prediction scales traced times by the untraced steps' wall time.

Several steps (the same graph under two configurations, the user's step beside it) are timed
side by side (``profiler.paired_timing``): a step's wall time moves by tens of percent with
the machine's load, and a prediction made of walls measured a minute apart inherits that; walls
of the same round saw the same load, so their ratios hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.paired_timing import paired_step_times
from graphfit.profiler.session import OpenSessions

__all__ = ["StepIntervals", "op_intervals"]


@dataclasses.dataclass(frozen=True)
class StepIntervals:
    """Per traced step, op name -> (start, end) in µs from the step's first op start; and the
    wall times (µs) of the untraced steps, round by round (rounds of one ``op_intervals``
    call line up across its steps)."""

    traced: list[dict[str, tuple[float, float]]]
    untraced_wall_us: list[float]

# Nodes the runtime adds to a partition graph (not ops of the user's graph).
_RUNTIME_NODES = ("_SOURCE", "_SINK")


def _spans(metadata: tf.compat.v1.RunMetadata) -> dict[str, tuple[float, float]]:
    spans = {}
    for device in metadata.step_stats.dev_stats:
        for stats in device.node_stats:
            if stats.node_name not in _RUNTIME_NODES:
                spans[stats.node_name] = (stats.all_start_micros,
                                          stats.all_start_micros + stats.all_end_rel_micros)
    origin = min(start for start, _ in spans.values())
    return {name: (start - origin, end - origin) for name, (start, end) in spans.items()}


def op_intervals(steps: Mapping[str, tuple[GraphItem, tf.compat.v1.ConfigProto]],
                 rounds: int = 3, traced: int = 3, warmup: int = 2, min_seconds: float = 0.0,
                 sessions: OpenSessions | None = None) -> dict[str, StepIntervals]:
    """Time untraced steps side by side, then trace steps of each, side by side too.

    Parameters:
        steps: name -> (a step: its update and loss are fetched, as ``tools.train`` runs it;
            the session configuration to run it with, e.g. ``profiler.session.user_config``,
            or ``serial_config`` of it for ops one at a time).
        rounds, warmup, min_seconds: of the untraced steps (``paired_step_times``).
        traced: traced steps of each, at least; more until they took ``min_seconds``
            (an op's time in one traced step of a few milliseconds is noise: on a 30 ms Keras
            step the prediction moved by 15% between runs of 4 traced steps, by 1.5% with 12).
        sessions: run in the pool's sessions (``profiler.session.OpenSessions``).

    Returns:
        name -> its ``StepIntervals``.
    """
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with OpenSessions.reuse(sessions) as pool:
        runs = {}
        for name, (item, config) in steps.items():
            session = pool.get(item.graph, config)
            item.initialize(session)
            runs[name] = functools.partial(session.run, [item.train_op, item.loss],
                                           item.feed_dict())
        walls = paired_step_times(runs, rounds, warmup, min_seconds)
        spans: dict[str, list] = {name: [] for name in steps}

        def trace(name: str) -> None:
            metadata = tf.compat.v1.RunMetadata()
            runs[name](options=options, run_metadata=metadata)
            spans[name].append(_spans(metadata))

        paired_step_times({name: functools.partial(trace, name) for name in steps}, traced,
                          warmup=0, min_seconds=min_seconds)
    return {name: StepIntervals(traced=spans[name],
                                untraced_wall_us=[seconds * 1e6 for seconds in walls[name]])
            for name in steps}
