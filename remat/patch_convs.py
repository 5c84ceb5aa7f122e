"""Strided convolution gradients over space-to-depth blocks, without TF's 32 MiB column buffer.

With oneDNN off, TF's default CPU kernels for ``Conv2DBackpropFilter`` and
``Conv2DBackpropInput`` unfold patches into a column buffer sized for 30 MiB of work whatever
the batch (``remat.conv_grad_kernels`` says where). Stride-1 gradients get Eigen's kernel,
which needs none (``conv_grad_kernels``); on strided gradients Eigen's kernel is 2-25x slower.
So every strided gradient keeps a fixed 10-32 MiB that no plan can shrink: on the ConvNeXt-style
step of ``bench.reconcile`` (64², batch 8, SGD) the stem's filter gradient took 32 MiB of the
37 MB the step adds (the planner's floor was 33.1 MiB against a budget of 18.5 MiB), and on the
Keras ResNet-style step of ``bench.reconcile`` (16², batch 8) the two strided 3x3 gradients set
the floor at 0.49 of what the step adds, so ``memory_ratio=0.5`` was refused in one fresh
process in three.

A convolution of stride ``s`` is a stride-1 convolution over ``SpaceToDepth(x, s)`` (each
``s x s`` block of pixels on the channel axis, in the order ``(row, column, channel)``) with a
kernel of ``ceil(k / s)`` blocks: the filter padded with zeros to whole blocks and laid out
the same way, ``W' = Reshape(Transpose(Reshape(Pad(W), [k', s, k', s, C, O]), [0, 2, 1, 3, 4,
5]), [k', k', s*s*C, O])``, with the convolution's padding counted in blocks. So:

- ``Conv2DBackpropFilter(x, sizes, dy)`` is the stride-1 filter gradient over
  ``SpaceToDepth(x, s)``, laid out back and cropped to ``k x k``;
- ``Conv2DBackpropInput(sizes, W, dy)`` is ``DepthToSpace`` of the stride-1 input gradient
  over the blocks with ``W'``.

Stride-1 gradients run on Eigen's kernel (``conv_grad_kernels`` labels them after this pass).
Where the kernel is one block and nothing is padded (``k = s`` on a ``VALID`` grid: ConvNeXt's
and the vision transformers' patchify stem, ConvNeXt's 2x2 downsampling), the stride-1
gradient is a matrix product of the blocks with the gradient, run as one ``MatMul``. A 1x1
convolution of stride ``s`` (ResNet50's downsampling ones) reads one pixel of each block: its
filter gradient is the product of ``x[:, ::s, ::s]`` with the gradient, its input gradient
the product of the gradient with the filter, put in the first pixel of each block; a filter
padded to a whole block would be copied ``s*s`` times instead (32 MiB for ResNet50's 1x1 of
1024x2048, which raised its floor above the budget at 0.5). Eigen's 1x1 gradient over the
blocks took 10.9 ms on 32x32²x32, 1x1x32x64 of stride 2, against 1.05 ms on TF's default
kernel; in the step of ``bench.reach``'s Keras ResNet-style net the products over blocks of its
two 1x1 convolutions of stride 2 took 1.5-3.2 ms against 0.8-3.0 ms on the default kernels (op
time, one traced run each).

Measured on this 2-core machine (2026-12-06 22:26 UTC, load average 1.3-1.6, oneDNN off, BFC
allocator, float32, one gradient, median of 9 interleaved runs; ms and MiB the op adds,
output included; filter gradient | input gradient; the blocks' filter gradients with the
padding explicit, as first written: padded first, as now, the second row's took 12.7 ms
against 30.3 ms, at 22:35, load average 3.5):

==============================  =====================  ====================  ==================
input, filter, stride           default kernel         ``eigen_tensor``      blocks (this pass)
==============================  =====================  ====================  ==================
8x16²x16, 3x3x16x32, 2 SAME     0.45, 32.0 | 0.27, 32.1  1.17, 0.0 | 0.64, 0.1  1.11, 0.2 | 0.56, 0.4
32x32²x32, 3x3x32x64, 2 SAME    5.4, 32.1 | 2.3, 32.0  14.8, 0.1 | 7.5, 4.0  15.0, 4.1 | 4.0, 8.0
32x16²x64, 3x3x64x128, 2 SAME   2.5, 10.0 | 2.0, 14.9  7.9, 0.3 | 6.9, 3.0   8.6, 4.2 | 4.3, 5.0
8x70²x3, 7x7x3x64, 2 VALID      2.3, 32.0 | 3.2, 1.0   49.9, 0.0 | 38.6, 0.5  6.3, 0.5 | 3.9, 0.9
==============================  =====================  ====================  ==================

That is memory bought with time, as ``conv_grad_kernels``' is: the blocks' gradients take 1.2-3.4x
the default kernels' time (a kernel of whole blocks does up to ``(s*k'/k)²`` = 1.8x the
products of a 3x3 one) and hold a copy of the input (or of its gradient) instead of the
column buffer; they are 1.5-12x faster than Eigen's strided kernels.

The rewrite applies to an ``NHWC`` gradient of dilation 1, equal strides ``s >= 2`` and a
fully known shape, where the input's height and width are multiples of ``s`` and the padding
before and after falls on whole blocks (``SAME`` 3x3 or 7x7 of stride 2 over an even size;
not ``SAME`` 5x5, which pads one pixel before), and the kernel is 1x1 or at least a block
wide; the others are counted (``left``) and keep TF's kernels. Each rewritten node keeps its name and control inputs; the blocks of the input
(or of the filter) are taken once the incoming gradient exists, so no copy is made in the
forward pass. The products sum in another order than the kernels, so results agree within
float tolerance, not bit for bit. Skipped with oneDNN on: its own kernels replace the ops and
allocate no such buffer.

Postconditions: the rewritten graph imports, is acyclic and keeps every fetched and fed name
(``graph_def_walk.rebuild``).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.conv_kernels import CONV_GRADIENT_OP_TYPES
from graphfit.profiler.graph_def_walk import (const_node, matmul_node, rebuild, reshape_nodes,
                                              split_input)
from graphfit.profiler.session import onednn_enabled

__all__ = ["patchify_conv_gradients"]

# A filter of [s*kh', s*kw', C, O] reshaped to [kh', s, kw', s, C, O] goes to
# [kh', kw', s, s, C, O], whose last four axes are ``SpaceToDepth``'s channels (row and column
# in the block, channel); the permutation is its own inverse, so it also goes back.
_PHASE_PERMUTATION = [0, 2, 1, 3, 4, 5]


def _axis_blocks(size: int, kernel: int, stride: int, padding: bytes,
                 explicit: tuple[int, int]) -> tuple[int, int] | None:
    """The padding before and after one spatial axis of the convolution, in blocks of
    ``stride`` pixels, as a stride-1 convolution over the space-to-depth blocks with a kernel of
    ``ceil(kernel / stride)`` blocks reads it; ``None`` where it does not fall on the blocks."""
    if padding == b"VALID":
        before, out = 0, (size - kernel) // stride + 1
    elif padding == b"SAME":
        out = -(-size // stride)
        before = max((out - 1) * stride + kernel - size, 0) // 2
    else:
        before = explicit[0]
        out = (size + sum(explicit) - kernel) // stride + 1
    after = stride * (out + -(-kernel // stride) - 1) - size - before
    if size % stride or before % stride or after % stride or after < 0:
        return None
    return before // stride, after // stride


@dataclasses.dataclass(frozen=True)
class _Phases:
    """A strided convolution as a stride-1 one over ``SpaceToDepth(x, stride)`` (module
    docstring): the input's shape, the filter's, the stride, the padding in blocks
    ``(top, bottom, left, right)``."""

    x_shape: tuple[int, int, int, int]
    filter_shape: tuple[int, int, int, int]
    stride: int
    blocks: tuple[int, int, int, int]

    @property
    def block_kernel(self) -> tuple[int, int]:
        """The kernel's height and width in blocks: ``ceil(k / stride)``."""
        return tuple(-(-k // self.stride) for k in self.filter_shape[:2])

    @property
    def depth(self) -> int:
        """Channels of a block: ``stride * stride * C``."""
        return self.stride * self.stride * self.x_shape[3]

    @property
    def pointwise(self) -> bool:
        """A 1x1 filter: the convolution reads one pixel of each block."""
        return self.filter_shape[:2] == (1, 1)

    @property
    def as_product(self) -> bool:
        """A one-block kernel and no padding: the convolution is a matrix product."""
        return self.block_kernel == (1, 1) and not any(self.blocks)


def _phases(op: tf.Operation) -> _Phases | None:
    """How a strided convolution gradient reads as a stride-1 one over blocks, or ``None``
    where the rewrite does not apply (module docstring)."""
    node = op.node_def
    x = op.inputs[0] if op.type == "Conv2DBackpropFilter" else op.outputs[0]
    kernel = op.outputs[0] if op.type == "Conv2DBackpropFilter" else op.inputs[1]
    strides = list(node.attr["strides"].list.i)
    stride = strides[1] if len(strides) == 4 else 0
    if (node.attr["data_format"].s not in (b"", b"NHWC") or strides != [1, stride, stride, 1]
            or stride < 2 or list(node.attr["dilations"].list.i or [1] * 4) != [1] * 4
            or not x.shape.is_fully_defined() or not kernel.shape.is_fully_defined()):
        return None
    x_shape, filter_shape = tuple(x.shape.as_list()), tuple(kernel.shape.as_list())
    explicit = list(node.attr["explicit_paddings"].list.i) or [0] * 8
    axes = [_axis_blocks(x_shape[1 + a], filter_shape[a], stride, node.attr["padding"].s,
                         (explicit[2 + 2 * a], explicit[3 + 2 * a])) for a in (0, 1)]
    if None in axes or (1 < min(filter_shape[:2]) < stride) or (
            filter_shape[:2] == (1, 1) and any(axes[0] + axes[1])):
        return None
    return _Phases(x_shape, filter_shape, stride, (*axes[0], *axes[1]))


def _typed_node(op_type: str, name: str, inputs: list[str], like: tf.compat.v1.NodeDef,
                int32_attrs: tuple[str, ...] = ()) -> tf.compat.v1.NodeDef:
    """An ``op_type`` node of ``like``'s device and dtype; ``int32_attrs`` name its type
    attributes of int32 (an index, a permutation, paddings)."""
    node = tf.compat.v1.NodeDef(name=name, op=op_type, device=like.device, input=inputs)
    node.attr["T"].CopyFrom(like.attr["T"])
    for attr in int32_attrs:
        node.attr[attr].type = tf.int32.as_datatype_enum
    return node


def _depth_node(op_type: str, name: str, inputs: list[str], k: int,
                like: tf.compat.v1.NodeDef) -> tf.compat.v1.NodeDef:
    """``SpaceToDepth`` or ``DepthToSpace`` with block ``k``."""
    node = _typed_node(op_type, name, inputs, like)
    node.attr["block_size"].i = k
    node.attr["data_format"].s = b"NHWC"
    return node


def _permute_nodes(name: str, tensor: str, phases: _Phases, from_blocks: bool,
                   like: tf.compat.v1.NodeDef) -> list[tf.compat.v1.NodeDef]:
    """A filter of ``[kh', kw', s*s*C, O]`` (``from_blocks``) to ``[s*kh', s*kw', C, O]`` or
    back, the last node named ``name`` (a one-block kernel needs reshapes only)."""
    (kh, kw), s = phases.block_kernel, phases.stride
    c, o = phases.x_shape[3], phases.filter_shape[3]
    target = [s * kh, s * kw, c, o] if from_blocks else [kh, kw, phases.depth, o]
    if (kh, kw) == (1, 1):
        return reshape_nodes(name, tensor, target, like)
    six = [kh, kw, s, s, c, o] if from_blocks else [kh, s, kw, s, c, o]
    transpose = _typed_node("Transpose", f"{name}/transpose", [f"{name}/six", f"{name}/perm"],
                            like, ("Tperm",))
    return [*reshape_nodes(f"{name}/six", tensor, six, like),
            const_node(f"{name}/perm", _PHASE_PERMUTATION, like.device), transpose,
            *reshape_nodes(name, f"{name}/transpose", target, like)]


def _conv_node(op_type: str, name: str, inputs: list[str], blocks: tuple[int, ...] | None,
               like: tf.compat.v1.NodeDef) -> tf.compat.v1.NodeDef:
    """``like``'s gradient op at stride 1 over the blocks, with ``blocks`` of explicit padding
    (``None``: ``VALID``, the input padded already)."""
    node = tf.compat.v1.NodeDef(name=name, op=op_type, device=like.device, input=inputs)
    for attr in ("T", "data_format", "use_cudnn_on_gpu"):
        if attr in like.attr:
            node.attr[attr].CopyFrom(like.attr[attr])
    node.attr["strides"].list.i.extend([1, 1, 1, 1])
    node.attr["dilations"].list.i.extend([1, 1, 1, 1])
    node.attr["padding"].s = b"VALID" if blocks is None else b"EXPLICIT"
    if blocks is not None:
        top, bottom, left, right = blocks
        node.attr["explicit_paddings"].list.i.extend([0, 0, top, bottom, left, right, 0, 0])
    return node


def _pad_node(name: str, tensor: str, pads: list[list[int]], like: tf.compat.v1.NodeDef
              ) -> list[tf.compat.v1.NodeDef]:
    """``Pad(tensor, pads)`` with zeros, named ``name``, and its paddings constant."""
    return [const_node(f"{name}/pads", pads, like.device),
            _typed_node("Pad", name, [tensor, f"{name}/pads"], like, ("Tpaddings",))]


def _pointwise_nodes(op_type: str, node: tf.compat.v1.NodeDef, phases: _Phases,
                     data: list[str], controls: list[str], after_dy: list[str]
                     ) -> list[tf.compat.v1.NodeDef]:
    """A 1x1 convolution gradient of stride ``s`` as a matrix product of the pixels it reads:
    ``x[:, ::s, ::s]`` for the filter's; for the input's, the product put in the first pixel
    of each block (padded with zeros along the channels, then ``DepthToSpace``). Padding the
    filter to a whole block instead would copy it ``s*s`` times (32 MiB for ResNet50's last
    1x1 of stride 2, 1024x2048, which set its floor)."""
    (n, h, w, c), o, s = phases.x_shape, phases.filter_shape[3], phases.stride
    base = f"{node.name}/pixels"
    dy = reshape_nodes(f"{base}/dy", data[2], [-1, o], node)
    if op_type == "Conv2DBackpropFilter":
        read = _typed_node("StridedSlice", f"{base}/x",
                           [data[0], f"{base}/begin", f"{base}/end", f"{base}/strides",
                            *after_dy], node, ("Index",))
        for mask in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                     "shrink_axis_mask"):
            read.attr[mask].i = 0
        return [const_node(f"{base}/begin", [0, 0, 0, 0], node.device),
                const_node(f"{base}/end", [n, h, w, c], node.device),
                const_node(f"{base}/strides", [1, s, s, 1], node.device), read,
                *reshape_nodes(f"{base}/rows", f"{base}/x", [-1, c], node), *dy,
                matmul_node(f"{base}/product", f"{base}/rows", f"{base}/dy", node, True, False,
                            controls),
                *reshape_nodes(node.name, f"{base}/product", [1, 1, c, o], node)]
    return [*reshape_nodes(f"{base}/w", data[1], [c, o], node), *dy,
            matmul_node(f"{base}/product", f"{base}/dy", f"{base}/w", node, False, True,
                        controls),
            *reshape_nodes(f"{base}/first", f"{base}/product", [n, h // s, w // s, c], node),
            *_pad_node(f"{base}/block", f"{base}/first",
                       [[0, 0], [0, 0], [0, 0], [0, (s * s - 1) * c]], node),
            _depth_node("DepthToSpace", node.name, [f"{base}/block"], s, node)]


def _replacement(op: tf.Operation, node: tf.compat.v1.NodeDef
                 ) -> tuple[list[tf.compat.v1.NodeDef], bool] | None:
    """The nodes computing ``op`` (a strided convolution gradient) over blocks, the last one
    named as ``op``, and whether they compute it as a matrix product; or ``None``."""
    phases = _phases(op)
    if phases is None:
        return None
    data = [i for i in node.input if not i.startswith("^")]
    controls = [i for i in node.input if i.startswith("^")]
    # Blocks of the input (or of the filter) are taken once the gradient flowing in exists:
    # taken earlier, in the forward pass, a copy of the input would stay until the backward.
    after_dy = [f"^{split_input(data[2])[0]}"]
    if phases.pointwise:
        return _pointwise_nodes(op.type, node, phases, data, controls, after_dy), True
    n, h, w, _ = phases.x_shape
    kh, kw = phases.block_kernel
    (fh, fw, c, o), s, depth = phases.filter_shape, phases.stride, phases.depth
    base = f"{node.name}/blocks"
    if op.type == "Conv2DBackpropFilter":
        nodes = [_depth_node("SpaceToDepth", f"{base}/x", [data[0], *after_dy], s, node)]
        if phases.as_product:
            nodes += [*reshape_nodes(f"{base}/rows", f"{base}/x", [-1, depth], node),
                      *reshape_nodes(f"{base}/dy", data[2], [-1, o], node),
                      matmul_node(f"{base}/product", f"{base}/rows", f"{base}/dy", node, True,
                                  False, controls)]
        else:
            # Padded first: Eigen's filter gradient with explicit padding took 2x as long as
            # on a padded input (30.3 against 12.7 ms on 32x32²x32, 3x3x32x64, one op,
            # 2026-12-06 22:35 UTC, load average 3.5).
            top, bottom, left, right = phases.blocks
            blocks = f"{base}/x"
            if any(phases.blocks):
                nodes += _pad_node(f"{base}/padded", blocks,
                                   [[0, 0], [top, bottom], [left, right], [0, 0]], node)
                blocks = f"{base}/padded"
            nodes += [const_node(f"{base}/sizes", [kh, kw, depth, o], node.device),
                      _conv_node(op.type, f"{base}/product",
                                 [blocks, f"{base}/sizes", data[2], *controls], None, node)]
        if (s * kh, s * kw) == (fh, fw):
            return [*nodes, *_permute_nodes(node.name, f"{base}/product", phases, True,
                                            node)], phases.as_product
        crop = _typed_node("Slice", node.name,
                           [f"{base}/filter", f"{base}/begin", f"{base}/size"], node, ("Index",))
        return [*nodes, *_permute_nodes(f"{base}/filter", f"{base}/product", phases, True, node),
                const_node(f"{base}/begin", [0, 0, 0, 0], node.device),
                const_node(f"{base}/size", [fh, fw, c, o], node.device),
                crop], phases.as_product
    nodes, weights = [], data[1]
    if (s * kh, s * kw) != (fh, fw):      # the filter padded with zeros to whole blocks
        nodes = _pad_node(f"{base}/padded", weights,
                          [[0, s * kh - fh], [0, s * kw - fw], [0, 0], [0, 0]], node)
        weights = f"{base}/padded"
    if phases.as_product:
        nodes += [*reshape_nodes(f"{base}/w", weights, [depth, o], node),
                  *reshape_nodes(f"{base}/dy", data[2], [-1, o], node),
                  matmul_node(f"{base}/product", f"{base}/dy", f"{base}/w", node, False, True,
                              controls),
                  *reshape_nodes(f"{base}/gradient", f"{base}/product",
                                 [n, h // s, w // s, depth], node)]
    else:
        nodes += [*_permute_nodes(f"{base}/w", weights, phases, False, node),
                  const_node(f"{base}/sizes", [n, h // s, w // s, depth], node.device),
                  _conv_node(op.type, f"{base}/gradient",
                             [f"{base}/sizes", f"{base}/w", data[2], *controls],
                             phases.blocks, node)]
    # The filter's blocks, too, wait for the gradient (a reshape of the variable's value is a
    # view; its first copy is the pad or the transpose, which would otherwise run first).
    next(new for new in nodes if new.op != "Const").input.extend(after_dy)
    return [*nodes, _depth_node("DepthToSpace", node.name, [f"{base}/gradient"], s,
                                node)], phases.as_product


def patchify_conv_gradients(item: GraphItem) -> tuple[GraphItem, dict]:
    """Compute every strided convolution gradient of ``item`` over space-to-depth blocks, as
    a matrix product or a stride-1 gradient, neither of which needs TF's column buffer
    (module docstring).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when nothing matched or oneDNN
        is on) and a JSON-ready record: ``changed``, ``rewritten`` gradients, of which
        ``as_products`` became matrix products; ``left`` strided gradients whose padding does
        not fall on the blocks, on TF's kernels.
    """
    record = {"changed": False, "rewritten": 0, "as_products": 0, "left": 0}
    if onednn_enabled():
        return item, {**record, "skipped": "oneDNN on: its kernels need no column buffer"}
    graph_def = item.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    replacements = {}
    for op in item.graph.get_operations():
        if op.type not in CONV_GRADIENT_OP_TYPES or "_kernel" in op.node_def.attr:
            continue
        new = _replacement(op, nodes[op.name])
        if new and all(n.name == op.name or n.name not in nodes for n in new[0]):
            replacements[op.name] = new[0]
            record["as_products"] += new[1]
        elif list(op.node_def.attr["strides"].list.i)[1:3] != [1, 1]:
            record["left"] += 1
    if not replacements:
        return item, record
    kept = [node for node in graph_def.node if node.name not in replacements]
    del graph_def.node[:]
    graph_def.node.extend(kept)
    for new in replacements.values():
        graph_def.node.extend(new)
    record.update(changed=True, rewritten=len(replacements))
    return rebuild(item, graph_def, "patch_convs", record, exact_graph=False), record
