"""Benchmark: rematerialization heuristics against Checkmate's MILP and its LP relaxation.

For each graph and each budget ratio (of the checkpoint-all peak) it plans with Checkmate's
MILP (``remat.checkmate``; HiGHS with a time limit: the optimum, or the best schedule found and
HiGHS's lower bound; at most ``MILP_MAX_STAGES`` stages, so on the larger graphs the optimum is
that of a coarsened model and the bound is a bound of that model; skipped above
``MILP_MAX_OPS`` ops), Checkmate's LP relaxation with two-phase rounding on the whole graph
(``remat.checkmate_lp``: the rounded plan and the LP's value, a lower bound on the MILP's
optimum when the LP is not grouped), Chen et al.'s √n and greedy
segment checkpointing (``remat.baselines``), and the DTR simulator with ``dtr`` and the
``offline`` planner (``remat.simulator``: the best of a portfolio of eviction scores, ``belady``
reading the known future among them).
Every plan is replayed by ``remat.validate``; overhead = compute with recomputation / without.

Graphs:
- ``mlp``: ``models.build("mlp", preset="tiny", batch_size=2048, depth=24, width=128)`` (deep and narrow: activations dominate, so budgets down to 0.3 are feasible),
- ``resnet``: ``models.build("resnet", preset="tiny", batch_size=32)`` (depth 8),
  both profiled for real (``profiler.trace.profile_graph``: measured compute times) and
  calibrated to TF's allocations (``remat.tf_memory.tf_memory_model``: planning graph of
  buffer-forwarding chains, aliases free, feeds and constants resident): the graph the
  pipeline plans on;
- ``mlp/activations``, ``resnet/activations``, ``transformer/activations``: the zoo's
  rematerialization presets (``models.PRESETS``), profiled and calibrated the same way;
- ``training_like_N``: ``profiler.synthetic.training_like(N)`` with the batch scaled ×32
  (activation bytes and compute ×32, weights unchanged), so that activations, not weights,
  dominate the peak as in real training.

Writes ``out/bench/remat_milp.json``, ``remat_milp.png`` and ``remat_milp.txt``.

``--zoo`` instead plans every zoo model's presets (``default`` and ``activations``) with
``checkmate_lp`` alone at ``ZOO_RATIOS``: graph size, LP size, solve time, overhead beside
``dtr`` and ``offline``; writes ``out/bench/remat_lp_zoo.json`` and ``remat_lp_zoo.txt``.

    python -m graphfit.bench.remat_milp [time_limit_s]
    python -m graphfit.bench.remat_milp --zoo
"""

from __future__ import annotations

import os
import sys
import time

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.cost_graph import CostGraph
from graphfit.profiler.profile import atomic_write_json
from graphfit.profiler.synthetic import training_like
from graphfit.remat import baselines, checkmate, checkmate_lp, simulator
from graphfit.remat.pipeline import resident_outputs
from graphfit.remat.validate import InfeasibleBudgetError, minimum_budget_bytes, replay_plan

__all__ = ["main", "activation_heavy", "planners_at", "zoo"]

RESULTS = RESULTS_DIR
RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
PLANNERS = ("milp", "checkmate_lp", "chen_sqrt_n", "chen_greedy", "dtr", "offline")
PRESET_GRAPHS = (("mlp", "activations"), ("resnet", "activations"),
                 ("transformer", "activations"))
# Above this many ops the (coarsened) MILP finds nothing useful in its time limit.
MILP_MAX_OPS = 300
ZOO_MODELS = ("mlp", "cifarnet", "resnet", "inception_v3", "gnmt_v2", "transformer")
ZOO_RATIOS = (0.9, 0.7, 0.5)
TRAINING_LIKE_SIZES = (60, 120, 200)
BATCH_FACTOR = 32
# HiGHS solves Checkmate's model (a stage per decision op) within the time limit up to about
# this many stages; larger graphs advance the frontier several ops per stage (see
# remat.checkmate.checkmate_milp), which is optimal only under that restriction.
MILP_MAX_STAGES = 30
# Ops of profiler.synthetic.training_like whose outputs are batch-sized activations.
_ACTIVATION_ROLES = ("input", "matmul", "bias", "relu", "residual", "relu_grad", "input_grad")
_WEIGHT_ROLES = ("w", "read", "update")


def activation_heavy(graph: CostGraph, batch_factor: int = BATCH_FACTOR) -> CostGraph:
    """A ``training_like`` graph with its batch scaled by ``batch_factor``: activation outputs
    and every batch-dependent op's compute grow, weights and their updates do not. Variable
    reads become 0-byte aliases of the variable, as TF allocates them (``remat.tf_memory``)."""
    specs = []
    for spec in graph.to_specs():
        role = spec.name.rsplit("/", 1)[-1]
        if role in _ACTIVATION_ROLES:
            spec.output_bytes = [b * batch_factor for b in spec.output_bytes]
        if role == "read":
            spec.output_bytes = [0] * len(spec.output_bytes)
        if role not in _WEIGHT_ROLES:
            spec.compute_us *= batch_factor
        specs.append(spec)
    return CostGraph.from_ops(specs)


def _model_graph(name: str, **knobs) -> tuple[CostGraph, list[int], dict]:
    """The profiled, TF-calibrated planning graph of a model, its step outputs and config."""
    from graphfit import models
    from graphfit.profiler.trace import profile_graph
    from graphfit.remat.tf_memory import tf_memory_model

    item = models.build(name, **knobs)
    profile = profile_graph(item, steps=4, warmup=2, trace_every=2, progress=None)
    graph = tf_memory_model(item, profile).plan_graph
    return graph, resident_outputs(graph, item.loss), {"model": name, **knobs,
                                                        "costs": "profiled"}


def _run(planner: str, graph: CostGraph, budget: int, outputs: list[int],
         time_limit_s: float) -> dict:
    """One planner at one budget: overhead and peak of its plan, or why there is none."""
    begin, cpu = time.perf_counter(), time.process_time()
    if planner == "milp" and graph.num_ops > MILP_MAX_OPS:
        return {"skipped": f"more than {MILP_MAX_OPS} ops"}
    try:
        if planner == "checkmate_lp":
            plan = checkmate_lp.checkmate_lp(graph, budget, outputs=outputs)
        elif planner == "milp":
            plan = checkmate.checkmate_milp(graph, budget, time_limit_s=time_limit_s,
                                            outputs=outputs, max_stages=MILP_MAX_STAGES)
        elif planner == "chen_sqrt_n":
            plan = baselines.chen_sqrt_n(graph, outputs=outputs)
        elif planner == "chen_greedy":
            plan = baselines.chen_greedy(graph, budget, outputs=outputs)
        else:
            plan = simulator.simulate(graph, budget, planner, outputs=outputs)
    except (InfeasibleBudgetError, simulator.RematError, checkmate.NoScheduleFoundError) as error:
        return {"error": type(error).__name__, "message": str(error)[:300],
                "seconds": time.perf_counter() - begin, "cpu_seconds": time.process_time() - cpu}
    seconds = time.perf_counter() - begin
    replay = replay_plan(graph, plan, outputs)
    row = {"overhead": replay.overhead, "peak_bytes": replay.peak_bytes,
           "recomputes": replay.num_recomputes, "seconds": seconds,
           "cpu_seconds": time.process_time() - cpu,
           "within_budget": replay.peak_bytes <= budget}
    if planner == "milp":
        row.update({k: plan.stats[k] for k in ("status", "bound_overhead", "mip_gap",
                                                "num_stages", "coarsened", "num_binaries",
                                                "num_constraints")})
    if planner == "checkmate_lp":
        row.update({k: plan.stats[k] for k in (
            "lp_overhead", "lp_is_bound", "rounded_overhead", "grouped", "num_decision_ops",
            "num_stages", "num_variables", "num_constraints", "num_nonzeros",
            "requested_nonzeros_estimate", "fill_order", "build_s", "lp_s",
            "lp_solves", "rounding", "budget_scale")})
    return row


def planners_at(graph: CostGraph, outputs: list[int], ratios=RATIOS,
                time_limit_s: float = 20.0) -> dict:
    """Every planner at every budget ratio of ``graph``'s checkpoint-all peak."""
    peak = baselines.checkpoint_all(graph, outputs=outputs).peak_bytes
    result = {"num_ops": graph.num_ops, "baseline_peak_bytes": peak,
              "minimum_bytes": minimum_budget_bytes(graph, outputs=outputs),
              "baseline_compute_us": float(graph.compute_us.sum()), "budgets": []}
    for ratio in ratios:
        budget = int(ratio * peak)
        rows = {p: _run(p, graph, budget, outputs, time_limit_s) for p in PLANNERS}
        result["budgets"].append({"ratio": ratio, "budget_bytes": budget, "planners": rows})
    return result


def _cell(row: dict) -> str:
    if "skipped" in row:
        return "-"
    if "error" in row:
        return {"InfeasibleBudgetError": "infeas.", "BudgetTooSmallError": "infeas.",
                "NoScheduleFoundError": "no sol.", "ThrashError": "thrash",
                "OutOfMemoryError": "oom"}.get(row["error"], row["error"])
    if not row["within_budget"]:
        return f"({row['peak_bytes'] / 2**20:.0f}M)"
    text = f"{row['overhead']:.3f}"
    if row.get("lp_overhead") is not None:
        text += f"{'≥' if row['lp_is_bound'] else '~'}{row['lp_overhead']:.3f}"
    if row.get("status") == "time_limit":
        text += f"≥{row['bound_overhead']:.3f}"
    return text + ("*" if row.get("coarsened") else "")


def _write_table(name: str, table: str) -> None:
    """Write a text table under ``RESULTS`` through a temporary file and a rename (no half
    file for a reader)."""
    path = os.path.join(RESULTS, name)
    with open(path + ".tmp", "w") as f:
        f.write(table + "\n")
    os.replace(path + ".tmp", path)


def _table(results: dict) -> str:
    lines = ["overhead (compute with recomputation / without) at budget = ratio x checkpoint-all "
             "peak;", "milp 'a≥b': time limit hit, incumbent a, HiGHS lower bound b; 'no sol.': "
             "HiGHS found no schedule in the time limit;",
             f"'*': coarsened model (at most {MILP_MAX_STAGES} stages; optimal, and bounds, "
             "for that model only); '(NM)': the plan's peak (MiB) is over budget;",
             "checkmate_lp 'a≥b': rounded plan a, LP lower bound b; 'a~b': LP grouped (its "
             "value b bounds nothing); '-': not run (milp above "
             f"{MILP_MAX_OPS} ops);",
             "infeas.: below the minimum budget (or proved infeasible); oom/thrash: the DTR "
             "simulation failed", ""]
    header = f"{'graph':<24}{'ops':>5}{'ratio':>6}  " + "".join(f"{p:>16}" for p in PLANNERS)
    lines.append(header)
    for name, graph in results["graphs"].items():
        for entry in graph["budgets"]:
            cells = "".join(f"{_cell(entry['planners'][p]):>16}" for p in PLANNERS)
            lines.append(f"{name:<24}{graph['num_ops']:>5}{entry['ratio']:>6.2f}  {cells}")
    return "\n".join(lines)


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = results["graphs"]
    fig, axes = plt.subplots(1, len(graphs), figsize=(4 * len(graphs), 3.6), squeeze=False)
    for ax, (name, graph) in zip(axes[0], graphs.items()):
        for color, planner in enumerate(PLANNERS):  # one color per planner in every panel
            points = [(e["ratio"], e["planners"][planner]["overhead"]) for e in graph["budgets"]
                      if e["planners"][planner].get("within_budget")]
            ax.plot(*(zip(*points) if points else ([], [])), marker="o", color=f"C{color}",
                    label=planner)
        bounds = [(e["ratio"], e["planners"]["milp"]["bound_overhead"]) for e in graph["budgets"]
                  if e["planners"]["milp"].get("bound_overhead") is not None]
        if bounds:
            ax.plot(*zip(*bounds), "k--", linewidth=1, label="milp bound")
        lp = [(e["ratio"], e["planners"]["checkmate_lp"]["lp_overhead"]) for e in graph["budgets"]
              if e["planners"]["checkmate_lp"].get("lp_is_bound")]
        if lp:
            ax.plot(*zip(*lp), "k:", linewidth=1, label="LP bound")
        ax.set_title(f"{name} ({graph['num_ops']} ops)")
        ax.set_xlabel("budget / checkpoint-all peak")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("compute overhead")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)
    plt.close(fig)


def main(time_limit_s: float = 20.0) -> dict:
    """Run the benchmark; write JSON, PNG and a text table under ``out/bench``."""
    begin = time.perf_counter()
    graphs: dict[str, tuple[CostGraph, list[int], dict]] = {}
    graphs["mlp"] = _model_graph("mlp", preset="tiny", batch_size=2048, depth=24, width=128)
    graphs["resnet"] = _model_graph("resnet", preset="tiny", batch_size=32)
    for model, preset in PRESET_GRAPHS:
        graphs[f"{model}/{preset}"] = _model_graph(model, preset=preset)
    for size in TRAINING_LIKE_SIZES:
        graph = activation_heavy(training_like(size, seed=size))
        graphs[f"training_like_{size}"] = (
            graph, resident_outputs(graph, "loss"),
            {"generator": "training_like", "num_ops": size, "seed": size,
             "batch_factor": BATCH_FACTOR, "costs": "synthetic"})
    results = {"time_limit_s": time_limit_s, "ratios": list(RATIOS), "planners": list(PLANNERS),
               "graphs": {}}
    for name, (graph, outputs, config) in graphs.items():
        print(f"remat_milp: {name} ({graph.num_ops} ops)", flush=True)
        results["graphs"][name] = {"config": config, **planners_at(graph, outputs, RATIOS,
                                                                   time_limit_s)}
    results["seconds"] = time.perf_counter() - begin
    table = _table(results)
    atomic_write_json(os.path.join(RESULTS, "remat_milp.json"), results)
    _plot(results, os.path.join(RESULTS, "remat_milp.png"))
    _write_table("remat_milp.txt", table)
    print(table)
    print(f"remat_milp: {results['seconds']:.0f} s")
    return results


def _lp_cells(lp: dict) -> str:
    """The LP's size and times, its value, the rounded and the filled plan's overhead."""
    if "lp_s" not in lp:
        return f"{'':>48}{lp['seconds']:>7.1f}{'':>8}{'':>8}{_cell(lp):>8}"
    shape = ("full" if not lp["grouped"]
             else f"/{lp['num_decision_ops'] / lp['num_stages']:.1f}")
    value = f"{'≥' if lp['lp_is_bound'] else '~'}{lp['lp_overhead']:.3f}"
    plan = f"{lp['overhead']:.3f}" if lp["within_budget"] else _cell(lp)
    return (f"{shape:>6}{lp['num_decision_ops']:>7}{lp['num_stages']:>7}"
            f"{lp['num_variables']:>9}{lp['num_nonzeros']:>9}{lp['build_s']:>7.1f}"
            f"{lp['lp_s']:>7.1f}{lp['lp_solves']:>3}"
            f"{lp['seconds']:>7.1f}{value:>8}{lp['rounded_overhead']:>8.3f}{plan:>8}")


def _zoo_table(rows: list[dict]) -> str:
    """The zoo benchmark's table: one line per graph and budget ratio."""
    lines = ["checkmate_lp on each zoo graph: 'full' = one stage per decision op (the LP relaxes "
             "Checkmate's MILP: its value '≥v' is a lower bound),",
             "'/k' = k decision ops per group (a coarsened LP: its value '~v' bounds nothing); "
             "decision ops, stages, LP columns and nonzeros,",
             "LP build time, HiGHS time (all solves, and how many) and total planning time (s); "
             "LP value, the best phase-1/2 "
             "rounding, the plan after greedy filling; dtr, offline.",
             f"{'graph':<24}{'ops':>6}{'ratio':>6}{'LP':>6}{'dec.':>7}{'stages':>7}{'cols':>9}"
             f"{'nnz':>9}{'build':>7}{'lp s':>7}{'#':>3}{'tot s':>7}{'LP':>8}{'rounded':>8}{'plan':>8}{'dtr':>9}"
             f"{'offline':>9}"]
    for row in rows:
        lines.append(f"{row['graph']:<24}{row['num_ops']:>6}{row['ratio']:>6.2f}"
                     f"{_lp_cells(row['planners']['checkmate_lp'])}"
                     f"{_cell(row['planners']['dtr']):>9}{_cell(row['planners']['offline']):>9}")
    return "\n".join(lines)


def zoo(models=ZOO_MODELS, ratios=ZOO_RATIOS) -> dict:
    """``checkmate_lp`` beside ``dtr`` and ``offline`` on every zoo model's presets."""
    from graphfit.models import PRESETS

    begin, load = time.perf_counter(), os.getloadavg()  # the machine may be shared
    rows = []
    for model in models:
        for preset in ("default", "activations"):
            if preset not in PRESETS[model]:
                continue
            graph, outputs, _ = _model_graph(model, preset=preset)
            peak = baselines.checkpoint_all(graph, outputs=outputs).peak_bytes
            for ratio in ratios:
                runs = {p: _run(p, graph, int(ratio * peak), outputs, 60.0)
                        for p in ("checkmate_lp", "dtr", "offline")}
                rows.append({"graph": f"{model}/{preset}", "num_ops": graph.num_ops,
                             "ratio": ratio, "planners": runs})
                print(f"remat_lp_zoo: {model}/{preset} ({graph.num_ops} ops) {ratio}: "
                      + "  ".join(f"{p} {_cell(r)}" for p, r in runs.items())
                      + f"  ({runs['checkmate_lp']['seconds']:.1f} s)", flush=True)
    table = _zoo_table(rows)
    results = {"ratios": list(ratios), "rows": rows, "seconds": time.perf_counter() - begin,
               "max_nonzeros": checkmate_lp.MAX_NONZEROS, "load_average": load,
               "load_average_end": os.getloadavg()}
    atomic_write_json(os.path.join(RESULTS, "remat_lp_zoo.json"), results)
    _write_table("remat_lp_zoo.txt", table)
    print(table)
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zoo"]:
        zoo()
    else:
        main(*(float(a) for a in sys.argv[1:2]))
