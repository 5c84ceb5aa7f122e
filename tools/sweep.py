"""Rematerialization sweeps on real TensorFlow: budgets x planners, planned vs measured.

    python -m graphfit.tools.sweep --config tools/sweep_configs/ablation.json [--output_dir DIR]

The config follows the DTR prototype's evaluation configs: per model a list of commands, and
every list-valued field of a command is unfolded as a Cartesian product::

    {"steps": 3, "warmup": 1, "overhead_limit": 2.0,
     "models": [
       {"model": "mlp", "preset": "activations", "model_args": {"depth": 16},
        "commands": [
          {"type": "baseline"},
          {"type": "dtr", "kind": "ratio", "ratio": [0.5, 0.7], "heuristic": ["dtr", "lru"]},
          {"type": "dtr", "kind": "fixed", "memory_budget": ["150MiB"], "heuristic": "offline"}]}]}

``baseline`` measures the unmodified step; ``dtr`` plans with ``heuristic`` (any planner of
``remat.pipeline.PLANNERS``) under a ``fixed`` budget (bytes or a size string) or a ``ratio`` of
the measured baseline peak, rewrites the graph, and measures it (warm-up, then repeated steps;
peak from the allocator's records and its high-water mark; loss and gradients compared).
``overhead_limit`` may be set per command. A planner that cannot meet a budget is recorded
with its reason (infeasible: the minimum budget; thrash).

Writes under the output directory (default ``out/bench/sweep``): ``sweep.json`` (every
run), ``summary.txt`` (the table printed), ``overhead_vs_budget.png`` and
``planned_vs_measured.png``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tools/sweep_configs/ablation.json", "Sweep config (JSON).")
flags.DEFINE_string("output_dir", None, "Output directory; default: the config's "
                    "output_dir, else out/bench/sweep.")

__all__ = ["unfold", "run_sweep", "main"]

DEFAULT_OUTPUT_DIR = "out/bench/sweep"
_COMMAND_TYPES = ("baseline", "dtr")


class SweepConfigError(ValueError):
    """The sweep config is malformed (the message names the entry)."""


def unfold(command: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of a command's list-valued fields (Cartesian product, in key order).

    Examples:
        >>> unfold({"type": "dtr", "ratio": [0.5, 0.7], "heuristic": ["dtr", "lru"]})[1]
        {'type': 'dtr', 'ratio': 0.5, 'heuristic': 'lru'}
    """
    keys = [k for k, v in command.items() if isinstance(v, list)]
    combos = itertools.product(*(command[k] for k in keys))
    return [{**command, **dict(zip(keys, values))} for values in combos]


def _budget_bytes(run: dict[str, Any], baseline) -> int:
    """The run's budget: bytes, or a ratio of what the ``baseline`` step adds above its
    resident bytes (``remat.closed_loop.ratio_budget``, as ``pipeline.optimize``)."""
    from graphfit.profiler.sizes import parse_bytes
    from graphfit.remat.closed_loop import ratio_budget

    kind = run.get("kind", "ratio")
    if kind == "ratio":
        return ratio_budget(baseline.peak_bytes, baseline.resident_bytes, float(run["ratio"]))
    if kind == "fixed":
        budget = run["memory_budget"]
        return parse_bytes(budget) if isinstance(budget, str) else int(budget)
    raise SweepConfigError(f"command kind {kind!r} is not 'ratio' or 'fixed': {run}")


def _run_model(entry: dict[str, Any], defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """All commands of one model entry; the baseline is measured once and shared."""
    from graphfit import models
    from graphfit.profiler.session import session_config
    from graphfit.profiler.trace import print_progress
    from graphfit.remat.measure import measure_rewrite, measure_step
    from graphfit.remat.pipeline import BudgetError, rematerialize
    from graphfit.remat.tf_memory import tf_memory_model

    steps, warmup = entry.get("steps", defaults["steps"]), entry.get("warmup", defaults["warmup"])
    item = models.build(entry["model"], preset=entry.get("preset", "activations"),
                        **entry.get("model_args", {}))
    baseline = measure_step(item, steps=steps, warmup=warmup)
    # Plans are made for the project's configuration, which rewritten steps run under.
    memory_model = tf_memory_model(item, measure_step(item, steps=steps, warmup=warmup,
                                                      config=session_config()).profile)
    label = entry.get("label", entry["model"])
    common = {"model": label, "config": item.config,
              "baseline_peak_bytes": baseline.peak_bytes,
              "baseline_ruler": baseline.ruler,
              "baseline_resident_bytes": baseline.resident_bytes,
              "baseline_step_time_us": baseline.step_time_us}
    print_progress(f"sweep {label}: baseline peak {baseline.peak_bytes / 2**20:.1f} MiB, "
                   f"step {baseline.step_time_us / 1000:.1f} ms")
    results = []
    for command in entry["commands"]:
        if command.get("type") not in _COMMAND_TYPES:
            raise SweepConfigError(f"{label}: command type {command.get('type')!r} is not one "
                                   f"of {_COMMAND_TYPES}")
        for run in unfold(command):
            if run["type"] == "baseline":
                results.append({**common, "type": "baseline", "status": "ok"})
                continue
            budget = _budget_bytes(run, baseline)
            heuristic = run.get("heuristic", "dtr")
            record = {**common, "type": "dtr", "kind": run.get("kind", "ratio"),
                      "heuristic": heuristic, "budget_bytes": budget,
                      "budget_ratio": budget / baseline.peak_bytes}
            try:
                rewritten, plan = rematerialize(
                    item, memory_model, budget_bytes=budget, heuristic=heuristic,
                    overhead_limit=run.get("overhead_limit", defaults["overhead_limit"]))
            except BudgetError as error:
                record.update(status="infeasible", minimum_bytes=error.minimum_bytes,
                              reason=str(error).split(". ")[0])
                results.append(record)
                print_progress(f"  {heuristic} @ {record['budget_ratio']:.2f}: {record['reason']}")
                continue
            report = measure_rewrite(item, rewritten, plan, baseline=baseline, steps=steps,
                                     warmup=warmup)
            record.update(report, status="ok", budget_ratio=budget / baseline.peak_bytes,
                          planning_s=plan.stats.get("planning_s"))
            results.append(record)
            print_progress(f"  {heuristic} @ {record['budget_ratio']:.2f}: planned "
                           f"{plan.peak_bytes / 2**20:.1f} MiB, measured "
                           f"{report['measured_peak_bytes'] / 2**20:.1f} MiB, overhead "
                           f"{report['planned_overhead']:.2f}x planned / "
                           f"{report['measured_overhead']:.2f}x measured")
    return results


def _summary(results: list[dict[str, Any]]) -> str:
    header = (f"{'model':<14}{'planner':<14}{'budget':>8}{'base MiB':>10}{'plan MiB':>10}"
              f"{'meas MiB':>10}{'meas/base':>10}{'err':>8}{'ovh plan':>9}{'ovh meas':>9}"
              f"{'match':>7}")
    lines = [header, "-" * len(header)]
    for r in results:
        if r["type"] == "baseline":
            lines.append(f"{r['model']:<14}{'(baseline)':<14}{'':>8}"
                         f"{r['baseline_peak_bytes'] / 2**20:>10.1f}{'':>10}"
                         f"{r['baseline_peak_bytes'] / 2**20:>10.1f}{1.0:>10.3f}{'':>8}"
                         f"{'':>9}{1.0:>9.2f}{'':>7}")
        elif r["status"] != "ok":
            lines.append(f"{r['model']:<14}{r['heuristic']:<14}{r['budget_ratio']:>8.2f}"
                         f"{r['baseline_peak_bytes'] / 2**20:>10.1f}  {r['reason'][:70]}")
        else:
            match = "yes" if r["loss_match"] and r["gradients_match"] else "NO"
            lines.append(f"{r['model']:<14}{r['heuristic']:<14}{r['budget_ratio']:>8.2f}"
                         f"{r['baseline_peak_bytes'] / 2**20:>10.1f}"
                         f"{r['planned_peak_bytes'] / 2**20:>10.1f}"
                         f"{r['measured_peak_bytes'] / 2**20:>10.1f}{r['peak_ratio']:>10.3f}"
                         f"{r['prediction_error']:>+8.1%}{r['planned_overhead']:>9.2f}"
                         f"{r['measured_overhead']:>9.2f}{match:>7}")
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], output_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["type"] == "dtr" and r["status"] == "ok"]
    model_names = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, max(1, len(model_names)), squeeze=False,
                             figsize=(4.5 * max(1, len(model_names)), 3.8))
    for ax, model in zip(axes[0], model_names):
        for heuristic in dict.fromkeys(r["heuristic"] for r in ok if r["model"] == model):
            runs = sorted((r for r in ok if r["model"] == model and r["heuristic"] == heuristic),
                          key=lambda r: r["budget_ratio"])
            x = [r["budget_ratio"] for r in runs]
            line, = ax.plot(x, [r["measured_overhead"] for r in runs], "o-", label=heuristic)
            ax.plot(x, [r["planned_overhead"] for r in runs], "x--", color=line.get_color())
        ax.set(title=f"{model} (o measured, x planned)", xlabel="budget / baseline peak",
               ylabel="step time overhead")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no budget met", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, "overhead_vs_budget.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    for model in model_names:
        runs = [r for r in ok if r["model"] == model]
        ax.scatter([r["planned_peak_bytes"] / 2**20 for r in runs],
                   [r["measured_peak_bytes"] / 2**20 for r in runs], label=model, s=14)
    top = max([max(r["planned_peak_bytes"], r["measured_peak_bytes"]) / 2**20 for r in ok],
              default=1.0) * 1.05
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.2,
                    label="±10%")
    ax.set(xlabel="planned peak (MiB)", ylabel="measured peak (MiB)",
           title="rematerialized steps: planned vs measured peak")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, "planned_vs_measured.png"), dpi=110)
    plt.close(fig)


def run_sweep(config: dict[str, Any], output_dir: str) -> list[dict[str, Any]]:
    """Run every model entry of ``config``; write JSON, summary and plots to ``output_dir``.

    Raises:
        SweepConfigError: a malformed config.
    """
    from graphfit.profiler.profile import atomic_write_json

    if not config.get("models"):
        raise SweepConfigError("the config has no 'models' list")
    defaults = {"steps": config.get("steps", 3), "warmup": config.get("warmup", 1),
                "overhead_limit": config.get("overhead_limit", 2.0)}
    results = []
    for entry in config["models"]:
        if "model" not in entry or "commands" not in entry:
            raise SweepConfigError(f"model entry {entry} needs 'model' and 'commands'")
        results.extend(_run_model(entry, defaults))
    os.makedirs(output_dir, exist_ok=True)
    atomic_write_json(os.path.join(output_dir, "sweep.json"),
                      {"config": config, "results": results})
    summary = _summary(results)
    tmp = os.path.join(output_dir, "summary.txt.tmp")
    with open(tmp, "w") as f:
        f.write(summary + "\n")
    os.replace(tmp, os.path.join(output_dir, "summary.txt"))
    _plot(results, output_dir)
    print(summary)
    return results


def main(argv) -> None:
    del argv
    with open(FLAGS.config) as f:
        config = json.load(f)
    output_dir = FLAGS.output_dir or config.get("output_dir", DEFAULT_OUTPUT_DIR)
    try:
        run_sweep(config, output_dir)
    except SweepConfigError as error:
        raise app.UsageError(str(error)) from error


if __name__ == "__main__":
    sys.exit(app.run(main))
