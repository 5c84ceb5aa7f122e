"""TF gRPC clusters for placed steps: the cluster spec, its workers, and bounded waiting.

A placed step runs on a TF cluster through a v1 session on ``grpc://`` task 0, with ops pinned
to ``/job:worker/task:k/device:...`` (DESIGN.md §6). TensorFlow itself waits forever for a
worker that was stopped or killed (a ``RecvTensor`` that never comes), so every wait here has a
bound:

- every session on a cluster target has ``operation_timeout_in_ms`` set
  (``RunTarget.session``): each ``run`` and the session's ``close`` return within it (checked on
  TF 2.21: a step whose worker was SIGSTOPped fails with ``DeadlineExceededError`` after the
  timeout, and ``close`` after one more timeout);
- before any work, ``Cluster.start`` checks every task of the spec: it is listening and answers
  (``probe``: TF's own ``WorkerService/GetStatus`` call, with a deadline), and it was started
  by ``tools/worker.py`` with this client's TensorFlow (``read_worker_info``: the worker
  publishes its version, pid and lifetime in a resource of its own process, which the client
  reads through TF's gRPC session);
- a watchdog thread probes every task for the whole run; a TF error raised by a session on the
  cluster is turned into a ``ClusterError`` naming the worker, what happened to it and what to
  do (``Cluster.diagnose``). A TF error while every worker answers stays TF's own error.

Bound: a fault ends a session call within ``operation_timeout_s`` and closing it takes at most
one more, so a killed, stopped or missing worker is a ``ClusterError`` within
``2 * operation_timeout_s + probe_timeout_s`` plus the time a loaded machine adds (10 s allowed:
55 s with the defaults 20 s and 5 s; measured on TF 2.21 with 5 s and 2 s beside a CPU hog on
2 cores: 4.6-12.2 s, see tests/test_cluster_faults.py). Work beside the cluster that does not
use it (a local reference run) calls ``check_faults`` between steps. A worker missing at the
start is refused before any session, within one probe.

What the version check can and cannot see: a worker started by ``tools/worker.py`` reports
``tf.__version__`` and ``tf.version.GRAPH_DEF_VERSION``, and a different one is refused before
any work. A plain ``tf.distribute.Server`` (any version) has no such record and is refused as
"not started by graphfit's worker binary"; the version of such a server cannot be read from
TF's gRPC interface.

Exposure: TF 2.21's server listens on ``0.0.0.0:<port>`` (``grpc_server_lib.cc`` hard-codes it)
without authentication; ``tools/worker.py`` says so when it starts. ``LocalCluster`` workers
live at most ``lifetime_s`` and exit when the process that started them dies;
``baechi.netns`` runs them, with the client, in a private network namespace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

import tensorflow as tf

from graphfit.errors import GraphfitError, short_repr
from graphfit.baechi.run import RunTarget
from graphfit.profiler.session import session_config

__all__ = ["Cluster", "ClusterError", "LocalCluster", "Task", "WORKER_JOB", "exposure_warning",
           "parse_cluster_spec", "probe", "read_worker_info", "serve_worker"]

WORKER_JOB = "worker"
# Where a worker publishes its handshake record: a string resource variable of its own process.
_INFO_CONTAINER, _INFO_NAME = "graphfit", "worker_info"
_WHAT_TO_DO = ("check that the worker process runs (tools/worker.py, same TF version, lifetime "
               "not expired) and that its port is reachable from this machine, then run again")


class ClusterError(GraphfitError, RuntimeError):
    """A gRPC worker is missing, died, stopped answering, or is not a compatible worker."""


def _check_address(address: str, where: str) -> str:
    host, sep, port = address.rpartition(":")
    if (not sep or not host or not port.isdigit() or len(port) > 5
            or not 0 < int(port) < 65536):
        raise ValueError(f"{where}: {short_repr(address)} is not host:port (a port in "
                         "1..65535)")
    return address


def parse_cluster_spec(spec: str | Mapping) -> dict[str, list[str]]:
    """A cluster spec as TF's ``ClusterSpec`` dict ``{job: [host:port, ...]}``.

    Parameters:
        spec: ``job=host:port,host:port[;job=...]``, a path to a JSON file holding the dict
            (or TF_CONFIG's form ``{"cluster": {...}}``), or the dict itself.

    Raises:
        ValueError: malformed text, an unreadable file, an address that is not host:port, or
            an address listed twice.

    Examples:
        >>> parse_cluster_spec("worker=h1:2222,h2:2222")
        {'worker': ['h1:2222', 'h2:2222']}
    """
    if isinstance(spec, str) and os.path.isfile(spec):
        try:
            with open(spec) as f:
                loaded = json.load(f)
        except (OSError, ValueError) as error:
            raise ValueError(f"cluster spec file {spec}: {error}") from None
        where = f"cluster spec file {spec}"
        if isinstance(loaded, dict) and isinstance(loaded.get("cluster"), dict):
            loaded = loaded["cluster"]
        spec = loaded
    elif isinstance(spec, str):
        where = f"cluster spec {short_repr(spec)}"
        jobs = {}
        for part in filter(None, spec.split(";")):
            job, sep, addresses = part.partition("=")
            if not sep or not job.strip():
                raise ValueError(f"{where}: expected job=host:port,host:port (e.g. "
                                 "worker=h1:2222,h2:2222) or a JSON file")
            jobs[job.strip()] = [a.strip() for a in addresses.split(",") if a.strip()]
        spec = jobs
    else:
        where = "cluster spec"
    if (not isinstance(spec, Mapping) or not spec
            or not all(isinstance(v, list) and v for v in spec.values())):
        raise ValueError(f"{where}: expected {{job: [host:port, ...]}} with at least one task")
    parsed = {str(job): [_check_address(str(a), where) for a in addresses]
              for job, addresses in spec.items()}
    everything = [a for addresses in parsed.values() for a in addresses]
    twice = sorted({a for a in everything if everything.count(a) > 1})
    if twice:
        raise ValueError(f"{where}: {twice} listed more than once")
    return parsed


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a cluster: ``/job:{job}/task:{index}`` at ``address``."""

    job: str
    index: int
    address: str

    @property
    def name(self) -> str:
        return f"/job:{self.job}/task:{self.index}"

    def __str__(self) -> str:
        return f"worker {self.name} at {self.address}"


def probe(address: str, timeout_s: float) -> str | None:
    """``None`` when the TF server at ``address`` answers TF's ``WorkerService/GetStatus``
    within ``timeout_s``; else what went wrong, in words (nothing listening, or no answer)."""
    import grpc

    channel = grpc.insecure_channel(address)
    get_status = channel.unary_unary("/tensorflow.WorkerService/GetStatus")
    deadline = time.monotonic() + timeout_s
    try:
        try:
            get_status(b"", timeout=timeout_s)
            return None
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or deadline - time.monotonic() < 1:
                raise
            time.sleep(0.5)  # a refused connection is final, a reset may not be: ask again
            get_status(b"", timeout=deadline - time.monotonic())
            return None
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (f"does not answer within {timeout_s:g} s (the process is stopped, "
                    "overloaded or cut off)")
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return "is not listening (no process on that port: not started, killed or exited)"
        return f"answered with {error.code().name}: {error.details()}"
    finally:
        channel.close()


def _info_graph(task_name: str, record: str | None = None):
    """A graph that writes (``record``) or reads the handshake resource on ``task_name``."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(f"{task_name}/device:CPU:0"):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.string, shape=[], container=_INFO_CONTAINER,
                                        shared_name=_INFO_NAME)
        if record is None:
            op = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.string)
        else:
            op = tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(record))
    return graph, op


def _task_config(task: Task, timeout_s: float) -> tf.compat.v1.ConfigProto:
    config = session_config(1)
    config.device_filters.append(task.name)  # only this task: a dead neighbour cannot block it
    config.operation_timeout_in_ms = int(timeout_s * 1000)
    return config


def read_worker_info(task: Task, timeout_s: float) -> tuple[dict, list[str]]:
    """The handshake record a ``tools/worker.py`` worker published, and its devices.

    Raises:
        ClusterError: no record (not our worker binary), or no answer within ``timeout_s``.
    """
    graph, read = _info_graph(task.name)
    try:
        with tf.compat.v1.Session(f"grpc://{task.address}", graph=graph,
                                  config=_task_config(task, timeout_s)) as session:
            record = json.loads(session.run(read))
            devices = [d.name for d in session.list_devices()]
    except (tf.errors.NotFoundError, tf.errors.FailedPreconditionError):  # no record
        raise ClusterError(
            f"{task} is a TF server but was not started by graphfit's worker binary (or is "
            "still starting), so its TensorFlow version cannot be checked; start it with "
            "`python -m graphfit.tools.worker --cluster_spec=... --task=...`") from None
    except tf.errors.InvalidArgumentError as error:
        serves = re.search(r"available devices are \[ ?(.*?) ?\]", error.message)
        if not serves:
            raise
        raise ClusterError(
            f"{task}: the TF server there is not {task.name} (its devices are "
            f"{serves.group(1)[:300]}); list each worker in the cluster spec under the job and "
            "task it was started with (tools/worker.py --job, --task)") from None
    except tf.errors.OpError as error:
        raise ClusterError(f"{task} did not complete the handshake within {timeout_s:g} s "
                           f"({type(error).__name__}: {error.message.splitlines()[0]}); "
                           f"{_WHAT_TO_DO}") from None
    return record, devices


def _worker_record(task: Task, lifetime_s: float) -> dict:
    return {"tf_version": tf.__version__, "graph_def_version": tf.version.GRAPH_DEF_VERSION,
            "pid": os.getpid(), "task": task.name, "lifetime_s": lifetime_s,
            "exits_at_unix_s": time.time() + lifetime_s}


def serve_worker(cluster: Mapping[str, list[str]], task: Task, lifetime_s: float,
                 cpu_devices: int = 1, parent_pid: int | None = None,
                 on_ready: Callable[[dict], None] | None = None) -> None:
    """Serve ``task`` of ``cluster`` until ``lifetime_s`` has passed or ``parent_pid`` is gone
    (the body of ``tools/worker.py``); then exit the process at once (TF's server cannot be
    stopped cleanly). ``on_ready`` gets the handshake record once the server answers."""
    server = tf.distribute.Server(tf.train.ClusterSpec(dict(cluster)), job_name=task.job,
                                  task_index=task.index, config=session_config(cpu_devices),
                                  start=True)
    record = _worker_record(task, lifetime_s)
    graph, write = _info_graph(task.name, json.dumps(record))
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=_task_config(task, 60.0)) as session:
        session.run(write)
    if on_ready:
        on_ready(record)
    deadline = time.monotonic() + lifetime_s
    child_of_parent = os.getppid() == parent_pid
    while time.monotonic() < deadline:
        if parent_pid is not None and ((child_of_parent and os.getppid() != parent_pid)
                                       or not _alive(parent_pid)):
            break
        time.sleep(0.2)
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class Cluster:
    """The tasks of a cluster spec, checked before use and watched while in use.

    Use as a context manager; ``run_target`` is where placed graphs run: every device of every
    task (its GPUs, else its CPU devices), named ``/job:J/task:K/device:TYPE:I``.

    Parameters:
        spec: the cluster spec (``parse_cluster_spec``'s input).
        operation_timeout_s: bound on every session call on the cluster.
        probe_timeout_s: how long a liveness probe waits for an answer.
        probe_interval_s: the watchdog's period.

    Raises (``start``):
        ClusterError: a task is missing, does not answer, is not a graphfit worker, or runs
            another TensorFlow.
    """

    def __init__(self, spec: str | Mapping | None, operation_timeout_s: float = 20.0,
                 probe_timeout_s: float = 5.0, probe_interval_s: float = 1.0):
        if not operation_timeout_s > 0 or not probe_timeout_s > 0 or not probe_interval_s > 0:
            raise ValueError("operation_timeout_s, probe_timeout_s and probe_interval_s must be "
                             "positive")
        self.spec: dict[str, list[str]] = {}
        self.tasks: list[Task] = []
        if spec is not None:
            self._set_spec(spec)
        self.operation_timeout_s = operation_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self.worker_info: dict[str, dict] = {}
        self.faults: dict[Task, str] = {}
        self._devices: list[str] = []
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._on_fault: Callable[[ClusterError], None] | None = None

    def _set_spec(self, spec: str | Mapping) -> None:
        self.spec = parse_cluster_spec(spec)
        self.tasks = [Task(job, k, address) for job, addresses in self.spec.items()
                      for k, address in enumerate(addresses)]

    @property
    def run_target(self) -> RunTarget:
        if not self._devices:
            raise ClusterError("the cluster is not started (use it as a context manager)")
        return RunTarget(tuple(self._devices), "grpc", target=f"grpc://{self.tasks[0].address}",
                         operation_timeout_ms=int(self.operation_timeout_s * 1000),
                         diagnose=self.diagnose)

    def _task_fault(self, task: Task) -> str | None:
        """What is wrong with ``task`` now (``None``: it answers)."""
        return probe(task.address, self.probe_timeout_s)

    def _check(self, task: Task) -> list[str]:
        """Refuse ``task`` unless it answers the probe and the handshake with our version."""
        fault = self._task_fault(task)
        if fault:
            raise ClusterError(f"{task} {fault}; {_WHAT_TO_DO}")
        info, devices = read_worker_info(task, self.operation_timeout_s)
        mine = {"tf_version": tf.__version__, "graph_def_version": tf.version.GRAPH_DEF_VERSION}
        theirs = {key: info.get(key) for key in mine}
        if theirs != mine:
            raise ClusterError(f"{task} runs TensorFlow {theirs['tf_version']} (graph version "
                               f"{theirs['graph_def_version']}), this client "
                               f"{mine['tf_version']} ({mine['graph_def_version']}): start "
                               "every worker with the client's TensorFlow")
        self.worker_info[task.name] = info
        return _task_devices(task, devices)

    def start(self) -> "Cluster":
        """Check every task, then start the watchdog."""
        self._devices = [d for task in self.tasks for d in self._check(task)]
        self._stop.clear()
        self._watchdog = threading.Thread(target=self._watch, name="cluster-watchdog",
                                          daemon=True)
        self._watchdog.start()
        return self

    def watch(self, on_fault: Callable[[ClusterError], None]) -> None:
        """Call ``on_fault`` (from the watchdog thread) when a task first fails its probe."""
        self._on_fault = on_fault

    def _watch(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            for task in self.tasks:
                if task in self.faults or self._stop.is_set():
                    continue
                fault = self._task_fault(task)
                if fault and not self._stop.is_set():
                    self.faults.setdefault(task, fault)
                    if self._on_fault:
                        self._on_fault(self._error([task], None))

    def _error(self, tasks: list[Task], error: tf.errors.OpError | None) -> ClusterError:
        said = ""
        if error is not None:
            said = f" TensorFlow said {type(error).__name__}: {error.message.splitlines()[0]}."
        faults = "; ".join(f"{task} {self.faults[task]}" for task in tasks)
        return ClusterError(f"{faults}.{said} The run stopped; {_WHAT_TO_DO}")

    def failing(self) -> list[Task]:
        """The tasks that fail a probe now (all probed in parallel: one probe timeout). A task
        keeps the first description of its fault; one that answers again is forgiven."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.tasks)) as pool:
            now = dict(zip(self.tasks, pool.map(self._task_fault, self.tasks)))
        for task, fault in now.items():
            if fault:
                self.faults.setdefault(task, fault)
            else:
                self.faults.pop(task, None)
        return [task for task in self.tasks if now[task]]

    def check_faults(self) -> None:
        """Raise a ``ClusterError`` if the watchdog saw a task fail and it still fails: work
        that does not touch the cluster (a local reference run) calls this between steps, so
        a fault stops the run at once instead of when the cluster is next used."""
        failed = self.failing() if self.faults else []
        if failed:
            raise self._error(failed, None)

    def diagnose(self, error: tf.errors.OpError) -> Exception:
        """The ``ClusterError`` behind ``error`` (a TF error of a session on this cluster):
        which tasks fail their probe now; ``error`` itself when every task answers and the
        error is not a timeout."""
        failed = self.failing()
        if not failed and isinstance(error, tf.errors.DeadlineExceededError):
            return ClusterError(f"a session call on the cluster took longer than "
                                f"operation_timeout_s={self.operation_timeout_s:g} s although "
                                "every worker answers: raise the timeout for long steps "
                                "(train --cluster_timeout_s)")
        return self._error(failed, error) if failed else error

    def close(self) -> None:
        """Stop the watchdog (idempotent; a probe under way ends within its timeout, in a
        daemon thread that reports nothing once stopped)."""
        self._stop.set()
        self._watchdog = None

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def _task_devices(task: Task, listed: list[str]) -> list[str]:
    """``task``'s GPUs, else its CPUs, as ``/job:J/task:K/device:TYPE:I`` in index order."""
    specs = [tf.DeviceSpec.from_string(name) for name in listed]
    mine = [s for s in specs if s.job == task.job and s.task == task.index]
    kind = "GPU" if any(s.device_type == "GPU" for s in mine) else "CPU"
    return [f"{task.name}/device:{kind}:{i}"
            for i in sorted(s.device_index for s in mine if s.device_type == kind)]


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


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), ``""`` when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _process_fault(process: subprocess.Popen) -> str | None:
    """What the kernel says about a worker process: exited, killed, stopped (else ``None``)."""
    code = process.poll()
    if code is not None and code < 0:
        return f"(pid {process.pid}) was killed by {signal.Signals(-code).name}"
    if code is not None:
        return f"(pid {process.pid}) exited with code {code}"
    if _process_state(process.pid) == "T":
        return f"(pid {process.pid}) is stopped (SIGSTOP or a debugger)"
    return None


class LocalCluster(Cluster):
    """``num_workers`` workers of ``tools/worker.py`` on loopback ports, started and owned
    here, each in its own process; a ``Cluster`` of them.

    The workers are killed on ``close()`` (also at interpreter exit) and exit by themselves
    after ``lifetime_s`` or when this process dies. A worker's fault is read from its process
    first (exit status, signal, stopped), then from its probe.

    Parameters:
        num_workers: worker processes (tasks ``0..num_workers-1`` of job ``worker``).
        lifetime_s: upper bound on a worker's life.
        startup_timeout_s: how long to wait for every worker to report it is serving.
        cpu_devices: CPU devices of each worker.
        operation_timeout_s, probe_timeout_s, probe_interval_s: as ``Cluster``.

    Raises (``start``):
        ClusterError: a worker exited or did not report ready in time (its log is quoted).
    """

    def __init__(self, num_workers: int, lifetime_s: float = 900.0,
                 startup_timeout_s: float = 120.0, cpu_devices: int = 1, **timeouts: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.lifetime_s = lifetime_s
        self.startup_timeout_s = startup_timeout_s
        self.cpu_devices = cpu_devices
        self._processes: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []
        super().__init__(None, **timeouts)

    @property
    def addresses(self) -> list[str]:
        return [task.address for task in self.tasks]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [p.pid for p in self._processes]

    def start(self) -> "LocalCluster":
        """Start the workers, wait until each serves, check them, start the watchdog."""
        import atexit

        addresses = [f"127.0.0.1:{p}" for p in _free_loopback_ports(self.num_workers)]
        self._set_spec({WORKER_JOB: addresses})
        spec = f"{WORKER_JOB}={','.join(addresses)}"
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        atexit.register(self.close)
        for k in range(self.num_workers):
            log = tempfile.NamedTemporaryFile(prefix=f"graphfit_worker{k}_", suffix=".log")
            self._logs.append(log)
            self._processes.append(subprocess.Popen(
                [sys.executable, "-m", "graphfit.tools.worker", f"--cluster_spec={spec}",
                 f"--task={k}", f"--lifetime_s={self.lifetime_s}",
                 f"--cpu_devices={self.cpu_devices}", f"--parent_pid={os.getpid()}"],
                stdout=subprocess.PIPE, stderr=log, env=env, text=True))
        try:
            self._wait_ready()
            super().start()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self) -> None:
        import select

        deadline = time.monotonic() + self.startup_timeout_s
        for k, process in enumerate(self._processes):
            while True:
                remaining = deadline - time.monotonic()
                ready, _, _ = select.select([process.stdout], [], [], max(0.0, remaining))
                line = process.stdout.readline() if ready else ""
                if line.startswith("ready"):
                    break
                if process.poll() is not None or remaining <= 0:
                    state = (f"exited with code {process.returncode}"
                             if process.poll() is not None
                             else f"not ready after {self.startup_timeout_s:.0f} s")
                    raise ClusterError(f"{self.tasks[k]} {state}; its log ends with:\n"
                                       f"{self._log_tail(k)}")

    def _log_tail(self, k: int) -> str:
        self._logs[k].seek(0)
        return self._logs[k].read().decode(errors="replace")[-2000:]

    def _task_fault(self, task: Task) -> str | None:
        process = self._processes[task.index] if task.index < len(self._processes) else None
        if process is None:
            return super()._task_fault(task)
        fault = _process_fault(process) or super()._task_fault(task)
        if fault:  # a dying process closes its port before it can be reaped: wait for it
            try:
                process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            return _process_fault(process) or fault
        return None

    def exposure_warning(self) -> str:
        """What the running workers expose and for how long: TF's server listens on every
        interface (``exposure_warning``), even though they are addressed on loopback."""
        import getpass

        ports = ", ".join(address.rpartition(":")[2] for address in self.addresses)
        return (f"WARNING: the {len(self.tasks)} gRPC workers started here listen on port(s) "
                f"{ports} of every network interface (TF 2.21's server cannot bind one address) "
                "without authentication: anyone who can connect to them can run any TensorFlow "
                f"op as user {getpass.getuser()} until this run ends (they die with it, at the "
                f"latest after {self.lifetime_s:g} s). Run on a trusted network.")

    def close(self) -> None:
        """Stop the watchdog and kill the workers (idempotent)."""
        import atexit

        super().close()
        for process in self._processes:
            if process.poll() is None:
                process.kill()  # also ends a stopped worker; workers hold no state to save
        for process in self._processes:
            process.wait()
            if process.stdout:
                process.stdout.close()
        for log in self._logs:
            log.close()
        self._processes, self._logs = [], []
        atexit.unregister(self.close)


def exposure_warning(port: str, lifetime_s: float, parent_pid: int | None,
                     isolated: bool) -> str:
    """What this worker exposes and for how long, and how to keep it safe."""
    import getpass

    ends = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + lifetime_s))
    parent = f", or as soon as process {parent_pid} exits" if parent_pid else ""
    where = ("This process is in a network namespace whose only interface is loopback: the "
             "port is reachable from inside that namespace only." if isolated else
             "Run it only on a trusted network, let a firewall drop the port for every host but "
             f"the client's (e.g. `iptables -A INPUT -p tcp --dport {port} ! -s CLIENT_IP -j "
             "DROP`), or, on one machine, use `train --cluster=grpc --isolated_network` (workers "
             "and client in a private network namespace with loopback only).")
    return (f"WARNING: TensorFlow's gRPC server listens on 0.0.0.0:{port} (every network "
            "interface; TF 2.21 cannot bind one address) and has no authentication: anyone who "
            f"can connect to port {port} can run any TensorFlow op in this process (read and "
            f"write files, run programs) as user {getpass.getuser()}. This worker exits by "
            f"itself after {lifetime_s:g} s (at {ends}){parent}. {where}")
