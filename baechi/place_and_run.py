"""Place a training step, run it placed, and compare the plan with what was measured.

The whole placement path on a ``GraphItem``: cost graph (measured profile where given, static
estimates elsewhere) -> ``baechi.place.place`` -> ``baechi.apply.apply_placement`` -> one step
against the single-device step (loss and gradients must match) -> a traced run on the target for
per-device peak memory against each device's limit. ``tools/train.py`` calls it for
``--num_devices > 1``.

Reference: Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from graphfit.baechi.apply import apply_placement
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place import Placement, place, place_feeds_first
from graphfit.baechi.run import PLACEMENT_RTOL, RunTarget, measure_placed_run
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.profile import Profile
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.profiler.trace import step_fetches

__all__ = ["place_item", "place_and_check", "check_placement"]


def place_item(item: GraphItem, devices: DeviceSet, profile: Profile | None = None,
               memory_order: bool | None = None,
               **place_options: Any) -> tuple[GraphItem, Placement]:
    """Place ``item``'s step on ``devices`` and write the devices into a copy of its graph.

    Parameters:
        item: the training step.
        devices: device names (those of the run target), memory limits and link costs.
        profile: measured costs of ``item`` (else every cost is a static estimate).
        memory_order: write ``Placement.memory_order()`` into the graph (each device runs
            its ops in the planned order, after the releases the plan waited for); default:
            when the repair step placed it (``baechi.memory_first``: its peaks rely on
            waiting for memory).
        place_options: passed to ``baechi.place.place`` (method, placer_type, grouper,
            memory_model, sct_threshold, lp_solver); with ``memory_model="shared"`` (virtual
            CPU devices) the feeds go on the first device (``baechi.place.place_feeds_first``).

    Returns:
        (the placed item, the ``Placement``).

    Raises:
        baechi.schedule.PlacementError: the step does not fit the devices (from the placer), or
            the placement breaks a colocation constraint (``ColocationError``).
        profiler.profile.ProfileMismatchError: ``profile`` was measured on another graph.
    """
    cost_graph = cost_graph_from_graph(item.graph, step_fetches(item), profile)
    placer = place_feeds_first if place_options.get("memory_model") == "shared" else place
    placement = placer(cost_graph, devices, **place_options)
    if memory_order is None:
        memory_order = bool(placement.unit_schedule.info.get("memory_first"))
    ordering = placement.memory_order() if memory_order else ()
    return (apply_placement(item, placement.op_devices(), gated_reads=placement.gated_reads(),
                            ordering=ordering), placement)


def place_and_check(item: GraphItem, run_target: RunTarget, devices: DeviceSet,
                    profile: Profile | None = None, **place_options: Any
                    ) -> tuple[GraphItem, dict]:
    """Place ``item`` on ``run_target``, check the placed step equals the single-device step,
    and measure per-device peak memory against the limits of ``devices``.

    Parameters:
        item: the training step.
        run_target: where the placed step runs (``baechi.run.local_target`` or a
            ``LocalCluster``'s target); its device names must be ``devices.names``.
        devices: the placer's device set.
        profile: measured costs of ``item``.
        place_options: see ``place_item``.

    Returns:
        (the placed item, a JSON-ready report: ``Placement.summary()`` (options, placement
        time, makespan and its lower bound, LP statistics), and per device name the ops, the
        planned and measured peaks, the limit and any excess; the loss/gradient comparison).

    Raises:
        ValueError: ``devices`` and ``run_target`` name different devices.
        profiler.step_compare.StepMismatchError: the placed step's loss or gradients differ.
        baechi.run.DeviceMismatchError: the run's devices do not line up with the placement.
    """
    _check_devices(devices, run_target)
    placed, placement = place_item(item, devices, profile, **place_options)
    return placed, check_placement(item, placed, placement, run_target)


def _check_devices(devices: DeviceSet, run_target: RunTarget) -> None:
    if list(devices.names) != list(run_target.devices):
        raise ValueError(f"the device set {devices.names} is not the run target's devices "
                         f"{list(run_target.devices)}")


def check_placement(item: GraphItem, placed: GraphItem, placement: Placement,
                    run_target: RunTarget, fetch_gradients: bool = True) -> dict:
    """Check a placed step against the single-device step and measure it against its plan.

    Parameters:
        item: the step before placement (the reference).
        placed: ``item`` (or a rewrite of it that computes the same) with the placement's
            devices written in.
        placement: the plan (its devices' names are ``run_target``'s).
        run_target: where the placed step runs.
        fetch_gradients: whether the measured step fetches the gradients besides the update
            and the loss, as the plan assumed: a fetched gradient is held to the step's end,
            an unfetched one is freed after its update. ``place_item`` plans the step with
            its gradients fetched (``step_fetches``); joint mode plans the update and the
            loss only, as a training step runs (``pipeline.joint``), and measured with its
            gradients fetched the ``make train`` mlp read 0.25-1 MiB over its plan on a
            device, a 256 KiB weight gradient per layer updated before the peak
            (2026-12-07). The comparison with ``item`` reads the gradients either way.

    Returns:
        The report of ``place_and_check``, plus ``measured_timeline_bytes``: per device its
        measured memory over the step as ``[microseconds, bytes]`` pairs.

    Raises:
        ValueError: the placement's devices are not ``run_target``'s.
        profiler.step_compare.StepMismatchError: the placed step's loss or gradients differ.
        baechi.run.DeviceMismatchError: the run's devices do not line up with the placement.
    """
    devices = placement.devices
    _check_devices(devices, run_target)
    comparison = compare_steps(item, placed, run_target.session, rtol=PLACEMENT_RTOL)
    comparison.check()
    limits = {name: int(limit) for name, limit in zip(devices.names, devices.memory_bytes)}
    measured = measure_placed_run(placed if fetch_gradients else dataclasses.replace(
        placed, gradients=[]), run_target, limits, steps=1, warmup=1, trace_every=1)
    summary = placement.summary()
    names = list(devices.names)
    return {
        "plan": summary, "target": run_target.kind, "devices": names,
        "ops_per_device": dict(zip(names, summary["ops_per_device"])),
        "planned_peak_bytes": dict(zip(names, summary["peak_bytes"])),
        "limit_bytes": limits,
        "measured_peak_bytes": measured.peak_bytes,
        "over_limit_bytes": measured.over_limit_bytes,
        "measured_timeline_bytes": {name: [[float(t), int(b)] for t, b in timeline]
                                    for name, timeline in measured.timelines.items()},
        "loss_single_device": comparison.loss_reference, "loss_placed": comparison.loss_candidate,
        "max_abs_gradient_diff": comparison.max_abs_gradient_diff,
        "equal_to_single_device": comparison.equal,
        "seeded_random_ops": comparison.seeded_random_ops,
    }
