"""Memory models of a placed step: what a device must hold, and its exact peak.

Three models, selectable everywhere a placement is made:

- ``"static"`` (Baechi, Jeon et al., SoCC 2020, §3.2): every byte an op brings to a device —
  its outputs, temporary and persistent bytes, and every received copy of an input — is held for
  the whole step. Safe and simple, but blind to activations dying, which is exactly what
  rematerialization produces.
- ``"liveness"`` (default): persistent bytes are held all step; temporary bytes while the unit
  runs; an output from its producer's start until its last consumer on that device has finished
  and its last transfer out has ended (an output nobody reads dies with its producer); a received
  copy from its transfer's start until its last consumer on the receiving device has finished.
  An output that is a persistent buffer counts with the persistent bytes; a fetched output is
  held until the step ends.
  Releases at a time happen before allocations at the same time (one op's end, the next's start).
- ``"shared"``: liveness where devices share one memory and read each other's tensors in place
  (TensorFlow's virtual CPU devices of one process pass tensors zero-copy, and the allocator's
  records charge a buffer to the device of the op that allocated it): a transfer makes no copy,
  and an output stays on its producer's device until its last reader on any device finished.
  What runs on virtual CPU devices is measured in this model.

``device_peak_bytes`` computes the exact per-device peak of a finished schedule under either
model; the placers' fit test during list scheduling is described in ``baechi.schedule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from graphfit.errors import GraphfitError

if TYPE_CHECKING:
    from graphfit.baechi.schedule import Schedule
    from graphfit.profiler.cost_graph import CostGraph

__all__ = ["MEMORY_MODELS", "MemoryModelError", "check_memory_model", "colive_lower_bound_bytes",
           "device_peak_bytes", "device_timelines"]

MEMORY_MODELS = ("liveness", "static", "shared")


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
        >>> from graphfit.profiler.cost_graph import CostGraph, OpSpec
        >>> from graphfit.baechi.devices import DeviceSet
        >>> from graphfit.baechi.schedule import simulate
        >>> from graphfit.baechi.units import UnitGraph
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

    peaks = [int(level.max(initial=0)) for _, level in _liveness_levels(s)]
    return np.maximum(np.array(peaks, dtype=np.int64), 0) + persistent.astype(np.int64)


def _liveness_levels(s: "Schedule") -> list[tuple[np.ndarray, np.ndarray]]:
    """Per device, the times of its allocations and releases under the liveness model and the
    bytes in use (persistent bytes excluded) after each, releases first at equal times."""
    units, num_devices, device = s.units, len(s.devices), s.device
    num_t = units.num_tensors
    shared = s.memory_model == "shared"
    # Last use of each (tensor, device) copy: local consumers' finish, transfers out; with
    # shared memory, of the one buffer: every consumer's finish.
    last = np.full(num_t * num_devices, -np.inf)
    pair_t, pair_u = units.consumer_pairs()
    producer = units.tensor_producer
    reader_device = device[producer[pair_t]] if shared else device[pair_u]
    np.maximum.at(last, pair_t * num_devices + reader_device, s.finish_us[pair_u])
    np.maximum.at(last, s.transfer_tensor * num_devices + s.transfer_src, s.transfer_end_us)
    out_key = np.arange(num_t) * num_devices + device[producer]
    out_end = np.maximum(last[out_key], s.finish_us[producer])
    out_end[units.tensor_fetched] = np.inf
    copies = np.zeros(0, dtype=np.int64) if shared else s.transfer_tensor
    copy_end = _copy_ends(s) if len(copies) else np.zeros(0)

    dev = np.concatenate([device, device, device[producer], device[producer],
                          s.transfer_dst[:len(copies)], s.transfer_dst[:len(copies)]])
    time = np.concatenate([s.start_us, s.finish_us, s.start_us[producer], out_end,
                           s.transfer_start_us[:len(copies)], copy_end])
    tb = np.where(units.tensor_persistent, 0, units.tensor_bytes)
    cb = units.tensor_bytes[copies]
    delta = np.concatenate([units.temp_bytes, -units.temp_bytes, tb, -tb, cb, -cb])
    keep = delta != 0
    dev, time, delta = dev[keep], time[keep], delta[keep]
    order = np.lexsort((delta, time, dev))
    dev, time, delta = dev[order], time[order], delta[order]
    bounds = np.searchsorted(dev, np.arange(num_devices + 1))
    return [(time[bounds[d]:bounds[d + 1]], np.cumsum(delta[bounds[d]:bounds[d + 1]]))
            for d in range(num_devices)]


def _copy_ends(s: "Schedule") -> np.ndarray:
    """When each received copy is freed: the last finish of the readers on its device that
    start while it is the newest copy of its tensor there (a tensor fetched again after its
    copy was freed, ``Schedule.transient_copies``, has several)."""
    units, num_devices, device = s.units, len(s.devices), s.device
    key = s.transfer_tensor * num_devices + s.transfer_dst
    by_key = np.lexsort((s.transfer_start_us, key))
    sorted_key = key[by_key]
    pair_t, pair_u = units.consumer_pairs()
    remote = device[pair_u] != device[units.tensor_producer[pair_t]]
    reader_key = pair_t[remote] * num_devices + device[pair_u[remote]]
    reader = pair_u[remote]
    first = np.searchsorted(sorted_key, reader_key, side="left")
    count = np.searchsorted(sorted_key, reader_key, side="right") - first
    copy = first.copy()
    starts = s.transfer_start_us[by_key]
    for k in np.flatnonzero(count > 1).tolist():  # several copies: the newest before the read
        lo, hi = int(first[k]), int(first[k] + count[k])
        copy[k] = lo + max(0, int(np.searchsorted(starts[lo:hi], s.start_us[reader[k]],
                                                  side="right")) - 1)
    end = s.transfer_end_us[by_key].copy()
    np.maximum.at(end, copy[count > 0], s.finish_us[reader[count > 0]])
    copy_end = np.empty(len(key))
    copy_end[by_key] = end
    return copy_end


def device_timelines(schedule: "Schedule") -> list[tuple[np.ndarray, np.ndarray]]:
    """Per device, its memory over the simulated step: ``(times_us, bytes_in_use)`` after each
    allocation or release, persistent bytes included (the step starts at time 0 with them).

    Parameters:
        schedule: a finished ``baechi.schedule.Schedule``.

    Returns:
        One pair of equal-length arrays per device; the largest ``bytes_in_use`` is the
        device's ``device_peak_bytes``.
    """
    s = schedule
    persistent = np.bincount(s.device, weights=s.units.persistent_bytes,
                             minlength=len(s.devices)).astype(np.int64)
    if s.memory_model == "static":
        peaks = device_peak_bytes(s)
        return [(np.array([0.0, s.makespan_us]), np.array([peaks[d], peaks[d]]))
                for d in range(len(s.devices))]
    return [(np.concatenate([[0.0], times]), persistent[d] + np.concatenate([[0], level]))
            for d, (times, level) in enumerate(_liveness_levels(s))]


def colive_lower_bound_bytes(graph: "CostGraph", num_devices: int,
                             candidates: int = 16) -> tuple[int, int]:
    """A per-device limit below which no placement of ``graph`` on ``num_devices`` devices
    fits under the liveness model, and the op that shows it: ``(bytes, op index)``.

    Why: when every placer refuses a limit (even the repair step's topological order), this
    says whether a better placer could have done it. When an op ``v`` starts, whatever the
    devices and the order, these bytes exist on some device: all persistent bytes (held all
    step), ``v``'s outputs and temporary bytes, and every tensor an ancestor of ``v``
    produced that ``v`` or a descendant of ``v`` still reads (or that is fetched). So some
    device holds at least their sum / ``num_devices`` then. The bound holds at every op; it
    is computed at the ``candidates`` ops where the step run in op order holds the most,
    where it is largest in practice.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order

    n, num_tensors = graph.num_ops, graph.num_tensors
    reads = [(int(t), j) for j in range(n) for t in dict.fromkeys(graph.op_inputs(j).tolist())]
    read_tensor = np.array([t for t, _ in reads], dtype=np.int64)
    reader = np.array([j for _, j in reads], dtype=np.int64)
    control = [(int(i), j) for j in range(n) for i in graph.control_inputs(j).tolist()]
    src = np.concatenate([graph.tensor_producer[read_tensor],
                          np.array([i for i, _ in control], dtype=np.int64)])
    dst = np.concatenate([reader, np.array([j for _, j in control], dtype=np.int64)])
    forward = csr_matrix((np.ones(len(src)), (src, dst)), shape=(n, n))
    backward = forward.T.tocsr()
    held = graph.persistent_bytes.sum()
    counted = ~graph.tensor_persistent  # a persistent output counts with the persistent bytes
    # The step in op order (ops are stored topologically): a tensor lives from its producer
    # to its last reader (a fetched one to the end).
    last = graph.tensor_producer.astype(np.int64).copy()
    np.maximum.at(last, read_tensor, reader)
    last[graph.tensor_fetched] = n
    change = np.zeros(n + 2, dtype=np.int64)
    np.add.at(change, graph.tensor_producer + 1, np.where(counted, graph.tensor_bytes, 0))
    np.add.at(change, last + 1, -np.where(counted, graph.tensor_bytes, 0))
    in_order = np.cumsum(change)[:n] + graph.temp_bytes
    best = (0, 0)
    for v in np.argsort(-in_order, kind="stable")[:candidates].tolist():
        before = np.zeros(n, dtype=bool)
        before[breadth_first_order(backward, v, return_predecessors=False)] = True
        before[v] = False
        later = np.zeros(n, dtype=bool)
        later[breadth_first_order(forward, v, return_predecessors=False)] = True
        read_later = np.zeros(num_tensors, dtype=bool)
        read_later[read_tensor[later[reader]]] = True
        alive = counted & before[graph.tensor_producer] & (read_later | graph.tensor_fetched)
        outputs = graph.op_outputs(v)
        total = (held + graph.tensor_bytes[alive].sum() + graph.temp_bytes[v]
                 + graph.tensor_bytes[outputs][counted[outputs]].sum())
        bound = -(-int(total) // num_devices)
        if bound > best[0]:
            best = (bound, v)
    return best
