"""Measure a rematerialized step for real and hold it against its plan.

A plan predicts a peak (``RematPlan.peak_bytes``, the shared replay accounting on a cost graph
calibrated by ``remat.tf_memory``) and a compute overhead. This module runs the original step
as the user runs it (TF's default configuration) and the rewritten step under the project's
(``profiler.session.step_config``) and reports:

- the peak by TF's own allocator where it keeps statistics (the BFC allocator of each GPU
  the step is placed on; on CPU, oneDNN's or ``TF_CPU_ALLOCATOR_USE_BFC=true``;
  ``profiler.trace.allocator_devices``): the resident bytes counted from the graph
  plus what the allocator says the step adds above what it held when the step began
  (``StepMeasurement``); elsewhere the peak replayed from the allocator's records of a traced
  step. ``ruler`` names which; the records are reported beside;
- the measured overhead: the median, over rounds, of the rewritten step's time over the
  original's, the two run alternately in two open sessions so that both see the same load
  (this machine is shared and noisy); and the same against the original as the user runs it,
  under TF's defaults (``overhead_vs_user``);
- whether one step from identical initial variables gives the user's loss and gradients
  (``profiler.step_compare.compare_steps``, the reference under TF's defaults): a rewrite
  must change when things are computed, never what: loss within ``LOSS_RTOL``, gradients
  within ``GRADIENT_RTOL`` plus ``GRADIENT_ATOL_OF_MAX`` of the largest gradient.

Peaks are of the training step as ``tools.train`` runs it: the update and the loss are fetched,
the gradients are not (``remat.tf_memory.step_item``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary
from graphfit.profiler.profile import Profile
from graphfit.profiler.session import OpenSessions, step_config, user_config
from graphfit.profiler.step_compare import ReferenceStep, WeightCheck, compare_steps
from graphfit.profiler.tf_function import FunctionItem, on_variable_copies
from graphfit.profiler.trace import (added_by_calls, peak_reading, profile_graph,
                                     uncounted_below_bytes)
from graphfit.remat.plan import RematPlan
from graphfit.remat.tf_memory import step_item

__all__ = ["StepMeasurement", "compare_rewrite", "measure_step", "read_calls", "warmed_call",
           "step_peak", "paired_overhead", "paired_overheads", "measure_rewrite",
           "LOSS_RTOL", "GRADIENT_RTOL", "GRADIENT_ATOL_OF_MAX"]

# A rewritten step computes the user's step: the loss within LOSS_RTOL of the user's, each
# gradient within GRADIENT_RTOL of its largest |value| plus GRADIENT_ATOL_OF_MAX of the
# step's largest |gradient| (float32 recomputation; no widening by measured kernel noise).
LOSS_RTOL = 1e-5
GRADIENT_RTOL = 1e-4
GRADIENT_ATOL_OF_MAX = 1e-5
# ``paired_overheads``' name of the rewritten step among the originals' configurations.
_REWRITTEN = "rewritten"


@dataclasses.dataclass
class StepMeasurement:
    """What one training step cost on this machine.

    Attributes:
        peak_bytes: the step's peak by ``ruler``: ``resident_bytes`` plus what the step adds
            above them.
        ruler: ``"allocator"``: what the step added is TF's allocator's reading (its peak over
            the step minus its bytes in use when the step began, ``profiler.trace.
            AllocatorPeak``; of ``allocator_readings``, their ``profiler.trace.
            peak_reading``); ``"records"``: the
            allocator keeps no statistics (TF's default CPU allocator), or, with oneDNN on,
            its statistics, blind below 256 KiB, read less than the records (``profiler.
            trace.ONEDNN_UNCOUNTED_BYTES``), and the peak is replayed from the allocation
            records of a traced step.
        resident_bytes: what the step holds before it runs, counted from the graph: variables
            (optimizer slots included), kernels' persistent buffers, fed tensors.
        records_peak_bytes: the peak replayed from the allocation records of a traced step.
        allocator_added_bytes: the allocator's reading (``None``: no statistics): the
            ``profiler.trace.peak_reading`` of the session's steps, or as ``read_calls``
            reads the step with its calls.
        allocator_readings: what each step read added by the allocator: the session's
            steps (unless the calls alone read the step, ``read_calls``), then the calls
            (``called_added_bytes``).
        step_time_us: median time of the untraced steps.
        profile: the full profile (per-op costs) of the step.
        called_added_bytes: what the step added by the allocator called as the user calls a
            ``tf.function`` step (``measure_step``'s ``traced_from``), the ``peak_reading``
            of the calls; ``None``: not read.
    """

    peak_bytes: int
    ruler: str
    resident_bytes: int
    records_peak_bytes: int
    allocator_added_bytes: int | None
    step_time_us: float
    profile: Profile
    called_added_bytes: int | None = None
    allocator_readings: list[int] = dataclasses.field(default_factory=list)


def measure_step(item: GraphItem, steps: int = 4, warmup: int = 1, num_cpu_devices: int = 1,
                 config: tf.compat.v1.ConfigProto | None = None,
                 sessions: OpenSessions | None = None,
                 traced_from: GraphItem | None = None,
                 on_traced_step: Callable[[tf.compat.v1.RunMetadata], Any] | None = None,
                 readings: int = 0, beside: concurrent.futures.Future | None = None
                 ) -> StepMeasurement:
    """Run ``item``'s training step (update and loss) and measure its peak.

    ``steps`` steps follow ``warmup`` untraced ones; the first of them is traced, the others
    are timed; the allocator is read over all of them. ``config``: the session's configuration,
    by default the one the step runs with (``profiler.session.step_config``: TF's defaults for
    a step no pass rewrote, as the user runs it; the project's for a rewritten one). The
    project's configuration changes the user's step: without the dependency optimizer
    Keras's updates wait for the last gradient, and ``keras.applications.ResNet50`` (64x64,
    batch 8, SGD) added 135 MB instead of 79-86 MB (2026-12-06, ``bench/reconcile.py``).
    ``sessions``: run in the pool's session of the step (``profiler.session.OpenSessions``).
    ``on_traced_step``: called with the traced step's ``RunMetadata`` (``profile_graph``).
    ``beside``: work running on another thread while the session initialises and warms up
    (e.g. ``warmed_call`` of this step), waited for before the first measured step, which
    nothing may overlap.
    ``readings``: where no calls are read (below), read the allocator over that many session
    steps (untraced, untimed steps after ``steps``; fewer where they do not spread: ``profiler.
    trace.added_by_calls``): the user's step, whose reading moves from one step to the next
    (``profiler.trace.PEAK_READINGS``). The step's reading is the ``profiler.trace.
    peak_reading`` of all the steps read.

    ``traced_from``: the user's step ``item`` was rewritten from (or ``item`` itself). When it
    is a traced ``tf.function`` (``profiler.tf_function.FunctionItem``) and the allocator keeps
    statistics, ``item`` is also read as the user then calls it (``to_callable``, on copies
    of the user's variables: ``profiler.tf_function.on_variable_copies``): ``warmup`` calls,
    then up to ``profiler.trace.PEAK_READINGS`` read (``read_calls``). The user's own step
    (``traced_from`` is ``item``) is then read by its calls alone, as the user calls it; calls
    of it read as the user's calls do (``keras.applications.ResNet50``, 64x64, batch 8: 90th
    percentiles of 98.4 and 98.5 MB over 32 calls against 97.3 and 98.4 MB for the user's,
    where a session's steps read 3 MB more in the body, 2026-12-07). The two ways of running
    one step part: ``keras.applications.ResNet50`` (64x64, batch 8, SGD)
    rewritten for half of what it adds (oneDNN off, BFC allocator, about 45 MB added) read
    3.3 MB less to 9.8 MB more per call than per session step in the same process (17
    comparisons, median +2.4 MB), and one call's reading moved from 45.9 to 51.3 MB after
    95 MB of variables were made and freed (2026-12-07, ``bench/RESULTS.md``): the BFC
    allocator counts the free chunk it hands a request whole, up to twice the request, so a
    step's reading depends on how it runs and on the free chunks earlier work left
    (DESIGN.md §12).
    """
    config = config or step_config(item, num_cpu_devices)
    stepped = step_item(item)
    with OpenSessions.reuse(sessions) as pool:
        profile = profile_graph(stepped, steps=steps, warmup=warmup, trace_every=steps,
                                num_cpu_devices=num_cpu_devices, progress=None,
                                session_factory=lambda graph: pool.borrow(graph, config),
                                on_traced_step=on_traced_step,
                                before_measuring=None if beside is None else beside.result)
        allocators = profile.metadata["allocator_devices"]
        read = profile.metadata["allocator_added_bytes"]    # empty: no statistics
        if read and not isinstance(traced_from, FunctionItem):
            read = added_by_calls(functools.partial(pool.get(stepped.graph, config).run,
                                                    [stepped.train_op, stepped.loss],
                                                    stepped.feed_dict()),
                                  devices=allocators, readings=readings, first=read)
    times = profile.step_time_us or [float("nan")]
    resident = sum(memory.resident_bytes for memory in profile.devices.values())
    added = peak_reading(read)
    peak, ruler = step_peak(resident, added, profile.peak_bytes, allocators)
    measured = StepMeasurement(
        peak_bytes=peak, ruler=ruler, resident_bytes=resident,
        records_peak_bytes=profile.peak_bytes, allocator_added_bytes=added,
        step_time_us=statistics.median(times), profile=profile, allocator_readings=read)
    return (measured if traced_from is None
            else read_calls(measured, item, traced_from, warmup,
                            with_session=item is not traced_from))


def warmed_call(item: GraphItem, traced_from: FunctionItem, warmup: int = 1
                ) -> Callable[[], tf.Tensor]:
    """A call of ``item``'s step as the user calls it (``profiler.tf_function.
    on_variable_copies``), made ``warmup`` times. The closed loop builds a rewritten step's
    on the second core while its session runs its first step (``measure_step``'s ``beside``;
    on the CPU only, where memory is the host's: a GPU would hold both first steps at once):
    the building and the first call, the function's own Grappler pass, then take no wall
    time of their own (2.3 s of ``keras.applications.ResNet50``'s 31 s, 64x64, batch 8,
    2026-12-07). Not the user's step's: built so, its calls read 4.5 MB more (191.3 against
    186.8 MB, the means of 20 and 9 fresh processes; the BFC allocator's free chunks after two
    steps at once), and the budget is a share of that reading, held to the user's own."""
    call = on_variable_copies(item, traced_from)
    for _ in range(warmup):
        call()
    return call


def read_calls(measured: StepMeasurement, item: GraphItem, traced_from: GraphItem,
               warmup: int = 1, with_session: bool = True,
               call: Callable[[], Any] | None = None) -> StepMeasurement:
    """``measured`` (``item``'s session steps) with ``item`` also read as the user calls it,
    when ``traced_from`` is a traced ``tf.function`` and the allocator keeps statistics
    (``measure_step``'s ``traced_from``): read by the larger of the session's steps' and the
    calls' ``peak_reading``, the two ways a rewritten step may run; or by the calls' alone
    (not ``with_session``: the user's own step, which the user calls; a session's steps read
    it 3 MB higher in the body on ``keras.applications.ResNet50``, and their readings with
    the calls' made a higher quantile than the user's calls alone); as it is otherwise.
    ``call``: the call to read, warmed up already (``warmed_call``); by default one made here."""
    allocators = measured.profile.metadata["allocator_devices"]
    if measured.allocator_added_bytes is None or not isinstance(traced_from, FunctionItem):
        return measured
    calls = added_by_calls(call or warmed_call(item, traced_from, warmup), 0, allocators)
    called = peak_reading(calls)
    added = max(measured.allocator_added_bytes, called) if with_session else called
    peak, ruler = step_peak(measured.resident_bytes, added, measured.records_peak_bytes,
                            allocators)
    return dataclasses.replace(measured, peak_bytes=peak, ruler=ruler,
                               allocator_added_bytes=added, called_added_bytes=called,
                               allocator_readings=(measured.allocator_readings
                                                   if with_session else []) + calls)


def step_peak(resident_bytes: int, allocator_added_bytes: int | None, records_peak_bytes: int,
              allocators: Iterable[str]) -> tuple[int, str]:
    """A step's peak and its ruler (``StepMeasurement``): the resident bytes plus what
    ``allocators`` read the step adding; or the peak replayed from the allocation records
    where they keep no statistics (``allocator_added_bytes`` is ``None``), or where their
    statistics leave small buffers out (oneDNN's CPU allocator, ``profiler.trace.
    uncounted_below_bytes``) and read less than the records, which in turn leave out
    oneDNN's own buffers: both read low there, so the larger rules."""
    records = allocator_added_bytes is None or (
        uncounted_below_bytes(allocators) > 0
        and records_peak_bytes > resident_bytes + allocator_added_bytes)
    if records:
        return records_peak_bytes, "records"
    return resident_bytes + allocator_added_bytes, "allocator"


def paired_overheads(rewritten: GraphItem,
                     references: Mapping[str, tuple[GraphItem, tf.compat.v1.ConfigProto | None]],
                     rounds: int = 3, warmup: int = 1, min_seconds: float = 2.0,
                     sessions: OpenSessions | None = None) -> dict[str, tuple[float, float]]:
    """Per name of ``references`` (a step and the configuration to run it with; ``None``:
    the project's ``session_config``, as the rewritten step): the median over the rounds of
    (rewritten step time / that step's), and that step's median time (µs). Every step runs
    once per round, side by side in open sessions (``profiler.paired_timing``), at least
    ``rounds`` rounds and ``min_seconds`` of steps (short steps need many rounds), so one
    rewritten session serves every comparison; in ``sessions``' sessions, if given."""
    with OpenSessions.reuse(sessions) as pool:
        steps = {}
        for name, (item, config) in [*references.items(), (_REWRITTEN, (rewritten, None))]:
            session = pool.get(item.graph, config)
            item.initialize(session)
            steps[name] = functools.partial(session.run, [item.train_op, item.loss],
                                            item.feed_dict())
        times = paired_step_times(steps, rounds, warmup, min_seconds)
    return {name: (ratio_summary(times, name)[_REWRITTEN]["median"],
                   statistics.median(times[name]) * 1e6) for name in references}


def paired_overhead(original: GraphItem, rewritten: GraphItem, rounds: int = 3,
                    warmup: int = 1, original_config: tf.compat.v1.ConfigProto | None = None,
                    min_seconds: float = 2.0) -> tuple[float, float]:
    """``paired_overheads`` against one configuration of the original (default: the project's
    ``session_config``, as the rewritten step)."""
    return paired_overheads(rewritten, {"original": (original, original_config)}, rounds,
                            warmup, min_seconds)["original"]


def measure_rewrite(original: GraphItem, rewritten: GraphItem, plan: RematPlan,
                    baseline: StepMeasurement | None = None, steps: int = 4,
                    warmup: int = 1, weights: WeightCheck | None = None,
                    sessions: OpenSessions | None = None) -> dict[str, Any]:
    """Measure ``rewritten`` (``measure_step``) and compare it with ``original`` and with
    ``plan``'s predictions (``compare_rewrite``).

    Parameters:
        original: the step before rematerialization.
        rewritten: ``remat.rewrite.rewrite(original, cost_graph, plan)``.
        plan: the plan (its ``peak_bytes`` and ``overhead`` are the predictions).
        baseline: a measurement of ``original`` to reuse; ``None`` measures it.
        steps, warmup: as in ``measure_step``.
        weights: also compare the variables after the step (``profiler.step_compare.
            WeightCheck``), in the same runs as the loss and gradients: ``weights_match``,
            ``max_abs_weight_diff``.
        sessions: run the steps in the pool's sessions (``profiler.session.OpenSessions``).

    Returns:
        A JSON-ready report: budget, planned / measured peaks of both graphs by the ``ruler``
        (``StepMeasurement``; the records' peaks and the resident bytes beside),
        ``peak_ratio`` (measured / baseline), ``prediction_error`` (measured /
        planned - 1), planned and measured (``paired_overhead``, both steps under the project's
        session configuration) overhead, ``overhead_vs_user`` (the rewritten step against the
        original under TF's defaults, ``profiler.session.user_config``, whose step time is
        ``user_step_time_us``), step times of the
        separate measurements, loss / gradient match (``compare_steps``: ``loss_match``,
        ``gradients_match``, ``max_abs_gradient_diff``, ``max_relative_gradient_diff``,
        ``seeded_random_ops``, ``loss``).

    Raises:
        profiler.step_compare.StepMismatchError: the rewritten step computes another loss or
            other gradients.
    """
    baseline = baseline or measure_step(original, steps, warmup, sessions=sessions)
    measured = measure_step(rewritten, steps, warmup, sessions=sessions, traced_from=original)
    return compare_rewrite(original, rewritten, plan, baseline, measured, weights, sessions,
                           rounds=max(steps, 3), warmup=warmup)


def compare_rewrite(original: GraphItem, rewritten: GraphItem, plan: RematPlan,
                    baseline: StepMeasurement, measured: StepMeasurement,
                    weights: WeightCheck | None = None, sessions: OpenSessions | None = None,
                    rounds: int = 4, warmup: int = 1, planned: GraphItem | None = None,
                    reference_step: ReferenceStep | None = None) -> dict[str, Any]:
    """``measure_rewrite``'s report from the measurements of both steps already made: runs
    one step of each to compare the loss and gradients (``compare_steps``), then times them
    side by side (``paired_overheads``, ``rounds`` rounds at least after ``warmup``) with the
    user's step and with ``planned``, the step the plan was made for (default
    ``original``; in ``optimize``, the step after the graph passes, whose session is open).
    The closed loop (``remat.closed_loop``) measures each round's peak first and compares
    only the step it returns; it runs ``original``'s step ahead (``reference_step``,
    ``profiler.step_compare.run_reference``).

    Raises:
        profiler.step_compare.StepMismatchError: as ``measure_rewrite``.
    """
    comparison = compare_steps(original, rewritten, rtol=GRADIENT_RTOL, atol=0.0,
                               loss_rtol=LOSS_RTOL, atol_of_max=GRADIENT_ATOL_OF_MAX,
                               weights=weights, sessions=sessions,
                               reference_step=reference_step)
    comparison.check()  # a rewrite that changes the loss or gradients is a bug, not a figure
    # Against the step planned under the project's configuration (what the planned overhead
    # predicts) and the user's step under TF's defaults, in the same rounds: the rounds a
    # pair took apart (at least 2 s of steps each), in 1.5x the seconds.
    overheads = paired_overheads(rewritten, {"project": (planned or original, None),
                                             "user": (original, user_config())},
                                 rounds, warmup, min_seconds=3.0, sessions=sessions)
    overhead, _ = overheads["project"]
    overhead_vs_user, user_step_us = overheads["user"]
    return {
        "method": plan.method,
        "budget_bytes": int(plan.budget_bytes),
        "planned_peak_bytes": int(plan.peak_bytes),
        # The ruler of the peaks (``StepMeasurement.ruler``); records are kept beside.
        "ruler": measured.ruler,
        "baseline_peak_bytes": baseline.peak_bytes,
        "baseline_records_peak_bytes": baseline.records_peak_bytes,
        "baseline_resident_bytes": baseline.resident_bytes,
        "measured_peak_bytes": measured.peak_bytes,
        "measured_records_peak_bytes": measured.records_peak_bytes,
        "measured_resident_bytes": measured.resident_bytes,
        # What the step added called as the user calls it (``measure_step``'s
        # ``traced_from``; ``None``: not read), within ``measured_peak_bytes``.
        "measured_called_added_bytes": measured.called_added_bytes,
        # How many steps' allocator readings each peak is read from (``StepMeasurement``).
        "baseline_allocator_readings": len(baseline.allocator_readings),
        "measured_allocator_readings": len(measured.allocator_readings),
        "peak_ratio": measured.peak_bytes / baseline.peak_bytes,
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
        "max_relative_gradient_diff": (comparison.max_abs_gradient_diff
                                       / max(comparison.max_abs_gradient, 1e-30)),
        "seeded_random_ops": comparison.seeded_random_ops,
        "loss": comparison.loss_reference,
        **({} if weights is None else {"weights_match": comparison.weights_equal,
                                       "max_abs_weight_diff": comparison.max_abs_weight_diff}),
    }
