"""Verifiers run after a pass: structural checks of the step a pass hands back.

As a compiler verifies its IR between passes, these functions re-check, from the resulting TF
graph alone, the invariants every pass must keep, independently of the pass's own bookkeeping:

- ``verify_step``: the step is a well-formed graph: acyclic over data and control edges, every
  input names an existing node and one of its outputs (every read version exists), and the
  fetched, fed and initialising names resolve.
- ``verify_rewrite``: a rematerialization kept every original node (name and op type), added
  only clones ``n/remat_k`` of an original ``n`` with the same op and attributes, never of a
  stateful, random or variable op (and the ``Identity`` gates and group ends of
  ``profiler.remapper_fusions``, each colocated with its node), and the plan's predicted peak is
  within its budget.
- ``verify_placement``: a placement changed devices only (same nodes, ops and inputs), put
  every op of the step on a device of the set, kept each group TensorFlow colocates on one
  device, and each device's planned peak within its limit.

They run in the tests, and in ``pipeline.optimize(..., verify_structure=True)`` (the ``train``
binary's ``--verify_structure`` debug flag) after each pass. Each raises
``VerificationError`` naming the first broken invariant: that is a bug of the pass, not of
the user's input.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import networkx as nx
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from graphfit.baechi.apply import enforced_colocation_groups
from graphfit.baechi.devices import DeviceSet
from graphfit.errors import GraphfitError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.tf_import import step_operations
from graphfit.profiler.trace import step_fetches
from graphfit.remat.plan import RematPlan
from graphfit.profiler.remapper_fusions import DONE_SUFFIX, GATE_SUFFIX

__all__ = ["VerificationError", "verify_placement", "verify_rewrite", "verify_step"]

_CLONE = re.compile(r"^(?P<original>.+)/remat_\d+$")
# Ops whose value is state or a fresh draw: a copy would not compute the same thing.
_NEVER_CLONED = {"Placeholder", "PlaceholderWithDefault", "VarHandleOp", "VariableV2",
                 "Variable", "ReadVariableOp"}


class VerificationError(GraphfitError, AssertionError):
    """A pass broke an invariant of the step (a bug in the pass)."""


def _nodes(item: GraphItem) -> dict[str, tf.compat.v1.NodeDef]:
    return {node.name: node for node in item.graph_def().node}


def _split(name: str) -> tuple[str, int | None]:
    """(producer, output port) of an input name; port ``None`` for a control input."""
    if name.startswith("^"):
        return name[1:], None
    producer, _, port = name.partition(":")
    return producer, int(port or 0)


def verify_step(item: GraphItem) -> None:
    """Check that ``item`` is a well-formed step (see the module docstring).

    Raises:
        VerificationError: a dangling input, an output port the producer lacks, a cycle, or a
            fetched / fed / initialising name that does not resolve.
    """
    graph, nodes = item.graph, _nodes(item)
    dependencies = nx.DiGraph()
    dependencies.add_nodes_from(nodes)
    for node in nodes.values():
        for name in node.input:
            producer, port = _split(name)
            if producer not in nodes:
                raise VerificationError(f"{node.name!r} reads {name!r}, which names no node")
            if port is not None and port >= len(graph.get_operation_by_name(producer).outputs):
                raise VerificationError(f"{node.name!r} reads {name!r}, but {producer!r} has "
                                        f"{len(graph.get_operation_by_name(producer).outputs)} "
                                        "outputs")
            dependencies.add_edge(producer, node.name)
    if not nx.is_directed_acyclic_graph(dependencies):
        cycle = nx.find_cycle(dependencies)
        raise VerificationError(f"the step has a cycle: {' -> '.join(u for u, _ in cycle)}")
    names = [item.train_op, item.loss, item.init_op, *item.gradients, *item.feeds,
             *item.init_feeds]
    missing = [name for name in names if _split(name)[0] not in nodes]
    if missing:
        raise VerificationError(f"the step lost fetched or fed names {missing}")


def _is_stateful(op_type: str) -> bool:
    op_def = op_def_registry.get(op_type)
    return op_def is None or op_def.is_stateful or op_type in _NEVER_CLONED


def _is_fusion_helper(name: str, nodes: dict) -> bool:
    """Whether ``name`` is a gate or group end ``profiler.remapper_fusions`` adds: an
    ``Identity`` of one data input, named after and colocated with a node of the step."""
    for suffix in (GATE_SUFFIX, DONE_SUFFIX):
        member = name[:-len(suffix)] if name.endswith(suffix) else None
        if member in nodes:
            node = nodes[name]
            data = [i for i in node.input if not i.startswith("^")]
            return (node.op == "Identity" and len(data) == 1 and
                    list(node.attr["_class"].list.s) == [f"loc:@{member}".encode()])
    return False


def verify_rewrite(original: GraphItem, rewritten: GraphItem,
                   plan: RematPlan | None = None) -> None:
    """Check a rematerialization rewrite (see the module docstring).

    Parameters:
        original: the step before the pass.
        rewritten: the step after it.
        plan: the plan it lowered; its predicted peak must be within its budget.

    Raises:
        VerificationError: naming the first broken invariant.
    """
    verify_step(rewritten)
    before, after = _nodes(original), _nodes(rewritten)
    lost = sorted(name for name in before
                  if name not in after or after[name].op != before[name].op)
    if lost:
        raise VerificationError(f"the rewrite removed or changed original nodes {lost[:5]}")
    for name in sorted(after.keys() - before.keys()):
        if _is_fusion_helper(name, after):
            continue
        match = _CLONE.match(name)
        source = before.get(match.group("original")) if match else None
        if source is None:
            raise VerificationError(f"the rewrite added {name!r}, which is no clone "
                                    "'<original>/remat_<k>' of an original node")
        clone = after[name]
        if clone.op != source.op or dict(clone.attr) != dict(source.attr):
            raise VerificationError(f"clone {name!r} differs from {source.name!r} in op or "
                                    "attributes")
        if _is_stateful(source.op):
            raise VerificationError(f"clone {name!r} copies the stateful or random op "
                                    f"{source.name!r} ({source.op}): it would not compute "
                                    "the same value")
    if plan is not None and plan.peak_bytes > plan.budget_bytes:
        raise VerificationError(f"the plan's peak {plan.peak_bytes:,} bytes exceeds its budget "
                                f"{plan.budget_bytes:,}")


def verify_placement(original: GraphItem, placed: GraphItem, devices: DeviceSet,
                     planned_peak_bytes: Sequence[int] | np.ndarray | None = None) -> None:
    """Check a placement (see the module docstring).

    Parameters:
        original: the step before the pass.
        placed: the step after it.
        devices: the device set placed on (names and memory limits).
        planned_peak_bytes: the placer's planned peak per device (``Placement.peak_bytes``).

    Raises:
        VerificationError: naming the first broken invariant.
    """
    verify_step(placed)
    before, after = _nodes(original), _nodes(placed)
    changed = sorted(name for name in before.keys() | after.keys()
                     if name not in before or name not in after
                     or (after[name].op, list(after[name].input))
                     != (before[name].op, list(before[name].input)))
    if changed:
        raise VerificationError(f"the placement changed more than devices: nodes {changed[:5]}")
    canonical = {tf.DeviceSpec.from_string(d).to_string(): d for d in devices.names}
    device_of = {op.name: canonical.get(tf.DeviceSpec.from_string(op.device).to_string())
                 for op in placed.graph.get_operations()}
    unplaced = [op.name for op in step_operations(placed.graph, step_fetches(placed))
                if device_of[op.name] is None]
    if unplaced:
        raise VerificationError(f"{len(unplaced)} op(s) of the step are on no device of "
                                f"{devices.names}, e.g. {unplaced[:3]}")
    group_devices: dict[str, set] = {}
    for op, group in enforced_colocation_groups(placed.graph).items():
        if device_of[op] is not None:
            group_devices.setdefault(group, set()).add(device_of[op])
    split = {group: sorted(ds) for group, ds in group_devices.items() if len(ds) > 1}
    if split:
        group, names = next(iter(sorted(split.items())))
        raise VerificationError(f"colocation group {group!r} is split over {names}: TF would "
                                "move its ops, and the plan would not describe the run")
    if planned_peak_bytes is not None:
        over = [(name, int(peak), int(limit)) for name, peak, limit
                in zip(devices.names, planned_peak_bytes, devices.memory_bytes) if peak > limit]
        if over:
            raise VerificationError("planned peak above the limit on " + ", ".join(
                f"{name} ({peak:,} > {limit:,} bytes)" for name, peak, limit in over))
