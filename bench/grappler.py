"""Benchmark: is the optimized step as fast as the user's own, does the plan's overhead come
true, which Grappler optimizers may stay on, and how does TF's own memory optimizer compare?

Per model (zoo ``activations`` presets; Keras 3 steps: a ResNet-style conv net, a
MobileNet-style depthwise net and a transformer encoder, deep enough that activations
dominate the peak, so a plan at 0.5 exists):

- **The user's step**: for a zoo model its graph in a session with TF's defaults
  (``profiler.session.user_config``); for a Keras model the user's ``tf.function`` itself,
  called eagerly (what a Keras user runs; its traced graph in a default session is timed too,
  ``user_session``).
- **No budget**: the step ``pipeline.optimize`` returns without a budget (the user's graph,
  run with ``profiler.session.step_config``: TF's defaults; for Keras the user's own
  function), timed side by side with the user's (``profiler.paired_timing``: interleaved
  rounds, alternating order; median ratio and quartiles). Beside it: the same graph under the
  project's configuration for rewritten steps (``session_config``: what CSE and the
  dependency optimizer off cost) and, for Keras, the traced graph imported back
  (``tf_function.to_callable``), the path a rewritten step takes.
- **At ``RATIO`` of the measured peak** (``optimize(..., remat_heuristic="offline")``):
  planned overhead (recomputation only), planned step time against the user's
  (``remat.step_time``: recomputation and the chained backward pass), measured step time
  against the user's step (side by side, as above), measured peak over the plan, loss and
  gradients equal.
- **Grappler's switches** on a rewritten step (``SWITCH_MODELS``): from the project's
  configuration, each optimizer flipped alone (on ones off, off ones on): peak replayed from a
  traced step over the plan and over the project configuration's, and step time (side by
  side).
- **Grappler's ``memory_optimization``** (``RECOMPUTATION_HEURISTICS``,
  ``SWAPPING_HEURISTICS``, ``HEURISTICS``) on the user's graph: peak over the user's, step
  time against the user's graph in a session.

Writes ``out/bench/grappler.json`` (``--quick``: ``grappler_quick.json``) and the plot
beside it; the JSON records the load average before and after.

    python -m graphfit.bench.grappler [--quick]
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402

from graphfit.bench import RESULTS_DIR
from graphfit import models  # noqa: E402
from graphfit.pipeline.meta_optimizer import optimize  # noqa: E402
from graphfit.models.graph_item import GraphItem  # noqa: E402
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary  # noqa: E402
from graphfit.profiler.profile import atomic_write_json  # noqa: E402
from graphfit.profiler.session import (onednn_enabled, session_config, step_config,  # noqa: E402
                                        user_config)
from graphfit.profiler.trace import print_progress, profile_from_run_metadata  # noqa: E402
from graphfit.remat.pipeline import BudgetError  # noqa: E402
from graphfit.remat.rewrite import RematRewriteError  # noqa: E402
from graphfit.remat.tf_memory import step_item  # noqa: E402

__all__ = ["main", "keras_step", "keras_user_step"]

RATIO = 0.5
# Steps timed side by side (``paired_step_times`` with the bench's rounds): name -> seconds.
Timed = Callable[[dict[str, Callable[[], object]]], dict[str, list[float]]]
RESULT_DIR = RESULTS_DIR
MEMORY_OPTIMIZERS = ("RECOMPUTATION_HEURISTICS", "SWAPPING_HEURISTICS", "HEURISTICS")
# RewriterConfig toggles that session_config leaves at TF's default (on), and the two it
# turns off.
DEFAULT_ON = ("layout_optimizer", "loop_optimization", "shape_optimization", "remapping",
              "constant_folding", "arithmetic_optimization", "memory_optimization")
TURNED_OFF = ("common_subgraph_elimination", "dependency_optimization")
SWITCH_MODELS = ("mlp/activations", "keras_conv")


def keras_user_step(kind: str, batch: int = 16, size: int = 32
                    ) -> tuple[GraphItem, Callable, tuple]:
    """A Keras 3 classifier's ``tf.function`` SGD step (``classifier_train_step``), traced
    as a ``FunctionItem``, with the step itself and the batch it runs on:
    ``(item, step, (x, y))``.

    ``"conv"``: a ResNet-style net (ZeroPadding2D, Conv2D with bias, BatchNorm, residual
    adds, a strided projection) on ``size``² images; ``"depthwise"``: a MobileNet-style net
    (``bench.reach``'s: depthwise + pointwise convolutions, BatchNorm, ReLU6, four
    blocks up to 128 channels) on ``size``² images; ``"attention"``: a transformer encoder
    (``bench.reach``'s: two blocks of 4-head attention, LayerNorm, MLP) over ``size``
    tokens of width 128. The depthwise and attention nets are deeper than a single block
    so that activations stay the bulk of the peak: in a shallow one, one op's working set or
    the weights are most of it, and no plan reaches 0.5."""
    import keras

    from graphfit.profiler.tf_function import classifier_train_step, graph_item_from_function
    from graphfit.bench.reach import _attention, _mobilenet

    layers = keras.layers
    keras.utils.set_random_seed(0)
    if kind == "attention":
        inputs = keras.Input((size, 128))
        logits = _attention(keras, inputs, 10)
        shape = (batch, size, 128)
    elif kind == "depthwise":
        inputs = keras.Input((size, size, 3))
        logits = _mobilenet(keras, inputs, 10)
        shape = (batch, size, size, 3)
    else:
        inputs = keras.Input((size, size, 3))
        x = layers.Conv2D(16, 7, strides=2)(layers.ZeroPadding2D(3)(inputs))
        x = layers.ReLU()(layers.BatchNormalization()(x))
        for filters, stride in ((16, 1), (16, 1), (32, 2), (32, 1)):
            x = _residual_block(x, filters, stride)
        logits = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
        shape = (batch, size, size, 3)
    model = keras.Model(inputs, logits)
    train_step = classifier_train_step(model, keras.optimizers.SGD(0.001))

    rng = np.random.default_rng(0)
    batch_x = rng.standard_normal(shape, dtype=np.float32)
    batch_y = rng.integers(0, 10, batch).astype(np.int32)
    item = graph_item_from_function(train_step, batch_x, batch_y, name=f"keras_{kind}")
    return item, train_step, (batch_x, batch_y)


def keras_step(kind: str, batch: int = 16, size: int = 32) -> GraphItem:
    """``keras_user_step``'s traced step alone."""
    return keras_user_step(kind, batch, size)[0]


def _residual_block(x, filters: int, stride: int):
    import keras
    layers = keras.layers
    y = layers.Conv2D(filters, 3, strides=stride)(layers.ZeroPadding2D(1)(x))
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.BatchNormalization()(layers.Conv2D(filters, 3, padding="same")(y))
    if stride != 1 or x.shape[-1] != filters:
        x = layers.BatchNormalization()(layers.Conv2D(filters, 1, stride)(x))
    return layers.ReLU()(layers.Add()([y, x]))


def _flipped_config(switch: str) -> tf.compat.v1.ConfigProto:
    """``session_config`` with one Grappler optimizer flipped: a default-on one off, an off
    one on (CSE with the classic optimizer's L1, which carries its own CSE)."""
    config = session_config()
    toggle = rewriter_config_pb2.RewriterConfig
    setattr(config.graph_options.rewrite_options, switch,
            toggle.OFF if switch in DEFAULT_ON else toggle.ON)
    if switch == "common_subgraph_elimination":
        options = config.graph_options.optimizer_options
        options.opt_level = tf.compat.v1.OptimizerOptions.L1
        options.do_common_subexpression_elimination = True
    return config


def _traced_peak(session: tf.compat.v1.Session, item: GraphItem) -> int:
    """Peak replayed from the allocation records of one traced step in ``session``."""
    metadata = tf.compat.v1.RunMetadata()
    session.run([item.train_op, item.loss], item.feed_dict(), run_metadata=metadata,
                options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    _, devices = profile_from_run_metadata(item.graph, [metadata], set())
    return max(m.peak_bytes for m in devices.values())


class _Sessions:
    """Open sessions of steps, each initialised; closes them all on exit."""

    def __init__(self):
        self.sessions: list[tf.compat.v1.Session] = []

    def step(self, item: GraphItem, config: tf.compat.v1.ConfigProto
             ) -> tuple[Callable[[], object], tf.compat.v1.Session]:
        session = tf.compat.v1.Session(graph=item.graph, config=config)
        self.sessions.append(session)
        item.initialize(session)
        return functools.partial(session.run, [item.train_op, item.loss],
                                 item.feed_dict()), session

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for session in self.sessions:
            session.close()


def _round(summary: dict) -> dict:
    return {key: round(value, 4) if isinstance(value, float) else value
            for key, value in summary.items()}


def _no_budget(item: GraphItem, user: tuple[Callable, tuple] | None, timed: Timed) -> dict:
    """The no-budget step, the project's configuration and Grappler's memory optimizers,
    side by side with the user's step (module docstring)."""
    from graphfit.profiler.tf_function import to_callable

    optimized = optimize(item, progress=None).item
    with _Sessions() as sessions:
        steps, peaks = {}, {}
        steps["user_session"], session = sessions.step(item, user_config())
        peaks["user_session"] = _traced_peak(session, item)
        if user is not None:       # Keras: the user's tf.function; the optimized step is it
            function, args = user
            steps["user"] = functools.partial(function, *args)
            steps["no_budget"] = (steps["user"] if optimized is item else
                                  functools.partial(to_callable(optimized, item), *args))
            steps["imported"] = functools.partial(to_callable(item), *args)
        else:
            steps["user"] = steps["user_session"]
            steps["no_budget"], _ = sessions.step(optimized, step_config(optimized))
        steps["project_config"], _ = sessions.step(item, session_config())
        for level in MEMORY_OPTIMIZERS:
            config = user_config()
            config.graph_options.rewrite_options.memory_optimization = getattr(
                rewriter_config_pb2.RewriterConfig, level)
            steps[level], session = sessions.step(item, config)
            peaks[level] = _traced_peak(session, item)
        if user is None:
            del steps["user_session"]
        times = timed(steps)
    summary = ratio_summary(times, "user")
    return {"no_budget_returns_input": optimized is item,
            "vs_user": {name: _round(s) for name, s in summary.items()},
            "user_step_ms": summary["user"]["median_ms"],
            "user_peak_bytes": peaks["user_session"],
            "tf_memory_optimizer": {
                level: {"peak_bytes": peaks[level],
                        "peak_vs_user": peaks[level] / peaks["user_session"],
                        "step_vs_user_session": (summary[level]["median"] /
                                                 summary.get("user_session", summary["user"])
                                                 ["median"])}
                for level in MEMORY_OPTIMIZERS}}


def _at_ratio(item: GraphItem, user: tuple[Callable, tuple] | None, timed: Timed
              ) -> tuple[dict, GraphItem]:
    """``optimize`` at ``RATIO``: plan, measured peak, and the step side by side with the
    user's; returns the row and the rewritten step."""
    from graphfit.profiler.tf_function import to_callable

    result = optimize(item, memory_ratio=RATIO, remat_heuristic="offline", predict_step_time=True,
                      progress=None)
    report = result.report()["remat"]
    row = {key: report.get(key) for key in (
        "budget_bytes", "baseline_peak_bytes", "planned_peak_bytes", "measured_peak_bytes",
        "planned_overhead", "planned_step_vs_user", "planned_step_time",
        "measured_overhead", "overhead_vs_user", "num_recomputes",
        "gradients_match", "loss_match", "weights_match")}
    row["peak_vs_plan"] = report["measured_peak_bytes"] / report["planned_peak_bytes"]
    row["side_by_side_events"] = result.plan.stats.get("side_by_side_events")
    rewritten = result.item
    with _Sessions() as sessions:
        if user is not None:
            function, args = user
            steps = {"user": functools.partial(function, *args),
                     "optimized": functools.partial(to_callable(rewritten, item), *args)}
        else:
            steps = {"user": sessions.step(item, user_config())[0],
                     "optimized": sessions.step(rewritten, step_config(rewritten))[0]}
        summary = ratio_summary(timed(steps), "user")
    row["paired_vs_user"] = _round(summary["optimized"])
    row["paired_overhead_error"] = summary["optimized"]["median"] / row["planned_overhead"] - 1
    row["paired_step_prediction_error"] = (summary["optimized"]["median"] /
                                           row["planned_step_vs_user"] - 1)
    return row, rewritten


def _switches(rewritten: GraphItem, planned_peak: int, timed: Timed) -> dict:
    """Each Grappler optimizer flipped alone on the rewritten step: peak and time against the
    project's configuration, or the error of a step that no longer runs (the dependency
    optimizer stopped the Keras conv step in 4 of 5 plans on 2026-12-06: "Retval[0] does not
    have value")."""
    switches = DEFAULT_ON + TURNED_OFF
    with _Sessions() as sessions:
        steps, peaks, errors = {}, {}, {}
        for name, config in [("project", session_config())] + [
                (switch, _flipped_config(switch)) for switch in switches]:
            try:
                step, session = sessions.step(rewritten, config)
                peaks[name] = _traced_peak(session, rewritten)
            except tf.errors.OpError as error:
                if name == "project":
                    raise
                errors[name] = f"{type(error).__name__}: {error.message}"[:300]
                continue
            steps[name] = step
        summary = ratio_summary(timed(steps), "project")
    return {name: {"flipped_to": "off" if name in DEFAULT_ON else "on",
                   **({"error": errors[name]} if name in errors else {
                       "peak_vs_plan": peaks[name] / planned_peak,
                       "peak_vs_project": peaks[name] / peaks["project"],
                       "time_vs_project": _round(summary[name])})}
            for name in ["project", *switches]}


def bench_model(name: str, item: GraphItem, user: tuple[Callable, tuple] | None,
                timed: Timed) -> dict:
    item = step_item(item)
    print_progress(f"bench_grappler {name}: user step, no budget, TF memory optimizers")
    row = {"model": name, **_no_budget(item, user, timed)}
    print_progress(f"bench_grappler {name}: optimize at {RATIO}")
    try:
        row["remat"], rewritten = _at_ratio(item, user, timed)
    except (BudgetError, RematRewriteError, tf.errors.OpError) as error:  # a result too
        row["remat_error"] = f"{type(error).__name__}: {error}"[:500]
        return row
    if name.split(" ")[0] in SWITCH_MODELS:
        print_progress(f"bench_grappler {name}: Grappler switches on the rewritten step")
        row["switches"] = _switches(rewritten, row["remat"]["planned_peak_bytes"], timed)
    return row


# --quick: the zoo ``activations`` presets at a smaller batch (activations still dominate).
QUICK_BATCH = {"mlp": 1024, "resnet": 16, "transformer": 4}


def _models(quick: bool) -> list[tuple[str, GraphItem, tuple[Callable, tuple] | None]]:
    zoo = [(f"{name}/activations" + (f" batch {batch}" if quick else ""),
            models.build(name, preset="activations", **({"batch_size": batch} if quick else {})),
            None) for name, batch in QUICK_BATCH.items()]
    keras = [("keras_conv batch 64", *_user(keras_user_step("conv", batch=64))),
             ("keras_depthwise batch 32", *_user(keras_user_step("depthwise", batch=32))),
             ("keras_attention batch 16 seq 128",
              *_user(keras_user_step("attention", batch=16, size=128)))]
    return zoo + keras


def _user(built: tuple) -> tuple[GraphItem, tuple[Callable, tuple]]:
    item, train_step, args = built
    return item, (train_step, args)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    x = np.arange(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    no_budget = [r["vs_user"]["no_budget"] for r in rows]
    width = 0.16
    left.bar(x - 2 * width, [s["median"] for s in no_budget], width, label="no budget",
             yerr=[[s["median"] - s["q1"] for s in no_budget],
                   [s["q3"] - s["median"] for s in no_budget]])
    left.bar(x - width, [r.get("remat", {}).get("planned_overhead", np.nan) for r in rows],
             width, label=f"recompute overhead planned at {RATIO}")
    left.bar(x, [r.get("remat", {}).get("planned_step_vs_user", np.nan) for r in rows], width,
             label=f"step time planned at {RATIO}")
    measured = [r.get("remat", {}).get("paired_vs_user") for r in rows]
    left.bar(x + width, [m["median"] if m else np.nan for m in measured], width,
             label=f"measured at {RATIO}",
             yerr=[[m["median"] - m["q1"] if m else 0 for m in measured],
                   [m["q3"] - m["median"] if m else 0 for m in measured]])
    left.bar(x + 2 * width, [r["vs_user"]["HEURISTICS"]["median"] for r in rows], width,
             label="Grappler HEURISTICS")
    left.set_ylabel("step time / user's step (TF defaults)")
    right.bar(x - 0.2, [r.get("remat", {}).get("measured_peak_bytes", np.nan)
                        / r["user_peak_bytes"] for r in rows], 0.4, label=f"plan at {RATIO}")
    right.bar(x + 0.2, [r["tf_memory_optimizer"]["HEURISTICS"]["peak_vs_user"] for r in rows],
              0.4, label="Grappler HEURISTICS")
    right.set_ylabel("peak / user's peak")
    for axis in (left, right):
        axis.set_xticks(x, names, rotation=30, ha="right")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    stem = f"{RESULT_DIR}/grappler" + ("_quick" if quick else "")
    load_before = os.getloadavg()
    # Short steps get more rounds: 5 s (quick) or 15 s of steps per comparison at least.
    timed = functools.partial(paired_step_times, rounds=11 if quick else 25,
                              min_seconds=5.0 if quick else 15.0)
    rows = [bench_model(name, item, user, timed)
            for name, item, user in _models(quick)]
    atomic_write_json(f"{stem}.json", {
        "ratio": RATIO, "quick": quick, "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "onednn": onednn_enabled(), "rows": rows})
    _plot(rows, f"{stem}.png")
    for r in rows:
        remat = r.get("remat", {})
        nb = r["vs_user"]["no_budget"]
        measured = remat.get("paired_vs_user", {})
        print(f"{r['model']:34s} user {r['user_step_ms']:8.1f} ms  no budget {nb['median']:.3f}"
              f" [{nb['q1']:.3f}, {nb['q3']:.3f}]  planned "
              f"{remat.get('planned_overhead', np.nan):.2f}"
              f" / step {remat.get('planned_step_vs_user', np.nan):.2f}  measured "
              f"{measured.get('median', np.nan):.2f}  peak/plan "
              f"{remat.get('peak_vs_plan', np.nan):.3f}  HEURISTICS peak "
              f"{r['tf_memory_optimizer']['HEURISTICS']['peak_vs_user']:.2f}"
              + (f"  {r['remat_error'][:80]}" if "remat_error" in r else ""))


if __name__ == "__main__":
    main()
