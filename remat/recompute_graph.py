"""The cost graph of a step that executes a rematerialization plan: one node per (re)computation.

A plan (``remat.plan``) says in which order a step computes, recomputes and frees; the placer
and the schedule simulator read a ``CostGraph``. ``recompute_graph`` unrolls a plan into the
graph the rewritten step will run, on the IR alone, so a search over budgets and placements
(``pipeline.joint``) can simulate many plans without building a TensorFlow graph for each:

- the ``k``-th recomputation of op ``n`` is a node ``remat.rewrite.clone_name(n, k)`` with the
  op's costs (its persistent bytes stay with the original: constants are never cloned);
- every node reads the newest version of each input at its position in the plan, the rule
  ``remat.rewrite`` lowers plans with, so an original tensor whose later readers all moved to
  a clone dies after its last remaining reader;
- the rewrite's ``"tail"`` ordering edges: from the backward pass's first read of a tensor the
  forward pass computed (or the first recomputation, if earlier) on, each node waits for the
  node of the previous plan event, so the backward pass runs in plan order.

A clone is free to go to any device (TF gives a copied NodeDef no colocation of its own),
unless its op was explicitly colocated with another op.

``take_over_buffers`` then writes in the buffers TF hands from a tensor to its only reader,
which the unrolled plan creates where the backward pass moved to a clone.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np

from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, RematPlan

__all__ = ["RecomputeGraph", "recompute_graph", "take_over_buffers", "viewed", "clone_name",
           "original_name"]

_CLONE_SUFFIX = re.compile(r"/remat_\d+(?=/|$)")
# Per batch-norm op type, its output that holds the activation's workspace when Grappler's
# remapper runs it with its Relu as one kernel (``_FusedBatchNormEx``; 1/8 of the activation
# with oneDNN) and is empty when it runs alone (``take_over_buffers``).
_FUSED_WORKSPACE_PORT = {"FusedBatchNormV3": 5}


def clone_name(op_name: str, version: int) -> str:
    """Name of the ``version``-th recomputation (1-based) of op ``op_name``."""
    return f"{op_name}/remat_{version}"


def original_name(name: str) -> str:
    """``clone_name``'s inverse: the op a clone recomputes; for a node the rewrite names after
    a clone (``<clone>/fusion_done``), the original's node of that name."""
    return _CLONE_SUFFIX.sub("", name)


@dataclasses.dataclass
class RecomputeGraph:
    """A plan unrolled into a cost graph.

    Attributes:
        graph: one node per compute / recompute event of the plan.
        source: per node of ``graph`` (by id), ``(op id in the planned graph, version)``;
            version 0 is the first computation, ``k`` the ``k``-th recomputation.
    """

    graph: CostGraph
    source: list[tuple[int, int]]


def _backward_start(graph: CostGraph, plan: RematPlan, loss: str | None) -> int | None:
    """The first op computed outside the loss's fan-in that reads a tensor the forward pass
    computed (not a constant, feed or variable read); ``None``: no loss or no such op."""
    name = loss.split(":")[0] if loss else None
    if name not in graph.index:
        return None
    forward, stack = set(), [graph.index[name]]
    while stack:
        i = stack.pop()
        if i not in forward:
            forward.add(i)
            stack.extend(graph.predecessors(i))
    from_variable = graph.is_variable[graph.tensor_producer]
    computed = {i for i in forward if (~from_variable[graph.op_inputs(i)]).any()}
    for kind, i in plan.events:
        if kind == COMPUTE and i not in forward and any(
                int(graph.tensor_producer[t]) in computed for t in graph.op_inputs(i)):
            return i
    return None


def recompute_graph(graph: CostGraph, plan: RematPlan, loss: str | None = None
                    ) -> RecomputeGraph:
    """The cost graph of the step that runs ``plan`` (module docstring).

    Parameters:
        graph: the graph ``plan`` was made for (e.g. ``MemoryModel.plan_graph``).
        plan: its compute / recompute / free events.
        loss: the loss tensor's name: where the forward pass ends, for the ordering edges.

    Returns:
        The ``RecomputeGraph``.

    Raises:
        ValueError: the plan recomputes an op before computing it.

    Examples:
        >>> from graphfit.remat.plan import Event
        >>> g = CostGraph.from_ops([OpSpec("a", "X", output_bytes=[8], compute_us=1),
        ...                         OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[8]),
        ...                         OpSpec("c", "X", inputs=[("a", 0), ("b", 0)])])
        >>> plan = RematPlan([Event("compute", 0), Event("compute", 1), Event("free", 0),
        ...                   Event("recompute", 0), Event("compute", 2)], 16, 16, 1, 2, "x")
        >>> unrolled = recompute_graph(g, plan)
        >>> unrolled.graph.names, unrolled.source
        (['a', 'b', 'a/remat_1', 'c'], [(0, 0), (1, 0), (0, 1), (2, 0)])
        >>> [unrolled.graph.tensor_name(t) for t in unrolled.graph.op_inputs(3)]
        ['a/remat_1:0', 'b:0']
    """
    backward_start = _backward_start(graph, plan, loss)
    newest: dict[int, str] = {}            # op id -> name of the node holding its newest version
    versions: dict[int, int] = {}
    specs, source = [], []
    previous, pinning = None, False
    for kind, i in plan.events:
        if kind == FREE:
            continue
        name = graph.names[i]
        if kind == RECOMPUTE:
            if i not in newest:
                raise ValueError(f"the plan recomputes {name!r} before computing it")
            versions[i] += 1
            name = clone_name(name, versions[i])
        else:
            versions[i] = 0
        inputs = [(newest[int(graph.tensor_producer[t])], int(graph.tensor_port[t]))
                  for t in graph.op_inputs(i)]
        pinning = pinning or kind == RECOMPUTE or i == backward_start
        controls = [graph.names[int(c)] for c in graph.control_inputs(i)]   # as rewrite keeps them
        if pinning and previous is not None and previous not in {p for p, _ in inputs}:
            controls.append(previous)
        group = graph.colocation_groups[i]
        specs.append(OpSpec(
            name=name, op_type=graph.op_types[i], inputs=inputs,
            control_inputs=sorted(set(controls)), output_bytes=graph.output_bytes(i).tolist(),
            compute_us=float(graph.compute_us[i]), temp_bytes=int(graph.temp_bytes[i]),
            persistent_bytes=int(graph.persistent_bytes[i]) if kind == COMPUTE else 0,
            device=graph.devices[i],
            colocation_group=group if kind == COMPUTE or group != graph.names[i] else name,
            is_stateful=bool(graph.is_stateful[i]), is_random=bool(graph.is_random[i]),
            is_variable=bool(graph.is_variable[i]),
            reads_resource=bool(graph.reads_resource[i]), measured=bool(graph.measured[i])))
        source.append((i, versions[i]))
        newest[i] = name
        previous = name
    unrolled = CostGraph.from_ops(specs)
    position = {spec.name: k for k, spec in enumerate(specs)}
    order = np.array([position[name] for name in unrolled.names], dtype=np.int64)
    return RecomputeGraph(unrolled, [source[k] for k in order.tolist()])


def take_over_buffers(unrolled: RecomputeGraph, planned: CostGraph,
                      reuses: Mapping[int, Sequence[int]]) -> RecomputeGraph:
    """``unrolled`` with each buffer TF hands from a tensor to its last reader written in.

    TF's element-wise kernels write their output into an input's buffer when they hold its
    last reference; ``reuses`` (``remat.tf_memory.MemoryModel.reuses``: per node of
    ``planned``, the tensors of ``planned`` whose buffer it took over in the traced step)
    names the pairs. In the unrolled step TF does the same wherever the reader runs after
    every other reader of the tensor: it is the only one left (the backward pass reads a
    clone), or every other reader is its ancestor (the rewrite pins the backward pass in plan
    order). The buffer stays the producer's allocation, charged to the producer's device
    until the reader's output dies. Counted as a new buffer on the reader's device, the pair
    is held twice while the reader runs and on the wrong device after it (the zoo resnet on
    four 10.5 MiB devices: 10.34 MiB planned, 8.35 MiB measured on one of them; its residual
    gradient is handed along four ``AddN``s, 2026-12-06). So the reader's output becomes a
    view of the tensor, as ``remat.tf_memory`` writes identities: 0 bytes, every reader of
    the view also reads the tensor, and the reader joins the producer's colocation group (a
    take-over across devices is nothing to plan on). A reader of several outputs, or one
    whose output is not the tensor's size, is left as it is.

    A ``Relu`` listed as taking a batch norm's output over may be one Grappler's remapper ran
    inside the batch norm (``remat.tf_memory._fused_into_producer``): the fused kernel also
    allocates an activation workspace, ``reserve_space_3``, which the model was calibrated
    with. The remapper fuses the pair only where the ``Relu`` is the output's only reader; a
    batch norm whose output the unrolled plan reads twice (a ``Relu`` recomputed twice from
    one kept clone) runs unfused and allocates no workspace, so it is counted as 0 bytes (256
    KiB planned and not measured on a 4.5 MiB device of the zoo resnet, -5.4%, 2026-12-07).
    """
    import networkx as nx

    graph = unrolled.graph
    specs = graph.to_specs()
    readers: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    for k, spec in enumerate(specs):
        for source in set(spec.inputs):
            readers[source].append(k)
    views: dict[tuple[str, int], tuple[str, int]] = {}
    unfused = set()                     # workspace outputs the unfused kernel does not allocate
    for k, (spec, (node, _)) in enumerate(zip(specs, unrolled.source)):
        wanted = {(int(planned.tensor_producer[t]), int(planned.tensor_port[t]))
                  for t in reuses.get(node, ())}
        for producer, port in spec.inputs:
            p = graph.index[producer]
            if (unrolled.source[p][0], port) not in wanted:
                continue
            workspace = _FUSED_WORKSPACE_PORT.get(graph.op_types[p].split("+")[-1])
            if (port == 0 and len(readers[(producer, port)]) > 1 and workspace is not None
                    and workspace < len(specs[p].output_bytes)):
                unfused.add((p, workspace))
            if (len(spec.output_bytes) == 1 and not spec.fetched_outputs
                    and spec.output_bytes[0] == graph.output_bytes(p)[port]
                    and _runs_last(graph, k, readers[(producer, port)])):
                views[(spec.name, 0)] = (producer, port)
                break
    if not views and not unfused:
        return unrolled
    for p, workspace in unfused:
        specs[p].output_bytes[workspace] = 0
    groups = nx.utils.UnionFind(graph.colocation_groups)
    by_name = {spec.name: spec for spec in specs}
    for (reader, _), (producer, _) in views.items():
        by_name[reader].output_bytes = [0]
        groups.union(by_name[producer].colocation_group, by_name[reader].colocation_group)
    for spec in specs:
        sources = [tuple(source) for source in spec.inputs]
        spec.inputs = sources + sorted({viewed(views, s) for s in sources if s in views}
                                       - set(sources))
        spec.colocation_group = groups[spec.colocation_group]
    source_of = dict(zip(graph.names, unrolled.source))
    taken = CostGraph.from_ops(specs)
    return RecomputeGraph(taken, [source_of[name] for name in taken.names])


def viewed(views: Mapping[tuple[str, int], tuple[str, int]], tensor: tuple[str, int]
           ) -> tuple[str, int]:
    """The tensor whose buffer ``tensor`` is, through any number of views (``views``: a view
    -> the tensor it shows)."""
    while tensor in views:
        tensor = views[tensor]
    return tensor


def _runs_last(graph: CostGraph, reader: int, readers: Sequence[int]) -> bool:
    """Whether every op of ``readers`` other than ``reader`` is an ancestor of ``reader``."""
    others = set(readers) - {reader}
    if not others:
        return True
    if max(others) > reader:        # node ids are a topological order
        return False
    seen, stack = {reader}, [reader]
    while stack and others:
        for p in graph.predecessors(stack.pop()):
            if p not in seen:
                seen.add(p)
                others.discard(p)
                stack.append(p)
    return not others
