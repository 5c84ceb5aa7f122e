"""Fusion: merge the ops of each group into placement units without creating a cycle.

A fused unit is placed and scheduled as one task, which shrinks the graph the placers and
m-SCT's LP see (Baechi, Jeon et al., SoCC 2020, §3.3 "operator fusion"). Merging two ops of a
group is unsafe when a path leaves one and re-enters the other through ops outside the unit:
the fused unit would then depend on itself. Baechi avoided that with a conservative in/out-degree
test; this module uses an exact test.

Ops are visited in topological order and each joins an existing unit of its group or starts a
new one. Every unit then holds only ops already visited, so the new op has no successors yet,
and adding op ``j`` to unit ``U`` closes a cycle exactly when ``U`` already reaches (through
other units) some unit holding a predecessor of ``j``. That reachability is searched
depth-first over the units built so far; a search that would visit more than
``search_limit`` units is treated as "reaches" (the merge is refused, which is always safe).
Refused ops start a new unit of the same group, so a group may become several units; the
placers still keep a group on one device. The result is checked acyclic when the
``UnitGraph`` is built.
"""

from __future__ import annotations

import numpy as np

from graphfit.baechi.units import UnitGraph
from graphfit.profiler.cost_graph import CostGraph

__all__ = ["fuse"]


def _reaches(start: int, targets: set[int], successors: list[set[int]], limit: int) -> bool:
    """Whether unit ``start`` reaches a unit of ``targets``; True when the search exceeds
    ``limit`` visited units (the caller then refuses the merge)."""
    seen = {start}
    stack = [start]
    while stack:
        for v in successors[stack.pop()]:
            if v in targets:
                return True
            if v not in seen:
                if len(seen) >= limit:
                    return True
                seen.add(v)
                stack.append(v)
    return False


def fuse(graph: CostGraph, groups: np.ndarray, search_limit: int = 512) -> UnitGraph:
    """Fuse each group's ops into as few acyclic placement units as the exact test allows.

    Parameters:
        graph: the cost graph.
        groups: group id per op (``baechi.grouping``); units never span groups.
        search_limit: largest number of units one cycle check may visit before it refuses.

    Returns:
        The ``UnitGraph``; ``unit_of_op`` maps every original op to its unit, ``ops(u)`` back.

    Raises:
        UnitGraphError: never for a valid input (the units are acyclic by construction); it
            is the postcondition check of ``UnitGraph``.

    Examples:
        >>> from graphfit.profiler.cost_graph import CostGraph, OpSpec
        >>> g = CostGraph.from_ops([
        ...     OpSpec("a", "X", output_bytes=[4], compute_us=1),
        ...     OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[4], compute_us=1),
        ...     OpSpec("c", "X", inputs=[("a", 0), ("b", 0)], compute_us=1)])
        >>> fuse(g, [0, 1, 0]).unit_of_op.tolist()  # {a, c} would depend on b and feed it
        [0, 1, 2]
        >>> fuse(g, [0, 0, 0]).unit_of_op.tolist()
        [0, 0, 0]
    """
    groups = np.asarray(groups, dtype=np.int64)
    group_list = groups.tolist()
    unit_of = [-1] * graph.num_ops
    unit_group: list[int] = []
    successors: list[set[int]] = []
    latest_of_group: dict[int, int] = {}
    for j in range(graph.num_ops):
        pred_units = {unit_of[p] for p in graph.predecessors(j)}
        g = group_list[j]
        # Prefer joining a predecessor's unit (saves a transfer), then the group's newest unit.
        candidates = sorted((u for u in pred_units if unit_group[u] == g), reverse=True)[:2]
        latest = latest_of_group.get(g)
        if latest is not None and latest not in candidates:
            candidates.append(latest)
        chosen = next((u for u in candidates
                       if not _reaches(u, pred_units - {u}, successors, search_limit)), -1)
        if chosen == -1:
            chosen = len(successors)
            successors.append(set())
            unit_group.append(g)
            latest_of_group[g] = chosen
        unit_of[j] = chosen
        for u in pred_units:
            if u != chosen:
                successors[u].add(chosen)
    return UnitGraph(graph, np.array(unit_of, dtype=np.int64), groups)
