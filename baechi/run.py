"""Run a placed training step and check it: the ``run`` pass of the pipeline (TF at the edge).

Where a placed graph runs (DESIGN.md §6):

- ``local_target(n)``: one process; ``/GPU:i`` when TensorFlow sees ``n`` GPUs, else ``n``
  virtual CPU devices ``/device:CPU:i``. Virtual CPU devices share one allocator and thread pool and
  pass tensors zero-copy: right for correctness and per-device memory accounting, not for speed.
- ``LocalCluster(n)``: ``n`` ``tf.distribute.Server`` workers in separate processes on
  loopback ports, a v1 session on ``grpc://127.0.0.1:port``, ops pinned to
  ``/job:worker/task:k/device:CPU:0``. Transfers are real and memory is per process. Workers
  live at most ``lifetime_s`` and exit when the process that started them dies.

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

import atexit
import dataclasses
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO

import tensorflow as tf

from graphfit.baechi.devices import default_device_names
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import session_config
from graphfit.profiler.tf_import import step_operations
from graphfit.profiler.trace import profile_graph, step_fetches

__all__ = ["ClusterError", "DeviceMismatchError", "LocalCluster", "MemoryLimitError",
           "PLACEMENT_RTOL", "PlacedRun", "RunTarget", "local_target", "measure_placed_run"]

WORKER_JOB = "worker"
# Relative tolerance of a placed step against the single-device step: devices may sum in
# another order.
PLACEMENT_RTOL = 1e-4


class ClusterError(RuntimeError):
    """A local gRPC worker did not start or died."""


class DeviceMismatchError(RuntimeError):
    """The devices a run reports do not line up with the placement's device names."""


class MemoryLimitError(RuntimeError):
    """A device's measured peak memory exceeds its limit."""


@dataclasses.dataclass(frozen=True)
class RunTarget:
    """Where a placed graph runs.

    Attributes:
        devices: the device names a placement may use, in order.
        kind: ``"virtual_cpu"``, ``"gpu"`` or ``"grpc"``.
        target: the session target (``""`` in process, ``grpc://...`` on a cluster).
        num_cpu_devices: CPU devices of the in-process session.
    """

    devices: tuple[str, ...]
    kind: str
    target: str = ""
    num_cpu_devices: int = 1

    def session(self, graph: tf.Graph) -> tf.compat.v1.Session:
        """A session on ``graph`` with the project's config (``profiler.session``); on a
        cluster each session gets its own variables."""
        config = session_config(self.num_cpu_devices)
        config.isolate_session_state = bool(self.target)
        return tf.compat.v1.Session(target=self.target, graph=graph, config=config)


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


def _free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (sockets held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _serve_worker(cluster_json: str, task_index: int, lifetime_s: float, parent_pid: int) -> None:
    """Body of a worker process: serve until the lifetime ends or the parent is gone."""
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(cluster_json)),
                                  job_name=WORKER_JOB, task_index=task_index,
                                  config=session_config(1), start=True)
    print(f"ready {server.target}", flush=True)
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline and os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(0)


class LocalCluster:
    """``num_workers`` TF gRPC workers on loopback ports, each in its own process.

    Use as a context manager; ``run_target`` is where placed graphs run. The workers are
    terminated on ``close()`` (also at interpreter exit), and exit by themselves after
    ``lifetime_s`` or when this process dies. TF's server listens on every interface
    (hard-coded ``0.0.0.0``); the cluster only ever addresses ``127.0.0.1``.

    Parameters:
        num_workers: worker processes (tasks ``0..num_workers-1`` of job ``worker``).
        lifetime_s: upper bound on a worker's life.
        startup_timeout_s: how long to wait for every worker to report it is serving.

    Raises:
        ClusterError: a worker exited or did not report ready in time (its log is quoted).
    """

    def __init__(self, num_workers: int, lifetime_s: float = 900.0,
                 startup_timeout_s: float = 60.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.lifetime_s = lifetime_s
        self.startup_timeout_s = startup_timeout_s
        self.addresses: list[str] = []
        self._processes: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []

    @property
    def run_target(self) -> RunTarget:
        """Devices ``/job:worker/task:k/device:CPU:0`` and the session target of task 0."""
        if not self._processes:
            raise ClusterError("the cluster is not started (use it as a context manager)")
        return RunTarget(
            tuple(f"/job:{WORKER_JOB}/task:{k}/device:CPU:0" for k in range(self.num_workers)),
            "grpc", target=f"grpc://{self.addresses[0]}")

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [p.pid for p in self._processes]

    def start(self) -> "LocalCluster":
        """Start the workers and wait until each serves."""
        self.addresses = [f"127.0.0.1:{p}" for p in _free_loopback_ports(self.num_workers)]
        cluster_json = json.dumps({WORKER_JOB: self.addresses})
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        atexit.register(self.close)
        for k in range(self.num_workers):
            log = tempfile.NamedTemporaryFile(prefix=f"baechi_worker{k}_", suffix=".log")
            code = (f"from baechi.run import _serve_worker; _serve_worker({cluster_json!r}, "
                    f"{k}, {self.lifetime_s!r}, {os.getpid()})")
            self._logs.append(log)
            self._processes.append(subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, env=env,
                text=True))
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for k, process in enumerate(self._processes):
            while True:
                remaining = deadline - time.monotonic()
                ready, _, _ = select.select([process.stdout], [], [], max(0.0, remaining))
                line = process.stdout.readline() if ready else ""
                if line.startswith("ready"):
                    break
                if process.poll() is not None or remaining <= 0:
                    self._logs[k].seek(0)
                    tail = self._logs[k].read().decode(errors="replace")[-2000:]
                    state = (f"exited with code {process.returncode}"
                             if process.poll() is not None
                             else f"not ready after {self.startup_timeout_s:.0f} s")
                    raise ClusterError(f"gRPC worker {k} ({self.addresses[k]}) {state}; "
                                       f"its log ends with:\n{tail}")

    def close(self) -> None:
        """Terminate the workers (idempotent)."""
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout:
                process.stdout.close()
        for log in self._logs:
            log.close()
        self._processes, self._logs = [], []
        atexit.unregister(self.close)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class PlacedRun:
    """Measured step of a placed graph.

    Attributes:
        step_time_ms_median: median wall time of the untraced steps.
        step_times_ms: every untraced step's wall time.
        peak_bytes: placement device name -> peak bytes replayed from allocation records.
        limit_bytes: placement device name -> its limit (devices without a limit absent).
        stats_devices: placement device name -> the device name TF's step stats used.
    """

    step_time_ms_median: float
    step_times_ms: list[float]
    peak_bytes: dict[str, int]
    limit_bytes: dict[str, int]
    stats_devices: dict[str, str]

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
                            target=run_target.target, progress=None)
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
        limit_bytes=dict(limit_bytes or {}), stats_devices=matches)
