"""Measure a rematerialized step for real and hold it against its plan.

A plan predicts a peak (``RematPlan.peak_bytes``, the shared replay accounting on a cost graph
calibrated by ``remat.tf_memory``) and a compute overhead. This module runs the original and
the rewritten training step under the project's one session configuration and reports:

- the peak from the allocator's records of a traced step (``profiler.trace.profile_graph``)
  and, where the allocator keeps statistics, its own high-water mark over that step
  (``profiler.trace.AllocatorPeak``; ``None`` with TF's default CPU allocator), for both graphs;
- the measured overhead: the median, over rounds, of the rewritten step's time over the
  original's, the two run alternately in two open sessions so that both see the same load
  (this machine is shared and noisy); and the same against the original as the user runs it,
  under TF's default configuration (``overhead_vs_user``);
- whether one step from identical initial variables gives the same loss and gradients
  (``profiler.step_compare.compare_steps``): a rewrite must change when things are computed,
  never what. The rewrite keeps TF's fusions off some ops (its ordering edges), so the
  tolerance includes the original step's own kernel-order noise (``kernel_order_noise``).

Peaks are of the training step as ``tools.train`` runs it: the update and the loss are fetched,
the gradients are not (``remat.tf_memory.step_item``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary
from graphfit.profiler.profile import Profile
from graphfit.profiler.session import make_session, user_config
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.trace import profile_graph
from graphfit.remat.plan import RematPlan
from graphfit.remat.tf_memory import step_item

__all__ = ["StepMeasurement", "measure_step", "paired_overhead", "measure_rewrite"]


@dataclasses.dataclass
class StepMeasurement:
    """What one training step cost on this machine.

    Attributes:
        peak_bytes: peak replayed from the allocator's records of a traced step (resident
            variables and feeds included).
        allocator_peak_bytes: the allocator's high-water mark over the traced step (``None``:
            the allocator keeps no statistics, ``profiler.trace.AllocatorPeak``).
        step_time_us: median time of the untraced steps.
        profile: the full profile (per-op costs) of the step.
    """

    peak_bytes: int
    allocator_peak_bytes: int | None
    step_time_us: float
    profile: Profile


def measure_step(item: GraphItem, steps: int = 4, warmup: int = 1,
                 num_cpu_devices: int = 1) -> StepMeasurement:
    """Profile ``item``'s training step (update and loss) and read the allocator's peak.

    ``steps`` steps follow ``warmup`` untraced ones; the first of them is traced, the others
    are timed.
    """
    profile = profile_graph(step_item(item), steps=steps, warmup=warmup, trace_every=steps,
                            num_cpu_devices=num_cpu_devices, progress=None)
    times = profile.step_time_us or [float("nan")]
    return StepMeasurement(peak_bytes=profile.peak_bytes,
                           allocator_peak_bytes=max(profile.metadata["allocator_peak_bytes"],
                                                    default=None),
                           step_time_us=statistics.median(times), profile=profile)


def paired_overhead(original: GraphItem, rewritten: GraphItem, rounds: int = 3,
                    warmup: int = 1, original_config: tf.compat.v1.ConfigProto | None = None,
                    min_seconds: float = 2.0) -> tuple[float, float]:
    """Median over the rounds (at least ``rounds``, and ``min_seconds`` of steps: short steps
    need many) of (rewritten step time / original step time), the two steps run side by side
    in two open sessions (``profiler.paired_timing``), and the original's median step time
    (µs). The original runs with ``original_config`` (default: the project's
    ``session_config``, as the rewritten step)."""
    with make_session(original.graph, config=original_config) as first, \
            make_session(rewritten.graph) as second:
        steps = {}
        for name, session, item in (("original", first, original),
                                    ("rewritten", second, rewritten)):
            session.run(item.init_op)
            steps[name] = functools.partial(session.run, [item.train_op, item.loss],
                                            item.feed_dict())
        summary = ratio_summary(paired_step_times(steps, rounds, warmup, min_seconds),
                                "original")
    return summary["rewritten"]["median"], summary["original"]["median_ms"] * 1e3


def measure_rewrite(original: GraphItem, rewritten: GraphItem, plan: RematPlan,
                    baseline: StepMeasurement | None = None, steps: int = 4,
                    warmup: int = 1) -> dict[str, Any]:
    """Measure ``rewritten`` against ``original`` and against ``plan``'s predictions.

    Parameters:
        original: the step before rematerialization.
        rewritten: ``remat.rewrite.rewrite(original, cost_graph, plan)``.
        plan: the plan (its ``peak_bytes`` and ``overhead`` are the predictions).
        baseline: a measurement of ``original`` to reuse; ``None`` measures it.
        steps, warmup: as in ``measure_step``.

    Returns:
        A JSON-ready report: budget, planned / measured (records and allocator) peaks of both
        graphs, ``peak_ratio`` (measured / baseline, records), ``prediction_error`` (measured /
        planned - 1), planned and measured (``paired_overhead``, both steps under the project's
        session configuration) overhead, ``overhead_vs_user`` (the rewritten step against the
        original under TF's defaults, ``profiler.session.user_config``, whose step time is
        ``user_step_time_us``), step times of the
        separate measurements, loss / gradient match (``compare_steps``: ``loss_match``,
        ``gradients_match``, ``max_abs_gradient_diff``, ``max_kernel_noise``,
        ``seeded_random_ops``, ``loss``).

    Raises:
        profiler.step_compare.StepMismatchError: the rewritten step computes another loss or
            other gradients.
    """
    baseline = baseline or measure_step(original, steps, warmup)
    measured = measure_step(rewritten, steps, warmup)
    comparison = compare_steps(original, rewritten, kernel_order_noise=True)
    comparison.check()  # a rewrite that changes the loss or gradients is a bug, not a figure
    rounds = max(steps, 3)
    overhead, _ = paired_overhead(original, rewritten, rounds, warmup)
    overhead_vs_user, user_step_us = paired_overhead(original, rewritten, rounds, warmup,
                                                     original_config=user_config())
    return {
        "method": plan.method,
        "budget_bytes": int(plan.budget_bytes),
        "planned_peak_bytes": int(plan.peak_bytes),
        "baseline_peak_bytes": baseline.peak_bytes,
        "baseline_allocator_peak_bytes": baseline.allocator_peak_bytes,
        "measured_peak_bytes": measured.peak_bytes,
        "measured_allocator_peak_bytes": measured.allocator_peak_bytes,
        "peak_ratio": measured.peak_bytes / baseline.peak_bytes,
        # None without allocator statistics; oneDNN's small-size allocator is invisible to
        # them, so tiny graphs read 0.
        "allocator_peak_ratio": (measured.allocator_peak_bytes / baseline.allocator_peak_bytes
                                 if baseline.allocator_peak_bytes and measured.allocator_peak_bytes
                                 is not None else None),
        "prediction_error": measured.peak_bytes / plan.peak_bytes - 1.0,
        "planned_overhead": plan.overhead,
        "measured_overhead": overhead,
        # Against the step as the user runs it (TF's default configuration).
        "overhead_vs_user": overhead_vs_user,
        "user_step_time_us": user_step_us,
        "baseline_step_time_us": baseline.step_time_us,
        "step_time_us": measured.step_time_us,
        "num_recomputes": plan.num_recomputes,
        "loss_match": comparison.loss_equal,
        "gradients_match": comparison.gradients_equal,
        "max_abs_gradient_diff": comparison.max_abs_gradient_diff,
        "max_kernel_noise": comparison.max_kernel_noise,
        "seeded_random_ops": comparison.seeded_random_ops,
        "loss": comparison.loss_reference,
    }
