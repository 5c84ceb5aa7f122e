"""Benchmark: how fast and how lean is building the IR for large graphs?

For generated graphs of 1k, 10k and 50k ops it times two paths and records their memory:
- ``from_tf``: ``cost_graph_from_graph`` on a real ``tf.Graph`` (every op a TF op with static
  shapes; no profile, so every cost is estimated — the slowest path);
- ``from_ops``: ``CostGraph.from_ops`` on the same ops as specs (what the algorithms' own
  generators and the DTR log reader use).

Target (issue #2): the 50k-op graph builds in under 3 s and under 1 GiB.
Writes ``out/bench/ir_build.json`` and prints a table.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc

import tensorflow as tf

from graphfit.bench import RESULTS_DIR
from graphfit.profiler.cost_graph import CostGraph
from graphfit.profiler.profile import atomic_write_json
from graphfit.profiler.synthetic import random_dag
from graphfit.profiler.tf_import import cost_graph_from_graph

__all__ = ["main", "tf_graph_of"]

SIZES = (1_000, 10_000, 50_000)
REPEATS = 3
RESULT_PATH = f"{RESULTS_DIR}/ir_build.json"


def tf_graph_of(cost_graph: CostGraph, width: int = 256) -> tuple[tf.Graph, list[str]]:
    """A real TF graph with ``cost_graph``'s structure: sources become placeholders, ops with
    one input ``Relu``, with more ``AddN``. Returns the graph and its sink ops (the fetches)."""
    graph = tf.Graph()
    with graph.as_default():
        tensors = []
        for i in range(cost_graph.num_ops):
            inputs = [tensors[cost_graph.tensor_producer[t]] for t in cost_graph.op_inputs(i)]
            name = cost_graph.names[i]
            if not inputs:
                out = tf.compat.v1.placeholder(tf.float32, [64, width], name=name)
            elif len(inputs) == 1:
                out = tf.nn.relu(inputs[0], name=name)
            else:
                out = tf.math.add_n(inputs, name=name)
            tensors.append(out)
    sinks = [cost_graph.names[i] for i in range(cost_graph.num_ops)
             if not cost_graph.successors(i)]
    return graph, sinks


def _measure(build) -> dict:
    """Median seconds over REPEATS builds, and the Python heap peak of one build."""
    seconds = []
    for _ in range(REPEATS):
        begin = time.perf_counter()
        result = build()
        seconds.append(time.perf_counter() - begin)
    tracemalloc.start()
    build()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds_median": statistics.median(seconds), "seconds": seconds,
            "heap_peak_bytes": peak, "ops": result.num_ops}


def main() -> dict:
    rows = []
    for size in SIZES:
        spec_graph = random_dag(size, seed=size)
        specs = spec_graph.to_specs()
        graph, sinks = tf_graph_of(spec_graph)
        rows.append({"size": size,
                     "from_tf": _measure(lambda: cost_graph_from_graph(graph, sinks)),
                     "from_ops": _measure(lambda: CostGraph.from_ops(specs))})
        print(f"IR {size:>6} ops: from tf.Graph {rows[-1]['from_tf']['seconds_median']:.2f} s "
              f"(heap {rows[-1]['from_tf']['heap_peak_bytes'] / 2**20:.0f} MiB), from specs "
              f"{rows[-1]['from_ops']['seconds_median']:.2f} s "
              f"(heap {rows[-1]['from_ops']['heap_peak_bytes'] / 2**20:.0f} MiB)", flush=True)
    result = {"benchmark": "ir_build", "repeats": REPEATS, "rows": rows}
    atomic_write_json(RESULT_PATH, result)
    return result


if __name__ == "__main__":
    main()
