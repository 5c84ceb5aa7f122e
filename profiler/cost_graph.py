"""The cost graph: the IR every algorithm in this project reads.

One node per TF op, numbered in a topological order, with the costs a planner needs (compute
time, bytes of each output, temporary and persistent bytes) and the flags that say what may be
recomputed or moved (stateful, random, variable, reads a resource). Edges are tensors
(producer op and port -> consumer ops) plus control edges.

Hot fields live in numpy arrays indexed by op id (or tensor id), and adjacency in CSR form, so
algorithms over 50k-op graphs stay fast; ``to_networkx`` gives a networkx view where its
algorithms help. TensorFlow is touched only by ``from_graph`` (see ``profiler.tf_import``); the
algorithms build graphs with ``from_ops`` and never import TF.

Tensor ids are contiguous per op: the outputs of op ``i`` are tensors
``output_offset[i] .. output_offset[i + 1] - 1`` in port order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
from collections.abc import Iterable, Sequence

import networkx as nx
import numpy as np

from graphfit.errors import GraphfitError, short_repr

__all__ = ["CostGraph", "CostGraphError", "OpSpec", "gc_paused", "FEED_OP_TYPES"]

# Ops whose output the session feeds from the client.
FEED_OP_TYPES = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector: building a large graph creates millions of
    small containers, and collections triggered by their sheer number (not by garbage) cost
    more than the build itself (about 40% of building a 50k-op IR)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CostGraphError(GraphfitError, ValueError):
    """The graph or its profile cannot form a valid cost graph (cycle, dangling input, mismatch)."""


@dataclasses.dataclass
class OpSpec:
    """One op as given to ``CostGraph.from_ops``.

    ``inputs`` are ``(producer name, output port)`` pairs in input order; ``control_inputs`` are
    producer names. ``colocation_group`` defaults to the op's own name (a group of one).
    ``persistent_outputs`` are ports whose output *is* a persistent buffer (a weight a framework
    hands out as an op output): held all step on the producer's device, counted once (not in
    ``persistent_bytes`` too). ``fetched_outputs`` are ports the caller fetches: held until the
    step ends.
    """

    name: str
    op_type: str
    inputs: Sequence[tuple[str, int]] = ()
    control_inputs: Sequence[str] = ()
    output_bytes: Sequence[int] = ()
    compute_us: float = 0.0
    temp_bytes: int = 0
    persistent_bytes: int = 0
    device: str = ""
    colocation_group: str | None = None
    is_stateful: bool = False
    is_random: bool = False
    is_variable: bool = False
    reads_resource: bool = False
    measured: bool = True
    persistent_outputs: Sequence[int] = ()
    fetched_outputs: Sequence[int] = ()


def _csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list of integer rows."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((v for r in rows for v in r), dtype=np.int32, count=int(offsets[-1]))
    return offsets, values


def _topological_order(specs: Sequence[OpSpec], index: dict[str, int]) -> list[int]:
    """Kahn's algorithm, ties broken by the given order so the result is stable.

    Raises ``CostGraphError`` naming an op on a cycle, or an input that names no op.
    """
    n = len(specs)
    indegree = [0] * n
    successors: list[list[int]] = [[] for _ in range(n)]
    for j, spec in enumerate(specs):
        producers = [p for p, _ in spec.inputs] + list(spec.control_inputs)
        for producer in producers:
            i = index.get(producer)
            if i is None:
                raise CostGraphError(
                    f"op {spec.name!r} reads {producer!r}, which is not an op of the graph "
                    "(dangling input): pass the whole graph, or prune the reader too")
            successors[i].append(j)
            indegree[j] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:
        stuck = next(specs[i].name for i in range(n) if indegree[i] > 0)
        raise CostGraphError(
            f"the graph has a cycle through op {stuck!r} ({n - len(order)} ops on or behind "
            "cycles); loops must be statically unrolled or kept inside a function op")
    return order


# Sizes are int64 in the IR. Each must be below 2^63, and all of one graph's together below 2^62,
# so any sum the planners form (a device's live bytes, plus one more tensor, against a limit of
# up to 2^63 - 1) fits as well: nothing wraps.
MAX_TOTAL_BYTES = 2 ** 62


def _to_float(value) -> float:
    """``value`` as a float: NaN if it is not a number, inf if it is an integer beyond floats."""
    if isinstance(value, (bool, str)) or not np.isscalar(value):
        return float("nan")
    try:
        return float(value)
    except OverflowError:
        return float("inf")
    except (TypeError, ValueError):
        return float("nan")


def _checked_costs(specs: Sequence[OpSpec], field: str, values: list, integer: bool = False
                   ) -> np.ndarray:
    """``values`` (one per spec) as an array, after checking each is a finite, non-negative
    number (a whole one below 2^63 for bytes): a NaN or negative cost would make every plan
    garbage, and a size beyond int64 would wrap to a small or negative one.

    Raises ``CostGraphError`` naming the first op with a bad value.
    """
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.shape != (len(values),):
        array = np.array([_to_float(v) for v in values], dtype=np.float64)
    bad = ~np.isfinite(array) | (array < 0)
    if integer:
        bad |= (array != np.floor(array)) | (array >= 2.0 ** 63)
    if bad.any():
        k = int(np.argmax(bad))
        kind = ("a whole, non-negative number of bytes below 2^63 (what the IR holds)"
                if integer else "a finite, non-negative time (µs)")
        raise CostGraphError(f"op {specs[k].name!r}: {field} = {short_repr(values[k])} is not "
                             f"{kind}")
    return array.astype(np.int64) if integer else array


def _check_total_bytes(graph: "CostGraph") -> None:
    """Refuse a graph whose sizes add up to ``MAX_TOTAL_BYTES`` or more (see there)."""
    total = sum(float(a.sum(dtype=np.float64))
                for a in (graph.temp_bytes, graph.persistent_bytes, graph.tensor_bytes))
    if total >= MAX_TOTAL_BYTES:
        raise CostGraphError(
            f"the sizes of the graph (output_bytes, temp_bytes and persistent_bytes of every op) "
            f"add up to {total:.3g} bytes, more than the 2^62 ({MAX_TOTAL_BYTES:.3g}) the IR "
            "can add up without wrapping: sizes are in bytes; check the file's units")


class CostGraph:
    """Ops, tensors and control edges with measured or estimated costs.

    Per op ``i`` (0 <= i < num_ops, topologically ordered): ``names[i]``, ``op_types[i]``,
    ``devices[i]`` (requested or assigned), ``colocation_groups[i]``, and arrays
    ``compute_us``, ``temp_bytes``, ``persistent_bytes``, ``is_stateful``, ``is_random``,
    ``is_variable``, ``reads_resource``, ``measured``.
    Per tensor ``t``: ``tensor_producer[t]``, ``tensor_port[t]``, ``tensor_bytes[t]``,
    ``tensor_persistent[t]`` and ``tensor_fetched[t]`` (``OpSpec``).
    CSR adjacency: ``op_inputs(i)`` (tensor ids in input order), ``tensor_consumers(t)``
    (distinct consumer ops, ascending), ``control_inputs(i)`` (op ids).
    """

    def __init__(self, specs: Sequence[OpSpec]):
        index = {}
        for k, spec in enumerate(specs):
            if spec.name in index:
                raise CostGraphError(f"two ops are named {spec.name!r}: op names must be unique")
            index[spec.name] = k
        order = _topological_order(specs, index)
        specs = [specs[k] for k in order]
        self.names: list[str] = [s.name for s in specs]
        self.index: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        self.op_types: list[str] = [s.op_type for s in specs]
        self.devices: list[str] = [s.device for s in specs]
        self.colocation_groups: list[str] = [s.colocation_group or s.name for s in specs]
        self.compute_us = _checked_costs(specs, "compute_us", [s.compute_us for s in specs])
        self.temp_bytes = _checked_costs(specs, "temp_bytes", [s.temp_bytes for s in specs],
                                         integer=True)
        self.persistent_bytes = _checked_costs(specs, "persistent_bytes",
                                               [s.persistent_bytes for s in specs], integer=True)
        for flag in ("is_stateful", "is_random", "is_variable", "reads_resource", "measured"):
            setattr(self, flag, np.array([getattr(s, flag) for s in specs], dtype=bool))

        counts = np.array([len(s.output_bytes) for s in specs], dtype=np.int64)
        self.output_offset = np.zeros(len(specs) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.output_offset[1:])
        self.tensor_producer = np.repeat(np.arange(len(specs), dtype=np.int32), counts)
        self.tensor_port = (np.arange(int(self.output_offset[-1]), dtype=np.int32)
                            - self.output_offset[:-1].repeat(counts).astype(np.int32))
        self.tensor_bytes = _checked_costs(
            [s for s in specs for _ in s.output_bytes], "output_bytes",
            [b for s in specs for b in s.output_bytes], integer=True)
        _check_total_bytes(self)
        self.tensor_persistent = self._port_flags(specs, counts, "persistent_outputs")
        self.tensor_fetched = self._port_flags(specs, counts, "fetched_outputs")

        input_rows = []
        for s in specs:
            row = []
            for producer, port in s.inputs:
                i = self.index[producer]
                if not 0 <= port < counts[i]:
                    raise CostGraphError(
                        f"op {s.name!r} reads output {port} of {producer!r}, which has "
                        f"{counts[i]} outputs")
                row.append(int(self.output_offset[i]) + port)
            input_rows.append(row)
        self._input_offset, self._input_tensors = _csr(input_rows)
        consumer_rows: list[list[int]] = [[] for _ in range(self.num_tensors)]
        for j, row in enumerate(input_rows):
            for t in dict.fromkeys(row):
                consumer_rows[t].append(j)
        self._consumer_offset, self._consumers = _csr(consumer_rows)
        self._control_offset, self._control = _csr(
            [sorted({self.index[c] for c in s.control_inputs}) for s in specs])

    def _port_flags(self, specs: Sequence[OpSpec], counts: np.ndarray, field: str) -> np.ndarray:
        """Per tensor: whether its port is listed in the op spec's ``field``."""
        flags = np.zeros(int(self.output_offset[-1]), dtype=bool)
        for i, s in enumerate(specs):
            for port in getattr(s, field):
                if not 0 <= port < counts[i]:
                    raise CostGraphError(f"op {s.name!r} lists output {port} in {field}, but "
                                         f"has {counts[i]} outputs")
                flags[int(self.output_offset[i]) + port] = True
        return flags

    @classmethod
    def from_ops(cls, specs: Iterable[OpSpec]) -> "CostGraph":
        """Build from op specs in any order (they are sorted topologically).

        Raises:
            CostGraphError: on duplicate names, a dangling input, a bad port, a cycle, or a
                cost that is negative, NaN or infinite.

        Examples:
            >>> g = CostGraph.from_ops([
            ...     OpSpec("x", "Placeholder", output_bytes=[400]),
            ...     OpSpec("y", "Relu", inputs=[("x", 0)], output_bytes=[400], compute_us=3.0)])
            >>> g.num_ops, g.num_tensors, list(g.tensor_consumers(0))
            (2, 2, [1])
        """
        with gc_paused():
            return cls(list(specs))

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def num_tensors(self) -> int:
        return int(self.output_offset[-1])

    # -- adjacency --------------------------------------------------------------------------
    def op_outputs(self, i: int) -> range:
        """Tensor ids of op ``i``'s outputs, in port order."""
        return range(int(self.output_offset[i]), int(self.output_offset[i + 1]))

    def op_inputs(self, i: int) -> np.ndarray:
        """Tensor ids op ``i`` reads, in input order (repeats kept)."""
        return self._input_tensors[self._input_offset[i]:self._input_offset[i + 1]]

    def tensor_consumers(self, t: int) -> np.ndarray:
        """Distinct ops reading tensor ``t``, ascending."""
        return self._consumers[self._consumer_offset[t]:self._consumer_offset[t + 1]]

    def control_inputs(self, i: int) -> np.ndarray:
        """Ops that must finish before op ``i`` starts without passing it a tensor."""
        return self._control[self._control_offset[i]:self._control_offset[i + 1]]

    def predecessors(self, i: int) -> list[int]:
        """Distinct ops op ``i`` depends on (data or control), ascending."""
        data = self.tensor_producer[self.op_inputs(i)]
        return sorted(set(data.tolist()) | set(self.control_inputs(i).tolist()))

    def successors(self, i: int) -> list[int]:
        """Distinct ops that depend on op ``i`` (data or control), ascending."""
        return self._successor_lists()[i]

    def _successor_lists(self) -> list[list[int]]:
        if not hasattr(self, "_successor_cache"):
            rows: list[set[int]] = [set() for _ in range(self.num_ops)]
            for j in range(self.num_ops):
                for i in self.predecessors(j):
                    rows[i].add(j)
            self._successor_cache = [sorted(r) for r in rows]
        return self._successor_cache

    def tensor_name(self, t: int) -> str:
        """TF's name of tensor ``t``: ``producer:port``."""
        return f"{self.names[self.tensor_producer[t]]}:{self.tensor_port[t]}"

    def output_bytes(self, i: int) -> np.ndarray:
        """Bytes of each output of op ``i``."""
        return self.tensor_bytes[self.output_offset[i]:self.output_offset[i + 1]]

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph over op ids; edge attribute ``bytes`` sums the distinct tensors it carries
        (0 for a pure control edge), node attributes are the op's name and costs."""
        g = nx.DiGraph()
        for i in range(self.num_ops):
            g.add_node(i, name=self.names[i], compute_us=float(self.compute_us[i]))
        for j in range(self.num_ops):
            for t in dict.fromkeys(self.op_inputs(j).tolist()):
                i = int(self.tensor_producer[t])
                previous = g.edges[i, j]["bytes"] if g.has_edge(i, j) else 0
                g.add_edge(i, j, bytes=previous + int(self.tensor_bytes[t]))
            for i in self.control_inputs(j).tolist():
                if not g.has_edge(i, j):
                    g.add_edge(i, j, bytes=0)
        return g

    def to_specs(self) -> list[OpSpec]:
        """The graph as op specs (topological order): the inverse of ``from_ops``."""
        return [
            OpSpec(
                name=self.names[i], op_type=self.op_types[i],
                inputs=[(self.names[self.tensor_producer[t]], int(self.tensor_port[t]))
                        for t in self.op_inputs(i)],
                control_inputs=[self.names[c] for c in self.control_inputs(i)],
                output_bytes=self.output_bytes(i).tolist(),
                compute_us=float(self.compute_us[i]), temp_bytes=int(self.temp_bytes[i]),
                persistent_bytes=int(self.persistent_bytes[i]), device=self.devices[i],
                colocation_group=self.colocation_groups[i],
                is_stateful=bool(self.is_stateful[i]), is_random=bool(self.is_random[i]),
                is_variable=bool(self.is_variable[i]),
                reads_resource=bool(self.reads_resource[i]), measured=bool(self.measured[i]),
                persistent_outputs=[int(t - self.output_offset[i]) for t in self.op_outputs(i)
                                    if self.tensor_persistent[t]],
                fetched_outputs=[int(t - self.output_offset[i]) for t in self.op_outputs(i)
                                 if self.tensor_fetched[t]])
            for i in range(self.num_ops)]

    def __repr__(self) -> str:
        return (f"CostGraph({self.num_ops} ops, {self.num_tensors} tensors, "
                f"{self.compute_us.sum():.0f} us compute)")
