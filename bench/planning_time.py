"""Benchmark "planning time": how long ``optimize(memory_ratio=0.5)`` keeps a user waiting.

Issue 31's models, each as its user's ``tf.function`` training step: ``keras.applications``
ResNet50 (64², batch 8, SGD), EfficientNetB0 (96², batch 8, SGD) and ConvNeXtTiny (64²,
batch 4, SGD) as ``bench.reach`` builds them, and keras-hub's GPT-2 and BERT backbones (random
weights; 4 layers, 4 heads, width 256, intermediate 1024, sequence 128, batch 8, Adam, a
1000-way ``Dense`` on the sequence output; skipped when keras-hub is not installed). Each is
optimized with the default settings in a fresh process (a user's first call pays TF's start-up
too, and one run's sessions must not warm the next), and the row records the wall seconds of
``optimize``, its stages (the graph passes, then ``report()["remat"]["stage_seconds"]``), the
closed loop's rounds, the measured peak over the budget (TF's allocator where it keeps
statistics, ``remat.measure``), loss and gradients equal, and the step against the user's: the
report's short measurement, and after the clock stopped the median of ``STEP_ROUNDS`` paired,
interleaved rounds.

    python -m graphfit.bench.planning_time [--models a,b]

Writes ``out/bench/planning_time.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.profile import atomic_write_json

__all__ = ["MODELS", "main"]

MODELS = ("keras_resnet50", "keras_hub_gpt2", "keras_hub_bert", "keras_efficientnetb0",
          "keras_convnext_tiny")
RESULT_PATH = f"{RESULTS_DIR}/planning_time.json"
# A run that takes longer than this is recorded as a timeout.
TIMEOUT_S = 1800
STEP_ROUNDS = 30


def _keras_hub_item(name: str):
    """The keras-hub backbone ``name`` (``gpt2`` or ``bert``) with a 1000-way head, as the
    user's traced training step (``bench.reach.keras_step_item``)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import keras_hub
    import numpy as np

    from graphfit.bench.reach import keras_step_item

    keras.utils.set_random_seed(0)
    sizes = dict(vocabulary_size=1000, num_layers=4, num_heads=4, hidden_dim=256,
                 intermediate_dim=1024, max_sequence_length=128)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 1000, (8, 128)).astype("int32"),
         "padding_mask": np.ones((8, 128), dtype="int32")}
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(**sizes)
        sequence = backbone.output
    else:
        backbone = keras_hub.models.BertBackbone(**sizes)
        sequence = backbone.output["sequence_output"]
        x["segment_ids"] = np.zeros((8, 128), dtype="int32")
    model = keras.Model(backbone.input, keras.layers.Dense(1000)(sequence))
    y = rng.integers(0, 1000, (8, 128)).astype("int32")
    return keras_step_item(f"keras_hub_{name}", model, keras.optimizers.Adam(), x, y)


def _one(name: str) -> dict:
    """Build ``name``'s step, then time ``optimize`` on it (in this process)."""
    from graphfit import pipeline
    from graphfit.bench.reach import MODELS as REACH_MODELS
    from graphfit.profiler.session import user_config
    from graphfit.remat.measure import paired_overheads

    item = (_keras_hub_item(name.removeprefix("keras_hub_")) if name.startswith("keras_hub_")
            else REACH_MODELS[name]())
    row = {"model": name, "ops": len(item.graph.get_operations())}
    begin = time.perf_counter()
    try:
        result = pipeline.optimize(item, memory_ratio=0.5, progress=None)
    except Exception as error:  # noqa: BLE001 - a refusal is a row, with its message
        return {**row, "optimize_s": round(time.perf_counter() - begin, 1),
                "error": f"{type(error).__name__}: {error}"[:2000]}
    seconds = round(time.perf_counter() - begin, 1)
    remat = result.report()["remat"]
    # The report's step time is one short paired measurement; the bench's, after the clock
    # stopped, takes STEP_ROUNDS rounds (issue 31 asks medians of paired, interleaved rounds).
    step_vs_user, _ = paired_overheads(result.item, {"user": (item, user_config())},
                                       rounds=STEP_ROUNDS, warmup=2)["user"]
    return {**row, "optimize_s": seconds,
            "stage_seconds": {**{r.name: round(r.seconds, 2) for r in result.passes
                                 if r.seconds and r.name != "remat"},
                              **remat.get("stage_seconds", {})},
            "rounds": len(remat.get("rounds", [])),
            "measured_peak_over_budget": remat.get("measured_peak_over_budget"),
            "equal": bool(remat.get("loss_match") and remat.get("gradients_match")),
            "planned_overhead": remat.get("planned_overhead"),
            "step_vs_user": remat.get("overhead_vs_user"),
            f"step_vs_user_{STEP_ROUNDS}_rounds": step_vs_user,
            "num_recomputes": remat.get("num_recomputes")}


def _in_fresh_process(name: str) -> dict:
    """``_one(name)`` in a new Python process; its last line of output is the row."""
    begin = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "graphfit.bench.planning_time",
                               "--one", name], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"model": name, "error": done.stderr[-2000:],
                "seconds": round(time.perf_counter() - begin, 1)}
    return {**json.loads(lines[-1]), "load_average": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help=f"comma-separated of {', '.join(MODELS)}")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)   # the child's model
    args = parser.parse_args(argv if argv is not None else [])
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    names = [n for n in args.models.split(",") if n] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if importlib.util.find_spec("keras_hub") is None:
        print("planning_time: keras-hub is not installed (make setup installs it); its "
              "models are skipped", file=sys.stderr)
        names = [n for n in names if not n.startswith("keras_hub_")]
    rows = []
    for name in names:
        print(f"planning_time: {name}", file=sys.stderr, flush=True)
        rows.append(_in_fresh_process(name))
        print(json.dumps(rows[-1]), flush=True)
        atomic_write_json(RESULT_PATH, {"rows": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
