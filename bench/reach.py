"""Benchmark "reach": how far below its measured peak each model's training step can go.

For zoo models (``default`` and ``activations`` presets) and Keras 3 models written here with
stock Keras layers (a ResNet-style conv net with BatchNorm and residual adds, a MobileNet-style
depthwise net, a DenseNet-style net of concatenations, LSTM and GRU classifiers with
``unroll=True`` and with Keras's default ``unroll=False``, an attention block), and
``keras.applications`` models (ResNet50, MobileNetV2, ConvNeXtTiny, DenseNet121,
EfficientNetB0; SGD), at shapes this 2-core machine runs
in minutes:

- ``baseline_peak_bytes``: the step's measured peak (allocator records, as ``remat.measure``);
- ``graph_passes``: what ``pipeline.passes.run_graph_passes`` (gradient accumulation, early
  updates) rewrote, and the measured peak after them;
- ``lower_bound_ratio``: the planner's lower bound (``simulator.minimum_budget_bytes`` on the
  calibrated planning graph of the prepared step) / baseline peak;
- ``lowest_ratio``: per planner (``dtr``, ``offline``), the lowest of ``RATIOS`` at which it
  finds a plan in one traced order, as it ran or with its backward pass reordered
  (``remat.backward_order``) (planned, not run; ratios below a failure are not tried);
- ``at_half``: ``pipeline.optimize(memory_ratio=0.5)`` with the default settings, as a user
  calls it (the budget: the step's resident bytes plus half of what it adds, both by TF's
  allocator where it keeps statistics), run and verified: planned and measured overhead, the
  predicted and measured step against the user's (``remat.step_time``), measured peak /
  budget, loss / gradients / weights equal, the closed loop's rounds; or the error,
  verbatim. (Until 2026-12-06 a budget of half the row's whole peak: below the weights'
  floor on ``keras.applications`` models, where weights dominate.) Also the measured
  overhead against the original step run one op at a time (``measured_overhead_vs_serial``):
  the rewrite runs the backward pass as a chain, so the gap between the measured overhead and
  this one is the inter-op parallelism the chain gives up, not recomputation. And how long ``optimize`` took
  (``optimize_seconds``) and where (``stage_seconds``: each graph pass, then the remat pass's
  stages, ``remat.closed_loop``).

    python -m graphfit.bench.reach [--quick] [--models a,b] [--output_stem reach_x]

Writes ``out/bench/reach.json`` (``--quick``: ``reach_quick.json``) and ``reach.png``
and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.profile import atomic_write_json
from graphfit.profiler.session import onednn_enabled

__all__ = ["MODELS", "QUICK_MODELS", "RATIOS", "keras_step_item", "main", "reach"]

RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
QUICK_RATIOS = (0.7, 0.5, 0.3)
PLANNERS = ("dtr", "offline")
RESULT_DIR = RESULTS_DIR


def _zoo(name: str, preset: str, **knobs) -> Callable:
    def build():
        from graphfit import models
        return models.build(name, preset=preset, **knobs)
    return build


def keras_step_item(name: str, model, optimizer, x: np.ndarray, y: np.ndarray):
    """The ``tf.function`` training step of a Keras ``model`` (logits out; sparse
    cross-entropy; ``optimizer``), traced on ``(x, y)``, as a ``FunctionItem``."""
    from graphfit.profiler.tf_function import classifier_train_step, graph_item_from_function

    train_step = classifier_train_step(model, optimizer)
    return graph_item_from_function(train_step, x, y, name=name)


def _keras(name: str, layers: Callable, input_shape: tuple, batch: int, classes: int = 10,
           optimizer: str = "adam") -> Callable:
    """A builder of the step (``optimizer``: ``adam`` or ``sgd``) of a Keras model
    ``layers(keras, inputs, classes) -> logits``, traced at ``batch``."""
    def build():
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        import keras

        keras.utils.set_random_seed(0)
        inputs = keras.Input(input_shape)
        model = keras.Model(inputs, layers(keras, inputs, classes))
        x = np.random.default_rng(0).standard_normal((batch, *input_shape), dtype=np.float32)
        step_optimizer = (keras.optimizers.Adam(1e-3) if optimizer == "adam"
                          else keras.optimizers.SGD(1e-2))
        return keras_step_item(name, model, step_optimizer, x, np.arange(batch) % classes)
    return build


def _application(architecture: str):
    """A ``keras.applications`` model nobody here wrote (random weights, logits out)."""
    def layers(keras, x, classes):
        return getattr(keras.applications, architecture)(
            weights=None, input_tensor=x, classes=classes, classifier_activation=None).output
    return layers


def _resnet(keras, x, classes, widths=(32, 64, 128), blocks=2):
    layers = keras.layers
    x = layers.Conv2D(widths[0], 3, padding="same")(x)
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage and not block else 1
            shortcut = x
            y = layers.Conv2D(width, 3, strides=stride, padding="same")(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.BatchNormalization()(layers.Conv2D(width, 3, padding="same")(y))
            if stride != 1 or shortcut.shape[-1] != width:
                shortcut = layers.Conv2D(width, 1, strides=stride)(shortcut)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
    return layers.Dense(classes)(layers.GlobalAveragePooling2D()(x))


def _mobilenet(keras, x, classes, widths=(32, 64, 128, 128)):
    layers = keras.layers
    x = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(widths[0], 3, padding="same",
                                                                   use_bias=False)(x)))
    for k, width in enumerate(widths):
        x = layers.DepthwiseConv2D(3, strides=2 if k % 2 else 1, padding="same",
                                   use_bias=False)(x)
        x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
        x = layers.Conv2D(width, 1, use_bias=False)(x)
        x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
    return layers.Dense(classes)(layers.GlobalAveragePooling2D()(x))


def _densenet(keras, x, classes, blocks=3, layers_per_block=6, growth=16):
    layers = keras.layers
    x = layers.Conv2D(2 * growth, 3, padding="same", use_bias=False)(x)
    for block in range(blocks):
        for _ in range(layers_per_block):
            y = layers.ReLU()(layers.BatchNormalization()(x))
            y = layers.Conv2D(4 * growth, 1, use_bias=False)(y)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.Conv2D(growth, 3, padding="same", use_bias=False)(y)
            x = layers.Concatenate()([x, y])
        if block < blocks - 1:
            x = layers.ReLU()(layers.BatchNormalization()(x))
            x = layers.Conv2D(x.shape[-1] // 2, 1, use_bias=False)(x)
            x = layers.AveragePooling2D(2)(x)
    return layers.Dense(classes)(layers.GlobalAveragePooling2D()(layers.ReLU()(x)))


def _recurrent(cell: str, units=256, unroll=True):
    def layers(keras, x, classes):
        rnn = getattr(keras.layers, cell)(units, unroll=unroll)
        return keras.layers.Dense(classes)(rnn(x))
    return layers


def _attention(keras, x, classes, heads=4, blocks=2):
    layers = keras.layers
    width = x.shape[-1]
    for _ in range(blocks):
        y = layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, y]))
        y = layers.Dense(width, activation="relu")(layers.Dense(4 * width)(x))
        x = layers.LayerNormalization()(layers.Add()([x, y]))
    return layers.Dense(classes)(layers.GlobalAveragePooling1D()(x))


MODELS: dict[str, Callable] = {
    "mlp/activations": _zoo("mlp", "activations"),
    "resnet/activations": _zoo("resnet", "activations"),
    "transformer/activations": _zoo("transformer", "activations"),
    "cifarnet/activations": _zoo("cifarnet", "activations"),
    "mlp/default": _zoo("mlp", "default"),
    "resnet/default": _zoo("resnet", "default"),
    "transformer/default": _zoo("transformer", "default"),
    "gnmt_v2/default": _zoo("gnmt_v2", "default"),
    "keras_resnet": _keras("keras_resnet", _resnet, (32, 32, 3), 32),
    "keras_mobilenet": _keras("keras_mobilenet", _mobilenet, (32, 32, 3), 32),
    "keras_densenet": _keras("keras_densenet", _densenet, (32, 32, 3), 32),
    "keras_lstm": _keras("keras_lstm", _recurrent("LSTM"), (32, 64), 32),
    "keras_gru": _keras("keras_gru", _recurrent("GRU"), (32, 64), 32),
    "keras_attention": _keras("keras_attention", _attention, (128, 128), 16),
    # Keras's default unroll=False: the loops are unrolled at trace time
    # (profiler.unroll_loops); the shapes of bench_loops.
    "keras_lstm_loop": _keras("keras_lstm_loop", _recurrent("LSTM", 128, unroll=False),
                              (32, 32), 32),
    "keras_gru_loop": _keras("keras_gru_loop", _recurrent("GRU", 128, unroll=False),
                             (32, 32), 32),
    "keras_resnet50": _keras("keras_resnet50", _application("ResNet50"), (64, 64, 3), 8,
                             optimizer="sgd"),
    "keras_mobilenetv2": _keras("keras_mobilenetv2", _application("MobileNetV2"),
                                (64, 64, 3), 8, optimizer="sgd"),
    # Depthwise 7x7 convolutions as grouped Conv2D: nested XLA functions, inlined
    # (profiler.inline_functions) and run on the depthwise kernels.
    "keras_convnext_tiny": _keras("keras_convnext_tiny", _application("ConvNeXtTiny"),
                                  (64, 64, 3), 4, optimizer="sgd"),
    "keras_densenet121": _keras("keras_densenet121", _application("DenseNet121"),
                                (64, 64, 3), 8, optimizer="sgd"),
    "keras_efficientnetb0": _keras("keras_efficientnetb0", _application("EfficientNetB0"),
                                   (96, 96, 3), 8, optimizer="sgd"),
}
QUICK_MODELS = ("mlp/activations", "keras_lstm", "keras_gru", "keras_lstm_loop",
                "keras_gru_loop", "keras_densenet", "keras_resnet50")


def _lowest_ratio(plan_graphs: list, loss: str, baseline_bytes: int, planner: str,
                  ratios: tuple[float, ...]) -> dict:
    """The lowest of ``ratios`` (tried from the top, stopping at the first failure) at which
    ``planner`` plans the step on one of ``plan_graphs`` (one traced order as it ran and with
    its backward pass reordered, as ``remat.rematerialize`` plans), with the cheaper planned
    overhead there and the failure below it."""
    from graphfit.remat.pipeline import BudgetError, plan_for_budget

    found, failure = None, None
    for ratio in ratios:
        overheads, errors = [], []
        for plan_graph in plan_graphs:
            try:
                overheads.append(plan_for_budget(plan_graph, int(ratio * baseline_bytes),
                                                 planner, loss=loss).overhead)
            except BudgetError as error:
                errors.append(error)
        if not overheads:
            failure = {"ratio": ratio, "reason": str(errors[0]).split(". ")[0]}
            break
        found = {"ratio": ratio, "planned_overhead": round(min(overheads), 4)}
    return {"lowest": found, "first_failure": failure}


def _overhead_vs_serial(original, rewritten, rounds: int = 7) -> float:
    """The rewritten step's time over the original's run one op at a time
    (``profiler.session.serial_config``), paired. The rewrite chains the backward pass, so
    its step loses TF's inter-op parallelism there; against the serial original, what is
    left is the recomputation (and the forward pass's parallelism, which it keeps)."""
    from graphfit.profiler.session import serial_config, session_config
    from graphfit.remat.measure import paired_overhead
    from graphfit.remat.tf_memory import step_item

    overhead, _ = paired_overhead(step_item(original), rewritten, rounds,
                                  original_config=serial_config(session_config()))
    return overhead


def reach(name: str, build: Callable, ratios: tuple[float, ...]) -> dict:
    """Every number of the table for one model (see the module docstring)."""
    from graphfit import pipeline
    from graphfit.remat.backward_order import reorder_backward
    from graphfit.remat.measure import measure_step
    from graphfit.pipeline.passes import run_graph_passes
    from graphfit.remat.pipeline import resident_outputs
    from graphfit.remat.simulator import minimum_budget_bytes
    from graphfit.remat.tf_memory import tf_memory_model

    begin = time.perf_counter()
    item = build()
    row = {"model": name, "ops": len(item.graph.get_operations())}
    baseline = measure_step(item, steps=2, warmup=1)
    row["baseline_peak_bytes"] = baseline.peak_bytes
    row["baseline_step_time_us"] = baseline.step_time_us
    prepared, records = run_graph_passes(item)
    row["graph_passes"] = records
    measured = baseline if prepared is item else measure_step(prepared, steps=2, warmup=1)
    row["prepared_peak_bytes"] = measured.peak_bytes
    model = tf_memory_model(prepared, measured.profile)
    lower = minimum_budget_bytes(model.plan_graph,
                                 outputs=resident_outputs(model.plan_graph, prepared.loss))
    row["lower_bound_ratio"] = lower / baseline.peak_bytes
    plan_graphs = [model.plan_graph, reorder_backward(prepared, model).plan_graph]
    row["lowest_ratio"] = {planner: _lowest_ratio(plan_graphs, prepared.loss,
                                                  baseline.peak_bytes, planner, ratios)
                           for planner in PLANNERS}
    try:
        started = time.perf_counter()
        result = pipeline.optimize(item, memory_ratio=0.5, progress=None)
        optimize_seconds = time.perf_counter() - started
        remat = result.report()["remat"]
        row["at_half"] = {key: remat.get(key) for key in (
            "budget_bytes", "planned_peak_bytes", "measured_peak_bytes",
            "measured_peak_over_budget", "planned_overhead", "measured_overhead",
            "planned_step_vs_user", "overhead_vs_user", "overhead_by_order",
            "side_by_side_events", "loss_match", "gradients_match", "weights_match",
            "num_recomputes", "late_variable_readers")}
        row["at_half"]["rounds"] = [
            {k: r[k] for k in ("planning_budget_bytes", "planned_peak_bytes",
                               "measured_peak_bytes")} for r in remat.get("rounds", [])]
        row["at_half"]["measured_overhead_vs_serial"] = _overhead_vs_serial(item, result.item)
        row["at_half"]["optimize_seconds"] = round(optimize_seconds, 1)
        row["at_half"]["stage_seconds"] = {
            **{r.name: round(r.seconds, 2) for r in result.passes if r.seconds},
            **remat.get("stage_seconds", {})}
    except Exception as error:  # noqa: BLE001 - a benchmark records every failure verbatim
        row["at_half"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - begin, 1)
    return row


def _table(rows: list[dict]) -> str:
    lines = ["| model | baseline MiB | after passes | lower bound | lowest dtr / offline | "
             "overhead @0.5 planned / measured / vs user / vs serial | measured / budget | "
             "equal |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | error: {row['error'][:120]} |")
            continue
        lowest = [row["lowest_ratio"][p]["lowest"] for p in PLANNERS]
        half = row["at_half"]
        if "error" in half:
            fit = f"failed: {half['error'][:100]}"
        else:
            equal = all(half.get(k) in (True, None) for k in
                        ("loss_match", "gradients_match", "weights_match"))
            fit = (f"{half['planned_overhead']:.2f} / {half['measured_overhead']:.2f} / "
                   f"{half['overhead_vs_user']:.2f} / "
                   f"{half['measured_overhead_vs_serial']:.2f} | "
                   f"{half['measured_peak_over_budget']:.3f} | {'yes' if equal else 'NO'}")
        lines.append(
            f"| {row['model']} | {row['baseline_peak_bytes'] / 2**20:.1f} | "
            f"{row['prepared_peak_bytes'] / row['baseline_peak_bytes']:.2f} | "
            f"{row['lower_bound_ratio']:.2f} | "
            + " / ".join(f"{x['ratio']}" if x else "-" for x in lowest) + f" | {fit} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in rows if "error" not in row]
    figure, axis = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    positions = np.arange(len(rows))
    series = [("after graph passes", [r["prepared_peak_bytes"] / r["baseline_peak_bytes"]
                                      for r in rows]),
              ("lower bound", [r["lower_bound_ratio"] for r in rows])]
    series += [(f"lowest {p}", [(r["lowest_ratio"][p]["lowest"] or {"ratio": 1.0})["ratio"]
                                for r in rows]) for p in PLANNERS]
    series.append(("measured @0.5", [r["at_half"].get("measured_peak_bytes", np.nan)
                                     / r["baseline_peak_bytes"] for r in rows]))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        axis.bar(positions + k * width, values, width, label=label)
    axis.set_xticks(positions + 0.4 - width / 2, [r["model"] for r in rows], rotation=30,
                    ha="right")
    axis.set_ylabel("fraction of the measured baseline peak")
    axis.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK_MODELS)}, ratios {QUICK_RATIOS}")
    parser.add_argument("--models", default="", help="comma-separated names of MODELS")
    parser.add_argument("--output_stem", default="",
                        help="file name stem under out/bench (default reach, reach_quick)")
    args = parser.parse_args(argv if argv is not None else [])
    names = ([n for n in args.models.split(",") if n] or
             list(QUICK_MODELS if args.quick else MODELS))
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    ratios = QUICK_RATIOS if args.quick else RATIOS
    stem = args.output_stem or ("reach_quick" if args.quick else "reach")
    rows = []
    for name in names:
        print(f"reach: {name}", file=sys.stderr, flush=True)
        try:
            rows.append(reach(name, MODELS[name], ratios))
        except Exception as error:  # noqa: BLE001 - one model's failure is a row, not a crash
            traceback.print_exc()
            rows.append({"model": name, "error": f"{type(error).__name__}: {error}"[:2000]})
        atomic_write_json(f"{RESULT_DIR}/{stem}.json", {"ratios": ratios,
                                                        "onednn": onednn_enabled(), "rows": rows})
    _plot(rows, f"{RESULT_DIR}/{stem}.png")
    print(_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
