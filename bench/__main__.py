"""``make bench``: run every benchmark, one after another, and index their results.

Each benchmark module writes its own JSON (and plots) under ``out/bench/``; this driver
runs them in a fixed order, times them, and records in ``out/bench/index.json`` when and on
what machine each ran, so README numbers can be traced to a run.

    python -m graphfit.bench                 # all
    python -m graphfit.bench ir placement    # some, by name
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.profile import atomic_write_json

INDEX_PATH = f"{RESULTS_DIR}/index.json"
BENCHMARKS = {
    "ir": "graphfit.bench.ir",
    "remat_traces": "graphfit.bench.remat_traces",
    "remat_milp": "graphfit.bench.remat_milp",
    "remat_lp_zoo": "graphfit.bench.remat_lp_zoo",
    "placement": "graphfit.bench.placement",
    "loops": "graphfit.bench.loops",
    "reach": "graphfit.bench.reach",
    "planning_time": "graphfit.bench.planning_time",
    "grappler": "graphfit.bench.grappler",
    "side_by_side": "graphfit.bench.side_by_side",
}


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version()}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    runs = {}
    if os.path.exists(INDEX_PATH):  # a partial run keeps the other benchmarks' entries
        with open(INDEX_PATH) as f:
            runs = json.load(f)["runs"]
    for name in names or list(BENCHMARKS):
        print(f"== benchmark {name} ==", flush=True)
        begin = time.perf_counter()
        importlib.import_module(BENCHMARKS[name]).main()
        runs[name] = {"seconds": round(time.perf_counter() - begin, 1),
                      "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine()}
        atomic_write_json(INDEX_PATH, {"runs": runs})


if __name__ == "__main__":
    main(sys.argv[1:])
