"""One TF gRPC worker of a cluster spec, for ``train --cluster_spec`` (and its own tests).

    python -m graphfit.tools.worker --cluster_spec=worker=h1:2222,h2:2222 --task=0 \\
        --lifetime_s=3600

Starts a ``tf.distribute.Server`` for task ``--task`` of job ``--job`` with ``--cpu_devices``
CPU devices (and the machine's GPUs), publishes its TensorFlow version for the client's
handshake (``baechi.cluster``), prints ``ready ...`` on stdout, and serves until
``--lifetime_s`` has passed or the process ``--parent_pid`` is gone. It then exits by itself.

TF 2.21's server listens on ``0.0.0.0:<port>`` (every interface; ``grpc_server_lib.cc``
hard-codes it) and has no authentication: whoever reaches the port can run any TF op in this
process. The binary says so on stderr when it starts.
"""

from __future__ import annotations

import sys

from absl import flags

from graphfit.errors import ArgumentError, check_number
from graphfit.tools import cli

_CLUSTER_SPEC = flags.DEFINE_string(
    "cluster_spec", None, "The whole cluster: job=host:port,host:port (e.g. "
    "worker=h1:2222,h2:2222) or a JSON file {\"worker\": [\"h1:2222\", ...]}.")
_JOB = flags.DEFINE_string("job", "worker", "This worker's job in the cluster spec.")
_TASK = flags.DEFINE_integer("task", None, "This worker's task index in its job.",
                             lower_bound=0)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 1, "CPU devices of this worker (TF virtual "
                                    "devices; the placer places over each).", lower_bound=1)
_LIFETIME_S = flags.DEFINE_float("lifetime_s", 3600.0, "Exit after this many seconds (1 s to a "
                                 "week: an exposed server's life is bounded).")
MAX_LIFETIME_S = 7 * 86400
_PARENT_PID = flags.DEFINE_integer("parent_pid", None, "Also exit when this process (the one "
                                   "that started the worker) is gone.", lower_bound=1)
flags.mark_flags_as_required(["cluster_spec", "task"])


def main(argv: list[str]) -> None:
    del argv  # tools.cli refuses stray arguments
    check_number(_LIFETIME_S.value, "--lifetime_s", minimum=1, maximum=MAX_LIFETIME_S)
    cli.quiet_tensorflow()      # after the check that needs no TF: a bad lifetime fails at once
    from graphfit.baechi.cluster import (ClusterError, Task, exposure_warning,
                                         parse_cluster_spec, serve_worker)
    from graphfit.baechi.netns import network_interfaces

    try:
        spec = parse_cluster_spec(_CLUSTER_SPEC.value)
    except ValueError as error:
        raise ArgumentError(f"--cluster_spec: {error}") from None
    addresses = spec.get(_JOB.value)
    if addresses is None or _TASK.value >= len(addresses):
        jobs = ", ".join(f"{job} (tasks 0-{len(a) - 1})" for job, a in spec.items())
        raise ArgumentError(f"--job={_JOB.value} --task={_TASK.value} is not in the cluster "
                            f"spec, whose jobs are {jobs}: give a job and task of the spec")
    task = Task(_JOB.value, _TASK.value, addresses[_TASK.value])
    port = task.address.rpartition(":")[2]
    print(exposure_warning(port, _LIFETIME_S.value, _PARENT_PID.value,
                           network_interfaces() == ["lo"]), file=sys.stderr, flush=True)

    def ready(record: dict) -> None:
        print(f"ready grpc://{task.address} {task.name} tf={record['tf_version']} "
              f"pid={record['pid']}", flush=True)

    try:
        serve_worker(spec, task, _LIFETIME_S.value, _CPU_DEVICES.value, _PARENT_PID.value,
                     on_ready=ready)
    except Exception as error:  # TF's server start reports a busy port as UnknownError
        raise ClusterError(f"{task} could not start: {type(error).__name__}: {error} (is port "
                           f"{port} in use?)") from None


def run():
    """Console-script entry point."""
    cli.run(main, tensorflow=False)


if __name__ == "__main__":
    run()
