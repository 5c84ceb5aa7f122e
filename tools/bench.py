"""``make bench``: run every benchmark, one after another, and index their results.

Each benchmark module writes its own JSON (and plots) under ``bench/results/``; this driver
runs them in a fixed order, times them, and writes ``bench/results/index.json`` naming the
machine they ran on, so README numbers can be traced to a run.

    python -m tools.bench                 # all
    python -m tools.bench ir placement    # some, by name
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time

from profiler.profile import atomic_write_json

BENCHMARKS = {
    "ir": "tools.bench_ir",
    "remat_traces": "tools.bench_remat_traces",
    "remat_milp": "tools.bench_remat_milp",
    "placement": "tools.bench_placement",
}


def machine() -> dict:
    """What the numbers were measured on."""
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    index = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "runs": {}}
    for name in names or list(BENCHMARKS):
        print(f"== benchmark {name} ==", flush=True)
        begin = time.perf_counter()
        importlib.import_module(BENCHMARKS[name]).main()
        index["runs"][name] = {"seconds": round(time.perf_counter() - begin, 1)}
        atomic_write_json("bench/results/index.json", index)


if __name__ == "__main__":
    main(sys.argv[1:])
