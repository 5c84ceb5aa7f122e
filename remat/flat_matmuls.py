"""Batch matrix products against one shared matrix, run as one matrix product.

Keras layers that apply a weight matrix to every position of a sequence
(``MultiHeadAttention``'s query, key, value and output projections, ``EinsumDense``) emit
``BatchMatMulV2(x, w)`` with ``x`` of shape ``[B..., M, K]`` and ``w`` a ``[K, N]`` matrix, and
TF's gradient of it a ``BatchMatMulV2(x, dy, adj_x=True)`` of shape ``[B..., K, N]`` that a
``Sum`` over the batch axes and a ``Reshape`` turn into the weight's ``[K, N]`` gradient. With
oneDNN off, TF's CPU kernel runs such a product as ``B`` small ones. Measured on this 2-core
machine (2026-12-05, float32, one op in a ``tf.function``, B=16, M=K=N=128): the forward
product took 2.59 ms against 0.75 ms as one ``[B*M, K] x [K, N]`` product, the weight gradient
(product and sum) 2.35 ms against 0.96 ms as one ``[B*M, K]^T x [B*M, N]`` product, which also
never holds the ``[B..., K, N]`` partial gradients (1 MiB there). With oneDNN on, its batch
kernel runs the shared matrix as fast (0.70 against 0.74 ms, 0.89 against 0.81 ms), so the pass
is skipped there.

The pass rewrites both forms:

- ``BatchMatMulV2(x, w)``, ``adj_x`` false, ``w`` of rank 2, ``x`` of rank at least 3 with a
  fully known shape: ``Reshape(MatMul(Reshape(x, [-1, K]), w, transpose_b=adj_y), out_shape)``;
- ``Reshape(Sum(BatchMatMulV2(x, dy, adj_x=True)))`` to a ``[K, N]`` matrix, where ``x`` and
  ``dy`` have the same fully known batch shape and the product and the sum have no other reader:
  ``MatMul(Reshape(x, [-1, K]), Reshape(dy, [-1, N]), transpose_a=True)``. The ``Reshape``'s
  size, ``K * N``, shows that the sum reduced every batch axis.

Each rewritten node keeps its name (its readers and every fetched name are unchanged) and
control inputs; the replaced product and sum are removed. The products sum in another order,
so results equal the originals within float tolerance (about 1e-6 relative), not bit for bit.

Postconditions: the rewritten graph imports, is acyclic and keeps every fetched and fed name
(``graph_def_walk.rebuild``).
"""

from __future__ import annotations

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.session import onednn_enabled
from graphfit.profiler.graph_def_walk import matmul_node, rebuild, reshape_nodes

__all__ = ["flatten_shared_matmuls"]


def _known(tensor: tf.Tensor) -> list[int] | None:
    return tensor.shape.as_list() if tensor.shape.is_fully_defined() else None


def _readers(graph: tf.Graph) -> dict[str, list[tf.Operation]]:
    """Tensor name -> the ops reading it; ``^op`` -> the ops with a control edge from it."""
    readers: dict[str, list[tf.Operation]] = {}
    for op in graph.get_operations():
        for tensor in op.inputs:
            readers.setdefault(tensor.name, []).append(op)
        for control in op.control_inputs:
            readers.setdefault(f"^{control.name}", []).append(op)
    return readers


def _sole_reader(op: tf.Operation, readers: dict, op_type: str) -> tf.Operation | None:
    """``op``'s only reader if it has one output, read once by an op of ``op_type``, and no
    control reader."""
    found = readers.get(op.outputs[0].name, []) if len(op.outputs) == 1 else []
    if len(found) == 1 and found[0].type == op_type and f"^{op.name}" not in readers:
        return found[0]
    return None


def _forward(op: tf.Operation, node: tf.compat.v1.NodeDef) -> list[tf.compat.v1.NodeDef] | None:
    """The nodes replacing ``BatchMatMulV2(x, w)`` by one product, or ``None``."""
    x, w = op.inputs
    x_shape, w_shape, out_shape = _known(x), _known(w), _known(op.outputs[0])
    if (node.attr["adj_x"].b or x_shape is None or w_shape is None or out_shape is None
            or len(x_shape) < 3 or len(w_shape) != 2):
        return None
    controls = [i for i in node.input if i.startswith("^")]
    data = [i for i in node.input if not i.startswith("^")]
    flat = f"{node.name}/flat"
    return [*reshape_nodes(f"{flat}/lhs", data[0], [-1, x_shape[-1]], node),
            matmul_node(flat, f"{flat}/lhs", data[1], node, False, node.attr["adj_y"].b, controls),
            *reshape_nodes(node.name, flat, out_shape, node)]


def _weight_gradient(reshape: tf.Operation, nodes: dict, readers: dict
                     ) -> tuple[list[tf.compat.v1.NodeDef], list[str]] | None:
    """The nodes replacing ``Reshape(Sum(BatchMatMulV2(x, dy, adj_x=True)))`` by one product,
    and the names of the product and the sum it makes dead; or ``None``."""
    total = reshape.inputs[0].op
    if total.type != "Sum" or _sole_reader(total, readers, "Reshape") is not reshape:
        return None
    product = total.inputs[0].op
    node = nodes[product.name]
    if (product.type != "BatchMatMulV2" or _sole_reader(product, readers, "Sum") is not total
            or not node.attr["adj_x"].b or node.attr["adj_y"].b):
        return None
    x, dy = product.inputs
    x_shape, dy_shape, out_shape = _known(x), _known(dy), _known(reshape.outputs[0])
    if (x_shape is None or dy_shape is None or len(x_shape) < 3
            or x_shape[:-2] != dy_shape[:-2] or out_shape != [x_shape[-1], dy_shape[-1]]):
        return None
    target = nodes[reshape.name]
    controls = sorted({i for n in (node, nodes[total.name], target) for i in n.input
                       if i.startswith("^")})
    data = [i for i in node.input if not i.startswith("^")]
    flat = f"{reshape.name}/flat"
    return ([*reshape_nodes(f"{flat}/lhs", data[0], [-1, x_shape[-1]], node),
             *reshape_nodes(f"{flat}/rhs", data[1], [-1, dy_shape[-1]], node),
             matmul_node(reshape.name, f"{flat}/lhs", f"{flat}/rhs", node, True, False, controls)],
            [product.name, total.name])


def flatten_shared_matmuls(item: GraphItem) -> tuple[GraphItem, dict]:
    """Run every batch product of ``item`` against one shared matrix, and every weight
    gradient of one, as a single matrix product (module docstring).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when nothing matched or oneDNN
        is on) and a JSON-ready record: ``changed``, ``products`` and ``weight_gradients``
        rewritten.
    """
    record = {"changed": False, "products": 0, "weight_gradients": 0}
    if onednn_enabled():
        return item, {**record, "skipped": "oneDNN on: its batch kernel is as fast"}
    graph_def = item.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    readers = _readers(item.graph)
    replacements: dict[str, list[tf.compat.v1.NodeDef]] = {}
    dead: set[str] = set()

    def fresh(new: list[tf.compat.v1.NodeDef], name: str) -> bool:
        return all(n.name == name or n.name not in nodes for n in new)

    for op in item.graph.get_operations():
        found = _weight_gradient(op, nodes, readers) if op.type == "Reshape" else None
        if found and fresh(found[0], op.name):
            replacements[op.name], removed = found
            dead.update(removed)
            record["weight_gradients"] += 1
    for op in item.graph.get_operations():
        found = (_forward(op, nodes[op.name])
                 if op.type == "BatchMatMulV2" and op.name not in dead else None)
        if found and fresh(found, op.name):
            replacements[op.name] = found
            record["products"] += 1
    if not replacements:
        return item, record
    kept = [node for node in graph_def.node if node.name not in dead
            and node.name not in replacements]
    del graph_def.node[:]
    graph_def.node.extend(kept)
    for new in replacements.values():
        graph_def.node.extend(new)
    record["changed"] = True
    return rebuild(item, graph_def, "flat_matmuls", record, exact_graph=False), record
