"""Measure a training step: run it traced and turn TF's step stats into a ``Profile``.

Baechi's recipe on TF 2.21: warm up, then run ``steps`` steps tracing every ``trace_every``-th
with ``FULL_TRACE``; per op take the median compute time and the largest bytes over the traced
steps. Per device, replay the allocator's records (each allocation and free, with its time) on
top of what was resident before the step (variables, kernels' persistent buffers, fed tensors)
to get the real memory timeline and its peak.

Each node's stats also sample the allocator's bytes in use when the node finished: the
allocator's own view of the step, kept beside the replay. On a device with an allocator of its
own (one CPU, a GPU) it is that device's memory; virtual CPU devices share one allocator, so
there only the replay splits memory by device.

The allocator's own reading (``AllocatorPeak``: its high-water mark over each measured step,
and what the step added above the bytes in use when it began) is kept beside the replay where
TF keeps statistics, and ``remat.measure`` takes it as the ruler there. TF's default CPU
allocator keeps none: with oneDNN off (the default on CPUs without AVX-512, or
``TF_ENABLE_ONEDNN_OPTS=0``) ``reset_memory_stats('CPU:0')`` raises ``Cannot reset memory
stats``. oneDNN's allocator and TF's BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, read
once, when TF creates its CPU allocator; a GPU's allocator always) keep them. The library does
not set that variable: in a process that already ran TF it comes too late, and it would change
the allocator the user's own steps run with. Without statistics the allocator's reading is
``None`` and peaks are the replay of allocation records, which TF keeps with every allocator.
In the same session the two agreed on ``keras.applications.ResNet50`` (64x64, batch 8, SGD,
oneDNN on): 134.1 MB added by the records, 134.9 MB by the allocator (2026-12-06).

oneDNN's allocator is blind to small buffers: TF 2.21's ``MklCPUAllocator``
(``mkl_cpu_allocator.h``) hands every request below ``ONEDNN_UNCOUNTED_BYTES`` (256 KiB) to a
small-size allocator whose statistics are off (``mkl_small_allocator_collect_stats = false``,
set nowhere), so its peak counts only the larger buffers (and oneDNN's own, which the records
miss). Measured on 2026-12-06: 4 MiB held at once as 64 KiB tensors added 0 bytes by the
allocator and 4 MiB by the records; as 256 KiB tensors 4.25 MiB by the allocator; with oneDNN
off and the BFC allocator both rulers read 4.0-4.2 MiB either way. On the Keras transformer of
``bench.reconcile`` (its activations are 128 KiB) the allocator read 6.8 MB where the records
read 9.5 MB: the records did not overcount, the allocator missed its small buffers.
``remat.measure`` therefore takes the larger of the two with oneDNN on.

Which allocator is read follows the step's placement (``allocator_devices``): the CPU's
(every CPU device of a process, virtual ones included, shares it) for a step on CPUs; for a
step placed on GPUs (``/GPU:i``, or unplaced in a process that sees a GPU, where TF's placer
puts it on the first) each of those GPUs' BFC allocators, which always keep statistics and
count every buffer, and the reading is of the GPU that added most. Only the CPU path is
measured here (this machine has no GPU).

Grappler (``profiler.session``) and oneDNN run some ops inside another node (the remapper's
``_FusedMatMul`` carries the name of the ``Relu`` it ends with) or fold them away: such an op,
all of whose readers were measured, costs 0 in the profile (no time, no output buffer): its
work and its result are its reader's.

Runtime-inserted nodes (``_SOURCE``, ``_Send``/``_Recv``, ``_arg_*``/``_retval_*``) are not graph
ops and are ignored; fed placeholders are costed exactly from their feeds.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.profile import DeviceMemory, OpCost, Profile, graph_fingerprint
from graphfit.profiler.progress import progress_bar
from graphfit.profiler.session import make_session, onednn_enabled
from graphfit.profiler.tf_import import VARIABLE_OP_TYPES, variable_bytes, step_operations

# The process-wide CPU allocator, shared by a session's (virtual) CPU devices: its peak over a
# traced step is the independent check of the peak replayed from allocation records.
CPU_ALLOCATOR = "CPU:0"
# With oneDNN on, the CPU allocator's statistics leave out every buffer below this size
# (module docstring).
ONEDNN_UNCOUNTED_BYTES = 262144
# A step's reading by the allocator is ``peak_reading`` of this many steps' readings
# (``added_by_calls``): the nearest-rank ``PEAK_QUANTILE``, of 12-19 readings the 2nd largest.
# One step's reading moves from one step to the next with the free chunks the steps before left
# (``keras.applications.ResNet50``, 64x64, batch 8: 73-106 MB added over 552 steps of 10 fresh
# processes, as widely with one inter-op and one intra-op thread, and with oneDNN off), more
# than the 5% a baseline is held to. Over 21 series of 24-32 steps in 11 processes, with the
# resident bytes, the 90th percentile read 186.6-195.6 MB (1.5% standard deviation), the
# largest 187.2-203.9 MB, and one series held a single step of 145 MB: the largest is at the
# mercy of one step, the median of where the body sits (176-191 MB). Cut into 64 series of 12,
# the 90th percentile moved by 1.8%, the largest by 3.5%: few readings cost little, since
# every reading is a step (12 calls of ResNet50's step made ``optimize``'s first stage 4.3-4.8 s
# longer at a load average of 1.8; 16 calls 7-8 s and 32 calls 9-12 s at 2-4). A high
# quantile is also what a user's worst steps run out of memory at (2026-12-07,
# ``bench/RESULTS.md``).
PEAK_READINGS = 12
PEAK_QUANTILE = 0.9
# Fewer readings where the first ones do not spread (a rewritten step whose order the rewrite
# pins: 24 calls of ``ResNet50``'s at half its memory read 41.3 MB each): this many, within
# this fraction of the largest.
STEADY_READINGS = 6
STEADY_SPREAD = 0.02

__all__ = ["profile_graph", "profile_from_run_metadata", "step_fetches", "print_progress",
           "AllocatorPeak", "added_by_calls", "allocator_devices", "default_allocator",
           "uncounted_below_bytes",
           "traced_peak_bytes", "CPU_ALLOCATOR", "ONEDNN_UNCOUNTED_BYTES", "PEAK_READINGS",
           "PEAK_QUANTILE", "peak_reading", "STEADY_READINGS", "STEADY_SPREAD"]


def print_progress(message: str) -> None:
    """Progress lines go to stderr so they never mix with a tool's JSON on stdout."""
    print(message, file=sys.stderr, flush=True)


def default_allocator() -> str:
    """The allocator of an op placed nowhere: TF's placer puts it on the first GPU when the
    process sees one (every op with a GPU kernel), else on the CPU."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else CPU_ALLOCATOR


def allocator_devices(device_names: Iterable[str], default: str = CPU_ALLOCATOR) -> list[str]:
    """The allocators (``get_memory_info``'s names, ``"CPU:0"``, ``"GPU:i"``) that hold a
    step whose ops are placed on ``device_names`` (``"/device:GPU:1"``, a full
    ``/job:.../device:CPU:0`` name; ``""``: placed by TF, on ``default``).

    Every CPU device of a process, virtual ones included, allocates from the one CPU allocator.
    A step on GPUs is read by their allocators only: what it holds in host memory (fed
    batches, shapes) is not what a GPU budget is about, and the CPU's allocator keeps no
    statistics by default anyway. Sorted, so readings line up between runs.

    Examples:
        >>> allocator_devices(["", "/device:CPU:1"])
        ['CPU:0']
        >>> allocator_devices(["/job:localhost/replica:0/task:0/device:GPU:1", "/CPU:0"])
        ['GPU:1']
        >>> allocator_devices(["", "/device:GPU:1"], default="GPU:0")
        ['GPU:0', 'GPU:1']
    """
    allocators = set()
    for name in device_names:
        spec = tf.DeviceSpec.from_string(name) if name else None
        if spec is None or spec.device_type is None:
            allocators.add(default)
        elif spec.device_type.upper() == "GPU":
            allocators.add(f"GPU:{spec.device_index or 0}")
        else:
            allocators.add(CPU_ALLOCATOR)
    gpus = sorted(a for a in allocators if a.startswith("GPU:"))
    return gpus or [CPU_ALLOCATOR]


def uncounted_below_bytes(allocators: Iterable[str]) -> int:
    """The size below which the statistics of ``allocators`` leave buffers out:
    ``ONEDNN_UNCOUNTED_BYTES`` when one is the CPU's with oneDNN on (module docstring), else
    0 (a GPU's BFC allocator, TF's BFC allocator on the CPU count every buffer)."""
    return ONEDNN_UNCOUNTED_BYTES if CPU_ALLOCATOR in allocators and onednn_enabled() else 0


class AllocatorPeak:
    """TF's allocators of ``devices`` (``allocator_devices``; default: the one an unplaced op
    runs on) over a ``with`` block: their high-water mark, and what the block added on top of
    what was in use when it began.

    ``bytes`` is the peak after the block and ``added_bytes`` the peak minus the bytes in use at
    its start (``reset_memory_stats`` sets the peak to the bytes in use), of the device that
    added most (one device: its own reading), or both ``None`` if an allocator keeps no
    statistics (module docstring) or ``enabled`` is false (e.g. a step on a gRPC target, whose
    workers' allocators are not this process's). ``added_bytes`` is what a step costs whatever
    else the process holds (a Keras model's own weights, other sessions' variables): the
    reading ``remat.measure`` compares steps by.
    """

    def __init__(self, enabled: bool = True, devices: Iterable[str] | None = None):
        self.bytes: int | None = None
        self.added_bytes: int | None = None
        self.devices = list(devices or [default_allocator()])
        self._kept = enabled
        self._start: dict[str, int] = {}

    def __enter__(self) -> "AllocatorPeak":
        if self._kept:
            try:
                for device in self.devices:
                    tf.config.experimental.reset_memory_stats(device)
            except ValueError:      # "Cannot reset memory stats": no statistics kept
                self._kept = False
            else:
                self._start = {device: int(tf.config.experimental.get_memory_info(device)
                                           ["current"]) for device in self.devices}
        return self

    def __exit__(self, *exc_info) -> None:
        if self._kept:
            peaks = {device: int(tf.config.experimental.get_memory_info(device)["peak"])
                     for device in self.devices}
            device = max(peaks, key=lambda d: peaks[d] - self._start[d])
            self.bytes = peaks[device]
            self.added_bytes = peaks[device] - self._start[device]


def added_by_calls(call: Callable[[], Any], warmup: int = 0,
                   devices: Iterable[str] | None = None, readings: int = PEAK_READINGS,
                   first: Iterable[int | None] = ()) -> list[int | None]:
    """What each call of ``call`` adds by the allocators of ``devices`` (``AllocatorPeak.
    added_bytes``; ``None``: they keep no statistics), after ``warmup`` calls: ``first``
    (readings made already, e.g. of a session's traced steps), then one reading per call
    until there are ``readings``, or ``STEADY_READINGS`` that spread by at most
    ``STEADY_SPREAD`` of the largest, or a ``None``. A step's reading is their
    ``peak_reading``."""
    done = list(first)
    if not _enough(done, readings):
        for _ in range(warmup):
            call()
    while not _enough(done, readings):
        with AllocatorPeak(devices=devices) as allocator:
            call()
        done.append(allocator.added_bytes)
    return done


def peak_reading(readings: Sequence[int | None]) -> int | None:
    """A step's reading from its steps' (``added_by_calls``): the nearest-rank
    ``PEAK_QUANTILE`` of them (of fewer than 10, the largest); ``None`` where there are none
    or the allocator keeps no statistics.

    Examples:
        >>> peak_reading(list(range(1, 33)))
        29
        >>> peak_reading([3, 9, 4])
        9
    """
    if not readings or None in readings:
        return None
    return sorted(readings)[math.ceil(PEAK_QUANTILE * len(readings)) - 1]


def _enough(readings: list[int | None], wanted: int) -> bool:
    """Whether ``readings`` are enough to read the step by (``added_by_calls``)."""
    if len(readings) >= wanted or None in readings:
        return True
    return (len(readings) >= STEADY_READINGS
            and max(readings) - min(readings) <= STEADY_SPREAD * max(readings))


def traced_peak_bytes(session: tf.compat.v1.Session, graph: tf.Graph, fetches, feeds) -> int:
    """Run ``fetches`` once traced in ``session``; the largest device peak replayed from the
    allocation records."""
    metadata = tf.compat.v1.RunMetadata()
    session.run(fetches, feeds, run_metadata=metadata,
                options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    _, devices = profile_from_run_metadata(graph, [metadata], set())
    return max(memory.peak_bytes for memory in devices.values())


def step_fetches(item: GraphItem) -> list[str]:
    """What one training step runs: the update, the loss and the gradients."""
    return [item.train_op, item.loss, *item.gradients]


def _resident_bytes(graph: tf.Graph, node_stats) -> int:
    """Bytes a device held before the step: variables it hosts, kernels' persistent buffers,
    and the fed tensors (``_arg_*`` outputs)."""
    total = 0
    for ns in node_stats:
        total += ns.memory_stats.persistent_memory_size
        if ns.node_name.startswith("_arg_"):
            total += sum(o.tensor_description.allocation_description.requested_bytes
                         for o in ns.output)
            continue
        try:
            op = graph.get_operation_by_name(ns.node_name)
        except KeyError:
            continue
        if op.type in VARIABLE_OP_TYPES:
            total += variable_bytes(op)
    return total


def _variable_release_us(graph: tf.Graph, update: tf.Operation,
                         end_us: dict[str, int]) -> int | None:
    """When the buffer a variable update replaced is freed: after the last op that read the
    old value through a ``ReadVariableOp`` of the same variable (``None``: not an update)."""
    handles = [t for t in update.inputs if t.dtype == tf.resource]
    if not update.op_def.is_stateful or not handles:
        return None
    readers = [c for h in handles for c in h.consumers() if c.type == "ReadVariableOp"]
    last_uses = [end_us[c.name] for r in readers for out in r.outputs
                 for c in out.consumers() if c.name in end_us]
    return max(last_uses, default=None)


def _allocation_records(graph: tf.Graph, node_stats) -> list[tuple[int, int]]:
    """(time, ±bytes) of every allocation and free in the step, in time order.

    An update op (stateful, takes a variable's handle) that allocates a buffer it keeps is a
    copy-on-write of the variable: TF copies when readers still hold the old value. The old
    buffer was allocated before the step, so its free is in no record; it is added here, at
    the end of the last op that read the old value.
    """
    end_us = {ns.node_name: ns.all_start_micros + ns.all_end_rel_micros for ns in node_stats}
    records = []
    for ns in node_stats:
        own = [(r.alloc_micros, r.alloc_bytes) for m in ns.memory for r in m.allocation_records]
        records += own
        kept = sum(b for _, b in own)
        if kept <= 0:
            continue
        try:
            op = graph.get_operation_by_name(ns.node_name)
        except KeyError:
            continue
        released = _variable_release_us(graph, op, end_us)
        if released is not None:
            records.append((max(released, max(t for t, _ in own)), -kept))
    return sorted(records)


def _memory_timeline(graph: tf.Graph, node_stats, step_start_us: int) -> DeviceMemory:
    records = _allocation_records(graph, node_stats)
    resident = _resident_bytes(graph, node_stats)
    in_use = resident + np.cumsum([b for _, b in records], dtype=np.int64)
    timeline = [(0.0, resident)] + [(float(t - step_start_us), int(b))
                                    for (t, _), b in zip(records, in_use)]
    samples = sorted((ns.all_start_micros + ns.all_end_rel_micros - step_start_us,
                      m.allocator_bytes_in_use)
                     for ns in node_stats for m in ns.memory if m.allocator_bytes_in_use)
    return DeviceMemory(peak_bytes=int(max(resident, in_use.max(initial=0))),
                        resident_bytes=resident, timeline=timeline,
                        allocator_peak_bytes=max((b for _, b in samples), default=0),
                        allocator_timeline=[(float(t), int(b)) for t, b in samples])


def profile_from_run_metadata(graph: tf.Graph, runs: list[tf.compat.v1.RunMetadata],
                              op_names: set[str]) -> tuple[dict[str, OpCost],
                                                           dict[str, DeviceMemory]]:
    """Per-op costs (median time, largest bytes) and per-device memory (the traced step with
    the highest peak) from traced runs; nodes not in ``op_names`` are ignored."""
    times: dict[str, list[float]] = defaultdict(list)
    outputs: dict[str, dict[int, int]] = defaultdict(dict)
    temp: dict[str, int] = defaultdict(int)
    persistent: dict[str, int] = defaultdict(int)
    devices: dict[str, DeviceMemory] = {}
    for md in runs:
        starts = [ns.all_start_micros for d in md.step_stats.dev_stats for ns in d.node_stats]
        step_start = min(starts, default=0)
        for dev in md.step_stats.dev_stats:
            memory = _memory_timeline(graph, dev.node_stats, step_start)
            if dev.device not in devices or memory.peak_bytes > devices[dev.device].peak_bytes:
                devices[dev.device] = memory
            for ns in dev.node_stats:
                name = ns.node_name
                if name not in op_names:
                    continue
                times[name].append((ns.op_end_rel_nanos - ns.op_start_rel_nanos) / 1000.0)
                for out in ns.output:
                    size = out.tensor_description.allocation_description.requested_bytes
                    outputs[name][out.slot] = max(outputs[name].get(out.slot, 0), size)
                temp[name] = max(temp[name], ns.memory_stats.temp_memory_size)
                persistent[name] = max(persistent[name], ns.memory_stats.persistent_memory_size)
    costs = {}
    for name, samples in times.items():
        ports = outputs[name]
        costs[name] = OpCost(
            compute_us=statistics.median(samples),
            output_bytes=[ports.get(p, 0) for p in range(max(ports, default=-1) + 1)],
            temp_bytes=temp[name], persistent_bytes=persistent[name])
    return costs, devices


def _fused_ops(step_ops: list[tf.Operation], costs: dict[str, OpCost]) -> list[str]:
    """Step ops the trace misses whose every reader was measured or is such an op itself:
    ops Grappler's remapper or oneDNN ran inside a reader (``MatMul`` + ``BiasAdd`` + ``Relu``
    as one ``_FusedMatMul`` under the ``Relu``'s name), or that Grappler folded or pruned."""
    names = {op.name for op in step_ops}
    missed = {op.name: [c.name for t in op.outputs for c in t.consumers() if c.name in names]
              for op in step_ops if op.name not in costs}
    fused: set[str] = set()
    changed = True
    while changed:                       # a chain of fused ops joins from its measured end
        changed = False
        for name, readers in missed.items():
            if name not in fused and readers and all(r in costs or r in fused
                                                     for r in readers):
                fused.add(name)
                changed = True
    return sorted(fused)


def profile_graph(item: GraphItem, steps: int = 6, warmup: int = 2, trace_every: int = 2,
                  num_cpu_devices: int = 1, target: str = "",
                  progress: bool | None = True,
                  session_factory: Callable[[tf.Graph], tf.compat.v1.Session] | None = None,
                  on_traced_step: Callable[[tf.compat.v1.RunMetadata], Any] | None = None,
                  before_measuring: Callable[[], Any] | None = None) -> Profile:
    """Run ``item``'s training step and measure it.

    Args:
        item: the training step.
        steps: steps run after warm-up; every ``trace_every``-th one is traced.
        warmup: untraced steps first (allocator and kernel caches settle).
        num_cpu_devices: virtual CPU devices of the session (for placed graphs).
        target: a ``grpc://`` address to profile on a TF cluster, or local.
        progress: a progress bar over the steps on a terminal (never in logs); ``None`` or
            ``False`` for none.
        session_factory: graph -> the session to run in (e.g. ``baechi.run.RunTarget.session``,
            which bounds and diagnoses calls on a cluster); default ``make_session``.
        on_traced_step: called with each traced step's ``RunMetadata`` (``remat.tf_memory.
            TracedOrders`` takes the first as the first order it plans on).
        before_measuring: called once between the warm-up steps and the first measured one,
            e.g. to wait for work run beside the session's first step (``remat.measure.
            measure_step``'s ``beside``), which no measured step may overlap.

    Returns:
        The profile; its ``coverage`` is the fraction of the step's ops measured.
    """
    if steps < 1 or trace_every < 1:
        raise ValueError(f"steps ({steps}) and trace_every ({trace_every}) must be at least 1")
    fetches = step_fetches(item)
    step_ops = step_operations(item.graph, fetches)
    op_names = {op.name for op in step_ops}
    allocators = allocator_devices({op.device for op in step_ops}, default_allocator())
    runs, step_times, allocator_peaks, allocator_added = [], [], [], []
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    session_factory = session_factory or (lambda g: make_session(g, num_cpu_devices, target))
    with session_factory(item.graph) as session:
        item.initialize(session)
        feeds = item.feed_dict()
        for k in progress_bar(range(warmup + steps), f"profile {item.name or 'graph'}",
                              enabled=bool(progress)):
            traced = k >= warmup and (k - warmup) % trace_every == 0
            if k == warmup and before_measuring is not None:
                before_measuring()
            metadata = tf.compat.v1.RunMetadata()
            with AllocatorPeak(k >= warmup and not target, allocators) as allocator:
                begin = time.perf_counter()
                session.run(fetches, feeds, options=options if traced else None,
                            run_metadata=metadata if traced else None)
                elapsed_us = (time.perf_counter() - begin) * 1e6
            if k >= warmup and not traced:
                step_times.append(elapsed_us)
            if allocator.bytes is not None:
                allocator_peaks.append(allocator.bytes)
                allocator_added.append(allocator.added_bytes)
            if traced:
                runs.append(metadata)
                if on_traced_step is not None:
                    on_traced_step(metadata)
    costs, devices = profile_from_run_metadata(item.graph, runs, op_names)
    fused = _fused_ops(step_ops, costs)
    costs.update((name, OpCost(compute_us=0.0, output_bytes=[0] * len(
        item.graph.get_operation_by_name(name).outputs))) for name in fused)
    for name, value in item.feeds.items():
        op_name = name.split(":")[0]
        costs.setdefault(op_name, OpCost(compute_us=0.0, output_bytes=[int(value.nbytes)]))
    return Profile(
        graph_fingerprint=graph_fingerprint(item.graph.as_graph_def()),
        ops=costs, devices=devices, step_time_us=step_times, num_graph_ops=len(op_names),
        unmeasured_ops=sorted(op_names - costs.keys()),
        metadata={"model": item.name, "config": item.config, "steps": steps,
                  "warmup": warmup, "trace_every": trace_every,
                  "traced_steps": len(runs), "num_cpu_devices": num_cpu_devices,
                  "fused_ops": len(fused),
                  "allocator_devices": allocators,
                  "allocator_peak_bytes": allocator_peaks,
                  "allocator_added_bytes": allocator_added})
