"""Gradient accumulation: sum gradient contributions as they arrive instead of all at once.

When a tensor has many readers, its gradient is the sum of one contribution per reader, and
``tf.gradients`` / ``tf.GradientTape`` sum them with one ``AddN``. In an unrolled RNN every time
step reads the same weights, so the ``AddN`` of a weight's gradient waits for one contribution
per time step; each of them stays alive from the step that made it to the end of the backward
pass. In gnmt_v2 (default preset) 57 such 3 MiB contributions are alive at the peak, 108 of
168 MiB, and no recomputation can free them: they are outputs, not activations.

The pass replaces every ``AddN`` / ``AccumulateNV2`` with at least ``min_inputs`` inputs by a
chain of two-input adds, ``s_1 = c_1 + c_2``, ``s_k = s_{k-1} + c_{k+1}``, with the
contributions in the order they come into existence (``graph_def_walk.production_depth``: the
backward pass of time step t runs before that of step t-1, so its contribution is shallower).
TF's executor runs ``s_k`` as soon as ``s_{k-1}`` and ``c_{k+1}`` exist and frees
``c_{k+1}`` (and ``s_{k-1}``, whose buffer the add may reuse) right after, so at most one partial
sum per gradient is alive. This is the idea of TF's ``EXPERIMENTAL_ACCUMULATE_N`` aggregation
and of Grappler's memory optimizer, done in the GraphDef before profiling, so that the profile,
the cost graph and therefore the rematerialization planner all see the freed memory.

The last add keeps the summing node's name, so its readers and every fetched name are
unchanged; it also carries a control edge from each earlier partial sum, which keeps
Grappler's arithmetic optimizer from folding the chain back into one ``AddN`` when the step
runs (measured on a Keras GRU, seq 32: without the edges the step's peak after the passes is
1.00 of the original's, with them 0.33). The memory model keeps each add a planning node of
its own whether or not it drives an edge (its contribution appears after the partial sum it
extends, ``remat.tf_memory``). Floating-point addition is not associative: the sums equal the
originals within float tolerance, not bit for bit.

Preconditions: the step's graph holds no cycle. Postconditions: the rewritten graph imports,
is acyclic, keeps every fetched and fed name, and every contribution of a rewritten sum is read
by exactly one add of its chain, in non-decreasing depth.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.graph_def_walk import GraphDefPassError, production_depth, rebuild, split_input

__all__ = ["SUM_OP_TYPES", "accumulate_gradients"]

SUM_OP_TYPES = ("AddN", "AccumulateNV2")


def _chain(node: tf.compat.v1.NodeDef, contributions: list[str], controls: list[str]
           ) -> list[tf.compat.v1.NodeDef]:
    """Two-input adds summing ``contributions`` in order; the last takes ``node``'s name."""
    adds, partial = [], contributions[0]
    for k, contribution in enumerate(contributions[1:], start=1):
        add = tf.compat.v1.NodeDef(
            name=node.name if k == len(contributions) - 1 else f"{node.name}/accumulate_{k}",
            op="AddV2", input=[partial, contribution] + (controls if k == 1 else []),
            device=node.device)
        add.attr["T"].CopyFrom(node.attr["T"])
        if "_class" in node.attr:
            add.attr["_class"].CopyFrom(node.attr["_class"])
        adds.append(add)
        partial = add.name
    # Grappler's arithmetic optimizer (on in the project's session) folds a tree of adds
    # whose partial sums have one reader each back into one AddN (AddOpsRewriteStage), which
    # would undo this pass at run time; it leaves an add alone that drives a control edge.
    # The edges to the last add order nothing the data edges do not.
    adds[-1].input.extend("^" + add.name for add in adds[:-2])
    return adds


def _check_chains(graph_def: tf.compat.v1.GraphDef, chains: dict[str, list[str]],
                  depth: dict[str, int]) -> None:
    """Each chain reads its sum's contributions once each, in non-decreasing depth."""
    nodes = {node.name: node for node in graph_def.node}
    for sum_name, contributions in chains.items():
        read, name = [], sum_name
        while name in nodes and (name == sum_name or name.startswith(sum_name + "/accumulate_")):
            data = [i for i in nodes[name].input if not i.startswith("^")]
            read.append(data[1])
            name = data[0]
        read.append(name)
        depths = [depth[split_input(c)[0]] for c in reversed(read)]
        if collections.Counter(read) != collections.Counter(contributions) or \
                depths != sorted(depths):
            raise GraphDefPassError(f"the chain replacing {sum_name!r} does not read its "
                                    "contributions once each in production order")


def accumulate_gradients(item: GraphItem, min_inputs: int = 3) -> tuple[GraphItem, dict]:
    """Rewrite every sum of at least ``min_inputs`` tensors in ``item`` as a running sum.

    Parameters:
        item: the training step.
        min_inputs: smallest ``AddN`` / ``AccumulateNV2`` to rewrite (a sum of two is one add
            already).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when nothing matched) and a
        JSON-ready record: ``changed``, ``sums`` rewritten, ``contributions`` they summed,
        ``largest`` (inputs of the largest sum).

    Raises:
        ValueError: ``min_inputs`` below 3.
        graph_def_walk.GraphDefPassError: the rewrite broke the step (a bug; names the node).

    Examples:
        >>> from graphfit import models                                   # doctest: +SKIP
        >>> step, record = accumulate_gradients(models.build("gnmt_v2"))  # doctest: +SKIP
        >>> record["largest"]                                             # doctest: +SKIP
        57
    """
    if min_inputs < 3:
        raise ValueError(f"min_inputs must be at least 3 (got {min_inputs}): a sum of two "
                         "tensors is a single add already")
    graph_def = item.graph.as_graph_def()
    sums = [node for node in graph_def.node if node.op in SUM_OP_TYPES
            and sum(not name.startswith("^") for name in node.input) >= min_inputs]
    record = {"changed": bool(sums), "sums": len(sums), "contributions": 0, "largest": 0}
    if not sums:
        return item, record
    depth = production_depth(graph_def)
    position = {node.name: k for k, node in enumerate(graph_def.node)}
    chains = {}
    replaced = {node.name for node in sums}
    kept = [node for node in graph_def.node if node.name not in replaced]
    del graph_def.node[:]
    graph_def.node.extend(kept)
    for node in sums:
        contributions = [name for name in node.input if not name.startswith("^")]
        controls = [name for name in node.input if name.startswith("^")]
        contributions.sort(key=lambda name: (depth[split_input(name)[0]],
                                             position[split_input(name)[0]]))
        chains[node.name] = contributions
        graph_def.node.extend(_chain(node, contributions, controls))
        record["contributions"] += len(contributions)
        record["largest"] = max(record["largest"], len(contributions))
    _check_chains(graph_def, chains, depth)
    return rebuild(item, graph_def, "grad_accumulation", record, exact_graph=True), record
