"""Placement units: the graph the placers schedule.

A unit is a set of ops of one colocation group that is placed and run as one task: one op per
unit for the ``default`` and ``colocation`` placers, a fused set of ops for the ``fusion`` placer
(``baechi.fusion``). A unit's compute time is the sum of its ops', its persistent bytes the sum,
its temporary bytes the largest op temporary plus the tensors that never leave the unit (they
live while the unit runs; Baechi counted only the temporary maximum, which under-counts fused
units). Its outputs are the distinct tensors leaving it; a control edge between two units becomes
a zero-byte "tensor" (a 4-byte transfer when it crosses devices, as in Baechi).

An output that *is* a persistent buffer (``CostGraph.tensor_persistent``) counts in its unit's
persistent bytes and not as a transient output (a copy sent to another device is transient
there); a fetched output (``CostGraph.tensor_fetched``) always leaves its unit and is held until
the step ends.

Arrays are indexed by unit id; units are numbered by their first op, so for a one-op-per-unit
partition unit ids equal op ids.
"""

from __future__ import annotations

import heapq

import numpy as np

from graphfit.errors import GraphfitError
from graphfit.profiler.cost_graph import CostGraph

__all__ = ["UnitGraph", "UnitGraphError", "CONTROL_EDGE_BYTES"]

CONTROL_EDGE_BYTES = 4  # what a cross-device control edge (or empty tensor) costs to send


class UnitGraphError(GraphfitError, ValueError):
    """A partition of a cost graph cannot form a unit graph (a cycle, or a unit across groups)."""


def _csr(keys: np.ndarray, values: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values sorted by key) for integer keys in [0, num_rows)."""
    order = np.argsort(keys, kind="stable")
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=num_rows), out=offsets[1:])
    return offsets, values[order]


class UnitGraph:
    """Units of a cost graph, with per-unit costs and the tensors that flow between units.

    Per unit ``u``: ``compute_us``, ``persistent_bytes``, ``temp_bytes``, ``output_bytes``
    (sum of its transient outputs), ``group`` (colocation group id: units of one group share a device),
    ``ops(u)`` (original op ids). Per unit tensor ``t``: ``tensor_bytes`` (0 for a control
    edge), ``tensor_producer`` (unit), ``tensor_op_tensor`` (the CostGraph tensor id, -1 for a
    control edge), ``consumers(t)`` (distinct units other than the producer). ``inputs(u)`` and
    ``outputs(u)`` are unit-tensor ids. ``topological_order`` lists all units.

    Raises:
        UnitGraphError: if a unit spans two groups or the units form a cycle.
    """

    def __init__(self, graph: CostGraph, unit_of_op: np.ndarray, group_of_op: np.ndarray):
        n_ops = graph.num_ops
        unit_of_op = np.asarray(unit_of_op, dtype=np.int64)
        # Renumber units by first op so ids are stable and, for singletons, equal op ids.
        _, first, inverse = np.unique(unit_of_op, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        unit = rank[inverse]
        n = len(first)
        self.graph = graph
        self.unit_of_op = unit
        self.num_units = n
        self._op_offset, self._ops = _csr(unit, np.arange(n_ops, dtype=np.int64), n)
        group_of_op = np.asarray(group_of_op, dtype=np.int64)
        self.group = np.empty(n, dtype=np.int64)
        self.group[unit] = group_of_op
        if (self.group[unit] != group_of_op).any():
            bad = int(np.flatnonzero(self.group[unit] != group_of_op)[0])
            raise UnitGraphError(f"op {graph.names[bad]!r} is fused with ops of another "
                                 "colocation group; units must not span groups")
        self.num_groups = int(self.group.max()) + 1 if n else 0
        self.compute_us = np.bincount(unit, weights=graph.compute_us, minlength=n)
        self.persistent_bytes = np.zeros(n, dtype=np.int64)
        np.add.at(self.persistent_bytes, unit, graph.persistent_bytes)
        self.temp_bytes = np.zeros(n, dtype=np.int64)
        np.maximum.at(self.temp_bytes, unit, graph.temp_bytes)

        # Data edges (op tensor, consumer op) -> (op tensor, consumer unit), cross-unit only.
        inputs = [graph.op_inputs(j) for j in range(n_ops)]
        lengths = np.fromiter((len(r) for r in inputs), dtype=np.int64, count=n_ops)
        edge_tensor = np.concatenate(inputs).astype(np.int64) if n_ops else np.zeros(0, np.int64)
        edge_consumer = unit[np.repeat(np.arange(n_ops), lengths)]
        edge_producer = unit[graph.tensor_producer[edge_tensor]]
        has_consumer = np.zeros(graph.num_tensors, dtype=bool)
        has_consumer[edge_tensor] = True
        cross = edge_consumer != edge_producer
        leaves = graph.tensor_fetched.copy()
        leaves[edge_tensor[cross]] = True
        persistent = graph.tensor_persistent
        np.add.at(self.persistent_bytes, unit[graph.tensor_producer[persistent]],
                  graph.tensor_bytes[persistent])
        internal = has_consumer & ~leaves & ~persistent
        np.add.at(self.temp_bytes, unit[graph.tensor_producer[internal]],
                  graph.tensor_bytes[internal])
        kept = np.flatnonzero(leaves | ~has_consumer)  # leaving the unit, or a graph output
        data_pairs = np.unique(np.stack([edge_tensor[cross], edge_consumer[cross]]), axis=1)

        # Control edges between units, minus pairs already joined by a tensor.
        ctrl = [(unit[i], unit[j]) for j in range(n_ops) for i in graph.control_inputs(j)]
        ctrl_pairs = {(int(a), int(b)) for a, b in ctrl if a != b}
        ctrl_pairs -= set(zip(unit[graph.tensor_producer[data_pairs[0]]].tolist(),
                              data_pairs[1].tolist()))
        ctrl_producers = sorted({a for a, _ in ctrl_pairs})

        n_data = len(kept)
        n_t = n_data + len(ctrl_producers)
        self.num_tensors = n_t
        self.tensor_op_tensor = np.concatenate([kept, -np.ones(len(ctrl_producers), np.int64)])
        self.tensor_bytes = np.concatenate(
            [graph.tensor_bytes[kept], np.zeros(len(ctrl_producers), np.int64)])
        self.tensor_producer = np.concatenate(
            [unit[graph.tensor_producer[kept]], np.array(ctrl_producers, dtype=np.int64)])
        no_ctrl = np.zeros(len(ctrl_producers), dtype=bool)
        self.tensor_persistent = np.concatenate([persistent[kept], no_ctrl])
        self.tensor_fetched = np.concatenate([graph.tensor_fetched[kept], no_ctrl])
        new_id = np.full(graph.num_tensors, -1, dtype=np.int64)
        new_id[kept] = np.arange(n_data)
        ctrl_id = {p: n_data + k for k, p in enumerate(ctrl_producers)}
        pair_t = np.concatenate([new_id[data_pairs[0]],
                                 np.array([ctrl_id[a] for a, _ in ctrl_pairs], np.int64)])
        pair_u = np.concatenate([data_pairs[1], np.array([b for _, b in ctrl_pairs], np.int64)])
        self._consumer_offset, self._consumers = _csr(pair_t, pair_u, n_t)
        self._input_offset, self._inputs = _csr(pair_u, pair_t, n)
        self._output_offset, self._outputs = _csr(self.tensor_producer,
                                                  np.arange(n_t, dtype=np.int64), n)
        self.output_bytes = np.bincount(
            self.tensor_producer, weights=np.where(self.tensor_persistent, 0, self.tensor_bytes),
            minlength=n).astype(np.int64)
        self.topological_order = self._topological_order(pair_t, pair_u)

    @classmethod
    def singletons(cls, graph: CostGraph, group_of_op: np.ndarray) -> "UnitGraph":
        """One unit per op (unit id = op id)."""
        return cls(graph, np.arange(graph.num_ops), group_of_op)

    def _topological_order(self, pair_t: np.ndarray, pair_u: np.ndarray) -> np.ndarray:
        src = self.tensor_producer[pair_t]
        edges = np.unique(np.stack([src, pair_u]), axis=1)
        indegree = np.bincount(edges[1], minlength=self.num_units).tolist()
        succ_offset, succ = _csr(edges[0], edges[1], self.num_units)
        succ_offset, succ = succ_offset.tolist(), succ.tolist()
        ready = [u for u in range(self.num_units) if indegree[u] == 0]
        order = []
        while ready:  # smallest id first: singletons keep the op order
            u = heapq.heappop(ready)
            order.append(u)
            for v in succ[succ_offset[u]:succ_offset[u + 1]]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    heapq.heappush(ready, v)
        if len(order) != self.num_units:
            stuck = next(u for u in range(self.num_units) if indegree[u] > 0)
            raise UnitGraphError(
                f"the units form a cycle through the unit of op {self.unit_name(stuck)!r}: "
                "this partition cannot be scheduled")
        self.edges = edges
        return np.array(order, dtype=np.int64)

    # -- adjacency ----------------------------------------------------------------------------
    def ops(self, u: int) -> np.ndarray:
        """Original op ids of unit ``u``, ascending (a topological order)."""
        return self._ops[self._op_offset[u]:self._op_offset[u + 1]]

    def inputs(self, u: int) -> np.ndarray:
        """Unit tensors unit ``u`` reads (distinct)."""
        return self._inputs[self._input_offset[u]:self._input_offset[u + 1]]

    def outputs(self, u: int) -> np.ndarray:
        """Unit tensors unit ``u`` produces."""
        return self._outputs[self._output_offset[u]:self._output_offset[u + 1]]

    def consumers(self, t: int) -> np.ndarray:
        """Distinct units (other than the producer) reading unit tensor ``t``."""
        return self._consumers[self._consumer_offset[t]:self._consumer_offset[t + 1]]

    def consumer_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (unit tensor, consumer unit) pair, as two arrays sorted by tensor."""
        counts = np.diff(self._consumer_offset)
        return np.repeat(np.arange(self.num_tensors), counts), self._consumers

    def adjacency_lists(self) -> dict[str, list]:
        """Python lists of the CSR arrays, for the schedulers' per-element loops
        (``inputs``, ``outputs``, ``consumers``: lists of lists)."""
        def rows(offset, values):
            offset, values = offset.tolist(), values.tolist()
            return [values[offset[k]:offset[k + 1]] for k in range(len(offset) - 1)]
        return {"inputs": rows(self._input_offset, self._inputs),
                "outputs": rows(self._output_offset, self._outputs),
                "consumers": rows(self._consumer_offset, self._consumers)}

    def bottom_level_us(self) -> np.ndarray:
        """Longest compute-only path from each unit to a sink, the unit included."""
        level = self.compute_us.copy()
        succ_offset, succ = _csr(self.edges[0], self.edges[1], self.num_units)
        succ_offset, succ, lv = succ_offset.tolist(), succ.tolist(), level.tolist()
        for u in reversed(self.topological_order.tolist()):
            row = succ[succ_offset[u]:succ_offset[u + 1]]
            if row:
                lv[u] += max(lv[v] for v in row)
        return np.array(lv)

    def unit_name(self, u: int) -> str:
        """The unit's first op name, with ``(+k)`` when it holds k more ops."""
        ops = self.ops(u)
        extra = f" (+{len(ops) - 1})" if len(ops) > 1 else ""
        return self.graph.names[int(ops[0])] + extra

    def __repr__(self) -> str:
        return (f"UnitGraph({self.num_units} units of {self.graph.num_ops} ops, "
                f"{self.edges.shape[1]} edges, {self.num_groups} groups)")
