"""Run a placed training step and check it: the ``run`` pass of the pipeline (TF at the edge).

Where a placed graph runs (DESIGN.md §6):

- ``local_target(n)``: one process; ``/GPU:i`` when TensorFlow sees ``n`` GPUs, else ``n``
  virtual CPU devices ``/device:CPU:i``. Virtual CPU devices share one allocator and thread pool and
  pass tensors zero-copy: right for correctness and per-device memory accounting, not for speed.
- a TF gRPC cluster (``baechi.cluster``: ``Cluster(spec)`` for workers started with
  ``tools/worker.py``, ``LocalCluster(n)`` for ``n`` such workers on loopback ports): a v1
  session on ``grpc://`` task 0, ops pinned to ``/job:worker/task:k/device:...``. Transfers are
  real and memory is per process. Every session on a cluster has an operation timeout, and its
  TF errors are turned into the cluster's diagnosis (``RunTarget.diagnose``).

Checks:

- one step of the placed graph (in ``RunTarget.session``) against one step of the original on a
  single device: ``profiler.step_compare.compare_steps`` with ``rtol=PLACEMENT_RTOL``.
- ``measure_placed_run``: step time and per-device peak memory replayed from the step stats'
  allocation records (``profiler.trace.profile_graph``), matched to the placement's device names
  and compared with each device's limit. On virtual CPU devices the records are attributed to the
  device of the op that allocated the buffer (checked: an activation made on ``CPU:1`` counts on
  ``CPU:1``); a tensor read zero-copy by another device stays on its producer's account.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

from graphfit.errors import GraphfitError
from graphfit.baechi.devices import default_device_names
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import session_config
from graphfit.profiler.tf_import import step_operations
from graphfit.profiler.trace import profile_graph, step_fetches

__all__ = ["DeviceMismatchError", "MemoryLimitError", "PLACEMENT_RTOL", "PlacedRun", "RunTarget",
           "local_target", "measure_placed_run"]

# Relative tolerance of a placed step against the single-device step: devices may sum in
# another order.
PLACEMENT_RTOL = 1e-4


class DeviceMismatchError(GraphfitError, RuntimeError):
    """The devices a run reports do not line up with the placement's device names."""


class MemoryLimitError(GraphfitError, RuntimeError):
    """A device's measured peak memory exceeds its limit."""


@dataclasses.dataclass(frozen=True)
class RunTarget:
    """Where a placed graph runs.

    Attributes:
        devices: the device names a placement may use, in order.
        kind: ``"virtual_cpu"``, ``"gpu"`` or ``"grpc"``.
        target: the session target (``""`` in process, ``grpc://...`` on a cluster).
        num_cpu_devices: CPU devices of the in-process session.
        operation_timeout_ms: bound on every call of a session on a remote target (0: none).
        diagnose: a TF error of such a session -> the exception to raise instead (a cluster's
            ``ClusterError`` naming the worker at fault).
    """

    devices: tuple[str, ...]
    kind: str
    target: str = ""
    num_cpu_devices: int = 1
    operation_timeout_ms: int = 0
    diagnose: Callable[[tf.errors.OpError], Exception] | None = dataclasses.field(
        default=None, compare=False, repr=False)

    def session(self, graph: tf.Graph) -> tf.compat.v1.Session:
        """A session on ``graph`` with the project's config (``profiler.session``); on a
        cluster each session gets its own variables, the operation timeout and ``diagnose``."""
        config = session_config(self.num_cpu_devices)
        config.isolate_session_state = bool(self.target)
        config.operation_timeout_in_ms = self.operation_timeout_ms
        if self.diagnose is None:
            return tf.compat.v1.Session(target=self.target, graph=graph, config=config)
        return _DiagnosedSession(self.diagnose, target=self.target, graph=graph, config=config)


class _DiagnosedSession(tf.compat.v1.Session):
    """A session whose TF errors go through ``diagnose`` (the cluster names the worker)."""

    def __init__(self, diagnose: Callable[[tf.errors.OpError], Exception], **kwargs):
        super().__init__(**kwargs)
        self._diagnose = diagnose
        self._failed = False

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        except tf.errors.OpError as error:
            self._failed = True
            raise self._diagnose(error) from error

    def close(self) -> None:
        """Close (bounded by the operation timeout); after a failed run, the close's own
        error (the same dead worker) is dropped: the run's error was already raised."""
        try:
            super().close()
        except tf.errors.OpError as error:
            if not self._failed:
                raise self._diagnose(error) from error


def local_target(num_devices: int) -> RunTarget:
    """``num_devices`` devices of this process: GPUs when TF sees that many, else virtual
    CPUs (names from ``baechi.devices.default_device_names``).

    Raises:
        baechi.devices.DeviceError: ``num_devices < 1``.
    """
    gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    names = tuple(default_device_names(num_devices, gpus))
    if names[0].startswith("/GPU:"):
        return RunTarget(names, "gpu")
    return RunTarget(names, "virtual_cpu", num_cpu_devices=num_devices)


@dataclasses.dataclass
class PlacedRun:
    """Measured step of a placed graph.

    Attributes:
        step_time_ms_median: median wall time of the untraced steps.
        step_times_ms: every untraced step's wall time.
        peak_bytes: placement device name -> peak bytes replayed from allocation records.
        limit_bytes: placement device name -> its limit (devices without a limit absent).
        stats_devices: placement device name -> the device name TF's step stats used.
        timelines: placement device name -> its memory over the traced step with the highest
            peak, ``(microseconds since the step began, bytes in use)`` pairs.
    """

    step_time_ms_median: float
    step_times_ms: list[float]
    peak_bytes: dict[str, int]
    limit_bytes: dict[str, int]
    stats_devices: dict[str, str]
    timelines: dict[str, list[tuple[float, int]]] = dataclasses.field(default_factory=dict)

    @property
    def over_limit_bytes(self) -> dict[str, int]:
        """Device -> bytes its peak exceeds its limit by (devices within limits absent)."""
        return {d: self.peak_bytes.get(d, 0) - limit for d, limit in self.limit_bytes.items()
                if self.peak_bytes.get(d, 0) > limit}

    def check_limits(self) -> None:
        """Raise ``MemoryLimitError`` naming every device whose peak exceeds its limit."""
        over = self.over_limit_bytes
        if over:
            detail = ", ".join(f"{d}: peak {self.peak_bytes[d]} > limit {self.limit_bytes[d]} "
                               f"by {b} bytes" for d, b in sorted(over.items()))
            raise MemoryLimitError(f"measured peak memory exceeds the limit on {detail}")


def _device_matches(placement_name: str, stats: tf.DeviceSpec) -> bool:
    """Whether a placement's device name designates the device TF reported (fields the
    placement name leaves out, e.g. job and task of ``/device:CPU:1``, match anything)."""
    want = tf.DeviceSpec.from_string(placement_name)
    return all(getattr(want, field) is None or getattr(want, field) == getattr(stats, field)
               for field in ("job", "replica", "task", "device_type", "device_index"))


def _match_stats_devices(devices: Sequence[str], used_devices: set[str],
                         stats_names: Sequence[str]) -> dict[str, str]:
    """placement device -> stats device name; raises when they do not line up.

    Stats devices the placement does not name (the client's CPU that feeds and fetches on a
    GPU machine, GPU stream timings) are left out.
    """
    matches: dict[str, str] = {}
    for name in stats_names:
        if "/stream:" in name or "/memcpy" in name:
            continue  # GPU stream timings; allocations are on the device's own entry
        spec = tf.DeviceSpec.from_string(name)
        owners = [d for d in devices if _device_matches(d, spec)]
        if len(owners) > 1:
            raise DeviceMismatchError(f"step stats device {name!r} matches several of the "
                                      f"placement's devices {owners}")
        if owners and owners[0] in matches:
            raise DeviceMismatchError(f"placement device {owners[0]!r} matches both "
                                      f"{matches[owners[0]]!r} and {name!r} in the step stats")
        if owners:
            matches[owners[0]] = name
    unseen = sorted(used_devices - matches.keys())
    if unseen:
        raise DeviceMismatchError(
            f"devices {unseen} host ops of the placement but the step stats report only "
            f"{sorted(stats_names)}: the run's devices do not line up with the placement")
    return matches


def measure_placed_run(placed: GraphItem, run_target: RunTarget,
                       limit_bytes: Mapping[str, int] | None = None, steps: int = 4,
                       warmup: int = 1, trace_every: int = 2) -> PlacedRun:
    """Time ``placed`` on ``run_target`` and measure each device's peak memory.

    Parameters:
        placed: a placed step.
        run_target: where it runs; its ``devices`` are the names the placement used.
        limit_bytes: device name -> memory limit to compare against (optional).
        steps, warmup, trace_every: as ``profiler.trace.profile_graph``; traced steps give the
            memory, untraced ones the step time (so ``steps >= 2`` with ``trace_every=2``).

    Returns:
        The measurement; ``.check_limits()`` raises if a device went over its limit.

    Raises:
        DeviceMismatchError: the step stats' devices do not line up with ``run_target.devices``.
    """
    profile = profile_graph(placed, steps=steps, warmup=warmup, trace_every=trace_every,
                            num_cpu_devices=run_target.num_cpu_devices,
                            target=run_target.target, progress=None,
                            session_factory=run_target.session)
    canonical = {tf.DeviceSpec.from_string(d).to_string(): d for d in run_target.devices}
    ops = [op for op in step_operations(placed.graph, step_fetches(placed)) if op.device]
    device_of = {op.name: canonical.get(tf.DeviceSpec.from_string(op.device).to_string(),
                                        op.device) for op in ops}
    unknown = sorted(set(device_of.values()) - set(run_target.devices))
    if unknown:
        raise DeviceMismatchError(f"the graph uses devices {unknown} that the run target "
                                  f"does not have ({list(run_target.devices)})")
    # A fed placeholder runs as an argument on the client's device, and TF may copy a Const
    # into its consumers' partitions: a device holding only those has no step stats.
    fed = {name.split(":")[0] for name in placed.feeds}
    used = {device_of[op.name] for op in ops if op.type != "Const" and op.name not in fed}
    matches = _match_stats_devices(run_target.devices, used, list(profile.devices))
    times_ms = [t / 1000.0 for t in profile.step_time_us]
    return PlacedRun(
        step_time_ms_median=statistics.median(times_ms) if times_ms else float("nan"),
        step_times_ms=times_ms,
        peak_bytes={d: profile.devices[s].peak_bytes for d, s in matches.items()},
        limit_bytes=dict(limit_bytes or {}), stats_devices=matches,
        timelines={d: profile.devices[s].timeline for d, s in matches.items()})
