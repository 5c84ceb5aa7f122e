"""Benchmark: how fast and how good are the placers, under both link models and tight memory,
and does the planned step time match a real run?

Sections (``out/bench/placement.json``, plot ``out/bench/placement.png``):

- ``quality``: generated graphs (layered, random, training-like and fork-join families, 500
  to 20,000 ops) on 4 devices with Baechi's GPU link fit (0.0001754 µs/B + 134 µs) and
  ample memory. Per graph, placer and link model the placer planned with: wall and CPU seconds,
  makespan / lower bound in the planning model, and the same placement judged in the other link
  model (lower bound = max(critical path, compute / devices)).
- ``tight``: at a per-device limit of 1.1 x (sequential peak / 4) (sequential peak: the whole
  step in op order on one device, liveness model), per graph, placer and link model: placed or
  not, makespan / lower bound, the peak of an independent replay of the placement (devices,
  order, send gates, waits) against the limit; and m-TOPO's own tightest limit (bisected) with
  its makespan there, and the placer's makespan over that one. ``floor`` is the largest
  single-op working set (inputs + output) / (sequential peak / 4), ``colive_floor`` the
  co-live lower bound (``baechi.memory.colive_lower_bound_bytes``) / (sequential peak / 4):
  no placement can go below either.
- ``variants``: the ``tight`` measurements on other members of the generated families, 4
  seeds each (``VARIANTS``: narrow and wide layers, random windows of 50, 200 and 2,000, fork-join
  with few short branches and with many, training-like with dense residuals), 1,000-2,000
  ops, both placers and both link models.
- ``lower_bound``: layered and training-like graphs of 8,000 ops at 1.25 x (sequential peak
  / 4) and, where there are variables, at 1.25 x (sequential peak less the persistent bytes /
  4), m-ETF and m-SCT with
  contention: placed (and the replay's peak) or refused, beside the co-live lower bound.
- ``scale``: m-ETF and m-SCT on 100,000-op graphs (training-like, layered, random), each in a
  fresh process, with wall and CPU seconds and the process's peak RSS.
- ``planned_vs_measured``: small models profiled on one device, placed with m-ETF on a local TF
  gRPC cluster (2 workers) and on 4 virtual CPU devices under each link model, run, and the
  planned makespan set beside the measured median step time and beside the prediction: the
  same placement simulated with the target's ``RuntimeCosts`` (fixed step cost, per-op cost,
  cores), measured on the target just before (``baechi.calibrate``; under ``calibration``).

The machine is shared: wall times are noisy, CPU seconds less so; see ``index.json``.

    python -m graphfit.bench.placement                  # all sections (about 2 hours)
    python -m graphfit.bench.placement tight --quick    # some sections, graphs <= 2k ops
    python -m graphfit.bench.placement variants         # the variant sweep (~10 min)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from graphfit.bench import RESULTS_DIR
from graphfit.baechi.devices import LINK_MODELS, DeviceSet, default_device_names  # noqa: E402
from graphfit.baechi.memory import colive_lower_bound_bytes  # noqa: E402
from graphfit.baechi.place import (METHODS, PlacementError, makespan_lower_bound_us,  # noqa: E402
                                   place)
from graphfit.baechi.schedule import simulate  # noqa: E402
from graphfit.baechi.units import UnitGraph  # noqa: E402
from graphfit.profiler.profile import atomic_write_json  # noqa: E402
from graphfit.profiler.synthetic import (fork_join, layered, random_dag,  # noqa: E402
                                         training_like)

__all__ = ["main"]

RESULT_PATH = f"{RESULTS_DIR}/placement.json"
PLOT_PATH = f"{RESULTS_DIR}/placement.png"
NUM_DEVICES = 4
COMM_COEFFS = "0.0001754,134"
TIGHT_RATIO = 1.1
SIZES = (500, 2_000, 8_000, 20_000)
QUICK_SIZES = (500, 2_000)
SCALE_OPS = 100_000
# The ``lower_bound`` section: 8k-op graphs at this ratio of two bases, the sequential peak
# and the sequential peak less the persistent bytes (issue 33's refused case: variables
# counted as the graph gives them, the limit from the rest).
BOUND_RATIO = 1.25
BOUND_GRAPHS = ("layered", "training_like")
BOUND_OPS = 8_000
BISECTION_STEPS = 7
# The families: layered (256 ops a layer), random (each op reads 1-3 of the 500 ops before
# it), training-like and fork-join (64 branches a stage) have live sets much larger than one
# op's working set; the random family with its default window (50) is the exception kept to
# show the floor.
FAMILIES = {
    "layered": lambda n: layered(n, seed=0, width=256),
    "random": lambda n: random_dag(n, seed=0, window=500),
    "training_like": lambda n: training_like(n, seed=0),
    "fork_join": lambda n: fork_join(n, seed=0),
}
# Other members of the families, at 1,000-2,000 ops (the ``variants`` section), per seed.
VARIANTS = {
    "layered_w64": lambda seed: layered(2_000, seed=seed, width=64),
    "layered_w1024": lambda seed: layered(2_000, seed=seed, width=1024),
    "random_w50": lambda seed: random_dag(2_000, seed=seed, window=50),
    "random_w200": lambda seed: random_dag(2_000, seed=seed, window=200),
    "random_w2000": lambda seed: random_dag(2_000, seed=seed, window=2_000),
    "fork_join_b16_short": lambda seed: fork_join(1_000, seed=seed, branches=16,
                                                   branch_ops=(1, 4)),
    "fork_join_b128": lambda seed: fork_join(2_000, seed=seed, branches=128, branch_ops=(1, 8)),
    "training_like_res2": lambda seed: training_like(1_000, seed=seed, residual_every=2),
}
VARIANT_SEEDS = (0, 1, 2, 3)
EXTRA_GRAPHS = {
    "random_window50_2k": lambda: random_dag(2_000, seed=0),
}
# Planned vs measured: (model, preset) pairs small enough for a 2-core machine.
RUN_MODELS = (("mlp", "tiny"), ("resnet", "tiny"))
# Transfer fit of the local gRPC cluster (tools/communication_benchmark.py --transport=grpc);
# bench/results/communication.json overrides it when that run was on gRPC.
GRPC_COEFFS = "0.000762,403"


def _devices(memory="64GiB", link_model=None) -> DeviceSet:
    return DeviceSet.uniform(default_device_names(NUM_DEVICES), memory, COMM_COEFFS,
                             link_model=link_model)


def _graphs(sizes):
    for family, make in FAMILIES.items():
        for n in sizes:
            yield f"{family}_{n}", make(n)


def sequential_peak_bytes(graph) -> int:
    """Peak bytes of the whole step run in op order on one device (liveness model)."""
    units = UnitGraph.singletons(graph, np.zeros(graph.num_ops, dtype=np.int64))
    return int(simulate(units, _devices(), np.zeros(graph.num_ops, dtype=np.int64))
               .peak_bytes[0])


def working_set_floor_bytes(graph) -> int:
    """The largest inputs + outputs + temporary bytes of one op: a device running it holds
    at least that."""
    return max(int(graph.tensor_bytes[graph.op_inputs(i)].sum() + graph.output_bytes(i).sum()
                   + graph.temp_bytes[i]) for i in range(graph.num_ops))


def _timed_place(graph, devices, **options):
    wall, cpu = time.perf_counter(), time.process_time()
    p = place(graph, devices, **options)
    return p, time.perf_counter() - wall, time.process_time() - cpu


def _quality(label, graph) -> list[dict]:
    rows = []
    lower = makespan_lower_bound_us(graph, NUM_DEVICES)
    for method in METHODS:
        for link_model in LINK_MODELS:
            p, wall, cpu = _timed_place(graph, _devices(link_model=link_model), method=method)
            other = next(m for m in LINK_MODELS if m != link_model)
            row = {"graph": label, "num_ops": graph.num_ops, "method": method,
                   "link_model": link_model, "wall_s": wall, "cpu_s": cpu,
                   "makespan_us": p.makespan_us, "over_lower_bound": p.makespan_us / lower,
                   f"judged_in_{other}_over_lower_bound": p.simulate(other).makespan_us / lower,
                   "lp_solve_s": p.unit_schedule.info.get("lp_solve_s")}
            rows.append(row)
            print(f"{label:>20} {method:>6} {link_model:>10} {wall:7.2f} s (cpu {cpu:6.2f}) "
                  f"{row['over_lower_bound']:6.3f} (in {other}: "
                  f"{row[f'judged_in_{other}_over_lower_bound']:6.3f})", flush=True)
    return rows


def _m_topo_tightest(graph, seq: int, link_model: str) -> tuple[float, float | None]:
    lo, hi = 0.0, 4.0
    best = None
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        try:
            best = place(graph, _devices(int(mid * seq / NUM_DEVICES), link_model),
                         method="m_topo").makespan_us
            hi = mid
        except PlacementError:
            lo = mid
    return hi, best


def _tight(label, graph) -> list[dict]:
    seq = sequential_peak_bytes(graph)
    limit = int(TIGHT_RATIO * seq / NUM_DEVICES)
    floor = working_set_floor_bytes(graph) / (seq / NUM_DEVICES)
    colive = colive_lower_bound_bytes(graph, NUM_DEVICES)[0] / (seq / NUM_DEVICES)
    lower = makespan_lower_bound_us(graph, NUM_DEVICES)
    ops = UnitGraph.singletons(graph, np.arange(graph.num_ops))
    rows = []
    for link_model in LINK_MODELS:
        topo_ratio, topo_makespan = _m_topo_tightest(graph, seq, link_model)
        for method in METHODS:
            devices = _devices(limit, link_model)
            row = {"graph": label, "num_ops": graph.num_ops, "method": method,
                   "link_model": link_model, "ratio": TIGHT_RATIO, "limit_bytes": limit,
                   "sequential_peak_bytes": seq, "floor": floor, "colive_floor": colive,
                   "m_topo_tightest_ratio": topo_ratio,
                   "m_topo_makespan_at_tightest_us": topo_makespan}
            try:
                p, wall, cpu = _timed_place(graph, devices, method=method)
                replay = simulate(ops, devices, p.device_index, p.schedule.order,
                                  **p.schedule.replay_options())
                row.update(placed=True, wall_s=wall, cpu_s=cpu, makespan_us=p.makespan_us,
                           over_lower_bound=p.makespan_us / lower,
                           over_m_topo=p.makespan_us / topo_makespan if topo_makespan else None,
                           replay_peak_over_limit=float(replay.peak_bytes.max() / limit),
                           repair_step=bool(p.unit_schedule.info.get("memory_first")),
                           attempts=p.unit_schedule.info.get("placement_attempts"))
            except PlacementError as e:
                row.update(placed=False, error=str(e)[:300])
            rows.append(row)
            what = (f"makespan/LB {row['over_lower_bound']:6.3f} (/m_topo's "
                    f"{row['over_m_topo'] or float('nan'):.3f}) replay peak/limit "
                    f"{row['replay_peak_over_limit']:.3f} repair {row['repair_step']} "
                    f"{row['wall_s']:.1f} s" if row["placed"] else "not placed")
            print(f"{label:>20} {link_model:>10} {method:>6} @{TIGHT_RATIO} (floor {floor:.2f},"
                  f" m_topo tightest {topo_ratio:.2f}): {what}", flush=True)
    return rows


def _lower_bound(label, graph) -> list[dict]:
    """Place at ``BOUND_RATIO`` x each base / 4 with m-ETF and m-SCT (contention), replay what
    places, and set the co-live lower bound (``baechi.memory.colive_lower_bound_bytes``)
    beside the limit: a refusal under a limit below the bound is no placer's fault."""
    seq = sequential_peak_bytes(graph)
    bound, at = colive_lower_bound_bytes(graph, NUM_DEVICES)
    ops = UnitGraph.singletons(graph, np.arange(graph.num_ops))
    rows = []
    bases = {"sequential_peak": seq}
    if graph.persistent_bytes.any():
        bases["sequential_peak_less_persistent"] = seq - int(graph.persistent_bytes.sum())
    for base, base_bytes in bases.items():
        limit = int(BOUND_RATIO * base_bytes / NUM_DEVICES)
        for method in ("m_etf", "m_sct"):
            devices = _devices(limit, "contention")
            row = {"graph": label, "num_ops": graph.num_ops, "method": method,
                   "link_model": "contention", "base": base, "ratio": BOUND_RATIO,
                   "limit_bytes": limit, "colive_bound_bytes": bound,
                   "colive_bound_at": graph.names[at], "bound_over_limit": bound / limit}
            try:
                p, wall, cpu = _timed_place(graph, devices, method=method)
                replay = simulate(ops, devices, p.device_index, p.schedule.order,
                                  **p.schedule.replay_options())
                row.update(placed=True, wall_s=wall, cpu_s=cpu,
                           replay_peak_over_limit=float(replay.peak_bytes.max() / limit))
                what = f"placed, replay peak/limit {row['replay_peak_over_limit']:.3f}"
            except PlacementError as e:
                row.update(placed=False, error=str(e)[:300])
                what = "not placed"
            rows.append(row)
            print(f"{label:>20} {method:>6} at {BOUND_RATIO} x {base} / {NUM_DEVICES}: {what}; "
                  f"co-live bound / limit {row['bound_over_limit']:.3f} (at "
                  f"{row['colive_bound_at']})", flush=True)
    return rows


def _scale_child(family: str, method: str, link_model: str, queue) -> None:
    graph = FAMILIES[family](SCALE_OPS)
    p, wall, cpu = _timed_place(graph, _devices(link_model=link_model), method=method)
    queue.put({"graph": f"{family}_{SCALE_OPS}", "num_ops": graph.num_ops, "method": method,
               "link_model": link_model, "wall_s": wall, "cpu_s": cpu,
               "over_lower_bound": p.makespan_us / makespan_lower_bound_us(graph, NUM_DEVICES),
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _scale() -> list[dict]:
    """Each placement in a fresh process, so its peak RSS is its own."""
    context = multiprocessing.get_context("spawn")
    rows = []
    for family in ("training_like", "layered", "random"):
        for method in ("m_etf", "m_sct"):
            for link_model in LINK_MODELS:
                queue = context.Queue()
                child = context.Process(target=_scale_child,
                                        args=(family, method, link_model, queue))
                child.start()
                row = queue.get()
                child.join()
                rows.append(row)
                print(f"{row['graph']:>20} {method:>6} {link_model:>10} {row['wall_s']:7.2f} s "
                      f"(cpu {row['cpu_s']:6.2f}) {row['over_lower_bound']:6.3f} x LB, peak RSS "
                      f"{row['peak_rss_mib']:.0f} MiB", flush=True)
    return rows


def _planned_vs_measured() -> tuple[list[dict], list[dict]]:
    """Profile each small model on one device, place it on a gRPC cluster and on virtual CPU
    devices under each link model, run it, and compare planned makespan, predicted and
    measured step time. Returns (rows, the targets' calibrations)."""
    from graphfit import models
    from graphfit.baechi.calibrate import calibrate_runtime
    from graphfit.baechi.place_and_run import place_item
    from graphfit.baechi.cluster import LocalCluster
    from graphfit.baechi.run import local_target, measure_placed_run
    from graphfit.profiler.trace import profile_graph

    grpc_coeffs = GRPC_COEFFS
    if os.path.exists("bench/results/communication.json"):
        with open("bench/results/communication.json") as f:
            measured = json.load(f)
        if measured.get("transport") == "grpc":
            link = measured["default"]
            grpc_coeffs = f"{link['a_us_per_byte']},{link['b_us']}"
    rows, calibrations = [], []
    for name, preset in RUN_MODELS:
        item = models.build(name, preset=preset)
        profile = profile_graph(item, steps=6, warmup=2, trace_every=2, progress=None)
        single = float(np.median(profile.step_time_us))
        with LocalCluster(2, startup_timeout_s=600) as cluster:  # TF imports slowly when loaded
            targets = [(cluster.run_target, grpc_coeffs), (local_target(NUM_DEVICES), "0,0")]
            for target, coeffs in targets:
                runtime, raw = calibrate_runtime(target)
                calibrations.append({"model": name, "target": target.kind,
                                     **runtime.to_json(), **raw})
                print(f"{target.kind:>11}: {runtime} ({raw['chains_at_once']:.2f} chains at "
                      "once)", flush=True)
                for link_model in LINK_MODELS:
                    devices = DeviceSet.uniform(list(target.devices), "64GiB", coeffs,
                                                link_model=link_model)
                    placed, placement = place_item(item, devices, profile, method="m_etf")
                    run = measure_placed_run(placed, target, steps=12, warmup=2, trace_every=4)
                    row = {"model": name, "preset": preset, "target": target.kind,
                           "link_model": link_model, "comm_cost_coeffs": coeffs,
                           "planned_ms": placement.makespan_us / 1e3,
                           "predicted_ms": placement.predict(runtime).makespan_us / 1e3,
                           "measured_ms": run.step_time_ms_median,
                           "single_device_measured_ms": single / 1e3,
                           "sum_of_op_times_ms": float(placement.graph.compute_us.sum()) / 1e3,
                           "transfers": len(placement.schedule.transfer_tensor),
                           "ops_per_device": placement.summary()["ops_per_device"]}
                    row["measured_over_planned"] = row["measured_ms"] / row["planned_ms"]
                    row["measured_over_predicted"] = row["measured_ms"] / row["predicted_ms"]
                    rows.append(row)
                    print(f"{name:>8} {target.kind:>11} {link_model:>10}: planned "
                          f"{row['planned_ms']:8.2f} ms, predicted {row['predicted_ms']:8.2f} ms,"
                          f" measured {row['measured_ms']:8.2f} ms "
                          f"({row['measured_over_planned']:.2f}x planned, "
                          f"{row['measured_over_predicted']:.2f}x predicted); one device "
                          f"{row['single_device_measured_ms']:.2f} ms, ops sum "
                          f"{row['sum_of_op_times_ms']:.2f} ms, {row['transfers']} transfers",
                          flush=True)
    return rows, calibrations


def _plot(result: dict) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    quality = [r for r in result["quality"] if r["graph"].split("_")[0] in FAMILIES]
    for method in METHODS:
        for link_model, style in zip(LINK_MODELS, ("-", "--")):
            pts = sorted((r["num_ops"], r["wall_s"]) for r in quality
                         if r["method"] == method and r["link_model"] == link_model
                         and r["graph"].startswith("layered"))
            if pts:
                axes[0].plot(*zip(*pts), style, marker="o", label=f"{method} {link_model}")
    axes[0].set(xscale="log", yscale="log", xlabel="ops", ylabel="placement wall time (s)",
                title="layered graphs, 4 devices")
    axes[0].legend(fontsize=7)
    labels = sorted({r["graph"] for r in result["quality"]},
                    key=[r["graph"] for r in result["quality"]].index)
    width = 0.8 / (len(METHODS) * len(LINK_MODELS))
    k = 0
    for method in METHODS:
        for link_model in LINK_MODELS:
            values = [next((r["over_lower_bound"] for r in result["quality"]
                            if r["graph"] == g and r["method"] == method
                            and r["link_model"] == link_model), 0) for g in labels]
            axes[1].bar([i + k * width for i in range(len(labels))], values, width,
                        label=f"{method} {link_model}")
            k += 1
    axes[1].set_xticks([i + 0.4 for i in range(len(labels))])
    axes[1].set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    axes[1].set(ylabel="makespan / lower bound", ylim=(0.9, None),
                title="planned in its own link model")
    axes[1].legend(fontsize=6)
    runs = result.get("planned_vs_measured", [])
    names = [f"{r['model']} {r['target']} {r['link_model']}" for r in runs]
    ys = np.arange(len(runs))
    axes[2].barh(ys, [r["planned_ms"] for r in runs], height=0.27, label="planned")
    axes[2].barh(ys + 0.27, [r.get("predicted_ms", 0) for r in runs], height=0.27,
                 label="predicted (calibrated)")
    axes[2].barh(ys + 0.54, [r["measured_ms"] for r in runs], height=0.27, label="measured")
    axes[2].set_yticks(ys + 0.27)
    axes[2].set_yticklabels(names)
    axes[2].set(xlabel="step (ms)", xscale="log", title="planned vs measured (m-ETF)")
    axes[2].tick_params(axis="y", labelsize=7)
    axes[2].legend(fontsize=7)
    tight = result.get("tight", [])
    graphs = sorted({r["graph"] for r in tight}, key=[r["graph"] for r in tight].index)
    placers = [(m, lm) for m in METHODS if m != "m_topo" for lm in LINK_MODELS]
    width = 0.8 / len(placers)
    for k, (method, link_model) in enumerate(placers):
        values = [next((r.get("over_m_topo") or 0 for r in tight if r["graph"] == g
                        and r["method"] == method and r["link_model"] == link_model), 0)
                  for g in graphs]
        axes[3].bar([i + k * width for i in range(len(graphs))], values, width,
                    label=f"{method} {link_model}")
    axes[3].axhline(1.0, color="black", linewidth=0.8)
    axes[3].set_xticks([i + 0.4 for i in range(len(graphs))])
    axes[3].set_xticklabels(graphs, rotation=30, ha="right", fontsize=7)
    axes[3].set(ylabel="makespan / m-TOPO's at its tightest limit",
                title=f"at {TIGHT_RATIO} x (sequential peak / {NUM_DEVICES}) (0: not placed)")
    axes[3].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(PLOT_PATH, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the sections named in ``argv`` (default: all), print tables, write JSON and plot.
    ``--quick``: graphs up to 2,000 ops only."""
    argv = list(argv or [])
    quick = "--quick" in argv
    sections = [a for a in argv if a != "--quick"] or ["quality", "tight", "variants",
                                                       "lower_bound", "scale",
                                                       "planned_vs_measured"]
    sizes = QUICK_SIZES if quick else SIZES
    began = time.perf_counter()
    result = {section: [] for section in sections}
    if "quality" in sections:
        for label, graph in list(_graphs(sizes)) + [(k, f()) for k, f in EXTRA_GRAPHS.items()]:
            result["quality"] += _quality(label, graph)
    if "tight" in sections:
        for label, graph in list(_graphs(sizes)) + [
                ("random_window50_2k", EXTRA_GRAPHS["random_window50_2k"]())]:
            result["tight"] += _tight(label, graph)
    if "variants" in sections:
        for name, make in VARIANTS.items():
            for seed in VARIANT_SEEDS:
                result["variants"] += _tight(f"{name}_s{seed}", make(seed))
    if "lower_bound" in sections:
        for family in BOUND_GRAPHS:
            result["lower_bound"] += _lower_bound(f"{family}_{BOUND_OPS}",
                                                  FAMILIES[family](BOUND_OPS))
    if "scale" in sections:
        result["scale"] = _scale()
    if "planned_vs_measured" in sections:
        result["planned_vs_measured"], result["calibration"] = _planned_vs_measured()
    merged = {"quality": [], "tight": [], "variants": [], "lower_bound": [], "scale": [],
              "planned_vs_measured": [], "calibration": []}
    if os.path.exists(RESULT_PATH):  # a partial run keeps the other sections' results
        with open(RESULT_PATH) as f:
            merged.update({k: v for k, v in json.load(f).items() if k in merged})
    merged.update(result, num_devices=NUM_DEVICES, comm_cost_coeffs=COMM_COEFFS,
                  tight_ratio=TIGHT_RATIO)
    merged.update(section_s={"+".join(sections): time.perf_counter() - began})
    atomic_write_json(RESULT_PATH, merged)
    _plot(merged)
    print(f"wrote {RESULT_PATH} and {PLOT_PATH} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
