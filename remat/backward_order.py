"""A backward-pass order for the planner: the ready op that adds the fewest bytes first.

``remat.rewrite`` chains the backward pass in the plan's order (from the first op that reads
an activation, or the first recomputation), so the planner may choose that order: any
topological order of the ops from there on is one TF will run. The order TF's executor
happened to start the ops in, in the traced step a memory model was calibrated on, is one such
order, and a poor one to plan on: it interleaves independent gradient branches, keeping
several large tensors alive at once. On a Keras attention step (2 blocks, seq 128, batch 16,
Adam) at 0.5 of its peak, six traced orders planned (``offline``) 1.231-1.359, and the same
six with their backward passes reordered here 1.185-1.198 (``bench.reach``,
2026-12-05 03:26).

The order is greedy, as a list scheduler for memory: among the ops whose predecessors have
all run, run the one whose outputs allocate the fewest bytes minus the bytes of its inputs it
is the last reader of (which it frees); ties go to the earlier op of the given order. Ops
before ``start`` keep their order.
"""

from __future__ import annotations

import heapq

import numpy as np

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.tf_memory import MemoryModel

__all__ = ["memory_greedy_order", "reorder_backward"]


def memory_greedy_order(graph: CostGraph, start: int) -> list[int]:
    """Op ids ``0 .. start - 1``, then the others in the greedy order (module docstring).

    Parameters:
        graph: a cost graph (its op ids are a topological order).
        start: the first op id to reorder.

    Returns:
        A topological order of all of ``graph``'s ops.
    """
    n = graph.num_ops
    run = np.zeros(n, dtype=bool)
    run[:start] = True
    inputs = [sorted(set(graph.op_inputs(i).tolist())) for i in range(n)]
    readers_left = np.zeros(graph.num_tensors, dtype=np.int64)
    for i in range(start, n):
        readers_left[inputs[i]] += 1
    waiting = np.array([sum(not run[p] for p in graph.predecessors(i)) for i in range(n)])
    sizes = graph.tensor_bytes
    gains: dict[int, int] = {}           # ready op -> bytes it would add now
    heap: list[tuple[int, int]] = []

    def make_ready(i: int) -> None:
        gains[i] = (int(sizes[graph.op_outputs(i)].sum()) -
                    sum(int(sizes[t]) for t in inputs[i] if readers_left[t] == 1))
        heapq.heappush(heap, (gains[i], i))

    for i in range(start, n):
        if not waiting[i]:
            make_ready(i)
    order = list(range(start))
    while heap:
        gain, i = heapq.heappop(heap)
        if gains.get(i) != gain:         # an entry from before its gain changed
            continue
        del gains[i]
        run[i] = True
        order.append(i)
        for t in inputs[i]:
            readers_left[t] -= 1
            if readers_left[t] == 1:     # its last reader now frees it: cheaper to run
                last = next(int(j) for j in graph.tensor_consumers(t) if not run[j])
                if last in gains:
                    make_ready(last)
        for j in graph.successors(i):
            waiting[j] -= 1
            if not waiting[j]:
                make_ready(j)
    return order


def reorder_backward(item: GraphItem, model: MemoryModel) -> MemoryModel:
    """``model`` with its planning graph's ops renumbered in ``memory_greedy_order`` after
    the node of the backward pass's first read of an activation (``remat.rewrite.
    backward_start`` in the traced order), where the rewrite's chain begins at the latest;
    ``model`` itself if the step has no backward pass.

    Everything before that node keeps its traced order, and the node stays where it was:
    ops placed before it would not be chained, and ``remat.step_time`` takes the chain's
    start from the traced step, where the op before the chain in plan order has ended (with
    the reordering starting at the node itself, a BatchNorm moving-average update TF ran last
    came before the chain, and the zoo resnet's step was predicted 1.83 of the user's,
    measured 1.18)."""
    from graphfit.remat.rewrite import backward_start

    first_read = backward_start(item, model.cost_graph, range(model.cost_graph.num_ops))
    if first_read is None:
        return model
    op = model.cost_graph.index[first_read]
    first = next(node for node, ops in enumerate(model.members) if op in ops)
    # That node stays first, so the chain starts where it did, after the same ops.
    order = memory_greedy_order(model.plan_graph, first + 1)
    old = model.plan_graph
    specs = old.to_specs()
    graph = CostGraph.from_ops([specs[i] for i in order])
    if list(graph.names) != [specs[i].name for i in order]:
        raise AssertionError("reorder_backward postcondition: the planning graph's ids do "
                             "not follow the order")
    new_id = {node: k for k, node in enumerate(order)}

    def tensor(t: int) -> int:
        return int(graph.output_offset[new_id[int(old.tensor_producer[t])]] +
                   old.tensor_port[t])

    return MemoryModel(model.cost_graph, graph, [model.members[i] for i in order],
                       {new_id[node]: [tensor(t) for t in tensors]
                        for node, tensors in model.reuses.items()})
