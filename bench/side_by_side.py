"""Benchmark the rewrite's two orders of the backward pass: a strict chain, and floating
events, which run as soon as their inputs exist where a bound on the memory stays within the
plan's peak (``remat.side_by_side``; what ``pipeline.optimize`` tries when it verifies).

Per model, one plan at 0.5 of the measured peak (``offline``, after the graph passes) is
lowered both ways, and the two rewritten steps are timed side by side with the user's step
(paired, interleaved rounds: ``profiler.paired_timing``), with their measured peaks and the
step time ``remat.step_time`` predicts for each (a replay of its own graph). The models:
``bench.grappler``'s quick ones and ``bench.reach``'s DenseNet-style step, whose
many small ops leave a core idle in a chain.

    python -m graphfit.bench.side_by_side

Writes ``out/bench/side_by_side.json`` and ``side_by_side.png`` and prints a table.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary
from graphfit.profiler.profile import atomic_write_json
from graphfit.profiler.session import onednn_enabled, step_config, user_config
from graphfit.profiler.tf_function import to_callable
from graphfit.profiler.trace import print_progress
from graphfit.remat.measure import measure_step
from graphfit.pipeline.passes import run_graph_passes
from graphfit.remat.pipeline import rematerialize
from graphfit.remat.step_time import trace_for_prediction
from graphfit.remat.tf_memory import step_item, tf_memory_model
from graphfit.bench.grappler import RATIO, _models, _Sessions, _traced_peak
from graphfit.bench.reach import MODELS

__all__ = ["main", "floating_vs_strict"]

RESULT = f"{RESULTS_DIR}/side_by_side"
ORDERS = {"strict": False, "floating": True}


def floating_vs_strict(item, user) -> dict:
    """One plan of ``item`` at ``RATIO``, rewritten as a strict chain and with floating events,
    timed beside the user's step (``user``: a Keras ``(step function, args)``, or ``None``
    for the graph under TF's defaults)."""
    item = step_item(item)
    prepared, _ = run_graph_passes(item)
    baseline = measure_step(item, steps=3, warmup=1)
    # One memory model (its calibration trace fixes the op order), so both orders lower the
    # same plan.
    model = tf_memory_model(prepared, measure_step(prepared, steps=3, warmup=1).profile)
    traces = trace_for_prediction(item, prepared, model)
    budget = int(RATIO * baseline.peak_bytes)
    steps, row = {}, {"budget_bytes": budget}
    with _Sessions() as sessions:
        steps["user"] = (functools.partial(user[0], *user[1]) if user is not None else
                         sessions.step(item, user_config())[0])
        for order, side_by_side in ORDERS.items():
            rewritten, plan = rematerialize(prepared, model, budget_bytes=budget,
                                            heuristic="offline", side_by_side=side_by_side,
                                            step_traces=traces)
            steps[order], session = sessions.step(rewritten, step_config(rewritten))
            if user is not None:       # Keras: time it called as the user calls theirs
                steps[order] = functools.partial(to_callable(rewritten, item), *user[1])
            row[order] = {"planned_peak_bytes": plan.peak_bytes,
                          "measured_peak_vs_plan": (_traced_peak(session, rewritten) /
                                                    plan.peak_bytes),
                          "planned_overhead": plan.overhead,
                          "side_by_side_events": plan.stats["side_by_side_events"],
                          "planned_step_vs_user": plan.stats["step_time"]["vs_user"]}
        summary = ratio_summary(paired_step_times(steps, rounds=15, min_seconds=8.0), "user")
    row["user_step_ms"] = summary["user"]["median_ms"]
    for order in ORDERS:
        row[order]["measured_vs_user"] = {k: round(v, 4) for k, v in summary[order].items()}
    row["floating_vs_strict"] = summary["floating"]["median"] / summary["strict"]["median"]
    return row


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, axis = plt.subplots(figsize=(10, 4.5))
    for shift, order in ((-0.2, "strict"), (0.2, "floating")):
        measured = [r[order]["measured_vs_user"] for r in rows]
        axis.bar(x + shift, [m["median"] for m in measured], 0.4, label=f"{order}, measured",
                 yerr=[[m["median"] - m["q1"] for m in measured],
                       [m["q3"] - m["median"] for m in measured]])
    for shift, order, marker in ((-0.2, "strict", "o"), (0.2, "floating", "D")):
        axis.scatter(x + shift, [r[order]["planned_step_vs_user"] for r in rows],
                     color="black", marker=marker, zorder=3,
                     label=f"{order}, predicted (remat.step_time)")
    axis.set_xticks(x, [r["model"] for r in rows], rotation=30, ha="right")
    axis.set_ylabel(f"step time / user's step, at {RATIO} of the peak")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    load_before = os.getloadavg()
    models = _models(quick=True)
    models.append(("keras_densenet", MODELS["keras_densenet"](), None))
    rows = []
    for name, item, user in models:
        print_progress(f"bench_side_by_side {name}: plan at {RATIO}, strict and floating")
        rows.append({"model": name, **floating_vs_strict(item, user)})
        r = rows[-1]
        print(f"{name:34s} user {r['user_step_ms']:7.1f} ms  strict "
              f"{r['strict']['measured_vs_user']['median']:.3f}  floating "
              f"{r['floating']['measured_vs_user']['median']:.3f}  predicted "
              f"{r['strict']['planned_step_vs_user']:.3f} / "
              f"{r['floating']['planned_step_vs_user']:.3f}  peak/plan "
              f"{r['strict']['measured_peak_vs_plan']:.3f} / "
              f"{r['floating']['measured_peak_vs_plan']:.3f}", flush=True)
    atomic_write_json(f"{RESULT}.json", {"ratio": RATIO, "onednn": onednn_enabled(),
                                         "load_average_before": load_before,
                                         "load_average_after": os.getloadavg(), "rows": rows})
    _plot(rows, f"{RESULT}.png")


if __name__ == "__main__":
    main()
