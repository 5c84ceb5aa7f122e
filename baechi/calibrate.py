"""Measure what a run target adds to a planned step: a fixed cost per step, a dispatch cost per
op, and how many ops really run at once (``baechi.schedule.RuntimeCosts``).

The placers plan with traced op times and a transfer fit; a real step also pays for starting
the step on every device (on a gRPC cluster, round trips to every worker), for dispatching each
op, and it shares one machine's cores among all devices (virtual CPU devices of one process and
local gRPC workers alike). Three small graphs, run side by side on the target (one session
each, the runs interleaved in a new order each round, so a load change hits all of them alike;
medians):

- ``step``: one scalar op on every device, fetched together: ``step_us`` is its median time
  (it includes those few trivial ops);
- ``chain(n)``: the same plus a chain of ``n`` dependent scalar ``Atan2`` ops on the first
  device, for two lengths: the slope per op, less the chain ops' median traced time (one traced
  run), is ``op_us``;
- ``hops(n)``: the ``step`` graph plus a chain of ``n`` scalar ``Atan2`` ops alternating
  between the first two devices: its time less ``step`` and ``n`` ops, over ``n - 1``
  transfers, is ``transfer_us`` (on virtual CPU devices, whose tensors are passed zero-copy,
  the cost of the rendezvous; on a cluster, a round of gRPC);
- ``matmuls(k)``: a chain of ``n x n`` matrix products on ``k`` devices (1 and all):
  ``k x (t1 - step) / (tk - step)`` is how many such chains ran at once; ``cores`` is that
  number rounded up (above ``NOISE`` past a whole number), clipped to [1, devices]. Rounded
  up because the value is fractional
  only where one op already used several cores: TF's inter-op pool runs as many ops at once
  as there are cores, and a product of 128 x 128 also splits over the intra-op threads, so
  two chains on two cores measured 1.37-1.42, not 2. Rounded to the nearest (1), the core
  cap serialised every op: resnet ``tiny`` on 4 virtual CPUs was predicted at 32.7 ms (the sum
  of its op times, 31.8 ms, plus the step) and measured at 15.0-16.7 ms, two ops at once on
  this 2-core machine.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import tensorflow as tf

from graphfit.baechi.run import RunTarget
from graphfit.baechi.schedule import RuntimeCosts

__all__ = ["NOISE", "calibrate_runtime"]

# How far past a whole number the measured parallelism must be to count one more core: one
# chain against one measured 0.9-1.1 on a loaded machine.
NOISE = 0.2

_CHAIN = "chain"


def _graph(devices: tuple[str, ...], chain_ops: int = 0, matmul_devices: int = 0,
           matmuls: int = 0, matmul_size: int = 0, hops: int = 0
           ) -> tuple[tf.Graph, list, tf.Operation]:
    """(graph, fetches, init op) of one calibration graph; its chain ops are named
    ``_CHAIN``."""
    graph = tf.Graph()
    fetches = []
    with graph.as_default():
        for k, device in enumerate(devices):
            with tf.device(device):
                v = tf.compat.v1.get_variable(f"v{k}", initializer=0.5, use_resource=True)
                x = y = v.read_value()
                if k == 0:  # a binary op: Grappler composes chains of unary ops into one
                    for _ in range(chain_ops):
                        x = tf.math.atan2(x, y, name=_CHAIN)
                if k < matmul_devices:
                    w = tf.compat.v1.get_variable(f"w{k}", initializer=tf.eye(matmul_size),
                                                  use_resource=True)
                    z = w.read_value()
                    for _ in range(matmuls):
                        z = tf.matmul(z, w)
                    x = x + tf.reduce_sum(z)
                fetches.append(tf.identity(x))
        x = fetches[0]
        for k in range(hops):
            with tf.device(devices[k % 2]):
                x = tf.math.atan2(x, 0.5)
        if hops:
            fetches.append(x)
        init = tf.compat.v1.global_variables_initializer()
    return graph, fetches, init


def _traced_median_us(session, fetches, name: str) -> float:
    """Median traced time of the ops called ``name`` (or ``name_k``) in one traced run."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    session.run(fetches, options=options, run_metadata=metadata)
    times = [node.all_end_rel_micros for dev in metadata.step_stats.dev_stats
             for node in dev.node_stats
             if node.node_name == name or node.node_name.startswith(name + "_")]
    return float(np.median(times)) if times else 0.0


def calibrate_runtime(run_target: RunTarget, repeats: int = 30, chain_ops: tuple[int, int] =
                      (16, 400), matmuls: int = 16, matmul_size: int = 128, hops: int = 64
                      ) -> tuple[RuntimeCosts, dict]:
    """Measure ``run_target``'s ``RuntimeCosts`` (module docstring).

    Parameters:
        run_target: where placed steps will run (``baechi.run.local_target`` or a cluster's).
        repeats: timed runs of each graph (after 3 warm-up runs), interleaved.
        chain_ops: the two chain lengths for the per-op cost.
        matmuls, matmul_size: the matrix-product chains for the parallelism.
        hops: the length of the chain between two devices for the transfer cost (needs two
            devices; with one, ``transfer_us`` is 0).

    Returns:
        (the costs, the raw medians in µs by graph, with the traced chain-op time).
    """
    devices = run_target.devices
    short, long_ = chain_ops
    graphs = {"step": _graph(devices), f"chain{short}": _graph(devices, short),
              f"chain{long_}": _graph(devices, long_),
              "matmuls1": _graph(devices, matmul_devices=1, matmuls=matmuls,
                                 matmul_size=matmul_size),
              f"matmuls{len(devices)}": _graph(devices, matmul_devices=len(devices),
                                               matmuls=matmuls, matmul_size=matmul_size)}
    if len(devices) > 1:
        graphs[f"hops{hops}"] = _graph(devices, hops=hops)
    sessions = {}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    try:
        for name, (graph, fetches, init) in graphs.items():
            sessions[name] = run_target.session(graph)
            sessions[name].run(init)
            for _ in range(3):
                sessions[name].run(fetches)
        rng = np.random.default_rng(0)
        for _ in range(repeats):  # in a new order each round: no graph always runs first
            for name in rng.permutation(list(graphs)).tolist():
                fetches = graphs[name][1]
                begin = time.perf_counter()
                sessions[name].run(fetches)
                times[name].append((time.perf_counter() - begin) * 1e6)
        traced_op_us = _traced_median_us(sessions[f"chain{long_}"], graphs[f"chain{long_}"][1],
                                         _CHAIN)
    finally:
        for session in sessions.values():
            session.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    step_us = median["step"]
    slope = (median[f"chain{long_}"] - median[f"chain{short}"]) / (long_ - short)
    one = median["matmuls1"] - step_us
    all_ = median[f"matmuls{len(devices)}"] - step_us
    parallel = len(devices) * one / all_ if all_ > 0 else float(len(devices))
    hop_us = ((median[f"hops{hops}"] - step_us - hops * slope) / (hops - 1)
              if len(devices) > 1 else 0.0)
    costs = RuntimeCosts(step_us=step_us, op_us=max(0.0, slope - traced_op_us),
                         cores=int(min(len(devices), max(1, math.ceil(parallel - NOISE)))),
                         transfer_us=max(0.0, hop_us))
    return costs, {"median_us": median, "traced_chain_op_us": traced_op_us,
                   "slope_us_per_op": slope, "chains_at_once": parallel,
                   "hop_us": hop_us}
