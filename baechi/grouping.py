"""Groupers: which ops must (or should) share a device.

- ``tf_colocation_groups``: what TensorFlow's placer enforces. Ops with the same colocation
  group (``_class = loc:@op``) share a device, and so does every op that reads a resource
  produced by a variable op (TF colocates resource consumers with the resource).
- ``coplacement_groups``: Baechi's co-placement on top of that: an op whose outputs feed a
  single consumer op joins that consumer's group, transitively (to a fixpoint), so a chain of
  single-consumer ops never pays a transfer between its links. Unlike a literal reading of
  Baechi, an op already tied to a TF colocation group (e.g. a variable's read) does not drag
  its group along: on real training graphs that chains every variable group through the
  layers (986 of Inception-V3's 1939 ops, 57 of the MLP's 82 ended in one group, and the
  fused placement lost 2x in step time).

Both return dense group ids (0..G-1, numbered by first op) per op id.

References:
    Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020, §3.3
    (grouping: colocation and co-placement).
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from graphfit.profiler.cost_graph import CostGraph

__all__ = ["tf_colocation_groups", "coplacement_groups", "GROUPERS", "groups_for"]

GROUPERS = ("tf", "coplace")
# TF also colocates every reader of a reference variable with it (the reader gets the ref).
_REF_VARIABLE_TYPES = frozenset({"VariableV2", "Variable"})


def _labels(uf: nx.utils.UnionFind, n: int) -> np.ndarray:
    """Dense group ids of ops ``0..n-1``, numbered in the order of each group's first op."""
    first: dict[int, int] = {}
    return np.array([first.setdefault(uf[x], len(first)) for x in range(n)], dtype=np.int64)


def _union_groups(graph: CostGraph, groups: np.ndarray | None) -> nx.utils.UnionFind:
    uf = nx.utils.UnionFind(range(graph.num_ops))
    if groups is not None:
        first: dict[int, int] = {}
        for i, g in enumerate(np.asarray(groups).tolist()):
            uf.union(first.setdefault(g, i), i)
    return uf


def tf_colocation_groups(graph: CostGraph) -> np.ndarray:
    """Group ids per op for the constraints TF's placer enforces.

    Ops sharing a ``colocation_groups`` label share a group; so do a variable op (``is_variable``)
    and every op reading one of its outputs as a resource (``reads_resource``, what TF enforces
    for resource handles; every reader of a reference variable ``VariableV2``). A reader without ``reads_resource`` (a weight buffer of a graph from
    another framework) is free to run elsewhere unless a colocation label ties it.

    Parameters:
        graph: the cost graph.

    Returns:
        int64 array of dense group ids, one per op.

    Examples:
        >>> from graphfit.profiler.cost_graph import CostGraph, OpSpec
        >>> g = CostGraph.from_ops([
        ...     OpSpec("w", "VarHandleOp", output_bytes=[8], is_variable=True),
        ...     OpSpec("read", "ReadVariableOp", inputs=[("w", 0)], output_bytes=[64],
        ...            reads_resource=True),
        ...     OpSpec("y", "MatMul", inputs=[("read", 0)], output_bytes=[64]),
        ...     OpSpec("z", "Relu", inputs=[("y", 0)], colocation_group="y")])
        >>> tf_colocation_groups(g).tolist()
        [0, 0, 1, 1]
    """
    uf = nx.utils.UnionFind(range(graph.num_ops))
    by_label: dict[str, int] = {}
    for i, label in enumerate(graph.colocation_groups):
        # most ops are labelled with their own name: no union (100k of them took 0.3 s)
        first = by_label.setdefault(label, i)
        if first != i:
            uf.union(first, i)
        j = graph.index.get(label)
        if j is not None and j != i:
            uf.union(j, i)
    for i in np.flatnonzero(graph.is_variable).tolist():
        for t in graph.op_outputs(i):
            for j in graph.tensor_consumers(t).tolist():
                if graph.reads_resource[j] or graph.op_types[i] in _REF_VARIABLE_TYPES:
                    uf.union(i, j)
    return _labels(uf, graph.num_ops)


def coplacement_groups(graph: CostGraph, groups: np.ndarray | None = None) -> np.ndarray:
    """Baechi's co-placement: an op with exactly one consumer op (data or control) that is
    alone in its starting group joins that consumer's group; applied transitively, so the
    result is a fixpoint.

    Parameters:
        graph: the cost graph.
        groups: groups to start from (default: ``tf_colocation_groups(graph)``).

    Returns:
        int64 array of dense group ids, one per op.

    Examples:
        >>> from graphfit.profiler.cost_graph import CostGraph, OpSpec
        >>> g = CostGraph.from_ops([
        ...     OpSpec("a", "X", output_bytes=[4]), OpSpec("b", "X", inputs=[("a", 0)],
        ...     output_bytes=[4]), OpSpec("c", "X", inputs=[("b", 0)]),
        ...     OpSpec("d", "X", inputs=[("b", 0)])])
        >>> coplacement_groups(g).tolist()  # a -> b only; b feeds two ops
        [0, 0, 1, 2]
    """
    if groups is None:
        groups = tf_colocation_groups(graph)
    uf = _union_groups(graph, groups)
    size = np.bincount(groups)[groups]
    for i in range(graph.num_ops):
        successors = graph.successors(i)
        if len(successors) == 1 and size[i] == 1:
            uf.union(i, successors[0])
    return _labels(uf, graph.num_ops)


def groups_for(graph: CostGraph, grouper: str) -> np.ndarray:
    """Group ids per op for a grouper name in ``GROUPERS``.

    Raises:
        ValueError: for an unknown grouper.
    """
    if grouper == "tf":
        return tf_colocation_groups(graph)
    if grouper == "coplace":
        return coplacement_groups(graph)
    raise ValueError(f"unknown grouper {grouper!r}; choose one of {GROUPERS}")
