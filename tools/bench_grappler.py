"""Benchmark: is the optimized step as fast as the user's own, and how does TF's own Grappler
memory optimizer compare?

Per model (zoo ``activations`` presets, Keras conv / depthwise-conv / attention steps):

- ``user_step_ms``: the input step under TF's default configuration (``profiler.session.
  user_config``), as the user runs it;
- ``no_budget_vs_user``: the step ``baechi.optimize`` returns without a budget (the same graph
  under the project's ``session_config``) against the user's, median of paired, interleaved
  runs (target: within 3 %);
- at ``RATIO`` of the measured peak: planned overhead, measured overhead against the user's
  step (``overhead_vs_user``; target: within 10 % of planned) and against the original under
  the project's configuration, measured peak over the plan (target: within 5 %), gradients
  equal;
- Grappler's ``memory_optimization`` (``RECOMPUTATION_HEURISTICS``, ``SWAPPING_HEURISTICS``,
  ``HEURISTICS``) on the user's step: peak replayed from a traced step, and step time against
  the user's (paired).

The machine may be shared: every time is a median of paired runs, and the JSON records the
load average. ``--quick`` runs smaller batches. Writes ``bench/results/grappler.json`` and
``grappler.png``.

    python -m graphfit.tools.bench_grappler [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402
from tensorflow.python.util import _pywrap_util_port  # noqa: E402

from graphfit import models  # noqa: E402
from graphfit.baechi.pipeline import optimize  # noqa: E402
from graphfit.models.graph_item import GraphItem  # noqa: E402
from graphfit.profiler.profile import atomic_write_json  # noqa: E402
from graphfit.profiler.session import session_config, user_config  # noqa: E402
from graphfit.profiler.trace import print_progress, profile_from_run_metadata  # noqa: E402
from graphfit.remat.pipeline import BudgetError  # noqa: E402
from graphfit.remat.rewrite import RematRewriteError  # noqa: E402
from graphfit.remat.tf_memory import step_item  # noqa: E402

__all__ = ["main", "keras_step"]

RATIO = 0.5
RESULT_PATH = "bench/results/grappler.json"
PLOT_PATH = "bench/results/grappler.png"
MEMORY_OPTIMIZERS = ("RECOMPUTATION_HEURISTICS", "SWAPPING_HEURISTICS", "HEURISTICS")


def keras_step(kind: str, batch: int = 16, size: int = 32) -> GraphItem:
    """A Keras classifier's ``tf.function`` SGD step traced as a GraphItem: ``"conv"`` a
    ResNet-style net (ZeroPadding2D, Conv2D with bias, BatchNorm, residual adds, a strided
    projection), ``"depthwise"`` a MobileNet-style net (depthwise + pointwise convolutions,
    BatchNorm, ReLU6), ``"attention"`` a transformer block (multi-head attention, LayerNorm,
    MLP) over ``size`` tokens of width 64."""
    import keras

    from graphfit.profiler.tf_function import classifier_train_step, graph_item_from_function

    layers = keras.layers
    keras.utils.set_random_seed(0)
    if kind == "attention":
        inputs = keras.Input((size, 64))
        x = layers.LayerNormalization()(inputs)
        x = inputs + layers.MultiHeadAttention(4, 16)(x, x)
        y = layers.Dense(64)(layers.Dense(256, activation="gelu")(layers.LayerNormalization()(x)))
        x = layers.GlobalAveragePooling1D()(x + y)
        shape = (batch, size, 64)
    else:
        inputs = keras.Input((size, size, 3))
        x = layers.Conv2D(16, 7, strides=2)(layers.ZeroPadding2D(3)(inputs))
        x = layers.ReLU()(layers.BatchNormalization()(x))
        for filters, stride in ((16, 1), (16, 1), (32, 2), (32, 1)):
            x = (_residual_block if kind == "conv" else _depthwise_block)(x, filters, stride)
        x = layers.GlobalAveragePooling2D()(x)
        shape = (batch, size, size, 3)
    model = keras.Model(inputs, layers.Dense(10)(x))
    train_step = classifier_train_step(model, keras.optimizers.SGD(0.01))

    rng = np.random.default_rng(0)
    batch_x = rng.standard_normal(shape, dtype=np.float32)
    batch_y = rng.integers(0, 10, batch).astype(np.int32)
    return graph_item_from_function(train_step, batch_x, batch_y, name=f"keras_{kind}")


def _residual_block(x, filters: int, stride: int):
    import keras
    layers = keras.layers
    y = layers.Conv2D(filters, 3, strides=stride)(layers.ZeroPadding2D(1)(x))
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.BatchNormalization()(layers.Conv2D(filters, 3, padding="same")(y))
    if stride != 1 or x.shape[-1] != filters:
        x = layers.BatchNormalization()(layers.Conv2D(filters, 1, stride)(x))
    return layers.ReLU()(layers.Add()([y, x]))


def _depthwise_block(x, filters: int, stride: int):
    import keras
    layers = keras.layers
    y = layers.DepthwiseConv2D(3, strides=stride, padding="same")(x)
    y = layers.ReLU(6.0)(layers.BatchNormalization()(y))
    y = layers.BatchNormalization()(layers.Conv2D(filters, 1)(y))
    return layers.Add()([y, x]) if stride == 1 and x.shape[-1] == filters else y


def _memory_optimizer_config(level: str) -> tf.compat.v1.ConfigProto:
    config = user_config()
    config.graph_options.rewrite_options.memory_optimization = getattr(
        rewriter_config_pb2.RewriterConfig, level)
    return config


def _paired(item: GraphItem, configs: list[tf.compat.v1.ConfigProto], rounds: int
            ) -> tuple[list[float], list[int]]:
    """``item``'s step in one session per config, the sessions run in turn ``rounds`` times:
    per config the median step time (ms) and the peak replayed from one traced step."""
    fetches = [item.train_op, item.loss]
    sessions = [tf.compat.v1.Session(graph=item.graph, config=c) for c in configs]
    try:
        feeds = item.feed_dict()
        peaks = []
        for session in sessions:
            session.run(item.init_op)
            session.run(fetches, feeds)
            metadata = tf.compat.v1.RunMetadata()
            session.run(fetches, feeds, run_metadata=metadata, options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
            _, devices = profile_from_run_metadata(item.graph, [metadata], set())
            peaks.append(max(m.peak_bytes for m in devices.values()))
        times = [[] for _ in sessions]
        for _ in range(rounds):
            for k, session in enumerate(sessions):
                begin = time.perf_counter()
                session.run(fetches, feeds)
                times[k].append((time.perf_counter() - begin) * 1000)
    finally:
        for session in sessions:
            session.close()
    return [statistics.median(t) for t in times], peaks


def bench_model(name: str, item: GraphItem, rounds: int) -> dict:
    item = step_item(item)
    print_progress(f"bench_grappler {name}: user step, no budget, TF memory optimizers")
    configs = [user_config(), session_config()] + [
        _memory_optimizer_config(level) for level in MEMORY_OPTIMIZERS]
    times, peaks = _paired(item, configs, rounds)
    row = {"model": name, "user_step_ms": times[0], "user_peak_bytes": peaks[0],
           "no_budget_step_ms": times[1], "no_budget_vs_user": times[1] / times[0],
           "tf_memory_optimizer": {
               level: {"peak_bytes": peak, "peak_vs_user": peak / peaks[0],
                       "step_vs_user": t / times[0]}
               for level, t, peak in zip(MEMORY_OPTIMIZERS, times[2:], peaks[2:])}}
    print_progress(f"bench_grappler {name}: optimize at {RATIO}")
    try:
        report = optimize(item, memory_ratio=RATIO, progress=None).report()["remat"]
    except (BudgetError, RematRewriteError, tf.errors.OpError) as error:  # a result too
        row["remat_error"] = f"{type(error).__name__}: {error}"[:500]
        return row
    row["remat"] = {key: report[key] for key in (
        "budget_bytes", "baseline_peak_bytes", "planned_peak_bytes", "measured_peak_bytes",
        "planned_overhead", "measured_overhead", "overhead_vs_user", "user_step_time_us",
        "num_recomputes", "gradients_match", "loss_match")}
    row["remat"]["peak_vs_plan"] = report["measured_peak_bytes"] / report["planned_peak_bytes"]
    row["remat"]["overhead_error"] = report["overhead_vs_user"] / report["planned_overhead"] - 1
    return row


# --quick: the zoo ``activations`` presets at a smaller batch (activations still dominate).
QUICK_BATCH = {"mlp": 1024, "resnet": 16, "transformer": 4}


def _models(quick: bool) -> list[tuple[str, GraphItem]]:
    zoo = [(f"{name}/activations" + (f" batch {batch}" if quick else ""),
            models.build(name, preset="activations", **({"batch_size": batch} if quick else {})))
           for name, batch in QUICK_BATCH.items()]
    batch = 16 if quick else 64
    return zoo + [(f"keras_{kind} batch {batch}", keras_step(kind, batch=batch))
                  for kind in ("conv", "depthwise", "attention")]


def _plot(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    x = np.arange(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.bar(x - 0.3, [r["no_budget_vs_user"] for r in rows], 0.2, label="no budget")
    left.bar(x - 0.1, [r.get("remat", {}).get("planned_overhead", np.nan) for r in rows], 0.2,
             label=f"planned at {RATIO}")
    left.bar(x + 0.1, [r.get("remat", {}).get("overhead_vs_user", np.nan) for r in rows], 0.2,
             label=f"measured at {RATIO}")
    left.bar(x + 0.3, [r["tf_memory_optimizer"]["HEURISTICS"]["step_vs_user"] for r in rows],
             0.2, label="Grappler HEURISTICS")
    left.set_ylabel("step time / user's step (TF defaults)")
    right.bar(x - 0.2, [r.get("remat", {}).get("measured_peak_bytes", np.nan)
                        / r["user_peak_bytes"] for r in rows], 0.4, label=f"DTR at {RATIO}")
    right.bar(x + 0.2, [r["tf_memory_optimizer"]["HEURISTICS"]["peak_vs_user"] for r in rows],
              0.4, label="Grappler HEURISTICS")
    right.set_ylabel("peak / user's peak")
    for axis in (left, right):
        axis.set_xticks(x, names, rotation=30, ha="right")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT_PATH, dpi=120)


def main(argv: list[str] | None = None) -> None:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    rows = [bench_model(name, item, rounds=5 if quick else 9)
            for name, item in _models(quick)]
    atomic_write_json(RESULT_PATH, {
        "ratio": RATIO, "quick": quick, "load_average": os.getloadavg(),
        "onednn": bool(_pywrap_util_port.IsMklEnabled()),
        "rows": rows})
    _plot(rows)
    for r in rows:
        remat = r.get("remat", {})
        print(f"{r['model']:24s} user {r['user_step_ms']:8.1f} ms  no-budget "
              f"{r['no_budget_vs_user']:.3f}x  planned {remat.get('planned_overhead', np.nan):.2f}x"
              f"  measured vs user {remat.get('overhead_vs_user', np.nan):.2f}x  peak/plan "
              f"{remat.get('peak_vs_plan', np.nan):.3f}  Grappler HEURISTICS peak "
              f"{r['tf_memory_optimizer']['HEURISTICS']['peak_vs_user']:.2f}x")


if __name__ == "__main__":
    main()
