"""Keep the rewrite's ordering edges through Grappler: re-pin after nodes Grappler removes.

``remat.rewrite`` pins each node of the backward pass after the node of the plan event before
it (a control edge, or the data edge that already orders the pair). Grappler then optimizes
the step before TF runs it, and it removes nodes: constant folding turns a
``BroadcastGradientArgs`` or a ``Shape`` of static shapes into constants (a clone too, even
where the original it copies was not folded), the arithmetic optimizer drops a ``Reshape``
that changes nothing. The constants it makes do not keep the removed node's control inputs,
so a node pinned after a removed node is ordered after nothing. On a Keras attention step 8
of 516 pins were lost so: ``Sum`` and ``BatchMatMulV2`` nodes could start before the events
they were pinned after, and held their outputs early.

The pass asks Grappler itself: it runs the same optimizers, offline
(``tf_optimizer.OptimizeGraph``, with the configuration the step runs under), on the pinned
graph, and gives every pinned node whose anchor did not survive an edge from what that
anchor waited for (through chains of removed anchors). The new edges come from nodes that
finished before the removed anchor could start, so they change no order the plan asked for;
they only restore it. Cost: one Grappler run (0.3 s on the zoo transformer's 2,400 nodes,
5 s on gnmt_v2's 15,700).

Precondition: ``anchors`` maps pinned nodes of ``graph_def`` to the nodes they wait for.
Postcondition: every pinned node Grappler keeps waits, directly or through data, only for
nodes Grappler keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import tensorflow as tf
from tensorflow.python.grappler import tf_optimizer

__all__ = ["optimized_graph_def", "repin_removed_anchors", "stand_ins"]


def optimized_graph_def(graph_def: tf.compat.v1.GraphDef, fetches: Iterable[str],
                        config: tf.compat.v1.ConfigProto) -> tf.compat.v1.GraphDef:
    """The graph Grappler, configured by ``config``, makes of ``graph_def`` to run ``fetches``
    (node or tensor names): what a session with ``config`` would execute."""
    # The meta graph is built, not exported from an imported graph: Grappler reads only the
    # graph and its fetches (the ``train_op`` collection), and importing 7,600 nodes took
    # 0.8 s of each rewrite of ``keras.applications.ResNet50`` (2026-12-06).
    meta_graph = tf.compat.v1.MetaGraphDef()
    meta_graph.graph_def.CopyFrom(graph_def)
    meta_graph.collection_def["train_op"].node_list.value.extend(
        name.split(":")[0] for name in fetches)
    return tf_optimizer.OptimizeGraph(config, meta_graph)


def stand_ins(anchors: Mapping[str, list[str]], kept: set[str]) -> dict[str, list[str]]:
    """For each removed node (not in ``kept``) that ``anchors`` names, the kept nodes it
    waited for, through chains of removed anchors. Resolved with a stack, not recursion: in
    a step chained from its first op (``remat.step_time.serial_chain``) Grappler can remove
    a thousand anchors in a row (gnmt_v2, 2026-12-06: Python's recursion limit)."""
    resolved: dict[str, list[str]] = {}
    entered: set[str] = set()
    for start in dict.fromkeys(anchor for waits_for in anchors.values() for anchor in waits_for
                               if anchor not in kept):
        stack = [start]
        while stack:
            name = stack[-1]
            if name in resolved:
                stack.pop()
                continue
            earlier = anchors.get(name, [])
            pending = [a for a in earlier if a not in kept and a not in resolved]
            if pending and name not in entered:     # resolve its removed anchors first
                entered.add(name)
                stack.extend(pending)
                continue
            # A removed anchor reached again on a cycle adds nothing more.
            resolved[name] = list(dict.fromkeys(
                kept_name for anchor in earlier
                for kept_name in ([anchor] if anchor in kept else resolved.get(anchor, []))))
            stack.pop()
    return resolved


def repin_removed_anchors(graph_def: tf.compat.v1.GraphDef, anchors: Mapping[str, list[str]],
                          fetches: Iterable[str], config: tf.compat.v1.ConfigProto) -> int:
    """Give each pinned node of ``graph_def`` (in place) an edge from what its removed anchors
    waited for (module docstring). Returns the number of edges added."""
    kept = {node.name for node in optimized_graph_def(graph_def, fetches, config).node}
    nodes = {node.name: node for node in graph_def.node}
    resolved = stand_ins(anchors, kept)
    added = 0
    for name, waits_for in anchors.items():
        if name not in kept or all(anchor in kept for anchor in waits_for):
            continue
        node = nodes[name]
        present = {entry.lstrip("^").split(":")[0] for entry in node.input}
        for anchor in waits_for:
            for stand_in in resolved.get(anchor, [anchor]):
                if stand_in not in present:
                    node.input.append("^" + stand_in)
                    present.add(stand_in)
                    added += 1
    return added
