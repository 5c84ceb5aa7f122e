"""When each op of a training step ran: start and end, per traced step.

A ``Profile`` keeps each op's median duration, which is enough to plan memory and compute; a
prediction of a step's wall time (``remat.step_time``) needs more: where the ops sat in time,
so what overlapped and what waited. This runs the step in one session, times a few untraced
steps and reads the ``FULL_TRACE`` step stats of a few more. Tracing costs time per op (on
the zoo's resnet preset a traced step took 1.3-1.4x an untraced one), so a prediction scales
traced times by the untraced steps' wall time.
"""

from __future__ import annotations

import dataclasses
import time

import tensorflow as tf

from graphfit.models.graph_item import GraphItem

__all__ = ["StepIntervals", "op_intervals"]


@dataclasses.dataclass(frozen=True)
class StepIntervals:
    """Per traced step, op name -> (start, end) in µs from the step's first op start; and the
    wall times (µs) of the untraced steps run in the same session."""

    traced: list[dict[str, tuple[float, float]]]
    untraced_wall_us: list[float]

# Nodes the runtime adds to a partition graph (not ops of the user's graph).
_RUNTIME_NODES = ("_SOURCE", "_SINK")


def op_intervals(item: GraphItem, config: tf.compat.v1.ConfigProto, steps: int = 3,
                 warmup: int = 2) -> StepIntervals:
    """Run ``item``'s step ``steps`` times untraced, then ``steps`` times traced.

    Parameters:
        item: the step (its update and loss are fetched, as ``tools.train`` runs it).
        config: the session configuration to run it with (e.g. ``profiler.session.
            user_config``, or ``serial_config`` of it for ops one at a time).
        steps: timed and traced steps each, after ``warmup`` untimed ones.
    """
    fetches = [item.train_op, item.loss]
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    intervals = []
    with tf.compat.v1.Session(graph=item.graph, config=config) as session:
        session.run(item.init_op)
        feeds = item.feed_dict()
        for _ in range(warmup):
            session.run(fetches, feeds)
        walls = []
        for _ in range(steps):
            begin = time.perf_counter()
            session.run(fetches, feeds)
            walls.append((time.perf_counter() - begin) * 1e6)
        for _ in range(steps):
            metadata = tf.compat.v1.RunMetadata()
            session.run(fetches, feeds, options=options, run_metadata=metadata)
            spans = {}
            for device in metadata.step_stats.dev_stats:
                for stats in device.node_stats:
                    if stats.node_name not in _RUNTIME_NODES:
                        spans[stats.node_name] = (
                            stats.all_start_micros,
                            stats.all_start_micros + stats.all_end_rel_micros)
            origin = min(start for start, _ in spans.values())
            intervals.append({name: (start - origin, end - origin)
                              for name, (start, end) in spans.items()})
    return StepIntervals(traced=intervals, untraced_wall_us=walls)
