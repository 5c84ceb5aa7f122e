"""Write a placement into a TensorFlow graph: the ``apply`` pass of the pipeline.

A placement maps every op of the training step (the fan-in of the train op, loss and
gradients) to a device name. ``apply_placement`` copies the item's GraphDef, sets
``NodeDef.device`` on every node and imports the copy into a new ``tf.Graph``; the original
item stays untouched and the new one keeps every fetched and fed name.

TensorFlow's placer keeps some ops together whatever devices they request (checked on TF 2.21:
a ``ReadVariableOp`` pinned to ``CPU:1`` whose variable lives on ``CPU:0`` silently runs on
``CPU:0``). The groups it enforces are the union of

- ``_class`` attributes (``loc:@other_op``: optimizer slots, initialisers, ``colocate_with``),
- resource and reference edges: an op that takes a variable handle (``ReadVariableOp``,
  ``ResourceApply*``, ``AssignVariableOp``) runs on the device of the op producing the handle.

A placement that splits such a group would be silently rewritten by TF, so its plan (memory,
makespan) would not describe what runs: ``apply_placement`` refuses it with a
``ColocationError`` naming the group and the devices. Ops outside the step (initialisers,
``VarIsInitializedOp``) take the device of their group; an op outside the step in no placed
group goes to ``default_device``.

A placement made by the repair step (``baechi.memory_first``) sends some tensors just in time:
the send waits for an op on the sending device, its gate. TF sends a tensor as soon as it
exists, so for each such send (``Placement.gated_reads()``) ``apply_placement`` adds an
``Identity`` of the tensor on the sending device with a control edge from the gate and lets the
send's readers read it: the tensor then leaves after the gate, as planned. A tensor the plan
sends twice to one device (a transient copy, freed and received again) gets one ``Identity``
per send, so TF receives it twice too.

The simulated peaks also assume each device runs its ops one at a time in the planned order,
and that an op waits for the releases the plan made before it (the repair step waits for memory
to be freed, often by an op on another device). ``ordering`` (``Placement.memory_order()``)
writes these as control edges; Grappler's remapper would then leave ``MatMul`` + ``BiasAdd`` +
activation groups unfused, and an edge into a ``Pow`` would stop Grappler on the whole step,
so ``profiler.remapper_fusions`` and ``profiler.pow_conversions`` move the edges off those
nodes without changing what runs after what.

Reference: Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020
(placements are written as TF device assignments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx
import tensorflow as tf

from graphfit.baechi.schedule import PlacementError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.tf_import import step_operations
from graphfit.profiler.trace import step_fetches
from graphfit.profiler.pow_conversions import keep_pow_conversions
from graphfit.profiler.remapper_fusions import keep_remapper_fusions

__all__ = ["ColocationError", "apply_placement", "enforced_colocation_groups"]


class ColocationError(PlacementError):
    """A placement puts ops that TensorFlow keeps together on different devices."""


def enforced_colocation_groups(graph: tf.Graph) -> dict[str, str]:
    """The colocation group of every op of ``graph`` as TensorFlow's placer enforces it.

    Groups are the connected components of two relations: an op's ``_class`` entries
    (``loc:@name``) and edges carrying a resource or reference tensor (the consumer joins the
    producer of the handle).

    Parameters:
        graph: the TF graph.

    Returns:
        op name -> group name; the group name is the name of one member, chosen
        deterministically (the smallest name), so equal graphs give equal groups.
    """
    operations = graph.get_operations()
    uf = nx.utils.UnionFind(op.name for op in operations)
    names = {op.name for op in operations}
    for op in operations:
        for entry in op.colocation_groups():
            other = entry.decode()[len("loc:@"):]
            if other in names:
                uf.union(op.name, other)
        for tensor in op.inputs:
            if tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype:
                uf.union(op.name, tensor.op.name)
    return {name: min(group) for group in uf.to_sets() for name in group}


def _check_device_name(name: str) -> None:
    try:
        spec = tf.DeviceSpec.from_string(name)
    except ValueError as error:
        raise PlacementError(f"device name {name!r} is malformed: {error}") from error
    if spec.device_type is None:
        raise PlacementError(f"device name {name!r} names no device type (e.g. /device:CPU:0)")


def _group_devices(op_devices: Mapping[str, str], groups: dict[str, str]) -> dict[str, str]:
    """group -> the one device its placed members use; raises on a split group."""
    members: dict[str, dict[str, list[str]]] = {}
    for name, device in op_devices.items():
        members.setdefault(groups[name], {}).setdefault(device, []).append(name)
    split = {g: by_device for g, by_device in members.items() if len(by_device) > 1}
    if split:
        group, by_device = sorted(split.items())[0]
        detail = "; ".join(f"{device}: {sorted(ops)[:3]}{' ...' if len(ops) > 3 else ''}"
                           for device, ops in sorted(by_device.items()))
        raise ColocationError(
            f"{len(split)} colocation group(s) are split across devices, e.g. the group of "
            f"{group!r} (TF keeps `_class` loc:@ groups and variables with the ops reading "
            f"their handles on one device) is placed on {detail}. Place each group on one "
            f"device (the placer's colocation grouping must include resource readers).")
    return {g: next(iter(by_device)) for g, by_device in members.items()}


def _gate_sends(graph_def, graph: tf.Graph, gated_reads: Sequence[Mapping]) -> None:
    """Add one ``Identity`` per gated send to ``graph_def`` (module docstring)."""
    nodes = {node.name: node for node in graph_def.node}
    for k, read in enumerate(gated_reads):
        tensor = graph.get_tensor_by_name(read["tensor"])
        producer, port = read["tensor"].rsplit(":", 1)
        source = producer if port == "0" else read["tensor"]
        gate = graph_def.node.add(name=f"{producer}/gated_send_{k}", op="Identity",
                                  device=read["src"], input=[source, "^" + read["after"]])
        gate.attr["T"].type = tensor.dtype.as_datatype_enum
        for reader in read["readers"]:
            inputs = nodes[reader].input
            for j, name in enumerate(inputs):
                if name == source or name == read["tensor"]:
                    inputs[j] = gate.name


def _order(graph_def, ordering: Sequence[tuple[str, str]]) -> None:
    """Add each ``(before, after)`` of ``ordering`` as a control input of ``after``, then keep
    Grappler's ``Pow`` conversions and the remapper's fusions (module docstring)."""
    nodes = {node.name: node for node in graph_def.node}
    for before, after in ordering:
        if before not in nodes or after not in nodes:
            raise PlacementError(f"the ordering edge {before!r} -> {after!r} names an op that "
                                 "is not in the graph: it was made for another graph")
        if "^" + before not in nodes[after].input:
            nodes[after].input.append("^" + before)
    if ordering:
        keep_pow_conversions(graph_def)
        keep_remapper_fusions(graph_def)


def apply_placement(item: GraphItem, op_devices: Mapping[str, str],
                    default_device: str | None = None,
                    gated_reads: Sequence[Mapping] = (),
                    ordering: Sequence[tuple[str, str]] = ()) -> GraphItem:
    """A copy of ``item`` whose every op carries the device the placement chose.

    Parameters:
        item: the training step (not modified).
        op_devices: op name -> device name (e.g. ``Placement.op_devices()``); must cover every
            op of the step, except ops TF colocates with a placed op (``_class``: such an op
            goes with its group, e.g. the gates of ``profiler.remapper_fusions``, which a plan's
            cost graph does not list), and may name ops outside it.
        default_device: device of ops outside the step that are in no placed colocation group
            (the initialiser's ``NoOp``); default: the smallest device name of the placement.
        gated_reads: sends that wait for an op on their source device
            (``Placement.gated_reads()``), written as ordering edges (module docstring).
        ordering: ``(before, after)`` op names, ``after`` to start once ``before`` ended
            (``Placement.memory_order()``), written as control edges (module docstring).

    Returns:
        A ``GraphItem`` on a new ``tf.Graph`` with the same op names, fetches and feeds.

    Raises:
        baechi.schedule.PlacementError: an op of the step has no device, a name is not an op
            of the graph, or a device name is malformed.
        ColocationError: two ops TF keeps on one device (see ``enforced_colocation_groups``) are
            placed on different devices.
    """
    graph = item.graph
    known = {op.name for op in graph.get_operations()}
    unknown = sorted(set(op_devices) - known)
    if unknown:
        raise PlacementError(f"{len(unknown)} placed op(s) are not in graph {item.name!r}, "
                             f"e.g. {unknown[:3]}: the placement was made for another graph")
    groups = enforced_colocation_groups(graph)
    group_device = _group_devices(op_devices, groups)
    missing = [op.name for op in step_operations(graph, step_fetches(item))
               if op.name not in op_devices and groups[op.name] not in group_device]
    if missing:
        raise PlacementError(f"{len(missing)} op(s) of the step have no device, e.g. "
                             f"{missing[:3]}: a placement must cover every op of the step "
                             "(or a placed op TF colocates it with)")
    if not op_devices:
        raise PlacementError("the placement is empty")
    for device in set(op_devices.values()):
        _check_device_name(device)
    if default_device is None:
        default_device = min(op_devices.values())
    _check_device_name(default_device)
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        node.device = op_devices.get(node.name) or group_device.get(groups[node.name],
                                                                    default_device)
    _gate_sends(graph_def, graph, gated_reads)
    _order(graph_def, ordering)
    placed = tf.Graph()
    with placed.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    wanted = {node.name: node.device for node in graph_def.node}
    moved = [op.name for op in placed.get_operations()
             if tf.DeviceSpec.from_string(op.device) != tf.DeviceSpec.from_string(
                 wanted[op.name])]
    if moved:  # postcondition: the import kept every assignment
        raise PlacementError(f"importing the placed graph changed the device of {len(moved)} "
                             f"op(s), e.g. {moved[:3]}")
    return item.with_graph(placed)
