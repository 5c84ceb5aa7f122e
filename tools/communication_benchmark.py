"""Communication benchmark: what moving a tensor between two devices costs, for the placer.

Times transfers of 2^0 .. 2^max_power float32 elements between two devices and fits
``transfer_us = a * bytes + b`` (Baechi, Jeon et al., SoCC 2020, §4: the placers' communication
model). Transports (``--transport``):

- ``grpc``: three local ``tools/worker.py`` workers the tool starts, addressed on loopback;
  transfers are real gRPC ``RecvTensor`` calls. The default without two GPUs. TF 2.21's
  server listens on every interface without authentication, so while the benchmark runs (its
  workers die with it, at most ``LocalCluster``'s lifetime) anyone who reaches their ports can
  run TF ops as this user: the tool says so on stderr. ``virtual`` exposes nothing.
- ``gpu``: ``/GPU:0`` -> ``/GPU:1`` in this process (needs two GPUs; the default with them).
- ``virtual``: two virtual CPU devices of this process. They pass tensors zero-copy, so what is
  measured is the executor's per-edge overhead; the JSON says ``"zero_copy": true``.
- ``--cluster_spec=worker=h1:p1,h2:p2`` (or a JSON file): the workers of a running cluster
  (``tools/worker.py`` on each machine); every pair of tasks is measured (between their first
  devices) and gets its own fitted link, both directions, and ``default`` is the fit over all
  pairs. Every session call is bounded (``baechi.cluster``).

Method: per size, a variable on the source device is read and sent along a chain of
``--hops`` ``Identity`` ops alternating between the two devices (each hop is one transfer, both
directions equally), and the same chain kept on the source device is the baseline. Each repeat
runs both; a transfer costs the median over repeats of (chain - baseline) / hops, so the
session's own overhead cancels out. The fit minimises the *relative* error (rows weighted by
1 / measured time, non-negative least squares), so the many small transfers, which are
latency-bound, weigh as much as the few large bandwidth-bound ones.

Contention: with a third device, the same ``--contention_bytes`` tensor is sent from the source
to one destination, and then to two destinations at once (two chains in one run); each is
timed against the local baseline as above. If two concurrent transfers out of one device take
at least ``CONTENTION_RATIO`` times as long as one, they share the sender's channel and the
JSON's ``"link_model"`` is ``"contention"`` (Baechi's model: one channel per device, for sends
and receives alike), else ``"parallel"`` (``baechi.devices``). With two devices only
(``--transport=gpu`` on two GPUs) nothing is measured and the JSON says so.

Output: ``--comm_cost_coeffs=a,b`` on stdout, and the per-link JSON that
``baechi.devices.DeviceSet.from_json`` reads (``default`` and directional ``links``, plus the
raw measurements), written atomically to ``--output``, with a log-log plot next to it.

    python -m graphfit.tools.communication_benchmark --transport=grpc --max_power=22
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import nullcontext

import numpy as np
import scipy.optimize
from absl import flags

from graphfit.errors import ArgumentError, GraphfitError, check_writable_path
from graphfit.tools import cli

__all__ = ["CONTENTION_RATIO", "contention_graph", "fit_relative", "main",
           "measure_contention", "measure_transfers", "transfer_graph"]

# Under out/, like every tool's output: run from the checkout, a run never overwrites the
# recorded bench/results/communication.json (bench/RESULTS.md), only --output can.
_OUTPUT = flags.DEFINE_string("output", "out/communication.json",
                              "Where to write the per-link communication costs (JSON); a "
                              "plot is written next to it (.png).")
_MAX_POWER = flags.DEFINE_integer("max_power", 22, "Largest transfer is 2^max_power float32 "
                                  "elements (22: 16 MiB); at least 1: the fit needs two "
                                  "sizes.", lower_bound=1, upper_bound=28)
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed repeats per size (median).",
                                lower_bound=1)
_HOPS = flags.DEFINE_integer("hops", 4, "Transfers per timed run (a chain alternating between "
                             "the two devices).", lower_bound=1)
_TRANSPORT = flags.DEFINE_enum("transport", None, ["grpc", "gpu", "virtual"],
                               "Devices to measure between; default: gpu with two GPUs, "
                               "else grpc.")
_CLUSTER_SPEC = flags.DEFINE_string("cluster_spec", None, "Measure the links between the "
                                    "tasks of this running cluster: job=host:port,host:port or "
                                    "a JSON file (instead of --transport).")

_CONTENTION_POWER = flags.DEFINE_integer(
    "contention_power", 20, "Concurrent-transfer test: tensors of 2^contention_power float32 "
    "elements.", lower_bound=10, upper_bound=28)

ELEMENT_BYTES = 4  # float32
# Two transfers from one device at once costing this many times one transfer: they contend.
CONTENTION_RATIO = 1.5


def contention_graph(src: str, dsts: list[str], power: int, hops: int):
    """One tensor of ``2^power`` floats on ``src`` sent ``hops`` times to each device of
    ``dsts`` at once (a chain ``src`` -> dst -> ``src`` ... per destination), plus the chain kept
    on ``src``. Returns (graph, init op, baseline fetch, one-destination fetch, all-destinations
    fetch)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        with tf.device(src):
            value = tf.Variable(tf.zeros([2 ** power]), name="data").read_value()
        ends, local = [], value
        for k, dst in enumerate(dsts):
            chain = value
            for hop in range(hops):
                with tf.device(dst if hop % 2 == 0 else src):
                    chain = tf.identity(chain, name=f"to_{k}_{hop}")
            with tf.device(src):
                ends.append(tf.identity(chain, name=f"back_{k}")[0])
        with tf.device(src):
            for hop in range(hops):
                local = tf.identity(local, name=f"local_{hop}")
            baseline = local[0]
        init = tf.compat.v1.global_variables_initializer()
        both = tf.group(*[e.op for e in ends])
    return graph, init, baseline, ends[0], both


def measure_contention(session, baseline, one, both, repeats: int, hops: int) -> dict:
    """Median per-hop time of one destination's chain and of all chains at once (each minus
    the local baseline), their ratio, and the link model that ratio indicates."""
    for _ in range(3):
        session.run([baseline, one, both])
    single, concurrent = [], []
    for _ in range(repeats):
        times = []
        for fetch in (baseline, one, both):
            begin = time.perf_counter()
            session.run(fetch)
            times.append((time.perf_counter() - begin) * 1e6)
        single.append((times[1] - times[0]) / hops)
        concurrent.append((times[2] - times[0]) / hops)
    single_us, concurrent_us = statistics.median(single), statistics.median(concurrent)
    ratio = concurrent_us / single_us if single_us > 0 else float("nan")
    return {"single_us": single_us, "two_concurrent_us": concurrent_us, "ratio": ratio,
            "threshold": CONTENTION_RATIO,
            "link_model": "contention" if ratio >= CONTENTION_RATIO else "parallel"}


def transfer_graph(src: str, dst: str, powers: list[int], hops: int):
    """The benchmark graph: per size ``2^p`` a variable on ``src``, a chain of ``hops``
    ``Identity`` ops alternating ``dst``, ``src``, ... (one transfer each) and the same chain on
    ``src`` alone; each chain ends in a one-element slice so only a scalar is fetched.

    Returns:
        (graph, init op, {p: (baseline fetch, chain fetch)}).
    """
    import tensorflow as tf

    graph = tf.Graph()
    fetches = {}
    with graph.as_default():
        for p in powers:
            with tf.device(src):
                value = tf.Variable(tf.zeros([2 ** p]), name=f"data_{p}").read_value()
            local = chain = value
            for hop in range(hops):
                with tf.device(dst if hop % 2 == 0 else src):
                    chain = tf.identity(chain, name=f"hop_{p}_{hop}")
                with tf.device(src):
                    local = tf.identity(local, name=f"local_{p}_{hop}")
            with tf.device(dst if hops % 2 else src):
                chain_end = chain[0]
            with tf.device(src):
                local_end = local[0]
            fetches[p] = (local_end, chain_end)
        init = tf.compat.v1.global_variables_initializer()
    return graph, init, fetches


def measure_transfers(session, fetches: dict, repeats: int, hops: int,
                      progress=None) -> list[dict]:
    """Time every size's chain against its baseline; one record per size with ``bytes``,
    ``transfer_us`` (median over repeats of the per-hop difference), and the medians of both."""
    records = []
    smallest = min(fetches)
    for _ in range(5):  # open the channels before timing anything
        session.run(fetches[smallest])
    for p in sorted(fetches):
        local, chain = fetches[p]
        for _ in range(2):
            session.run(local)
            session.run(chain)
        local_us, chain_us = [], []
        for _ in range(repeats):
            begin = time.perf_counter()
            session.run(local)
            middle = time.perf_counter()
            session.run(chain)
            end = time.perf_counter()
            local_us.append((middle - begin) * 1e6)
            chain_us.append((end - middle) * 1e6)
        per_hop = statistics.median((c - l) / hops for c, l in zip(chain_us, local_us))
        record = {"elements": 2 ** p, "bytes": ELEMENT_BYTES * 2 ** p,
                  "transfer_us": per_hop, "chain_us_median": statistics.median(chain_us),
                  "baseline_us_median": statistics.median(local_us)}
        records.append(record)
        if progress:
            progress(f"2^{p:<2d} floats ({record['bytes']:>10d} B): transfer "
                     f"{per_hop:10.1f} us (median of {repeats})")
    return records


def fit_relative(num_bytes: np.ndarray, transfer_us: np.ndarray) -> tuple[float, float]:
    """Fit ``a * bytes + b`` (a, b >= 0) minimising the sum of squared *relative* errors.

    Each row is divided by its measured time, so a 64 MiB transfer's milliseconds do not drown
    the microseconds of small ones. Sizes whose measured cost is not positive (below the timing
    noise) carry no relative information and are left out.

    Raises:
        GraphfitError: fewer than two sizes with a positive measured cost.

    Examples:
        >>> a, b = fit_relative(np.array([4, 4e3, 4e6]), np.array([100.004, 104.0, 4100.0]))
        >>> round(a, 6), round(b, 1)
        (0.001, 100.0)
    """
    x, y = np.asarray(num_bytes, float), np.asarray(transfer_us, float)
    keep = y > 0
    if keep.sum() < 2:
        raise GraphfitError(f"only {int(keep.sum())} size(s) had a measurable transfer time: "
                         "raise --repeats or --max_power")
    x, y = x[keep], y[keep]
    design = np.stack([x, np.ones_like(x)], axis=1) / y[:, None]
    (a, b), _ = scipy.optimize.nnls(design, np.ones_like(y))
    return float(a), float(b)


def _plot(path: str, records: list[dict], a: float, b: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.array([r["bytes"] for r in records], float)
    y = np.array([r["transfer_us"] for r in records], float)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(x[y > 0], y[y > 0], "o", label="measured (median)")
    ax.loglog(x, a * x + b, "-", label=f"fit {a:.3g} us/B * bytes + {b:.3g} us")
    ax.set_xlabel("bytes")
    ax.set_ylabel("transfer time (us)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    """Measure, fit, print ``--comm_cost_coeffs`` and write the per-link JSON."""
    del argv  # cli.run refuses positional arguments
    check_writable_path(_OUTPUT.value, "--output")
    import tensorflow as tf

    from graphfit.baechi.cluster import Cluster, ClusterError, LocalCluster
    from graphfit.baechi.devices import LinkCost
    from graphfit.baechi.run import RunTarget
    from graphfit.profiler.profile import atomic_write_json
    from graphfit.profiler.trace import print_progress

    num_gpus = len(tf.config.list_physical_devices("GPU"))
    if _CLUSTER_SPEC.value is not None and _TRANSPORT.value is not None:
        raise ArgumentError("give --cluster_spec or --transport, not both")
    transport = ("cluster" if _CLUSTER_SPEC.value is not None
                 else _TRANSPORT.value or ("gpu" if num_gpus >= 2 else "grpc"))
    if transport == "gpu" and num_gpus < 2:
        raise ArgumentError(f"--transport=gpu needs two GPUs; TF sees {num_gpus}. "
                            "Use --transport=grpc or --transport=virtual.")
    began = time.perf_counter()
    if transport == "cluster":
        try:
            cluster = Cluster(_CLUSTER_SPEC.value)
        except ValueError as error:
            raise ArgumentError(f"--cluster_spec: {error}") from None
    else:
        # Three local devices: one pair to fit the link, a third for the contention test.
        cluster = LocalCluster(3, startup_timeout_s=300) if transport == "grpc" else nullcontext()
    powers = list(range(_MAX_POWER.value + 1))
    pairs = []
    contention = {"measured": False, "reason": "needs a third device"}
    try:
        with cluster:
            if transport in ("grpc", "cluster"):
                target = cluster.run_target
                print_progress(f"{len(cluster.tasks)} gRPC workers at "
                               f"{', '.join(t.address for t in cluster.tasks)}")
                if transport == "grpc":
                    print(f"{cluster.exposure_warning()} Or use --transport=virtual: nothing "
                          "exposed.", file=sys.stderr, flush=True)
                ends = [next(d for d in target.devices if d.startswith(task.name + "/"))
                        for task in cluster.tasks]
                if len(ends) < 2:
                    raise ArgumentError("--cluster_spec: a link needs two tasks; the spec has "
                                        "one")
            elif transport == "gpu":
                target = RunTarget(tuple(f"/GPU:{k}" for k in range(min(num_gpus, 3))), "gpu")
                ends = list(target.devices)
            else:
                target = RunTarget(tuple(f"/device:CPU:{k}" for k in range(3)), "virtual_cpu",
                                   num_cpu_devices=3)
                ends = list(target.devices)
            # A given cluster: every pair of tasks; a local transport: one pair stands for all.
            measured_ends = ends if transport == "cluster" else ends[:2]
            for i, src in enumerate(measured_ends):
                for dst in measured_ends[i + 1:]:
                    graph, init, fetches = transfer_graph(src, dst, powers, _HOPS.value)
                    with target.session(graph) as session:
                        session.run(init)
                        print_progress(f"{src} <-> {dst}")
                        records = measure_transfers(session, fetches, _REPEATS.value,
                                                    _HOPS.value, print_progress)
                    pairs.append((src, dst, [{"src": src, "dst": dst, **r} for r in records]))
            if len(ends) >= 3:
                graph, init, baseline, one, both = contention_graph(
                    ends[0], ends[1:3], _CONTENTION_POWER.value, _HOPS.value)
                with target.session(graph) as session:
                    session.run(init)
                    contention = {"measured": True,
                                  "bytes": ELEMENT_BYTES * 2 ** _CONTENTION_POWER.value,
                                  **measure_contention(session, baseline, one, both,
                                                       _REPEATS.value, _HOPS.value)}
                print_progress(f"one transfer {contention['single_us']:.1f} us, two at once "
                               f"{contention['two_concurrent_us']:.1f} us per hop (x"
                               f"{contention['ratio']:.2f}): {contention['link_model']} links")
    except ClusterError as error:
        raise SystemExit(f"cluster error: {error}") from error
    links = []
    for src, dst, records in pairs:
        link = LinkCost(*fit_relative(np.array([r["bytes"] for r in records]),
                                      np.array([r["transfer_us"] for r in records]))).to_json()
        links += [{"src": src, "dst": dst, **link}, {"src": dst, "dst": src, **link}]
    records = [r for _, _, pair_records in pairs for r in pair_records]
    a, b = fit_relative(np.array([r["bytes"] for r in records]),
                        np.array([r["transfer_us"] for r in records]))
    zero_copy = transport == "virtual"
    result = {
        "default": LinkCost(a, b).to_json(), "links": links,
        **({"link_model": contention["link_model"]} if contention["measured"] else {}),
        "contention": contention,
        "transport": transport, "zero_copy": zero_copy,
        "fit": "non-negative least squares on relative error (rows weighted 1/measured)",
        "hops": _HOPS.value, "repeats": _REPEATS.value, "measurements": records,
        "elapsed_s": time.perf_counter() - began,
    }
    atomic_write_json(_OUTPUT.value, result)
    _plot(os.path.splitext(_OUTPUT.value)[0] + ".png", records, a, b,
          f"{transport}: " + ", ".join(f"{src} <-> {dst}" for src, dst, _ in pairs))
    print(f"{'bytes':>12s} {'transfer us':>12s} {'fit us':>12s}")
    for r in records:
        print(f"{r['bytes']:12d} {r['transfer_us']:12.1f} {a * r['bytes'] + b:12.1f}")
    if zero_copy:
        print("virtual CPU devices are zero-copy: no bytes move; the fit is the executor's "
              "per-edge overhead, not a link cost")
    print(f"--comm_cost_coeffs={a:.6g},{b:.6g}")
    print(f"per-link JSON: {_OUTPUT.value} ({transport}, {result['elapsed_s']:.1f} s)")


if __name__ == "__main__":
    cli.run(main)
