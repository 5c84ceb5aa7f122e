"""Benchmark: every eviction heuristic on DTR's eight PyTorch traces, budgets 100% .. 10%.

For each trace of ``../shared/dtr-logs/logs.zip`` (read by ``remat.dtr_logs``), each planner of
``remat.simulator.PLANNERS`` and each budget ratio 1.0, 0.9, ..., 0.1, it plans the step with
the DTR simulator and records the overhead (compute with recomputation / without) or the failure (``oom``: nothing left to evict; ``thrash``: overhead
above 2x; ``below_minimum``: under the lower bound every plan needs). Once a planner fails on a
trace, its lower ratios are not run (``skipped``): they would fail the same way, slowly. The
``offline`` planner replays ``belady`` and ``dtr`` and keeps the cheaper plan; its rows are
assembled from those two runs by the same rule rather than planned a second time (its planning
time is measured on its own, on the largest trace).

Budget bases: ``results`` take ratios of DTR's baseline, as in DTR's paper and simulator: the
peak of a replay without a budget that frees each storage at the log's release events
(``remat.dtr_logs.release_peak_bytes``), so "0.5" there is DTR's "0.5". The project's own
checkpoint-all peak (frees at last use, ``remat.simulator.baseline_peak_bytes``) is lower (0.74
of it on TreeLSTM): ``results_project_basis`` take the same ratios of that peak, for ``dtr``,
``belady`` and the ``offline`` planner made of them. Each trace records both peaks, and
``project_ratio_per_ratio`` (release peak / checkpoint-all peak) converts a ratio of DTR's basis
into one of the project's. Every planned point records its planning time (``planning_s``).

Targets (issue #4): ``dtr`` reaches ratio 0.5 on all eight with overhead <= 1.2x; ``offline``
is at least as good as ``dtr`` everywhere and better somewhere; planning a budget of the largest
trace (~8k ops) takes < 10 s.

Writes ``out/bench/remat_traces.json``, ``out/bench/remat_traces.png`` (overhead vs
budget ratio per model, one line per planner) and prints a table. Runs on two processes.
"""

from __future__ import annotations

import functools
import multiprocessing
import statistics
import time

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.profile import atomic_write_json
from graphfit.remat.dtr_logs import (default_logs_path, load_traces, release_peak_bytes,
                                     trace_names)
from graphfit.remat.simulator import (OFFLINE_PORTFOLIO, PLANNERS, BudgetTooSmallError, OutOfMemoryError,
                             ThrashError, baseline_peak_bytes, minimum_budget_bytes, simulate)

__all__ = ["main", "run_planner"]

RATIOS = tuple(round(1.0 - 0.1 * k, 1) for k in range(10))
OVERHEAD_LIMIT = 2.0
TIMING_RATIOS = (0.5, 0.3, 0.2)
TIMING_REPEATS = 3
RESULT_PATH = f"{RESULTS_DIR}/remat_traces.json"
PLOT_PATH = f"{RESULTS_DIR}/remat_traces.png"


@functools.lru_cache(maxsize=None)
def _trace(name: str):
    trace = load_traces(names=[name])[name]
    return (trace, release_peak_bytes(trace),
            baseline_peak_bytes(trace.graph, outputs=trace.outputs))


def run_planner(name: str, planner: str, basis: str = "release_peak"
                ) -> tuple[str, str, str, dict, float]:
    """One planner on one trace at every ratio of a baseline (``basis``: "release_peak",
    DTR's, or "checkpoint_all", the project's): (name, planner, basis, ratio -> status,
    overhead, peak, planning time; seconds for all ratios)."""
    trace, release_peak, checkpoint_all = _trace(name)
    base = release_peak if basis == "release_peak" else checkpoint_all
    rows, failed = {}, None
    begin = time.perf_counter()
    for ratio in RATIOS:
        if failed:
            rows[str(ratio)] = {"status": "skipped"}
            continue
        try:
            plan = simulate(trace.graph, ratio * base, planner, outputs=trace.outputs,
                            overhead_limit=OVERHEAD_LIMIT)
            rows[str(ratio)] = {"status": "ok", "overhead": plan.overhead,
                                "recomputes": plan.num_recomputes, "peak_bytes": plan.peak_bytes,
                                "planning_s": plan.stats["planning_s"],
                                "chosen": plan.stats.get("chosen", planner)}
        except BudgetTooSmallError:
            failed = rows[str(ratio)] = {"status": "below_minimum"}
        except OutOfMemoryError:
            failed = rows[str(ratio)] = {"status": "oom"}
        except ThrashError as e:
            failed = rows[str(ratio)] = {"status": "thrash", "overhead": e.overhead}
    return name, planner, basis, rows, time.perf_counter() - begin


def _planning_times(name: str) -> dict:
    """Median planning seconds of dtr and offline on one trace at a few ratios."""
    trace, base, _ = _trace(name)
    times = {}
    for planner in ("dtr", "offline"):
        for ratio in TIMING_RATIOS:
            samples = []
            for _ in range(TIMING_REPEATS):
                begin = time.perf_counter()
                try:
                    simulate(trace.graph, ratio * base, planner, outputs=trace.outputs,
                             overhead_limit=OVERHEAD_LIMIT)
                except (OutOfMemoryError, ThrashError):
                    pass
                samples.append(time.perf_counter() - begin)
            times[f"{planner}@{ratio}"] = statistics.median(samples)
    return times


def _best_of(results: dict, planners) -> dict:
    """Per ratio, the row of the planner with the least compute (then the lowest peak), as
    the ``offline`` planner chooses; the first planner's failure when all fail."""
    best = {}
    for ratio in map(str, RATIOS):
        ok = [(results[p][ratio]["overhead"], results[p][ratio]["peak_bytes"], p)
              for p in planners if results[p][ratio]["status"] == "ok"]
        if ok:
            _, _, planner = min(ok)
            best[ratio] = dict(results[planner][ratio], chosen=planner)
        else:
            best[ratio] = results[planners[0]][ratio]
    return best


def _cell(row: dict) -> str:
    return {"ok": lambda: f"{row['overhead']:.3f}", "oom": lambda: "OOM",
            "thrash": lambda: "THR", "below_minimum": lambda: "MIN",
            "skipped": lambda: "-"}[row["status"]]()


def _min_ratio(rows: dict) -> float | None:
    ok = [float(r) for r, row in rows.items() if row["status"] == "ok"]
    return min(ok) if ok else None


def _targets(traces: dict, timing: dict) -> dict:
    dtr_half = {n: t["results"]["dtr"]["0.5"] for n, t in traces.items()}
    dtr_ok = all(r["status"] == "ok" and r["overhead"] <= 1.2 for r in dtr_half.values())
    worse, better = [], []
    for n, t in traces.items():
        for ratio in map(str, RATIOS):
            d, o = t["results"]["dtr"][ratio], t["results"]["offline"][ratio]
            d_ok, o_ok = d["status"] == "ok", o["status"] == "ok"
            if d_ok and (not o_ok or o["overhead"] > d["overhead"] + 1e-12):
                worse.append(f"{n}@{ratio}")
            if o_ok and (not d_ok or o["overhead"] < d["overhead"] - 1e-12):
                better.append(f"{n}@{ratio}")
    slowest = max(timing.values())
    return {"dtr_ratio_0.5_overhead_le_1.2_on_all": dtr_ok,
            "offline_never_worse_than_dtr": not worse, "offline_worse_at": worse,
            "offline_better_at": better,
            "planning_s_largest_trace_max": slowest, "planning_under_10s": slowest < 10.0}


def _plot(traces: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 8), sharex=True)
    for ax, (name, t) in zip(axes.flat, traces.items()):
        for planner, rows in t["results"].items():
            points = [(float(r), row["overhead"]) for r, row in rows.items()
                      if row["status"] == "ok"]
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", markersize=3, label=planner,
                        linewidth=2.2 if planner in ("dtr", "offline") else 1.0)
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0.98, OVERHEAD_LIMIT)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("budget / DTR's baseline peak (frees at release)")
    for ax in axes[:, 0]:
        ax.set_ylabel("compute overhead (x)")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("DTR traces: overhead vs memory budget (missing points: OOM or thrash > 2x)")
    fig.tight_layout()
    fig.savefig(PLOT_PATH, dpi=110)
    plt.close(fig)


def main() -> None:
    zip_path = default_logs_path()
    if not zip_path.exists():
        print(f"skipping: DTR logs not found at {zip_path}")
        return
    names = list(trace_names(zip_path))
    begin = time.perf_counter()
    # Longest traces first, so the two workers finish together.
    bases = (("release_peak", PLANNERS), ("checkpoint_all", OFFLINE_PORTFOLIO))
    jobs = [(n, p, basis) for n in sorted(names, key=lambda n: -_trace(n)[0].graph.num_ops)
            for basis, planners in bases for p in planners if p != "offline"]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.starmap(run_planner, jobs)
    traces = {}
    for name in names:
        trace, base, own = _trace(name)
        minimum = minimum_budget_bytes(trace.graph, outputs=trace.outputs)
        traces[name] = {"num_ops": trace.graph.num_ops, "ratio_basis": "release_peak",
                        "release_peak_bytes": base, "checkpoint_all_peak_bytes": own,
                        "project_ratio_per_ratio": base / own,
                        "minimum_bytes": minimum, "minimum_ratio": minimum / base,
                        "results": {}, "results_project_basis": {}, "sweep_s": {}}
    for name, planner, basis, rows, seconds in results:
        key = "results" if basis == "release_peak" else "results_project_basis"
        traces[name][key][planner] = rows
        traces[name]["sweep_s"][f"{planner}@{basis}"] = seconds
    for t in traces.values():
        for key in ("results", "results_project_basis"):
            t[key]["offline"] = _best_of(t[key], OFFLINE_PORTFOLIO)
    largest = max(names, key=lambda n: traces[n]["num_ops"])
    timing = _planning_times(largest)
    data = {"ratios": RATIOS, "ratio_basis": "results: DTR's, release_peak_bytes (peak freeing "
            "at the log's release events); results_project_basis: the project's checkpoint-all "
            "peak (frees at last use); project_ratio = ratio * release_peak / checkpoint-all peak",
            "overhead_limit": OVERHEAD_LIMIT, "traces": traces,
            "planning_time": {"trace": largest, "num_ops": traces[largest]["num_ops"],
                              "median_s": timing},
            "targets": _targets(traces, timing),
            "wall_s": time.perf_counter() - begin}
    atomic_write_json(RESULT_PATH, data)
    _plot(traces)
    header = "planner    " + " ".join(f"{r:>6}" for r in RATIOS) + "   min ratio"
    for name, t in traces.items():
        print(f"\n{name}: {t['num_ops']} ops, DTR baseline (release) peak "
              f"{t['release_peak_bytes'] / 2**20:,.0f} MiB, checkpoint-all peak "
              f"{t['checkpoint_all_peak_bytes'] / 2**20:,.0f} MiB (ratio r of DTR's = "
              f"{t['project_ratio_per_ratio']:.3f} r of ours), lower bound ratio "
              f"{t['minimum_ratio']:.2f}")
        for key, basis in (("results", "DTR's basis"),
                           ("results_project_basis", "project's basis")):
            print(f"{basis}: {header}")
            for planner, rows in t[key].items():
                low = _min_ratio(rows)
                slowest = max((row.get("planning_s", 0.0) for row in rows.values()), default=0)
                print(f"{' ' * len(basis)}  {planner:10s} "
                      + " ".join(f"{_cell(rows[str(r)]):>6}" for r in RATIOS)
                      + f"   {low if low is not None else '-':<5}  slowest point {slowest:.2f}s")
    print(f"\nplanning time, {largest} ({traces[largest]['num_ops']} ops), median of "
          f"{TIMING_REPEATS}: " + ", ".join(f"{k} {v:.2f}s" for k, v in timing.items()))
    print("targets:", {k: v for k, v in data["targets"].items() if not isinstance(v, list)})
    print(f"offline better than dtr at {len(data['targets']['offline_better_at'])} points, "
          f"worse at {data['targets']['offline_worse_at'] or 'none'}")
    print(f"wrote {RESULT_PATH} and {PLOT_PATH} in {data['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
