"""Benchmark: how fast and how good are the Baechi placers?

For generated training-like graphs of 1k, 10k and 50k ops (plus a 10k random DAG) and for the
models' graphs (``models.build(name, preset="default")``, static cost estimates), on 4 devices
with Baechi's GPU link fit (0.0001754 µs/byte + 134 µs) and ample memory, it runs m-TOPO, m-ETF
and m-SCT both unfused (``placer_type="default"``) and fused (``"fusion"`` with co-placement)
and records: placement time (median over repeats; one run for 50k ops), units placed, LP size
(rows / columns / non-zeros) and solve time, simulated makespan, and makespan / lower bound
(lower bound = max(critical path, total compute / devices)). It then bisects, per graph and
placer, the tightest per-device memory limit the placer meets (as a fraction of the step's
sequential single-device peak) and checks the placement there respects it.

Targets (issue #3): m-ETF <= 1 s and m-SCT <= 3 s on 10k ops; <= 10 s and <= 30 s on 50k ops;
near-linear growth; m-SCT within 1.15x of the lower bound on training-like graphs.
Writes ``bench/results/placement.json`` and ``bench/results/placement.png``; prints a table.
"""

from __future__ import annotations

import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from graphfit.baechi.devices import DeviceSet, default_device_names  # noqa: E402
import numpy as np  # noqa: E402

from graphfit.baechi.place import METHODS, PlacementError, place  # noqa: E402
from graphfit.baechi.schedule import simulate  # noqa: E402
from graphfit.baechi.units import UnitGraph  # noqa: E402
from graphfit.profiler.profile import atomic_write_json  # noqa: E402
from graphfit.profiler.synthetic import random_dag, training_like  # noqa: E402

__all__ = ["main"]

RESULT_PATH = "bench/results/placement.json"
PLOT_PATH = "bench/results/placement.png"
NUM_DEVICES = 4
COMM_COEFFS = "0.0001754,134"
SIZES = (1_000, 10_000, 50_000)
BISECTION_STEPS = 7
TIGHT_CONFIGS = tuple((m, "default", "tf") for m in METHODS) + tuple(
    (m, "fusion", "coplace") for m in METHODS)
VARIANTS = (("default", "tf"), ("fusion", "coplace"))


def _devices() -> DeviceSet:
    return DeviceSet.uniform(default_device_names(NUM_DEVICES), "64GiB", COMM_COEFFS)


def _run(graph, label: str, repeats: int) -> list[dict]:
    rows = []
    for method in METHODS:
        for placer_type, grouper in VARIANTS:
            seconds, placement = [], None
            for _ in range(repeats):
                placement = place(graph, _devices(), method=method, placer_type=placer_type,
                                  grouper=grouper)
                seconds.append(placement.placement_s)
            row = {"graph": label, **placement.summary(),
                   "placement_s": statistics.median(seconds), "repeats": repeats}
            rows.append(row)
            print(f"{label:>22} {method:>6} {placer_type:>8} {row['num_units']:>7} "
                  f"{row['placement_s']:8.2f} {row.get('lp_rows', ''):>8} "
                  f"{row.get('lp_nnz', ''):>8} {row.get('lp_solve_s', 0.0):7.2f} "
                  f"{row['makespan_us'] / 1e3:12.1f} {row['makespan_over_lower_bound']:6.3f}",
                  flush=True)
    return rows


def _sequential_peak_bytes(graph) -> int:
    """Peak bytes of the whole step run in op order on one device (liveness model)."""
    units = UnitGraph.singletons(graph, np.zeros(graph.num_ops, dtype=np.int64))
    return int(simulate(units, _devices(), np.zeros(graph.num_ops, dtype=np.int64))
               .peak_bytes[0])


def _tightest(graph, label: str, configs) -> list[dict]:
    """Bisect the smallest per-device limit each placer meets, as a fraction of the sequential
    peak; record that the placement there respects memory and that just below it fails with a
    PlacementError naming the missing bytes."""
    seq = _sequential_peak_bytes(graph)
    rows = []
    for method, placer_type, grouper in configs:
        def attempt(limit):
            return place(graph, _devices().with_memory(int(limit)), method=method,
                         placer_type=placer_type, grouper=grouper)
        lo, hi = 0, 2 * seq
        below = ""
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) // 2
            try:
                attempt(mid)
                hi = mid
            except PlacementError as e:
                lo, below = mid, str(e)
        placed = attempt(hi)
        row = {"graph": label, "method": method, "placer_type": placer_type,
               "grouper": grouper, "sequential_peak_bytes": seq, "tightest_limit_bytes": hi,
               "tightest_over_sequential": hi / seq,
               "peak_bytes_at_tightest": placed.peak_bytes.tolist(),
               "respects_limit": bool((placed.peak_bytes <= hi).all()),
               "error_below": below[:300]}
        rows.append(row)
        print(f"{label:>22} {method:>6} {placer_type:>10} tightest {hi / seq:6.3f} x seq "
              f"peak ({hi / 2**20:9.1f} MiB), respected: {row['respects_limit']}", flush=True)
    return rows


def _model_graphs():
    """(name, cost graph) for every model, with static estimates; a model that fails to build
    is reported and skipped."""
    from graphfit import models
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.profiler.trace import step_fetches
    for name in models.MODEL_NAMES:
        try:
            item = models.build(name, preset="default")
            yield name, cost_graph_from_graph(item.graph, step_fetches(item))
        except Exception as e:  # a broken model must not hide the other results
            print(f"model {name}: skipped ({type(e).__name__}: {e})", file=sys.stderr)


def _plot(rows: list[dict]) -> None:
    fig, (ax_time, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    synthetic = [r for r in rows if r["graph"].startswith("training_like")]
    for method in METHODS:
        for placer_type, _ in VARIANTS:
            pts = sorted((r["num_ops"], r["placement_s"]) for r in synthetic
                         if r["method"] == method and r["placer_type"] == placer_type)
            if pts:
                ax_time.plot(*zip(*pts), marker="o", label=f"{method} {placer_type}")
    ax_time.set(xscale="log", yscale="log", xlabel="ops", ylabel="placement time (s)",
                title="training-like graphs, 4 devices")
    ax_time.legend(fontsize=8)
    labels = sorted({r["graph"] for r in rows}, key=lambda g: [r["graph"] for r in rows].index(g))
    width = 0.8 / len(METHODS)
    for k, method in enumerate(METHODS):
        values = [next((r["makespan_over_lower_bound"] for r in rows if r["graph"] == g
                        and r["method"] == method and r["placer_type"] == "fusion"), 0)
                  for g in labels]
        ax_ratio.bar([i + k * width for i in range(len(labels))], values, width, label=method)
    ax_ratio.axhline(1.15, color="grey", linestyle="--", linewidth=1)
    ax_ratio.set_xticks([i + width for i in range(len(labels))])
    ax_ratio.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax_ratio.set(ylabel="makespan / lower bound (fusion)", title="simulated step quality")
    ax_ratio.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT_PATH, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print the table, write the JSON and the plot."""
    began = time.perf_counter()
    print(f"{'graph':>22} {'method':>6} {'type':>8} {'units':>7} {'place_s':>8} "
          f"{'lp_rows':>8} {'lp_nnz':>8} {'lp_s':>7} {'makespan_ms':>12} {'/LB':>6}")
    rows = []
    for size in SIZES:
        rows += _run(training_like(size, seed=0), f"training_like_{size // 1000}k",
                     repeats=3 if size <= 10_000 else 1)
    rows += _run(random_dag(10_000, seed=0), "random_dag_10k", repeats=1)
    model_graphs = list(_model_graphs())
    for name, graph in model_graphs:
        rows += _run(graph, name, repeats=1)
    tight = []
    for label, graph in [("training_like_1k", training_like(1_000, seed=0)),
                         ("random_dag_1k", random_dag(1_000, seed=0))] + model_graphs:
        tight += _tightest(graph, label, TIGHT_CONFIGS)
    for label, graph in [("training_like_10k", training_like(10_000, seed=0)),
                         ("random_dag_10k", random_dag(10_000, seed=0))]:
        tight += _tightest(graph, label, [("m_etf", "default", "tf")])
    atomic_write_json(RESULT_PATH, {"num_devices": NUM_DEVICES, "comm_cost_coeffs": COMM_COEFFS,
                                    "results": rows, "tightest_limits": tight,
                                    "bench_s": time.perf_counter() - began})
    _plot(rows)
    print(f"wrote {RESULT_PATH} and {PLOT_PATH} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
