"""Lower a rematerialization plan into a TensorFlow graph: clones, rewired reads, control edges.

The pass takes a training step (``GraphItem``), the ``CostGraph`` a planner worked on and its
``RematPlan``, and returns a NEW step whose executor really runs the plan (DESIGN.md §4):

- **SSA clones.** The k-th ``recompute`` of op ``n`` becomes a copy of its NodeDef named
  ``n/remat_k``. The original keeps its name, so every fetched and fed name (train op, loss,
  gradients, placeholders, initialiser) still resolves.
- **Rewiring.** Walking the plan in order, each computed or recomputed op reads the newest
  version of each input that exists at its position in the plan. An original tensor whose
  later readers all moved to a clone dies after its last remaining reader, which is where the
  memory is saved. An ``Identity``/``IdentityN`` output is a view of its input's buffer
  (``remat.tf_memory``): a reader of a view whose source was recomputed after the view was
  taken reads the newer source itself, or the view would hold the old buffer alive.
- **Control edges.** TF's executor starts a node as soon as its inputs are ready, so a clone
  with only data inputs would run during the forward pass and save nothing. A control edge from
  the node of the previous plan event pins a node to its place in the plan. Anchoring only the
  clones (``pin_order="clones"``, one edge per clone; DESIGN.md's hand experiment anchored each
  segment's clones on the ReluGrad of its checkpoint layer) is not enough in general: the anchor
  may itself be an op TF runs early (a shape, a variable update), and the executor's two
  inter-op threads then run a clone next to the forward ops of another segment (measured on
  the 16-layer MLP: a clone of layer 3 running beside layer 15's, +20 MiB over the plan). The
  default ``pin_order="tail"`` chains every node in plan order (one edge per node, skipped
  where a data edge already orders the pair, and for source nodes, such as variable handles,
  which an initialiser may read) from the backward pass on: from the first gradient op that
  reads an activation (``backward_start``), or from the first recomputation if that comes
  earlier. The backward pass then runs in the plan's order, as the memory prediction
  assumes, while each kernel keeps its intra-op threads.
  Starting only at the first recomputation is not enough: when it comes late in the backward
  pass, the ops before it float, a layer's weight gradient (``MatMul_1``) and input gradient
  (``MatMul``) run side by side, and the slower one holds the activation or gradient both read
  past its planned free (measured on an 8-layer MLP of width 256: one or two 2 MiB buffers,
  +19 % / +38 %, in about one run of three). The forward pass keeps TF's own order, which the
  calibrated cost graph (``remat.tf_memory``) follows, and its inter-op parallelism (pinning
  it too cost Inception-V3 10-25 % step time). ``pin_order="all"`` chains from the plan's
  first event on: with nothing recomputed, the step one op at a time in the runtime and under
  the configuration the rewritten step runs with, which ``remat.step_time`` times.
- **Edges from nodes Grappler keeps.** Grappler folds some pinned nodes into constants and
  drops others; a node pinned after one of them would be ordered after nothing.
  ``remat.grappler_pins`` runs Grappler offline on the pinned step and gives such nodes an
  edge from what the removed node waited for.
- **Edges Grappler cannot re-associate away.** Where a data edge from the previous event
  already orders a pinned node, an ordering edge would be redundant, except on ``Mul``,
  ``Add`` and ``AddV2``: Grappler's arithmetic optimizer (its ``MinimizeBroadcasts`` and
  ``AddOpsRewrite`` stages) regroups a tree of such ops, handing inputs from one node to
  another, and it leaves alone only nodes with a control edge in or out. On a Keras attention
  step it turned ``mul_1 = sub * Softmax`` (pinned by its read of ``sub``) into
  ``mul_1 = scale * Softmax``, which then ran as soon as the recomputed ``Softmax`` existed
  and held a new 4 MiB buffer until ``sub`` ran (measured peak 1.04-1.19 of the plan with
  two events side by side). An ordering edge from the node the data edge comes from does not
  help: Grappler drops a control input that is also a data input. Such a node gets an edge
  from the latest earlier event that is not one of its data inputs: that event has finished
  anyway, so the edge changes no order, and it keeps the node out of the regrouping.
- **Floating events where memory allows** (``remat.pipeline.rematerialize(...,
  side_by_side=True)``; ``pipeline.optimize`` when it verifies). A strict chain also takes TF's
  inter-op parallelism from the backward pass (on a Keras attention step 1.21-1.24x the
  user's step with nothing recomputed). ``remat.side_by_side`` marks the events that may run
  as soon as their inputs exist without the plan's peak noticing (``floating``): such a node
  gets no pin, and every pinned node waits for the latest pinned node before it and for the
  floating events joined to it (``remat.side_by_side``'s joins: the first pinned event after
  a floating one, or a later one where the late bound allows), which is what the bound
  assumes.
- **oneDNN's run-time fusions.** With oneDNN on (``TF_ENABLE_ONEDNN_OPTS=1``), TF's
  ``MklLayoutRewritePass`` runs after Grappler, on the graph the session executes, and merges
  node pairs into one node (``remat.tf_memory.FUSABLE_PAIRS``: ``Conv2D`` + ``BiasAdd``, ``Pad``
  + ``Conv2D`` or ``_FusedConv2D``, ``Conv2DBackpropFilter`` + ``BiasAddGrad``). It merges a
  pair when the first's output feeds only the second (or, for the gradient pair, both read the
  same gradient), on one device, and both have the same control inputs; the merged node takes
  the inputs and outputs, data and control, of both. A pair that the plan's ordering edges
  connect through a third node (first -> ... -> X -> second) would become a cycle (measured on a
  Keras ResNet-50: ``Retval[0] does not have value``, or ``nodes in a cycle``), and a pair whose
  two nodes have the same, non-empty control inputs aborts the process (the merge checks that
  each node has only its data inputs: ``Check failed: pred->in_edges().size() == 2``). The
  rewrite checks every such pair of the rewritten graph and gives a pair of either kind a
  control edge from its earlier to its later node: the two control sets then differ and the pass
  leaves the pair unfused. Most pinned pairs are unfused anyway (the first waits for the
  previous plan event, the second only for the first), so oneDNN fuses mainly in the unpinned
  forward pass. The planning graph keeps such a pair in one node (``remat.tf_memory``), so a
  plan never puts another op between the two.
- **Grappler's remapper fusions.** The remapper runs a ``MatMul``/``Conv2D`` with its
  ``BiasAdd`` and activation as one kernel only when none of them has a control edge, which
  the pinning gives them; ``profiler.remapper_fusions`` then moves those edges onto gates and onto
  the group's end, so clones run fused as in the user's step.
- **Grappler itself.** A ``Pow`` with a control input makes Grappler's arithmetic optimizer
  emit an invalid node, and the session then runs the whole step without Grappler (keras-hub's
  GPT-2 and BERT at 0.5 ran 1.5-2x the user's step so; bench/RESULTS.md);
  ``profiler.pow_conversions`` moves the edges onto a gate.
- **Safety.** Stateful, random and variable ops, ops that read a resource (a variable read
  repeated after the optimizer wrote the variable would see the new value) and placeholders
  are never cloned: a plan that asks for it raises ``RematRewriteError``.

Grappler: rewritten graphs run under ``profiler.session.session_config``: Grappler at TF's
defaults without common-subgraph elimination and the dependency optimizer, the classic
optimizer at L0. CSE would merge a clone with the same op, attributes and inputs back into its
original, which then lives from the forward to the backward pass. An attribute on the clone
is not enough: the remapper fuses ``MatMul`` + ``BiasAdd`` + ``Relu`` clones into a
``_FusedMatMul`` without it, and CSE then merges the original's fused node into the clone's
(measured on the tiny mlp: the original ``layer_0/Relu`` is gone from the trace). The
dependency optimizer would strip the edges that keep oneDNN's merge away (above).

Pre- and postconditions are checked: the cost graph describes this graph, the rewritten step is
acyclic, every pinned node (every clone that does not float at least) keeps its edges from the
nodes it must run after, and every input names a node of the graph.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from graphfit.errors import GraphfitError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.cost_graph import CostGraph
from graphfit.profiler.tf_function import BACKWARD_SCOPE
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, RematPlan
from graphfit.profiler.session import EXACT_GRAPH, session_config
from graphfit.profiler.trace import step_fetches
from graphfit.profiler.graph_def_walk import GraphDefPassError, topological_order
from graphfit.remat.early_updates import VARIABLE_WRITE_OP_TYPES
from graphfit.remat.grappler_pins import repin_removed_anchors
from graphfit.remat.recompute_graph import clone_name
from graphfit.profiler.pow_conversions import keep_pow_conversions
from graphfit.profiler.remapper_fusions import keep_remapper_fusions
from graphfit.remat.tf_memory import FUSABLE_PAIRS, IDENTITY_OP_TYPES
from graphfit.remat.validate import recomputable_ops

__all__ = ["PIN_ORDERS", "RematRewriteError", "rewrite", "clone_name",
           "check_recomputable", "backward_start"]




# Ops Grappler's arithmetic optimizer regroups (re-associates) unless they have a control edge:
# where they float, they keep one from an event before their inputs (``_regrouping_guard``).
REGROUPED_OP_TYPES = frozenset({"Mul", "Add", "AddV2"})
# Ops oneDNN's pass may merge. The two nodes of a pair it could merge (``_fusable_pairs``)
# stay pinned where events float: a floating pair made a Keras ResNet-style step fail with
# `Retval[0] does not have value` in one CI run with oneDNN on; pinned, as in the strict
# chain, they never did.
FUSABLE_OP_TYPES = frozenset(t for pair in FUSABLE_PAIRS for t in pair[:2])


class RematRewriteError(GraphfitError, ValueError):
    """A plan cannot be lowered into the graph (unsafe clone, mismatched graph, cycle)."""




def check_recomputable(cost_graph: CostGraph, op: int) -> None:
    """Raise ``RematRewriteError`` unless running op ``op`` a second time is safe.

    Recomputing is safe for pure functions of their inputs only (``remat.validate.
    recomputable_ops``): stateful ops (variable reads and updates, queues), random ops (a new
    draw would differ from the first), variables and placeholders keep their single execution,
    and their outputs stay resident.
    """
    if recomputable_ops(cost_graph)[op]:
        return
    flags = [name for name in ("is_stateful", "is_random", "is_variable", "reads_resource")
             if getattr(cost_graph, name)[op]] or ["a placeholder"]
    raise RematRewriteError(
        f"the plan recomputes op {cost_graph.names[op]!r} ({cost_graph.op_types[op]}; "
        f"{', '.join(flags)}): recomputing it would not reproduce its outputs; the planner "
        "must keep its outputs resident (never evict them)")


def _split_input(name: str) -> tuple[str, str]:
    """``'^a'`` -> ``('a', '^')``, ``'a:1'`` -> ``('a', ':1')``, ``'a'`` -> ``('a', '')``."""
    if name.startswith("^"):
        return name[1:], "^"
    producer, sep, port = name.rpartition(":")
    if sep and port.isdigit():
        return producer, ":" + port
    return name, ""


def _check_plan_matches(graph_def: tf.compat.v1.GraphDef, cost_graph: CostGraph,
                        plan: RematPlan) -> None:
    names = {node.name for node in graph_def.node}
    missing = [n for n in cost_graph.names if n not in names]
    if missing:
        raise RematRewriteError(
            f"the cost graph names {len(missing)} ops the graph lacks (e.g. {missing[0]!r}): "
            "it was built for another graph; build it from this item")
    computed = [e.index for e in plan.events if e.kind == COMPUTE]
    if sorted(computed) != list(range(cost_graph.num_ops)):
        raise RematRewriteError(
            f"the plan computes {len(computed)} ops ({len(set(computed))} distinct) but the cost "
            f"graph has {cost_graph.num_ops}: every op must be computed exactly once")
    for event in plan.events:
        if event.kind not in (COMPUTE, RECOMPUTE, FREE):
            raise RematRewriteError(f"unknown plan event kind {event.kind!r}")


def _successors(graph_def: tf.compat.v1.GraphDef) -> dict[str, set[str]]:
    """Node -> the nodes reading it (data or control); raise on an input naming no node."""
    successors: dict[str, set[str]] = {node.name: set() for node in graph_def.node}
    for node in graph_def.node:
        for name in node.input:
            producer, _ = _split_input(name)
            if producer not in successors:
                raise RematRewriteError(
                    f"node {node.name!r} reads {name!r}, which names no node of the rewritten "
                    "graph")
            successors[producer].add(node.name)
    return successors


def _check_acyclic(graph_def: tf.compat.v1.GraphDef) -> None:
    """Raise naming a node on a cycle of data and control edges."""
    try:
        topological_order(graph_def)
    except GraphDefPassError as error:
        raise RematRewriteError(
            f"{error}: the plan's order contradicts the graph's dependencies") from None


def _check_pinned(graph_def: tf.compat.v1.GraphDef, anchors: dict[str, list[str]]) -> None:
    """Raise unless every pinned node reads (data or control) each node it must run after."""
    nodes = {node.name: node for node in graph_def.node}
    for name, node_anchors in anchors.items():
        before = {_split_input(i)[0] for i in nodes[name].input}
        for anchor in node_anchors:
            if anchor not in before:
                raise RematRewriteError(f"{name!r} lost its edge from {anchor!r}, which holds "
                                        "it at its place in the plan")


def _fusable_pairs(nodes: dict) -> list[tuple[str, str]]:
    """``(first, second)`` node pairs of ``FUSABLE_PAIRS`` the oneDNN pass could merge (the
    first's output 0 read only by the second, or both reading the same gradient; one
    device)."""
    readers = collections.defaultdict(list)       # "node:port" -> reading nodes
    for node in nodes.values():
        for name in node.input:
            producer, suffix = _split_input(name)
            if suffix != "^":
                readers[producer + (suffix or ":0")].append(node.name)
    pairs = []
    for first_type, second_type, port in FUSABLE_PAIRS:
        for first in (n for n in nodes.values() if n.op == first_type):
            if port is None:
                if len(first.input) < 3:
                    continue
                producer, suffix = _split_input(first.input[2])
                candidates = [r for r in readers[producer + (suffix or ":0")]
                              if nodes[r].op == second_type
                              and _split_input(nodes[r].input[0]) == (producer, suffix)]
            else:
                candidates = readers[first.name + ":0"]
                if len(candidates) != 1 or nodes[candidates[0]].op != second_type or \
                        _split_input(nodes[candidates[0]].input[port])[0] != first.name:
                    continue
            pairs += [(first.name, second) for second in candidates
                      if nodes[second].device == first.device]
    return pairs


def _protect_fusions(graph_def: tf.compat.v1.GraphDef) -> int:
    """Make every ``FUSABLE_PAIRS`` pair safe for oneDNN's merge (module docstring): a pair
    connected through a third node, or whose two nodes wait for the same control inputs, gets
    a control edge from its earlier to its later node, so the two control sets differ and the
    pass leaves the pair unfused. The edge is implied by the graph already (or joins two nodes
    no path joins), so what reaches what never changes and one analysis serves all pairs.
    Returns the number of pairs left unfused."""
    nodes = {node.name: node for node in graph_def.node}
    successors = _successors(graph_def)
    position = {name: k for k, name in enumerate(topological_order(graph_def))}

    def connected_through_another(first: str, second: str) -> bool:
        # A path first -> ... -> second other than the direct edge, or second -> ... -> first.
        source, target = (first, second) if position[first] < position[second] else (
            second, first)
        stack = [s for s in successors[source] if s != target]
        seen = set(stack)
        while stack:
            name = stack.pop()
            if name == target:
                return True
            for succ in successors[name]:
                if succ not in seen and position[succ] <= position[target]:
                    seen.add(succ)
                    stack.append(succ)
        return False

    unfused = 0
    for first, second in _fusable_pairs(nodes):
        controls = [{name for name in nodes[n].input if name.startswith("^")}
                    for n in (first, second)]
        if connected_through_another(first, second) or controls[0] == controls[1] != set():
            earlier, later = sorted((first, second), key=position.get)
            if "^" + earlier not in nodes[later].input:
                nodes[later].input.append("^" + earlier)
            unfused += 1
    return unfused


# Ops that read a tensor's shape only (TF runs them as soon as the tensor exists).
_SHAPE_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def backward_start(item: GraphItem, cost_graph: CostGraph, computed: Iterable[int]
                   ) -> str | None:
    """The first op of ``computed`` (op ids of ``cost_graph`` in the order a plan first
    computes them) in the backward pass that reads an activation: outside the
    loss's data fan-in, reading a tensor of the fan-in that depends on a variable (not a
    shape of the feeds, a constant, a variable read itself) and, when the graph names its
    backward pass (``gradient_tape/``, ``gradients/``), under that name scope. That is where
    the backward pass starts using the forward pass's tensors (``None``: no such op).
    Shape ops (``Shape``, ``ShapeN``, ``Size``, ``Rank``) read no values and never start it.

    Control inputs are not followed, and the loss is found behind ``Identity`` ops: a traced
    ``tf.function`` returns its loss through an ``Identity`` that waits for every update.
    Ops that read only shapes of the feeds (a Keras step's first loss-gradient op divides by
    the batch size) and BatchNorm's moving-average updates read forward tensors long before
    the backward pass: pinning from one of them chained the whole forward pass too (measured
    on the Keras conv net: from op 88 of 1156 on). So do ops that read only weights: a
    variable read, or what is computed from variable reads and constants alone, is not an
    activation. ``remat.patch_convs`` reshapes a 1x1 filter for its input gradient
    (``.../pixels/w``) under the backward's name; a plan computes that reshape in the
    forward pass, as soon as the weight is read, and pinning from it chained the forward
    pass of ``keras.applications.ResNet50`` from its first layer on (oneDNN off, 674 forward
    nodes given ordering edges). Grappler's arithmetic optimizer leaves any node with a
    control edge alone, so the residual adds stayed as traced where the user's step
    regroups them (``AddOpsRewrite``): the loss moved by 3.3e-6 (relative) and the weight
    updates by up to 2.0e-4 (absolute; 2.9e-3 of the largest weight update), the same in
    each of three plans (2026-12-07)."""
    loss_op = item.graph.get_operation_by_name(item.loss.split(":")[0])
    while loss_op.type == "Identity":
        loss_op = loss_op.inputs[0].op
    forward, stack = set(), [loss_op]
    while stack:
        op = stack.pop()
        if op.name not in forward:
            forward.add(op.name)
            stack.extend(t.op for t in op.inputs)
    downstream: set[str] = set()       # forward ops downstream of a variable
    weights: set[str] = set()          # of which computed from variables and constants only
    for name in cost_graph.names:      # topological
        if name not in forward:
            continue
        inputs = item.graph.get_operation_by_name(name).inputs
        if any(t.dtype == tf.resource or t.op.name in downstream for t in inputs):
            downstream.add(name)
            if all(t.dtype == tf.resource or t.op.type == "Const" or t.op.name in weights
                   for t in inputs):
                weights.add(name)
    activations = downstream - weights
    scoped = any(BACKWARD_SCOPE.search(name) for name in cost_graph.names)
    for index in computed:
        name = cost_graph.names[index]
        if (name in forward or cost_graph.op_types[index] in _SHAPE_OP_TYPES or
                (scoped and not BACKWARD_SCOPE.search(name))):
            continue
        if any(t.op.name in activations and t.dtype != tf.resource
               for t in item.graph.get_operation_by_name(name).inputs):
            return name
    return None


PIN_ORDERS = ("tail", "all", "clones")


def _data_producers(node: tf.compat.v1.NodeDef) -> set[str]:
    """The nodes ``node`` reads data from (not its control inputs)."""
    return {_split_input(name)[0] for name in node.input if not name.startswith("^")}


def _needs_regrouping_guard(node: tf.compat.v1.NodeDef) -> bool:
    """Whether Grappler may regroup ``node``: a ``REGROUPED_OP_TYPES`` node with no control
    input other than one of its data inputs."""
    data = _data_producers(node)
    return node.op in REGROUPED_OP_TYPES and not any(
        name.startswith("^") and name[1:] not in data for name in node.input)


def _regrouping_guard(node: tf.compat.v1.NodeDef, events_run: list[str],
                      anchors: "Collection[str]") -> str | None:
    """For a ``REGROUPED_OP_TYPES`` node without a control input Grappler keeps: the latest
    event, no later than its ``anchors`` (so it has finished when the node may start, for a
    pinned node; for a floating one, its data inputs), that is not one of its data inputs
    (module docstring, "Edges Grappler cannot re-associate away"); ``None`` if it needs none
    or none exists."""
    if not anchors or not _needs_regrouping_guard(node):
        return None
    data = _data_producers(node)
    reached = False                      # at or before the latest anchor
    for name in reversed(events_run):
        reached = reached or name in anchors
        if reached and name not in data:
            return name
    return None


def _hold_floating_chains(chains: "Iterable[list[tuple[tf.compat.v1.NodeDef, bool]]]") -> int:
    """Give each floating node of a chain (the ops of one planning event, with whether each
    floats) a control edge from every node outside the chain that any of its ops reads: the
    floating bound (``remat.side_by_side``) takes the chain's start from all of its inputs,
    while its first op alone could start as soon as its own exist (measured on the mlp
    ``activations`` step, batch 1024, at 0.5: an input gradient's ``MatMul``, chained with
    the next layer's ``ReluGrad`` that waits for a recomputed activation, ran ahead beside a
    weight gradient and held a 1 MiB buffer over the plan, in 3 of 4 runs). Returns the
    number of edges added."""
    added = 0
    for chain in chains:
        names = {node.name for node, _ in chain}
        outside = list(dict.fromkeys(
            _split_input(name)[0] for node, _ in chain for name in node.input
            if _split_input(name)[0] not in names))
        for node, floats in chain:
            present = {_split_input(name)[0] for name in node.input}
            for producer in outside if floats else ():
                if producer not in present:
                    node.input.append("^" + producer)
                    added += 1
    return added


def update_math(graph_def: tf.compat.v1.GraphDef) -> set[str]:
    """The nodes whose every reader is a variable write or another such node: an optimizer's
    arithmetic on a gradient (Adam's moments and step, SGD's scaled gradient) and gradients
    that only it reads. Stateful nodes (variable reads among them) never are.

    Such a node may run as soon as its inputs exist, like a floating event, whatever the
    floating bound says (``rewrite``'s ``float_updates``): its output is a variable's size
    and lives only until the pinned write, and in a chain the optimizer's arithmetic runs
    one op at a time beside nothing. Unpinning the 1,778 such ops of keras-hub GPT-2's
    strict chain at 0.5 took its step from 1.175 to 1.148 of the planned step for +1 MiB
    (0.9%) of its records; floating in ``optimize``'s steps (833 ops), GPT-2 measured 1.145
    of the user's step against 1.159 before, the records within 0.97-1.00 of the plans of
    the five bench models (2026-12-07, ``bench/RESULTS.md``). No bound holds it: a weight
    gradient whose inputs exist long before its place in the plan holds its product from
    then on. After a pass had removed the identities between ``ConvNeXtTiny``'s weight
    gradients and their updates, its floating step read 1.47 of its plan by the records, and
    the closed loop fell back to the strict chain, as it does for any step whose records miss.
    Letting the bound choose such nodes like any other event cost 1-5 points of the user's
    step on GPT-2, BERT, EfficientNetB0 and ResNet50 (2026-12-07), so the rule stays."""
    readers: dict[str, list[str]] = collections.defaultdict(list)
    nodes = {node.name: node for node in graph_def.node}
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):
                readers[_split_input(name)[0]].append(node.name)
    found: set[str] = set()
    for name in reversed(topological_order(graph_def)):
        node = nodes[name]
        op_def = op_def_registry.get(node.op)
        if op_def is None or op_def.is_stateful or not node.input or name not in readers:
            continue
        if all(nodes[r].op in VARIABLE_WRITE_OP_TYPES or r in found for r in readers[name]):
            found.add(name)
    return found


def rewrite(item: GraphItem, cost_graph: CostGraph, plan: RematPlan,
            pin_order: str = "tail", floating: "Mapping[int, int]" = MappingProxyType({}),
            joins: "Mapping[int, int]" = MappingProxyType({}),
            float_updates: bool = False) -> GraphItem:
    """A new training step that executes ``plan`` (the original ``item`` is left untouched).

    Parameters:
        item: the training step the cost graph was built from.
        cost_graph: the planner's IR of ``item``'s step (op ids of ``plan`` index it).
        plan: compute / recompute / free events; free events need no graph change (TF frees a
            tensor when its last reader finished, and rewiring moved the later readers away).
        pin_order: ``"tail"``: every node from the backward pass's first read of the forward
            pass (or the first recomputation, if earlier) on gets a control edge from the
            previous plan event's node; ``"all"``: every node from the plan's first event
            on does; ``"clones"``: only clones do.
        floating: positions in ``plan.events`` of events that may run as soon as their inputs
            exist (``remat.side_by_side.unpinned_events``), each mapped to the position of
            the first op of its chain (``remat.side_by_side.expanded_positions``; itself for
            an op alone): such a node gets no pin, and every pinned node waits for the latest
            pinned node and the floating ones joined to it. A floating op of a chain also waits
            for every input of its chain (``_hold_floating_chains``).
        joins: the position of the pinned node that waits for each floating one
            (``remat.side_by_side.expanded_joins``); without one, the next pinned node. A
            join that falls on a node the rewrite does not pin (a source) passes to the next
            pinned node.
        float_updates: the optimizer's arithmetic (``update_math``) floats too, joined as a
            floating event is.

    Returns:
        A ``GraphItem`` on a fresh ``tf.Graph`` with the same fetch, feed and init names;
        ``config["remat"]`` records the number of clones and control edges added, and
        ``pinned_from``: the position in ``plan.events`` from which ``"tail"`` (or ``"all"``)
        chains every event (``remat.step_time`` predicts the step's time from it).

    Raises:
        RematRewriteError: the plan recomputes an unsafe op (stateful, random, variable,
            resource read, placeholder), does not match the cost graph or this graph, or
            would create a cycle or a name clash.

    References:
        Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021 (the plans);
        DESIGN.md §4 (lowering into TF's executor).
    """
    if pin_order not in PIN_ORDERS:
        raise ValueError(f"pin_order {pin_order!r} is not one of {PIN_ORDERS}")
    graph_def = item.graph.as_graph_def()
    _check_plan_matches(graph_def, cost_graph, plan)
    nodes = {node.name: node for node in graph_def.node}
    version: dict[str, str] = {}        # op name -> node holding its newest version
    origin: dict[str, str] = {}         # clone name -> op name
    clone_count: collections.Counter[str] = collections.Counter()
    clones = []
    safe = recomputable_ops(cost_graph)
    previous = None                      # node of the plan's previous compute / recompute
    first_read = backward_start(item, cost_graph,
                                (e.index for e in plan.events if e.kind == COMPUTE))
    pinning = False                      # "tail": from the backward pass on
    pinned_from = len(plan.events)       # position of the first pinned event
    control_edges = 0
    anchors: dict[str, list[str]] = {}  # pinned node -> the nodes it must run after
    events_run: list[str] = []           # per (re)compute event, its node
    last_pinned = None                   # the latest node that waits for the ones before it
    joined: dict[int, list[str]] = collections.defaultdict(list)  # position -> floating nodes
    due: list[str] = []                  # floating nodes the next pinned node waits for
    chains: dict[int, list] = collections.defaultdict(list)  # first position -> (node, floats)
    updates = update_math(graph_def) if float_updates else frozenset()
    fusable = {name for pair in _fusable_pairs(nodes) for name in pair}
    updates_floating = 0

    def newest(producer: str, suffix: str) -> str:
        # What a read of ``producer`` + ``suffix`` reads now (see "Rewiring" above). A clone
        # copies its original's inputs as rewired when the original ran, which may name an
        # older clone: read through it to the op.
        producer = origin.get(producer, producer)
        name = version.get(producer, producer)
        view = nodes[name]
        if view.op in IDENTITY_OP_TYPES:
            source, source_suffix = _split_input(view.input[int(suffix[1:] or 0)])
            original = origin.get(source, source)
            if version.get(original, original) != source:
                return newest(original, source_suffix)
        return name + suffix

    def rewire(node) -> None:
        for k, name in enumerate(node.input):
            producer, suffix = _split_input(name)
            if suffix != "^":
                node.input[k] = newest(producer, suffix)

    for position, event in enumerate(plan.events):
        if event.kind == FREE:
            continue
        op_name = cost_graph.names[event.index]
        if event.kind == COMPUTE:
            node = nodes[op_name]
            rewire(node)
            version[op_name] = op_name
        else:
            if not safe[event.index]:
                check_recomputable(cost_graph, event.index)
            if op_name not in version:
                raise RematRewriteError(
                    f"the plan recomputes {op_name!r} before computing it")
            clone_count[op_name] += 1
            node = tf.compat.v1.NodeDef()
            node.CopyFrom(nodes[op_name])
            node.name = clone_name(op_name, clone_count[op_name])
            if node.name in nodes:
                raise RematRewriteError(
                    f"cannot name the clone {node.name!r}: the graph already has that node")
            rewire(node)
            if previous is None:
                raise RematRewriteError(f"the plan starts with a recompute of {op_name!r}")
            nodes[node.name] = node
            origin[node.name] = op_name
            clones.append(node)
            version[op_name] = node.name
        if not pinning and (pin_order == "all" or event.kind == RECOMPUTE or
                            op_name == first_read):
            pinning, pinned_from = True, position
        # A source node (no inputs: a variable's handle, a constant) is never held back:
        # nothing waits in memory for it, and the initialiser, which may read it, must not
        # wait for the step.
        # The optimizer's arithmetic is regrouped only with itself, as it floats whole.
        # A node a floating one is joined to stays pinned, and so does a node oneDNN may
        # merge: a clone by its type (clones may pair where their originals do not).
        merges = op_name in fusable or event.kind == RECOMPUTE and node.op in FUSABLE_OP_TYPES
        floats = pinning and position not in joined and (
            position in floating and not merges
            or node.name in updates and node.op not in FUSABLE_OP_TYPES)
        if floats and node.name not in updates and _needs_regrouping_guard(node):
            inputs = {_split_input(name)[0] for name in node.input}
            guard = _regrouping_guard(node, events_run, inputs)
            floats = guard is not None
            if floats:
                node.input.append("^" + guard)
                control_edges += 1
        updates_floating += floats and node.name in updates
        if floats and position in joins:
            joined[joins[position]].append(node.name)
        elif floats:
            due.append(node.name)
        due += joined.pop(position, [])
        if not floats and (event.kind == RECOMPUTE or (
                pin_order != "clones" and pinning and previous is not None and node.input)):
            waits_for = anchors[node.name] = [last_pinned] * (last_pinned is not None) + due
            due = []
            for anchor in waits_for:
                if not any(_split_input(name)[0] == anchor for name in node.input):
                    node.input.append("^" + anchor)
                    control_edges += 1
            guard = _regrouping_guard(node, events_run, waits_for)
            if guard is not None:
                node.input.append("^" + guard)
                control_edges += 1
        if position in floating:
            chains[floating[position]].append((node, floats))
        previous = version[op_name]
        # A source in the pinned region waits for nothing, so nothing can wait through it.
        if not floats and (node.input or not pinning):
            last_pinned = previous
        events_run.append(previous)

    # Before the clones are copied into the graph: ``extend`` copies, and edges added to a
    # clone after it would be lost.
    control_edges += _hold_floating_chains(chains.values())
    graph_def.node.extend(clones)
    _check_pinned(graph_def, anchors)
    _check_acyclic(graph_def)
    repinned = repin_removed_anchors(graph_def, anchors, step_fetches(item), session_config())
    unfused = _protect_fusions(graph_def)
    pows_gated = keep_pow_conversions(graph_def)
    fusions = keep_remapper_fusions(graph_def)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    rewritten = item.with_graph(graph)
    rewritten.config = {**item.config,
                        "remat": {"clones": len(clones), "control_edges": control_edges,
                                  "repinned_after_grappler": repinned,
                                  "unfused_pairs": unfused,
                                  "remapper_groups_freed": fusions["freed"],
                                  "pows_gated": pows_gated,
                                  "updates_floating": updates_floating,
                                  "pinned_from": pinned_from if pin_order != "clones" else None,
                                  "method": plan.method},
                        EXACT_GRAPH: True}
    return rewritten
