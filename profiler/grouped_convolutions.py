"""Run Keras' depthwise-grouped convolutions on TF's depthwise kernels.

Keras 3 runs a ``Conv2D`` with ``groups > 1`` as a nested, XLA-compiled function, because TF's
CPU kernels have no gradient of a grouped ``Conv2D`` ("Gradients for grouped convolutions are
not supported on CPU"). Once ``profiler.inline_functions`` has inlined it, the step runs
without XLA, so the grouped convolution needs kernels that exist. Where every group is one
channel in and one out (``groups == channels == filters``: ConvNeXt's 7x7 convolutions,
MobileNet-style layers written as grouped ``Conv2D``), it is exactly a depthwise convolution:
``Conv2D`` and its two gradients become ``DepthwiseConv2dNative`` and its gradients, with the
filter viewed as ``[h, w, channels, 1]`` instead of ``[h, w, 1, channels]`` (the same buffer:
a ``Reshape`` of a size-1 axis). Node names stay, so readers need no rewiring.

Other grouped convolutions (several channels per group) are left as they are: TF refuses
them when the step runs, naming the node.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2
from tensorflow.python.framework.tensor_util import constant_value_as_shape

__all__ = ["use_depthwise_kernels"]

_CONV_ATTRS = ("T", "strides", "padding", "explicit_paddings", "data_format", "dilations")


def _shapes(graph: tf.Graph, node: node_def_pb2.NodeDef
            ) -> tuple[tf.TensorShape, tf.TensorShape]:
    """The static shapes of the filter and of the convolution's input; a gradient's shape
    argument is read through ``Shape``/``ShapeN`` as far as TF can."""
    op = graph.get_operation_by_name(node.name)
    if node.op == "Conv2DBackpropFilter":
        return _shape_argument(op.inputs[1]), op.inputs[0].shape
    if node.op == "Conv2DBackpropInput":
        return op.inputs[1].shape, _shape_argument(op.inputs[0])
    return op.inputs[1].shape, op.inputs[0].shape


def _shape_argument(tensor: tf.Tensor) -> tf.TensorShape:
    """The shape a shape-valued tensor holds, as far as it is static (the tape computes a
    gradient's shape argument with ``ShapeN``, which ``constant_value_as_shape`` skips)."""
    if tensor.op.type == "ShapeN":
        return tensor.op.inputs[tensor.value_index].shape
    return constant_value_as_shape(tensor)


def _depthwise_channels(graph: tf.Graph, node: node_def_pb2.NodeDef) -> int | None:
    """The channel count if ``node`` (a ``Conv2D`` or one of its gradients, NHWC) is a
    depthwise-grouped convolution, else ``None``."""
    if node.attr["data_format"].s not in (b"", b"NHWC"):
        return None
    filter_shape, data_shape = _shapes(graph, node)
    if filter_shape.rank != 4 or data_shape.rank != 4 or None in (filter_shape[2],
                                                                  data_shape[3]):
        return None
    channels = data_shape[3]
    grouped = filter_shape[2] == 1 and channels > 1 and filter_shape[3] == channels
    return channels if grouped else None


def _const(name: str, values: list[int]) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values, tf.int32))
    return node


def _reshape(name: str, tensor: str, shape: str, dtype: attr_value_pb2.AttrValue
             ) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Reshape", input=[tensor, shape])
    node.attr["T"].CopyFrom(dtype)
    node.attr["Tshape"].type = tf.int32.as_datatype_enum
    return node


def _rewritten(node: node_def_pb2.NodeDef, graph: tf.Graph, channels: int
               ) -> list[node_def_pb2.NodeDef]:
    """The nodes that compute ``node`` on the depthwise kernels, the last named as it."""
    h, w = _shapes(graph, node)[0][:2]
    depthwise_shape = _const(f"{node.name}/depthwise_shape", [h, w, channels, 1])
    op_type = {"Conv2D": "DepthwiseConv2dNative",
               "Conv2DBackpropInput": "DepthwiseConv2dNativeBackpropInput",
               "Conv2DBackpropFilter": "DepthwiseConv2dNativeBackpropFilter"}[node.op]
    data = [i for i in node.input if not i.startswith("^")]
    controls = [i for i in node.input if i.startswith("^")]
    if node.op == "Conv2DBackpropFilter":
        kernel = node_def_pb2.NodeDef(name=f"{node.name}/depthwise", op=op_type,
                                      input=[data[0], depthwise_shape.name, data[2], *controls])
        grouped_shape = _const(f"{node.name}/grouped_shape", [h, w, 1, channels])
        last = [grouped_shape, _reshape(node.name, kernel.name, grouped_shape.name,
                                        node.attr["T"])]
    else:
        view = _reshape(f"{node.name}/depthwise_filter", data[1], depthwise_shape.name,
                        node.attr["T"])
        kernel = node_def_pb2.NodeDef(name=node.name, op=op_type,
                                      input=[data[0], view.name, data[2], *controls]
                                      if node.op == "Conv2DBackpropInput"
                                      else [data[0], view.name, *controls])
        last = []
    for attr in _CONV_ATTRS:
        if attr in node.attr:
            kernel.attr[attr].CopyFrom(node.attr[attr])
    if node.device:
        kernel.device = node.device
    return [depthwise_shape, *([] if node.op == "Conv2DBackpropFilter" else [view]), kernel,
            *last]


def use_depthwise_kernels(graph_def: graph_pb2.GraphDef) -> tuple[graph_pb2.GraphDef, int]:
    """``graph_def`` with its depthwise-grouped convolutions and their gradients on the
    depthwise kernels (module docstring).

    Returns:
        ``(the GraphDef, the number of nodes rewritten)``; ``graph_def`` itself when none is.
    """
    candidates = [n for n in graph_def.node
                  if n.op in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")]
    if not candidates:
        return graph_def, 0
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    grouped = {n.name: c for n in candidates
               if (c := _depthwise_channels(graph, n)) is not None}
    if not grouped:
        return graph_def, 0
    result = graph_pb2.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        result.node.extend(_rewritten(node, graph, grouped[node.name])
                           if node.name in grouped else [node])
    return result, len(grouped)
