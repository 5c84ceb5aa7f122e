"""Walking a GraphDef for the passes that rewrite a step before it is profiled.

``remat.grad_accumulation`` and ``remat.early_updates`` edit a ``GraphDef`` node by node (like
Grappler's optimizers edit a ``GraphDef`` in C++) and rebuild a ``tf.Graph`` from it. They share
what is here: reading an input name, a topological order of the nodes, reachability, the
rebuild with its checks, and the nodes the passes that replace an op by matrix products build
(``remat.flat_matmuls``, ``remat.patch_convs``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from graphfit.errors import GraphfitError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import EXACT_GRAPH

__all__ = ["GraphDefPassError", "split_input", "topological_order", "production_depth",
           "successors", "ancestors", "Reachability", "rebuild", "const_node",
           "reshape_nodes", "matmul_node"]


class GraphDefPassError(GraphfitError, ValueError):
    """A GraphDef pass produced a graph that is not a valid step (cycle, dangling name)."""


def split_input(name: str) -> tuple[str, int]:
    """``"op:2"`` -> ``("op", 2)``, ``"op"`` -> ``("op", 0)``, ``"^op"`` -> ``("op", -1)``
    (a control input)."""
    if name.startswith("^"):
        return name[1:], -1
    op, _, port = name.partition(":")
    return op, int(port or 0)


def successors(graph_def: tf.compat.v1.GraphDef) -> dict[str, list[str]]:
    """Node name -> the nodes that read it (data or control)."""
    successors: dict[str, list[str]] = collections.defaultdict(list)
    for node in graph_def.node:
        for name in node.input:
            successors[split_input(name)[0]].append(node.name)
    return successors


def topological_order(graph_def: tf.compat.v1.GraphDef) -> list[str]:
    """Node names in an order where every node follows its data and control inputs (Kahn's
    algorithm; ties keep the GraphDef's order).

    Raises:
        GraphDefPassError: an input names no node, or the graph has a cycle.
    """
    names = [node.name for node in graph_def.node]
    indegree = dict.fromkeys(names, 0)
    for node in graph_def.node:
        for name in node.input:
            producer = split_input(name)[0]
            if producer not in indegree:
                raise GraphDefPassError(f"node {node.name!r} reads {name!r}, which names no node")
            indegree[node.name] += 1
    readers = successors(graph_def)
    ready = collections.deque(name for name in names if indegree[name] == 0)
    order = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for successor in readers[name]:
            indegree[successor] -= 1
            if indegree[successor] == 0:
                ready.append(successor)
    if len(order) != len(names):
        stuck = next(name for name in names if indegree[name] > 0)
        raise GraphDefPassError(f"the rewritten graph has a cycle through {stuck!r}")
    return order


def production_depth(graph_def: tf.compat.v1.GraphDef) -> dict[str, int]:
    """Longest path (in edges) from a source to each node: a node of a deeper level cannot run
    before one of a shallower level it depends on, so in a backward pass through an unrolled
    loop the gradient of a later time step has the smaller depth. Used as the static order in
    which tensors come into existence."""
    nodes = {node.name: node for node in graph_def.node}
    depth: dict[str, int] = {}
    for name in topological_order(graph_def):
        depth[name] = max((depth[split_input(i)[0]] + 1 for i in nodes[name].input), default=0)
    return depth


def ancestors(graph_def: tf.compat.v1.GraphDef, sinks: Iterable[str]) -> set[str]:
    """Every node ``sinks`` depend on over data and control edges, ``sinks`` included (the
    fan-in a ``Session.run`` of them executes)."""
    nodes = {node.name: node for node in graph_def.node}
    seen: set[str] = set()
    stack = [split_input(sink)[0] for sink in sinks]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(split_input(i)[0] for i in nodes[name].input)
    return seen


class Reachability:
    """Which of some ``tracked`` nodes reach which nodes of a graph, over data and control
    edges, kept exact while edges are added.

    A pass that asks "is ``a`` upstream of ``b``?" for hundreds of pairs would walk the graph
    once per question: ``remat.early_updates`` did, 646 walks of ``keras.applications.
    ResNet50``'s 7,600 ops in one ``optimize`` (20.6 s of 231 s, 2026-12-06). Here one pass
    in topological order gives every node the set of tracked nodes it depends on, as a bitset
    (a Python int; bit ``k``: the ``k``-th tracked node), so a question is a bit test. Only the
    tracked nodes take bits, so the sets stay small on a large graph.
    """

    def __init__(self, graph_def: tf.compat.v1.GraphDef, tracked: Iterable[str]):
        self._bit = {name: 1 << k for k, name in enumerate(dict.fromkeys(tracked))}
        self._readers = successors(graph_def)
        nodes = {node.name: node for node in graph_def.node}
        self._upstream: dict[str, int] = {}
        for name in topological_order(graph_def):
            bits = self._bit.get(name, 0)
            for producer in nodes[name].input:
                bits |= self._upstream[split_input(producer)[0]]
            self._upstream[name] = bits

    def reaches(self, source: str, target: str) -> bool:
        """Whether ``target`` depends on ``source`` (a tracked node), or is it."""
        return bool(self._upstream[target] & self._bit[source])

    def upstream(self, target: str, among: Iterable[str]) -> set[str]:
        """The tracked nodes of ``among`` that ``target`` depends on (or is)."""
        bits = self._upstream[target]
        return {name for name in among if bits & self._bit[name]}

    def add_edge(self, source: str, target: str) -> None:
        """Record a new edge ``source -> target``: ``target`` and everything downstream of it
        now depend on what ``source`` depends on. (The caller edits the GraphDef itself.)"""
        bits = self._upstream[source]
        self._readers[source].append(target)
        stack = [target]
        while stack:      # a node that has the bits already passed them on downstream
            name = stack.pop()
            if bits & ~self._upstream[name]:
                self._upstream[name] |= bits
                stack.extend(self._readers[name])


def rebuild(item: GraphItem, graph_def: tf.compat.v1.GraphDef, config_key: str,
            record: dict, exact_graph: bool) -> GraphItem:
    """The step ``item`` on a new graph imported from ``graph_def``, its report under
    ``config[config_key]``; ``exact_graph``: the rewrite added clones or ordering edges that
    Grappler's CSE or dependency optimizer would undo (``profiler.session.EXACT_GRAPH``).

    Raises:
        GraphDefPassError: ``graph_def`` has a cycle or a dangling input, or lost a name the
            step fetches, feeds or initialises with.
    """
    topological_order(graph_def)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    for name in [item.train_op, item.loss, item.init_op, *item.gradients, *item.feeds,
                 *item.init_feeds]:
        try:
            graph.as_graph_element(name)
        except (KeyError, ValueError) as error:
            raise GraphDefPassError(f"the rewritten step lost {name!r}: {error}") from error
    rewritten = item.with_graph(graph)
    rewritten.config = {**item.config, config_key: record}
    if exact_graph:
        rewritten.config[EXACT_GRAPH] = True
    return rewritten


def const_node(name: str, values: list[int], device: str) -> tf.compat.v1.NodeDef:
    """An int32 ``Const`` of ``values``: a shape for the nodes below."""
    node = tf.compat.v1.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array(values, np.int32)))
    return node


def reshape_nodes(name: str, tensor: str, shape: list[int], like: tf.compat.v1.NodeDef
                  ) -> list[tf.compat.v1.NodeDef]:
    """``Reshape(tensor, shape)`` named ``name``, and its shape constant."""
    node = tf.compat.v1.NodeDef(name=name, op="Reshape", device=like.device,
                                input=[tensor, f"{name}/shape"])
    node.attr["T"].CopyFrom(like.attr["T"])
    node.attr["Tshape"].type = tf.int32.as_datatype_enum
    return [const_node(f"{name}/shape", shape, like.device), node]


def matmul_node(name: str, a: str, b: str, like: tf.compat.v1.NodeDef, transpose_a: bool,
                transpose_b: bool, controls: list[str]) -> tf.compat.v1.NodeDef:
    """``MatMul(a, b)`` named ``name`` on ``like``'s device and dtype, after ``controls``."""
    node = tf.compat.v1.NodeDef(name=name, op="MatMul", device=like.device,
                                input=[a, b, *controls])
    node.attr["T"].CopyFrom(like.attr["T"])
    node.attr["transpose_a"].b = transpose_a
    node.attr["transpose_b"].b = transpose_b
    return node
