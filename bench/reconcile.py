"""Benchmark "reconcile": the report's peaks against TF's own allocator, and the rewritten
step's loss and update against the user's own ``tf.function`` step.

Per model, in a fresh process (``--model NAME`` runs one and prints its JSON row; without it,
each model of ``BENCH_MODELS`` runs in a subprocess of its own and the rows go to
``bench/results/reconcile.json``). A zoo model has no ``tf.function`` of a user's: its user's
step is its graph in a session with TF's default configuration, and its rewritten step runs in
a session too (no loss or update comparison beyond the report's).

- the user's step (``classifier_train_step``) is called once to warm up, its variables are
  saved, and more calls are read by the allocator (``profiler.trace.AllocatorPeak``: its
  peak minus its bytes in use when the call began: what the step adds) over ``profiler.trace.
  PEAK_READINGS`` calls (fewer where they do not spread, ``profiler.trace.added_by_calls``),
  their ``profiler.trace.peak_reading`` (a high quantile), the statistic the report reads its
  steps by;
- ``pipeline.optimize(item, memory_ratio=RATIO)`` (``--ratio``): the report's baseline and
  measured peak (``ruler``: ``allocator`` or ``records``), its resident bytes, the budget;
- ``to_callable(result.item)`` right after ``optimize``, as the user calls it: one warm-up
  call, then calls read by the allocator as the user's. Not after restoring the saved
  variables first (as until 2026-12-07): assigning every variable anew moves the user's
  weights in the allocator and leaves their old chunks free, and the same rewritten ResNet50
  step then added 49.0 MB per call against 43.3 MB just before (``remat.measure.
  measure_step``: the BFC allocator's reading depends on the free chunks earlier work left).
  Then, from the saved variables, one call of each step: the losses and every variable after
  the step (for SGD the update is ``lr * gradient``), compared with the user's: loss relative
  difference, largest update difference over the largest update.

Peaks are compared on one basis: the resident bytes the report counts from the graph plus what
the allocator says the step adds (the allocator does not see every resident weight: eager
tensors that alias host buffers bypass it). With oneDNN on, the CPU allocator leaves every
buffer below 256 KiB out, and the row applies the report's rule (``remat.measure.step_peak``):
the larger of that and the records rules (``user_step_ruler``, ``rewritten_step_ruler``), the
records being the report's own (TF keeps no step stats of an eager call); the allocator's
readings are kept beside (``allocator_*``).

    python -m graphfit.bench.reconcile [--model keras_resnet50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from graphfit.profiler.profile import atomic_write_json

__all__ = ["MODELS", "ZOO_MODELS", "BENCH_MODELS", "RATIO", "reconcile", "main"]

RATIO = 0.5
RESULT_PATH = "bench/results/reconcile.json"


def _convnext(keras, x, classes, widths=(32, 64), blocks=2):
    """A ConvNeXt-style net: patchify stem, blocks of depthwise 7x7, LayerNormalization, an
    inverted-bottleneck MLP with GELU, residual adds."""
    layers = keras.layers
    x = layers.LayerNormalization()(layers.Conv2D(widths[0], 4, strides=4)(x))
    for stage, width in enumerate(widths):
        if stage:
            x = layers.Conv2D(width, 2, strides=2)(layers.LayerNormalization()(x))
        for _ in range(blocks):
            y = layers.DepthwiseConv2D(7, padding="same")(x)
            y = layers.Dense(4 * width, activation="gelu")(layers.LayerNormalization()(y))
            x = layers.Add()([x, layers.Dense(width)(y)])
    return layers.Dense(classes)(layers.GlobalAveragePooling2D()(layers.LayerNormalization()(x)))


def _transformer(keras, x, classes, heads=4, blocks=2):
    layers = keras.layers
    width = x.shape[-1]
    for _ in range(blocks):
        y = layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, y]))
        y = layers.Dense(width)(layers.Dense(4 * width, activation="gelu")(x))
        x = layers.LayerNormalization()(layers.Add()([x, y]))
    return layers.Dense(classes)(layers.GlobalAveragePooling1D()(x))


def _resnet50(keras, x, classes):
    return keras.applications.ResNet50(weights=None, input_tensor=x, classes=classes,
                                       classifier_activation=None).output


def _resnet_small(keras, x, classes):
    """The Keras ResNet-style step of ``bench.reach`` (BatchNorm, residual adds)."""
    from graphfit.bench.reach import _resnet
    return _resnet(keras, x, classes, widths=(16, 32), blocks=1)


# Keras models: name -> (layers, input shape, batch, optimizer). The ``_small`` ones are the
# suite's (tests/test_reconcile.py): seconds each.
MODELS = {
    "keras_resnet50": (_resnet50, (64, 64, 3), 8, "sgd"),
    "keras_convnext": (_convnext, (64, 64, 3), 8, "sgd"),
    "keras_transformer": (_transformer, (64, 64), 8, "sgd"),
    "keras_resnet_small": (_resnet_small, (16, 16, 3), 8, "sgd"),
    "keras_transformer_small": (lambda keras, x, classes: _transformer(keras, x, classes,
                                                                       blocks=1),
                                (32, 64), 8, "sgd"),
}
# Zoo models (v1 graphs, no tf.function of the user's): name -> (zoo name, preset, knobs).
ZOO_MODELS = {
    "resnet/activations": ("resnet", "activations", {}),
    "resnet_small": ("resnet", "tiny", {"batch_size": 32}),
}


def _allocator_readings(call) -> list[int] | None:
    """What each call adds by the allocator, read as the report reads its steps (``profiler.
    trace.added_by_calls``); the row reads their ``peak_reading`` and keeps all of them, to
    show the spread."""
    from graphfit.profiler.trace import added_by_calls

    readings = added_by_calls(call)
    return None if None in readings else readings


def _keras_steps(name: str):
    """(item, a call of the user's step on the batch, the variables, the batch)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from graphfit.profiler.tf_function import classifier_train_step, graph_item_from_function

    layers, shape, batch, optimizer_name = MODELS[name]
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    model = keras.Model(inputs, layers(keras, inputs, 10))
    optimizer = (keras.optimizers.SGD(1e-2) if optimizer_name == "sgd"
                 else keras.optimizers.Adam(1e-3))
    x = np.random.default_rng(0).standard_normal((batch, *shape), dtype=np.float32)
    y = np.arange(batch) % 10
    user_step = classifier_train_step(model, optimizer)
    user_step(x, y)
    variables = list(model.variables) + list(optimizer.variables)
    item = graph_item_from_function(user_step, x, y, name=name)
    return item, lambda: user_step(x, y), variables, (x, y)


def _session_step(item):
    """A call of ``item``'s step in an open session of the configuration it runs with (TF's
    defaults for the user's v1 graph), initialised once; the session stays open."""
    from graphfit.profiler.session import make_session, step_config

    session = make_session(item.graph, config=step_config(item))
    item.initialize(session)
    fetches, feeds = [item.train_op, item.loss], item.feed_dict()
    return lambda: session.run(fetches, feeds)[1]


def reconcile(name: str, ratio: float = RATIO) -> dict:
    """One model's row (module docstring)."""
    from graphfit import models
    from graphfit.pipeline import optimize
    from graphfit.profiler.session import onednn_enabled
    from graphfit.profiler.tf_function import to_callable
    from graphfit.profiler.trace import default_allocator, peak_reading, uncounted_below_bytes
    from graphfit.remat.measure import step_peak

    if name in ZOO_MODELS:
        zoo, preset, knobs = ZOO_MODELS[name]
        item, variables = models.build(zoo, preset=preset, **knobs), []
        user_step = _session_step(item)
    else:
        item, user_step, variables, batch = _keras_steps(name)
    saved = [v.numpy() for v in variables]

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)

    user_step()
    user_readings = _allocator_readings(user_step)
    user_added = user_readings and peak_reading(user_readings)
    result = optimize(item, memory_ratio=ratio, progress=None)
    remat = result.report()["remat"]
    if variables:
        rewritten = to_callable(result.item, item)
        step = lambda: rewritten(*batch)    # noqa: E731
    else:
        step = _session_step(result.item)
    step()
    rewritten_readings = _allocator_readings(step)
    rewritten_added = rewritten_readings and peak_reading(rewritten_readings)
    row = {}
    if variables:       # the user's own step against the rewritten one, from the same weights
        losses, after = {}, {}
        for label, call in (("user", user_step), ("rewritten", step)):
            restore()
            losses[label] = float(call())
            after[label] = [v.numpy() for v in variables]
        # Over the weights only: the optimizer's iteration counter moves by 1 (an integer
        # variable), which made the ratio an absolute difference until 2026-12-07.
        weights = [k for k, value in enumerate(saved) if np.issubdtype(value.dtype, np.floating)]
        update = max(float(np.max(np.abs(after["user"][k] - saved[k]))) for k in weights)
        row = {"loss_user": losses["user"], "loss_rewritten": losses["rewritten"],
               "loss_relative_diff": abs(losses["rewritten"] - losses["user"])
               / abs(losses["user"]),
               # SGD: the update is lr * gradient; their largest difference over the largest.
               "max_update_diff_over_max_update": max(
                   float(np.max(np.abs(after["rewritten"][k] - after["user"][k])))
                   for k in weights) / update}
    resident, rewritten_resident = (remat["baseline_resident_bytes"],
                                    remat["measured_resident_bytes"])
    budget = remat["budget_bytes"]
    # The calls run where TF places them (``profiler.trace.default_allocator``).
    allocators = [default_allocator()]
    # The report's rule (``remat.measure.step_peak``): where the allocator leaves small buffers
    # out (oneDNN on), the larger of its reading and the records rules. TF keeps no step stats
    # of an eager ``tf.function`` call (``export_run_metadata`` holds none), so the records of
    # a step called as the user calls it are those of its graph traced in a session: the
    # report's.
    user_peak, user_ruler = (None, None) if user_added is None else step_peak(
        resident, user_added, remat["baseline_records_peak_bytes"], allocators)
    rewritten_peak, rewritten_ruler = (None, None) if rewritten_added is None else step_peak(
        rewritten_resident, rewritten_added, remat["measured_records_peak_bytes"], allocators)
    return {
        "model": name, "onednn": onednn_enabled(), "ratio": ratio, "ruler": remat["ruler"],
        # The allocator's readings below leave out every buffer smaller than this.
        "allocator_uncounted_below_bytes": uncounted_below_bytes(allocators),
        "resident_bytes": resident,
        "report_baseline_bytes": remat["baseline_peak_bytes"],
        "report_baseline_records_bytes": remat["baseline_records_peak_bytes"],
        "allocator_user_step_bytes": None if user_added is None else resident + user_added,
        "user_step_bytes": user_peak, "user_step_ruler": user_ruler,
        "baseline_over_user": (None if user_peak is None
                               else remat["baseline_peak_bytes"] / user_peak),
        "budget_bytes": budget,
        "report_measured_bytes": remat["measured_peak_bytes"],
        # Within it: the resident bytes, and what the rewritten step added called as the user
        # calls it (``remat.measure.measure_step``'s ``traced_from``).
        "report_measured_resident_bytes": rewritten_resident,
        "report_called_added_bytes": remat["measured_called_added_bytes"],
        "report_baseline_readings": remat["baseline_allocator_readings"],
        "report_measured_readings": remat["measured_allocator_readings"],
        "allocator_rewritten_step_bytes": (None if rewritten_added is None
                                           else rewritten_resident + rewritten_added),
        "rewritten_step_bytes": rewritten_peak, "rewritten_step_ruler": rewritten_ruler,
        "rewritten_over_budget": None if rewritten_peak is None else rewritten_peak / budget,
        "rewritten_added_over_budget_added": (
            None if rewritten_peak is None
            else (rewritten_peak - rewritten_resident) / (budget - resident)),
        **row,
        "report_gradients_match": remat["gradients_match"],
        "report_max_relative_gradient_diff": remat["max_relative_gradient_diff"],
        "num_recomputes": remat["num_recomputes"],
        "floating_events": remat["side_by_side_events"],
        "allocator_user_added_readings": user_readings,
        "allocator_rewritten_added_readings": rewritten_readings,
    }


BENCH_MODELS = ("keras_resnet50", "keras_convnext", "keras_transformer", "resnet/activations")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted([*MODELS, *ZOO_MODELS]))
    parser.add_argument("--ratio", type=float, default=RATIO)
    args = parser.parse_args(argv)
    if args.model:
        print(json.dumps(reconcile(args.model, args.ratio)))
        return
    rows = []
    for name in BENCH_MODELS:
        run = subprocess.run([sys.executable, "-m", "graphfit.bench.reconcile", "--model", name,
                              "--ratio", str(args.ratio)],
                             capture_output=True, text=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                    else {"model": name, "error": run.stderr.strip().splitlines()[-1:]})
        print(json.dumps(rows[-1]), flush=True)
    atomic_write_json(RESULT_PATH, rows)


if __name__ == "__main__":
    main()
