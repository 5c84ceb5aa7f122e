"""Benchmark: Keras RNN layers with ``unroll=False``, unrolled into the step, under a budget.

For Keras 3 ``LSTM`` and ``GRU`` classifiers (Keras's default ``unroll=False``: a forward
``While`` and its gradient loop), traced with ``profiler.tf_function.graph_item_from_function``,
which unrolls both loops (``profiler.unroll_loops``):

- ``unrolled``: trip counts, ops of the traced graph (its loop bodies included) and of the
  unrolled step, seconds to trace and unroll;
- ``baseline_peak_bytes``: the unrolled step's measured peak; ``checkpoint_all_bytes``: the
  calibrated memory model's prediction of it; ``lower_bound_ratio``: the planners' lower
  bound (``simulator.minimum_budget_bytes``) / baseline peak;
- ``planned``: per planner of ``PLANNERS`` and ratio of ``RATIOS``, the planned overhead or
  the failure (planned, not run);
- ``runs``: ``pipeline.optimize(memory_ratio=r, remat_heuristic="offline")`` run and verified at
  0.5 and at the lowest ratio ``offline`` planned: measured peak / budget, planned and
  measured overhead, loss and gradients equal; or the error.

    python -m graphfit.bench.loops

Writes ``out/bench/loops.json`` and ``loops.png`` (planned overhead vs budget ratio) and
prints a table.
"""

from __future__ import annotations

import os
import time

import numpy as np

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.profile import atomic_write_json

__all__ = ["MODELS", "main"]

MODELS = {"lstm": ("LSTM", 32, 128, 32), "gru": ("GRU", 32, 128, 32)}   # layer, seq, units, batch
FEATURES, CLASSES = 32, 10
RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
PLANNERS = ("dtr", "msps", "offline")
OVERHEAD_LIMIT = 2.0
RESULT_PATH = f"{RESULTS_DIR}/loops.json"
PLOT_PATH = f"{RESULTS_DIR}/loops.png"


def _traced(layer: str, sequence: int, units: int, batch: int):
    """(the unrolled ``FunctionItem`` of a Keras RNN classifier's step, ops of the traced graph
    with its loop bodies, seconds to trace and unroll)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from graphfit.profiler.tf_function import classifier_train_step, graph_item_from_function

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((sequence, FEATURES)),
                              getattr(keras.layers, layer)(units), keras.layers.Dense(CLASSES)])
    train_step = classifier_train_step(model, keras.optimizers.Adam(1e-3))

    rng = np.random.default_rng(0)
    batch_data = (rng.standard_normal((batch, sequence, FEATURES), dtype=np.float32),
                  np.arange(batch) % CLASSES)
    graph_def = train_step.get_concrete_function(*batch_data).graph.as_graph_def()
    traced_ops = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    begin = time.perf_counter()
    item = graph_item_from_function(train_step, *batch_data, name=layer.lower())
    return item, traced_ops, time.perf_counter() - begin


def _planned(plan_graph, peak_bytes: int, outputs) -> dict:
    from graphfit.remat.simulator import simulate

    rows = {}
    for planner in PLANNERS:
        rows[planner] = {}
        for ratio in RATIOS:
            try:
                plan = simulate(plan_graph, ratio * peak_bytes, planner, outputs=outputs,
                                overhead_limit=OVERHEAD_LIMIT)
                rows[planner][str(ratio)] = {"status": "ok", "overhead": plan.overhead}
            except Exception as error:             # noqa: BLE001 - recorded verbatim
                rows[planner][str(ratio)] = {"status": type(error).__name__,
                                             "error": str(error)[:300]}
    return rows


def _run(item, ratio: float) -> dict:
    from graphfit import pipeline

    try:
        report = pipeline.optimize(item, memory_ratio=ratio, remat_heuristic="offline",
                                 remat_overhead_limit=OVERHEAD_LIMIT, progress=None
                                 ).report()["remat"]
    except Exception as error:                     # noqa: BLE001 - recorded verbatim
        return {"ratio": ratio, "error": f"{type(error).__name__}: {str(error)[:400]}"}
    keys = ("budget_bytes", "planned_peak_bytes", "measured_peak_bytes", "baseline_peak_bytes",
            "planned_overhead", "measured_overhead", "loss_match", "gradients_match",
            "num_recomputes")
    row = {"ratio": ratio, **{k: report.get(k) for k in keys}}
    row["measured_peak_over_budget"] = report["measured_peak_bytes"] / report["budget_bytes"]
    return row


def bench_model(name: str) -> dict:
    from graphfit.profiler.trace import profile_graph
    from graphfit.remat.baselines import checkpoint_all
    from graphfit.remat.pipeline import resident_outputs
    from graphfit.remat.simulator import minimum_budget_bytes
    from graphfit.remat.tf_memory import step_item, tf_memory_model

    item, traced_ops, unroll_seconds = _traced(*MODELS[name])
    profile = profile_graph(step_item(item), progress=None)
    model = tf_memory_model(step_item(item), profile)
    outputs = resident_outputs(model.plan_graph, item.loss)
    planned = _planned(model.plan_graph, profile.peak_bytes, outputs)
    offline_ok = [float(r) for r, row in planned["offline"].items() if row["status"] == "ok"]
    run_ratios = sorted({0.5, *([min(offline_ok)] if offline_ok else [])})
    return {
        "shape": dict(zip(("layer", "sequence", "units", "batch"), MODELS[name])),
        "unrolled": {"trip_counts": item.config["unrolled_loops"], "traced_ops": traced_ops,
                     "unrolled_ops": len(item.graph.get_operations()),
                     "trace_and_unroll_seconds": unroll_seconds},
        "baseline_peak_bytes": profile.peak_bytes,
        "checkpoint_all_bytes": checkpoint_all(model.plan_graph).peak_bytes,
        "lower_bound_ratio": minimum_budget_bytes(model.plan_graph, outputs=outputs)
        / profile.peak_bytes,
        "planned": planned,
        "runs": [_run(item, ratio) for ratio in run_ratios],
    }


def _plot(results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        for planner, rows in result["planned"].items():
            points = [(float(r), row["overhead"]) for r, row in rows.items()
                      if row["status"] == "ok"]
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=planner)
        ax.set_title(f"{name} (unroll=False, unrolled)")
        ax.set_xlabel("budget / measured peak")
        ax.set_ylabel("planned overhead")
        ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT_PATH)


def main() -> None:
    results = {name: bench_model(name) for name in MODELS}
    atomic_write_json(RESULT_PATH, {"models": results, "ratios": RATIOS,
                                    "overhead_limit": OVERHEAD_LIMIT})
    _plot(results)
    for name, result in results.items():
        print(f"{name}: ops {result['unrolled']['traced_ops']} -> "
              f"{result['unrolled']['unrolled_ops']}, peak {result['baseline_peak_bytes']:,} "
              f"(model {result['checkpoint_all_bytes']:,}), lower bound "
              f"{result['lower_bound_ratio']:.2f}")
        for planner, rows in result["planned"].items():
            print(f"  {planner:8s} " + " ".join(
                f"{r}:{row['overhead']:.2f}x" if row["status"] == "ok" else f"{r}:-"
                for r, row in rows.items()))
        for run in result["runs"]:
            print(f"  run {run}")


if __name__ == "__main__":
    main()
