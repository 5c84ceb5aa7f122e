"""Sums as Grappler groups them: apply the arithmetic optimizer's add regrouping ahead of time.

When the user's step runs, Grappler's arithmetic optimizer rewrites each tree of adds
(``AddOpsRewriteStage``, TF 2.21): inputs of one shape are summed by one ``AddN``, and those sums
are added from the smallest shape up. A Keras ResNet block's ``(x*s + b) + (y*t + c)`` (two
batch norms and the residual add) runs as ``(b + c) + (x*s + y*t)``. The stage leaves a tree
alone when one of its adds has a control edge, and takes in an inner add only while that add
has one reader. The project's rewrites add both: the remat rewrite pins nodes with control
edges (the forward pass too, from the first recomputation on, when a plan recomputes there),
and a clone of a tree's root is a second reader of its inner adds. The rewritten step then
adds in the traced order, and float addition is not associative: on
``keras.applications.ResNet50`` (64x64, batch 8, SGD) at ratios 0.35-0.4, two plans of six
computed weight updates 2.0e-3 of the largest update off the user's (1.3e-3 with oneDNN off),
where rounding flipped ReLU and max-pool decisions (2026-12-07). The report's own comparison
missed it: its reference, the item in a v1 session, is not regrouped either (below).

``profiler.tf_function.graph_item_from_function`` makes the same groups when it traces the
user's ``tf.function``, by the stage's rules, and tags the nodes it makes as the stage tags its
own (``_grappler_ArithmeticOptimizer_AddOpsRewriteStage``), so that Grappler leaves them alone:
every pass, clone and edge then works on the sums the user's step computes, and no edge can
change them (with every forward add of that ResNet50 pinned, the step computes the user's
update to 1.6e-6 instead of 1.3e-3, oneDNN off). Only traced functions: TF's function runtime
knows every static shape of the step, so Grappler groups every tree it can; a v1 graph run in a
session is grouped only where Grappler's own shape inference succeeds (on the same ResNet50
taken into a session it failed for every residual add, whose shapes it lost at the ``Pad``
before the max-pool), so the session's step keeps its sums as traced. The rules, as the stage
applies them:

- adds are taken as roots in reverse graph order, so a tree is taken whole from its root;
- a root is an ``Add``, ``AddV2`` or ``AddN`` without control edges in or out, not tagged, its
  output shape known, and every input broadcastable to it;
- an input of the tree is taken in (depth first, left input first) when it is such an add
  itself, has the root's shape and device and exactly one reader; every other input is a leaf;
- leaves of one shape are summed in that order by one ``AddN`` (a single leaf stays as it is);
  the sums, ordered by size, are added two at a time, ``(s0 + s1) + s2``, by ``Add`` for an
  ``Add`` root and ``AddV2`` otherwise.

Left to Grappler: trees of non-float sums (integer addition is associative), trees with a
``Const`` leaf (Grappler's constant folding, which runs first, pushes constants through adds),
shapes known only symbolically, and three or more leaf shapes with equal sizes (the stage's
order among them is unspecified); such a tree is left whole, its inner adds included, as
grouping part of it would change the tree Grappler takes. The root keeps its name, so its
readers and every fetched name are unchanged; the inner adds are removed; an add the step
fetches is never taken in.

Preconditions: an acyclic step. Postconditions (checked by ``rebuild``): the graph imports, is
acyclic, keeps every fetched, fed and initialising name.
"""

from __future__ import annotations

import collections
import math

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.graph_def_walk import rebuild, split_input

__all__ = ["REGROUPED_TAG", "regroup_sums"]

# The attribute Grappler's AddOpsRewriteStage puts on the nodes it made or took in; it never
# rewrites a node that has it.
REGROUPED_TAG = "_grappler_ArithmeticOptimizer_AddOpsRewriteStage"
_ADD_OP_TYPES = frozenset({"Add", "AddV2", "AddN"})


def regroup_sums(item: GraphItem) -> tuple[GraphItem, dict]:
    """Rewrite every tree of adds in ``item`` as Grappler's arithmetic optimizer does when the
    user's ``tf.function`` runs (module docstring).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when no tree matched) and a
        JSON-ready record: ``changed``, ``trees`` rewritten, ``adds_removed`` (the inner adds
        taken into a tree).

    Raises:
        graph_def_walk.GraphDefPassError: the rewrite broke the step (a bug; names the node).
    """
    graph_def = item.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    readers = collections.Counter()
    controlled = set()
    for node in graph_def.node:
        for name in node.input:
            producer, port = split_input(name)
            if port < 0:
                controlled.update((producer, node.name))
            else:
                readers[producer] += 1
    fetched = {split_input(name)[0] for name in [item.train_op, item.loss, item.init_op,
                                                 *item.gradients]}

    def shape(tensor: str) -> tuple[int, ...] | None:
        static = item.graph.get_tensor_by_name(tensor if ":" in tensor else f"{tensor}:0").shape
        return tuple(static.as_list()) if static.is_fully_defined() else None

    def is_add(node: tf.compat.v1.NodeDef) -> bool:
        return (node.op in _ADD_OP_TYPES and REGROUPED_TAG not in node.attr
                and node.name not in controlled
                and tf.as_dtype(node.attr["T"].type).is_floating)

    removed: set[str] = set()      # inner adds of the trees rewritten
    left: set[str] = set()         # adds of a tree left to Grappler, which takes it whole
    added: list[tf.compat.v1.NodeDef] = []
    trees = 0
    for root in reversed(graph_def.node):
        if root.name in removed or root.name in left or not is_add(root):
            continue
        root_shape = shape(root.name)
        inner, leaves = ([], []) if root_shape is None else _tree(
            root, root_shape, nodes, readers, fetched, shape, is_add)
        new_nodes = None
        if inner and not any(nodes[split_input(leaf)[0]].op == "Const" for leaf in leaves):
            new_nodes = _grouped_sums(root, [(leaf, shape(leaf)) for leaf in leaves])
        if new_nodes is None:
            # Grouping an inner add here would change the tree Grappler takes from this root.
            left.update(_adds_below(root, nodes, readers, is_add))
            continue
        trees += 1
        removed.update(node.name for node in inner)
        added.extend(new_nodes)
    record = {"changed": bool(trees), "trees": trees, "adds_removed": len(removed)}
    if not trees:
        return item, record
    kept = [node for node in graph_def.node if node.name not in removed]
    del graph_def.node[:]
    graph_def.node.extend(kept + added)
    return rebuild(item, graph_def, "sum_groups", record, exact_graph=False), record


def _tree(root, root_shape, nodes, readers, fetched, shape, is_add):
    """The inner adds ``root``'s tree takes in and its leaves (tensor names, depth first,
    left input first), by the stage's rules; no leaves where a shape is unknown."""

    def broadcast_inputs(node) -> bool:
        shapes = [shape(name) for name in node.input if not name.startswith("^")]
        return all(s is not None and _broadcastable(s, root_shape) for s in shapes)

    if not broadcast_inputs(root):
        return [], []
    inner, leaves = [], []
    pending = collections.deque(name for name in root.input if not name.startswith("^"))
    while pending:
        tensor = pending.popleft()
        node = nodes[split_input(tensor)[0]]
        if (is_add(node) and readers[node.name] == 1 and node.name not in fetched
                and node.device == root.device and shape(tensor) == root_shape
                and broadcast_inputs(node)):
            inner.append(node)
            pending.extendleft(reversed([name for name in node.input
                                         if not name.startswith("^")]))
        else:
            leaves.append(tensor)
    return inner, leaves


def _adds_below(root, nodes, readers, is_add) -> set[str]:
    """Every add a tree from ``root`` could take in, whatever the shapes: the adds read only
    by ``root`` or by one of them."""
    below, pending = set(), [name for name in root.input if not name.startswith("^")]
    while pending:
        node = nodes[split_input(pending.pop())[0]]
        if is_add(node) and readers[node.name] == 1 and node.name not in below:
            below.add(node.name)
            pending.extend(name for name in node.input if not name.startswith("^"))
    return below


def _broadcastable(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    return len(shape) <= len(to) and all(a in (b, 1) for a, b in zip(reversed(shape),
                                                                      reversed(to)))


def _grouped_sums(root: tf.compat.v1.NodeDef, leaves: list[tuple[str, tuple[int, ...]]]
                  ) -> list[tf.compat.v1.NodeDef] | None:
    """The nodes that sum ``leaves`` as the stage does; ``root`` is rewritten in place into
    the last of them. ``None`` where the stage's order is unspecified (module docstring)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for tensor, leaf_shape in leaves:
        groups.setdefault(leaf_shape, []).append(tensor)
    sizes = [math.prod(group_shape) for group_shape in groups]
    if len(groups) >= 3 and len(set(sizes)) < len(sizes):
        return None
    ordered = sorted(groups, key=math.prod)
    dtype = root.attr["T"].type
    new_nodes = []

    def node(name: str, op: str, inputs: list[str]) -> tf.compat.v1.NodeDef:
        made = tf.compat.v1.NodeDef(name=name, op=op, input=inputs, device=root.device)
        made.attr["T"].type = dtype
        if op == "AddN":
            made.attr["N"].i = len(inputs)
        made.attr[REGROUPED_TAG].b = True
        return made

    if len(ordered) == 1:
        root.CopyFrom(node(root.name, "AddN", groups[ordered[0]]))
        return new_nodes
    sums = []
    for k, group_shape in enumerate(ordered):
        group = groups[group_shape]
        if len(group) == 1:
            sums.append(group[0])
        else:
            new_nodes.append(node(f"{root.name}/sum_groups/leaf_{k}", "AddN", group))
            sums.append(new_nodes[-1].name)
    add_op = "Add" if root.op == "Add" else "AddV2"
    total = sums[0]
    for k, tensor in enumerate(sums[1:-1]):
        new_nodes.append(node(f"{root.name}/sum_groups/partial_{k}", add_op, [total, tensor]))
        total = new_nodes[-1].name
    root.CopyFrom(node(root.name, add_op, [total, sums[-1]]))
    return new_nodes
