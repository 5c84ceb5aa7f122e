"""Keep Grappler's remapper fusions in a step the project added ordering edges to.

Grappler's remapper runs a contraction (``MatMul``, ``Conv2D``, ``DepthwiseConv2dNative``)
together with the ``BiasAdd`` that is its only reader, and with an activation that is the
``BiasAdd``'s only reader, as one kernel (``_FusedMatMul``, ``_FusedConv2D``) named after the
group's last op. It leaves a group unfused when a member has a control input or a control reader (TF 2.21's
``remapper.cc``, checked on this machine under ``profiler.session.session_config`` and TF's
defaults: an edge into or out of the contraction or the ``BiasAdd`` keeps all three apart, one
into or out of the activation keeps the activation apart). With oneDNN on it also runs a
``FusedBatchNorm`` with the ``Relu`` that is its output 0's only reader as one kernel
(``_FusedBatchNormEx``, under the batch norm's name), unless either has a control edge; fused,
the ``Relu``'s output is the batch norm's and a workspace (``reserve_space_3``, an eighth of the
output) lives until the gradient reads it, apart the ``Relu`` takes the output's buffer over and
there is no workspace. The memory plans are calibrated on the user's step, where the pair is
fused: left apart in the placed zoo resnet, a device measured 0.31 MiB below its
plan (2026-12-07). The rematerialization rewrite pins
the backward pass with exactly such edges, so the rewritten step ran its clones unfused: on the
mlp ``activations`` preset at ratio 0.5 its ``BiasAdd`` cost 6.2 ms a step against 0.15 ms in
the user's step, its ``Relu`` 74 ms against 43 ms, while the plan was costed on the fused
profile.

The pass moves the edges off a group without changing what runs after what:

- **Control inputs** of the contraction (or batch norm) or the ``BiasAdd`` move to a gate: an
  ``Identity`` on the node's other data input (the head's input 0, the ``BiasAdd``'s bias) that
  carries them; the activation's (its one input is the previous member's output) move to the
  previous member's gate. Each member still starts after every op it waited for; an identity allocates nothing.
- **Control readers** of a member wait for the group's end instead: an ``Identity`` of the
  group's last output. Fused, the group is one kernel, so its end is each member's end. An
  edge between two members is dropped: data edges order them already.
- A group whose moved edges would close a cycle (a control reader that feeds the group, an
  activation's control input that comes after the ``BiasAdd``) keeps its edges, and stays
  unfused.

The pass runs last, on the finished ``GraphDef`` (``remat.rewrite``,
``remat.early_updates.order_updates_after_reads``). Precondition: an acyclic graph.
Postcondition (checked): still acyclic, or the graph is left as it was.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

from graphfit.profiler.graph_def_walk import GraphDefPassError, split_input, topological_order

__all__ = ["CONTRACTION_OP_TYPES", "ACTIVATION_OP_TYPES", "GATE_SUFFIX", "DONE_SUFFIX",
           "gate_node", "keep_remapper_fusions"]

CONTRACTION_OP_TYPES = frozenset({"MatMul", "Conv2D", "DepthwiseConv2dNative"})
# Batch norms the remapper fuses with a Relu (CPU with oneDNN, TF 2.21).
BATCH_NORM_OP_TYPES = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
# Activations the remapper fuses after a contraction and its BiasAdd (CPU, TF 2.21).
ACTIVATION_OP_TYPES = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})
GATE_SUFFIX = "/fusion_gate"
DONE_SUFFIX = "/fusion_done"


def gate_node(name: str, source: str, member: tf.compat.v1.NodeDef) -> tf.compat.v1.NodeDef:
    """A new ``Identity`` named ``name`` of ``source`` (an input or the output of ``member``, so
    of ``member``'s type ``T``), on ``member``'s device and colocated with it: a placer that put
    it elsewhere would copy the tensor across. ``pipeline.verify`` knows it by its name's
    suffix and its colocation."""
    node = tf.compat.v1.NodeDef(name=name, op="Identity", device=member.device)
    node.input.append(source)
    node.attr["T"].CopyFrom(member.attr["T"])
    node.attr["_class"].list.s.append(f"loc:@{member.name}".encode())
    return node


@dataclasses.dataclass(frozen=True)
class _Group:
    """A remapper group: its head (a contraction, or a batch norm), the head's ``BiasAdd``
    (``None`` after a batch norm), the activation (or ``None``)."""
    head: str
    bias_add: str | None
    activation: str | None

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(n for n in (self.head, self.bias_add, self.activation) if n)

    @property
    def last(self) -> str:
        return self.members[-1]

    @property
    def before_activation(self) -> str:
        """The member the activation reads (where its control inputs go)."""
        return self.bias_add or self.head


def _groups(nodes: dict) -> list[_Group]:
    """The contraction + ``BiasAdd`` (+ activation) and batch norm + ``Relu`` groups the
    remapper could fuse: each member's output 0 read (data) by the next member alone, on one
    device and dtype."""
    readers = collections.defaultdict(list)        # (node, port) -> data readers
    for node in nodes.values():
        for k, name in enumerate(node.input):
            producer, port = split_input(name)
            if port >= 0:
                readers[producer, port].append((node.name, k))

    def only_reader(name: str, op_types: frozenset) -> str | None:
        found = readers[name, 0]
        if len(found) != 1 or found[0][1] != 0:
            return None
        reader = nodes[found[0][0]]
        if reader.op not in op_types or reader.device != nodes[name].device:
            return None
        # (Both op types have a ``T``: reading a missing key of a NodeDef's map would add it.)
        return reader.name if reader.attr["T"] == nodes[name].attr["T"] else None

    groups = []
    for node in nodes.values():
        if node.op in CONTRACTION_OP_TYPES:
            bias_add = only_reader(node.name, frozenset({"BiasAdd"}))
            if bias_add:
                groups.append(_Group(node.name, bias_add,
                                     only_reader(bias_add, ACTIVATION_OP_TYPES)))
        elif node.op in BATCH_NORM_OP_TYPES:
            relu = only_reader(node.name, frozenset({"Relu"}))
            if relu:
                groups.append(_Group(node.name, None, relu))
    return groups


def keep_remapper_fusions(graph_def: tf.compat.v1.GraphDef) -> dict:
    """Move control edges off every remapper group of ``graph_def``, in place (module
    docstring).

    Returns:
        ``{"groups": ..., "freed": ..., "blocked": ...}``: remapper groups found, groups that
        had control edges and have none now, groups left with theirs (a cycle otherwise).

    Raises:
        GraphDefPassError: the graph has a cycle or a dangling input.
    """
    order = topological_order(graph_def)
    position = {name: k for k, name in enumerate(order)}
    nodes = {node.name: node for node in graph_def.node}
    groups = _groups(nodes)
    group_of = {member: group for group in groups for member in group.members}
    inputs_of = {name: [split_input(i)[0] for i in nodes[name].input] for name in nodes}

    def reaches(source: str, target: str) -> bool:
        # Whether ``source`` is an ancestor of ``target``: search back from ``target`` only
        # as far as ``source``'s position in the order.
        floor, stack, seen = position[source], [target], {target}
        while stack:
            for producer in inputs_of[stack.pop()]:
                if producer == source:
                    return True
                if producer not in seen and position[producer] > floor:
                    seen.add(producer)
                    stack.append(producer)
        return False

    def controls(name: str) -> list[str]:
        return [split_input(i)[0] for i in nodes[name].input if i.startswith("^")]

    new_nodes: dict[str, tf.compat.v1.NodeDef] = {}

    def helper(name: str, source: str, member: str) -> tf.compat.v1.NodeDef:
        # The ``gate_node`` named ``name`` (made once) of ``source``. One made by an earlier
        # run of this pass (a later pass added edges: a placement's order) is reused.
        if name in nodes:
            node = nodes[name]
            if node.op != "Identity" or not node.input or node.input[0] != source:
                raise GraphDefPassError(f"cannot add {name!r}: the graph has that node")
            return node
        if name not in new_nodes:
            new_nodes[name] = gate_node(name, source, nodes[member])
        return new_nodes[name]

    control_readers = collections.defaultdict(set)   # group -> non-member control readers
    for node in graph_def.node:
        for producer in controls(node.name):
            group = group_of.get(producer)
            if group and node.name not in group.members:
                control_readers[group].add(node.name)
    # The control inputs of the activation (whose one input is the BiasAdd's output) go to the
    # BiasAdd's gate: that would close a cycle if one of them comes after the BiasAdd. A
    # control reader that feeds the group could not wait for its end. Such groups keep their
    # edges.
    touched = [g for g in groups if control_readers[g] or any(controls(m) for m in g.members)]
    movable = [g for g in touched
               if not any(reaches(reader, g.last) for reader in control_readers[g])
               and not (g.activation and any(reaches(g.before_activation, c)
                                             for c in controls(g.activation)))]
    if not movable:          # nothing to move: no copy of the graph, no new node
        return {"groups": len(groups), "freed": 0, "blocked": len(touched)}
    done = {g.last: helper(g.last + DONE_SUFFIX, g.last, g.last).name for g in movable
            if control_readers[g]}
    end_of = {m: done[g.last] for g in movable if g.last in done for m in g.members}
    original = tf.compat.v1.GraphDef()
    original.CopyFrom(graph_def)
    # Control readers of a member wait for the group's end instead.
    for node in graph_def.node:
        if any(c in end_of for c in controls(node.name)):
            own = group_of.get(node.name)
            kept = []
            for name in node.input:
                producer = split_input(name)[0]
                if name.startswith("^") and producer in end_of:
                    if own is not None and producer in own.members:
                        continue             # the data edges order the members
                    name = "^" + end_of[producer]
                if name not in kept:
                    kept.append(name)
            del node.input[:]
            node.input.extend(kept)
    # No member keeps a control input: the head's and the BiasAdd's go to a gate on their
    # other data input, the activation's to the gate of the member it reads.
    for group in movable:
        moved = {name: controls(name) for name in (group.head, group.bias_add) if name}
        if group.activation:
            moved[group.before_activation] += controls(group.activation)
        for name in group.members:
            data = [i for i in nodes[name].input if not i.startswith("^")]
            del nodes[name].input[:]
            nodes[name].input.extend(data)
        for name, sources in moved.items():
            port = 0 if name == group.head else 1
            producer = split_input(nodes[name].input[port])[0]
            sources = list(dict.fromkeys(c for c in sources
                                         if c != producer and c not in group.members))
            if sources:
                gate = (nodes[producer] if producer == name + GATE_SUFFIX  # gated before
                        else helper(name + GATE_SUFFIX, nodes[name].input[port], name))
                gate.input.extend("^" + c for c in sources if "^" + c not in gate.input)
                nodes[name].input[port] = gate.name
    graph_def.node.extend(new_nodes.values())
    try:
        topological_order(graph_def)
    except GraphDefPassError:   # edges of two groups closed a cycle together: change nothing
        graph_def.CopyFrom(original)
        movable = []
    return {"groups": len(groups), "freed": len(movable),
            "blocked": len(touched) - len(movable)}
