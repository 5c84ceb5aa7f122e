"""Gradients of patchify convolutions as matrix products, without TF's 32 MiB column buffer.

A convolution whose stride equals its kernel size, with ``VALID`` padding (ConvNeXt's and the
vision transformers' "patchify" stem, ConvNeXt's 2x2 downsampling layers), reads each input
pixel once: it is a matrix product of the input's non-overlapping patches with the filter.
With oneDNN off, TF's default CPU kernels for its gradients still unfold patches into a column
buffer sized for 30 MiB of work whatever the batch (``remat.conv_grad_kernels`` says where),
and Eigen's kernel, which needs none, is 2-25x slower on strided gradients. Measured on this
2-core machine (2026-12-06, oneDNN off, BFC allocator, float32, one filter gradient, median of
9-15 runs on the loaded VM; ms and MiB the op adds):

==========================  =================  ==================  ===================
input, filter, stride       default kernel     ``eigen_tensor``    patches (this pass)
==========================  =================  ==================  ===================
8x64²x3, 4x4x3x32, 4        0.7-1.1, 32.0      27.7, 0             1.1, 0.4
8x64²x32, 2x2x32x64, 2      7.2-18.3, 32.0     17.1, 0             7.6, 4.0
==========================  =================  ==================  ===================

On the ConvNeXt-style step of ``bench.reconcile`` (64², batch 8, SGD) the stem's filter
gradient alone took 32 MiB (33.6 MB) of the 37 MB the step adds, so no plan at half of it
existed (the planner's floor was 33.1 MiB against a budget of 18.5 MiB).

``SpaceToDepth`` with the kernel size as its block puts each patch's pixels on the channel
axis in the order ``(row, column, channel)`` of an ``HWIO`` filter flattened to
``[k*k*C, O]``, so, with ``P = Reshape(SpaceToDepth(x, k), [-1, k*k*C])`` (one copy of the
input) and ``D = Reshape(dy, [-1, O])``:

- ``Conv2DBackpropFilter(x, sizes, dy)`` is ``Reshape(MatMul(P, D, transpose_a), sizes)``;
- ``Conv2DBackpropInput(sizes, w, dy)`` is
  ``DepthToSpace(Reshape(MatMul(D, Reshape(w, [k*k*C, O]), transpose_b), ...), k)``.

The rewrite applies to an ``NHWC`` gradient of dilation 1, ``VALID`` padding, a square or
rectangular kernel equal to its strides, and input height and width divisible by the kernel
(a remainder would be dropped by the convolution). Each rewritten node keeps its name and
control inputs. The products sum in another order than the kernels, so results agree within
float tolerance, not bit for bit. Skipped with oneDNN on: its own kernels replace the ops and
allocate no such buffer.

Postconditions: the rewritten graph imports, is acyclic and keeps every fetched and fed name
(``graph_def_walk.rebuild``).
"""

from __future__ import annotations

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.conv_kernels import CONV_GRADIENT_OP_TYPES
from graphfit.profiler.graph_def_walk import matmul_node, rebuild, reshape_nodes
from graphfit.profiler.session import onednn_enabled

__all__ = ["patchify_conv_gradients"]


def _patch_size(op: tf.Operation, x_shape: list[int] | None) -> int | None:
    """The kernel size ``k`` of a patchify convolution gradient over an input of ``x_shape``,
    or ``None`` where the rewrite does not apply (module docstring)."""
    node = op.node_def
    strides = list(node.attr["strides"].list.i)
    dilations = list(node.attr["dilations"].list.i or [1, 1, 1, 1])
    filter_shape = (op.outputs[0] if op.type == "Conv2DBackpropFilter" else op.inputs[1]).shape
    if (node.attr["padding"].s != b"VALID" or node.attr["data_format"].s not in (b"", b"NHWC")
            or dilations != [1, 1, 1, 1] or x_shape is None
            or not filter_shape.is_fully_defined()):
        return None
    k = strides[1]
    if strides != [1, k, k, 1] or filter_shape.as_list()[:2] != [k, k] or k < 2:
        return None
    return k if x_shape[1] % k == 0 and x_shape[2] % k == 0 else None


def _depth_node(op_type: str, name: str, tensor: str, k: int, like: tf.compat.v1.NodeDef
                ) -> tf.compat.v1.NodeDef:
    """``SpaceToDepth`` or ``DepthToSpace`` of ``tensor`` with block ``k``."""
    node = tf.compat.v1.NodeDef(name=name, op=op_type, device=like.device, input=[tensor])
    node.attr["T"].CopyFrom(like.attr["T"])
    node.attr["block_size"].i = k
    node.attr["data_format"].s = b"NHWC"
    return node


def _replacement(op: tf.Operation, node: tf.compat.v1.NodeDef
                 ) -> list[tf.compat.v1.NodeDef] | None:
    """The nodes computing ``op`` (a convolution gradient) as a matrix product, the last one
    named as ``op``; or ``None``."""
    filter_gradient = op.type == "Conv2DBackpropFilter"
    x = op.inputs[0] if filter_gradient else op.outputs[0]
    x_shape = x.shape.as_list() if x.shape.is_fully_defined() else None
    k = _patch_size(op, x_shape)
    if k is None:
        return None
    data = [i for i in node.input if not i.startswith("^")]
    controls = [i for i in node.input if i.startswith("^")]
    rows, depth = k * k * x_shape[3], op.inputs[2].shape.as_list()[3]
    base = f"{node.name}/patches"
    dy = reshape_nodes(f"{base}/dy", data[2], [-1, depth], node)
    if filter_gradient:
        return [_depth_node("SpaceToDepth", f"{base}/x", data[0], k, node),
                *reshape_nodes(f"{base}/rows", f"{base}/x", [-1, rows], node), *dy,
                matmul_node(f"{base}/product", f"{base}/rows", f"{base}/dy", node, True, False,
                            controls),
                *reshape_nodes(node.name, f"{base}/product", [k, k, x_shape[3], depth], node)]
    n, h, w = x_shape[:3]
    return [*reshape_nodes(f"{base}/w", data[1], [rows, depth], node), *dy,
            matmul_node(f"{base}/product", f"{base}/dy", f"{base}/w", node, False, True,
                        controls),
            *reshape_nodes(f"{base}/rows", f"{base}/product", [n, h // k, w // k, rows], node),
            _depth_node("DepthToSpace", node.name, f"{base}/rows", k, node)]


def patchify_conv_gradients(item: GraphItem) -> tuple[GraphItem, dict]:
    """Compute every patchify convolution gradient of ``item`` as a matrix product of
    patches, which needs no column buffer (module docstring).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when nothing matched or oneDNN
        is on) and a JSON-ready record: ``changed``, ``rewritten`` gradients.
    """
    record = {"changed": False, "rewritten": 0}
    if onednn_enabled():
        return item, {**record, "skipped": "oneDNN on: its kernels need no column buffer"}
    graph_def = item.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    replacements = {}
    for op in item.graph.get_operations():
        if op.type in CONV_GRADIENT_OP_TYPES:
            new = _replacement(op, nodes[op.name])
            if new and all(n.name == op.name or n.name not in nodes for n in new):
                replacements[op.name] = new
    if not replacements:
        return item, record
    kept = [node for node in graph_def.node if node.name not in replacements]
    del graph_def.node[:]
    graph_def.node.extend(kept)
    for new in replacements.values():
        graph_def.node.extend(new)
    record.update(changed=True, rewritten=len(replacements))
    return rebuild(item, graph_def, "patch_convs", record, exact_graph=False), record
