"""Read a ``tf.Graph`` (and optionally its profile) into a ``CostGraph``.

Only the ops a training step executes are imported: the transitive fan-in of its fetches
(train op, loss, gradients). Initialisers and savers never run in a step and would only distort
coverage and plans.

Costs come from the profile where measured. An op the trace missed although every reader of
its outputs was measured ran fused into them (oneDNN's run-time rewrite): it costs no time of
its own. The rest is estimated from static shapes: output
bytes from shape x dtype (unknown dimensions count as 1), compute time from the op's registered
FLOP count at the throughput the profile measured on this machine (or a default), and for ops
without a FLOP count from the bytes they write at a measured (or default) bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.util import deprecation

from graphfit.profiler.cost_graph import CostGraph, OpSpec, gc_paused
from graphfit.profiler.profile import Profile

__all__ = ["cost_graph_from_graph", "step_operations", "static_output_bytes", "variable_bytes"]

# Used only when a profile gives nothing to calibrate against (no profile, or no op with FLOPs).
DEFAULT_FLOPS_PER_US = 2_000.0     # 2 GFLOP/s: one core of these machines on small kernels
DEFAULT_BYTES_PER_US = 2_000.0     # 2 GB/s written by memory-bound kernels
MIN_OP_US = 1.0                    # launch overhead of any executed op

VARIABLE_OP_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp"})


def _is_random(op_type: str) -> bool:
    """Stateful random ops: recomputing them would draw different numbers."""
    if op_type.startswith("Stateless"):
        return False
    return "Random" in op_type or op_type in ("TruncatedNormal", "Multinomial",
                                              "ParameterizedTruncatedNormal")


def _tensor_bytes(tensor: tf.Tensor) -> int:
    """Static size of a tensor; unknown dimensions count as 1, non-numeric dtypes as 0."""
    dtype = tensor.dtype
    if dtype in (tf.resource, tf.variant, tf.string):
        return 0
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
    return int(np.prod([d if d is not None else 1 for d in dims], dtype=np.int64)) * dtype.size


def static_output_bytes(op: tf.Operation) -> list[int]:
    """Bytes of each output of ``op`` from its static shapes."""
    return [_tensor_bytes(t) for t in op.outputs]


def variable_bytes(op: tf.Operation) -> int:
    """Bytes of the buffer a variable op owns (its handle output is tiny)."""
    shape = tf.TensorShape(op.get_attr("shape"))
    dims = [d if d is not None else 1 for d in shape.as_list()] if shape.rank is not None else []
    return int(np.prod(dims, dtype=np.int64)) * tf.as_dtype(op.get_attr("dtype")).size


_TYPES_WITHOUT_FLOPS: set[str] = set()


def _flops(graph: tf.Graph, op: tf.Operation) -> float | None:
    """The op's registered FLOP count, or None. Op types that gave none are remembered:
    asking needs the serialised NodeDef, the dearest part of importing a large graph."""
    if op.type in _TYPES_WITHOUT_FLOPS:
        return None
    try:
        # TF's own FLOP functions call a deprecated TF helper: its notice is about TF's
        # internals, nothing a user of this project can act on.
        with deprecation.silence():
            value = tf_ops.get_stats_for_node_def(graph, op.node_def, "flops").value
    except (ValueError, TypeError):
        value = None
    if value is None:
        _TYPES_WITHOUT_FLOPS.add(op.type)
    return float(value) if value else None


def _fused_into_consumers(op: tf.Operation, profile: Profile) -> bool:
    """An op the trace missed while every op reading it was measured ran fused into them:
    oneDNN's run-time graph pass merges e.g. ``Conv2D`` into its ``BiasAdd`` and reports the
    pair under the consumer's name, so the op's time is already in its consumer's."""
    consumers = [c for t in op.outputs for c in t.consumers()]
    return bool(consumers) and all(c.name in profile.ops for c in consumers)


def step_operations(graph: tf.Graph, fetches: Iterable[str]) -> list[tf.Operation]:
    """The ops a ``Session.run(fetches)`` executes: the transitive fan-in of the fetches, in
    graph order. ``fetches`` are op or tensor names."""
    stack = [graph.as_graph_element(name) for name in fetches]
    stack = [x.op if isinstance(x, tf.Tensor) else x for x in stack]
    seen = {op.name for op in stack}
    while stack:
        op = stack.pop()
        for producer in [t.op for t in op.inputs] + list(op.control_inputs):
            if producer.name not in seen:
                seen.add(producer.name)
                stack.append(producer)
    return [op for op in graph.get_operations() if op.name in seen]


def _throughputs(graph: tf.Graph, operations: Sequence[tf.Operation],
                 profile: Profile | None) -> tuple[float, float]:
    """(FLOPs per µs, bytes per µs) measured on this machine by the profile, else defaults."""
    if profile is None:
        return DEFAULT_FLOPS_PER_US, DEFAULT_BYTES_PER_US
    flop_rates, byte_rates = [], []
    for op in operations:
        cost = profile.ops.get(op.name)
        if cost is None or cost.compute_us <= MIN_OP_US:
            continue
        flops = _flops(graph, op)
        if flops:
            flop_rates.append(flops / cost.compute_us)
        elif sum(cost.output_bytes):
            byte_rates.append(sum(cost.output_bytes) / cost.compute_us)
    return (float(np.median(flop_rates)) if flop_rates else DEFAULT_FLOPS_PER_US,
            float(np.median(byte_rates)) if byte_rates else DEFAULT_BYTES_PER_US)


def cost_graph_from_graph(graph: tf.Graph, fetches: Iterable[str],
                          profile: Profile | None = None) -> CostGraph:
    """The cost graph of the step that runs ``fetches`` on ``graph``.

    Args:
        graph: the TF graph.
        fetches: op or tensor names the step runs (e.g. ``[item.train_op, item.loss]``).
        profile: measured costs; must have been measured on this graph.

    Raises:
        ProfileMismatchError: ``profile`` was measured on another graph.
        CostGraphError: the step's ops form a cycle.
    """
    if profile is not None:
        profile.check_matches(graph.as_graph_def())
    with gc_paused():
        return _build(graph, fetches, profile)


def _build(graph: tf.Graph, fetches: Iterable[str], profile: Profile | None) -> CostGraph:
    operations = step_operations(graph, fetches)
    flops_per_us, bytes_per_us = _throughputs(graph, operations, profile)
    specs = []
    for op in operations:
        static_bytes = static_output_bytes(op)
        is_variable = op.type in VARIABLE_OP_TYPES
        persistent = variable_bytes(op) if is_variable else 0
        cost = profile.ops.get(op.name) if profile is not None else None
        if cost is not None:
            output_bytes = [m or s for m, s in zip(cost.output_bytes, static_bytes)]
            output_bytes += static_bytes[len(output_bytes):]
            compute_us, temp = cost.compute_us, cost.temp_bytes
            persistent = max(persistent, cost.persistent_bytes)
        elif profile is not None and _fused_into_consumers(op, profile):
            output_bytes, temp, compute_us = static_bytes, 0, 0.0
        else:
            output_bytes, temp = static_bytes, 0
            flops = _flops(graph, op)
            compute_us = MIN_OP_US + (flops / flops_per_us if flops
                                      else sum(static_bytes) / bytes_per_us)
        specs.append(OpSpec(
            name=op.name, op_type=op.type,
            inputs=[(t.op.name, t.value_index) for t in op.inputs],
            control_inputs=[c.name for c in op.control_inputs],
            output_bytes=output_bytes, compute_us=compute_us, temp_bytes=temp,
            persistent_bytes=persistent, device=op.device,
            colocation_group=min(op.colocation_groups()).decode()[len("loc:@"):],
            is_stateful=op.op_def.is_stateful, is_random=_is_random(op.type),
            is_variable=is_variable,
            reads_resource=any(t.dtype == tf.resource for t in op.inputs),
            measured=cost is not None))
    return CostGraph.from_ops(specs)
