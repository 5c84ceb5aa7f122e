"""Memory models of a placed step: what a device must hold, and its exact peak.

Two models, selectable everywhere a placement is made:

- ``"static"`` (Baechi, Jeon et al., SoCC 2020, §3.2): every byte an op brings to a device —
  its outputs, temporary and persistent bytes, and every received copy of an input — is held for
  the whole step. Safe and simple, but blind to activations dying, which is exactly what
  rematerialization produces.
- ``"liveness"`` (default): persistent bytes are held all step; temporary bytes while the unit
  runs; an output from its producer's start until its last consumer on that device has finished
  and its last transfer out has ended (an output nobody reads dies with its producer); a received
  copy from its transfer's start until its last consumer on the receiving device has finished.
  Releases at a time happen before allocations at the same time (one op's end, the next's start).

``device_peak_bytes`` computes the exact per-device peak of a finished schedule under either
model; the placers' fit test during list scheduling is described in ``baechi.schedule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from graphfit.errors import GraphfitError

if TYPE_CHECKING:
    from graphfit.baechi.schedule import Schedule

__all__ = ["MEMORY_MODELS", "MemoryModelError", "check_memory_model", "device_peak_bytes"]

MEMORY_MODELS = ("liveness", "static")


class MemoryModelError(GraphfitError, ValueError):
    """An unknown memory model was asked for."""


def check_memory_model(name: str) -> None:
    """Raise ``MemoryModelError`` unless ``name`` is one of ``MEMORY_MODELS``."""
    if name not in MEMORY_MODELS:
        raise MemoryModelError(f"unknown memory model {name!r}; choose one of {MEMORY_MODELS}")


def device_peak_bytes(schedule: "Schedule") -> np.ndarray:
    """Exact peak bytes per device of a schedule under ``schedule.memory_model``.

    Parameters:
        schedule: a finished ``baechi.schedule.Schedule``.

    Returns:
        int64 array, one peak per device.

    Examples:
        >>> from profiler.cost_graph import CostGraph, OpSpec
        >>> from baechi.devices import DeviceSet
        >>> from baechi.schedule import simulate
        >>> from baechi.units import UnitGraph
        >>> g = CostGraph.from_ops([OpSpec("a", "X", output_bytes=[100], compute_us=1),
        ...                         OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[10]),
        ...                         OpSpec("c", "X", inputs=[("b", 0)], output_bytes=[1])])
        >>> units = UnitGraph.singletons(g, [0, 1, 2])
        >>> devs = DeviceSet.uniform(["/GPU:0"], "1KiB", "0,0")
        >>> simulate(units, devs, [0, 0, 0]).peak_bytes.tolist()  # a and b live together
        [110]
        >>> simulate(units, devs, [0, 0, 0], memory_model="static").peak_bytes.tolist()
        [111]
    """
    s = schedule
    units, num_devices = s.units, len(s.devices)
    device = s.device
    persistent = np.bincount(device, weights=units.persistent_bytes, minlength=num_devices)
    if s.memory_model == "static":
        held = (persistent + np.bincount(device, weights=units.temp_bytes + units.output_bytes,
                                         minlength=num_devices)
                + np.bincount(s.transfer_dst, weights=units.tensor_bytes[s.transfer_tensor],
                              minlength=num_devices))
        return held.astype(np.int64)

    num_t = units.num_tensors
    # Last use of each (tensor, device) copy: local consumers' finish, transfers out.
    last = np.full(num_t * num_devices, -np.inf)
    pair_t, pair_u = units.consumer_pairs()
    np.maximum.at(last, pair_t * num_devices + device[pair_u], s.finish_us[pair_u])
    np.maximum.at(last, s.transfer_tensor * num_devices + s.transfer_src, s.transfer_end_us)
    producer = units.tensor_producer
    out_key = np.arange(num_t) * num_devices + device[producer]
    out_end = np.maximum(last[out_key], s.finish_us[producer])
    copy_end = last[s.transfer_tensor * num_devices + s.transfer_dst]

    dev = np.concatenate([device, device, device[producer], device[producer],
                          s.transfer_dst, s.transfer_dst])
    time = np.concatenate([s.start_us, s.finish_us, s.start_us[producer], out_end,
                           s.transfer_start_us, copy_end])
    tb = units.tensor_bytes
    cb = units.tensor_bytes[s.transfer_tensor]
    delta = np.concatenate([units.temp_bytes, -units.temp_bytes, tb, -tb, cb, -cb])
    keep = delta != 0
    dev, time, delta = dev[keep], time[keep], delta[keep]
    peaks = np.zeros(num_devices, dtype=np.int64)
    order = np.lexsort((delta, time, dev))
    dev, delta = dev[order], delta[order]
    bounds = np.searchsorted(dev, np.arange(num_devices + 1))
    for d in range(num_devices):
        level = np.cumsum(delta[bounds[d]:bounds[d + 1]])
        peaks[d] = max(int(level.max()), 0) if len(level) else 0
    return peaks + persistent.astype(np.int64)
