"""TF's two CPU kernels for a convolution gradient, chosen per node by its ``_kernel`` label.

``Conv2DBackpropFilter`` and ``Conv2DBackpropInput`` each have a default CPU kernel (im2col into
a column buffer, then a matrix product) and one labelled ``eigen_tensor`` (Eigen's
``SpatialConvolutionBackward*``, no buffer). ``remat.conv_grad_kernels`` gives stride-1
gradients the Eigen one; ``profiler.step_compare.unfused_twin`` runs each with the other
kernel than its step does, since the two sum in other orders and round differently.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["CONV_GRADIENT_OP_TYPES", "EIGEN_KERNEL_LABEL", "takes_eigen_kernel",
           "uses_eigen"]

CONV_GRADIENT_OP_TYPES = ("Conv2DBackpropFilter", "Conv2DBackpropInput")
EIGEN_KERNEL_LABEL = b"eigen_tensor"


def takes_eigen_kernel(node: tf.compat.v1.NodeDef) -> bool:
    """A convolution gradient of stride 1 and no dilation: the ops ``remat.conv_grad_kernels``
    gives the Eigen kernel (strided ones run 1.5-7x slower on it; its measurements)."""
    unit = [1, 1, 1, 1]
    return (node.op in CONV_GRADIENT_OP_TYPES and list(node.attr["strides"].list.i) == unit and
            list(node.attr["dilations"].list.i or unit) == unit)


def uses_eigen(node: tf.compat.v1.NodeDef) -> bool:
    """Whether ``node`` runs the Eigen kernel."""
    return "_kernel" in node.attr and node.attr["_kernel"].s == EIGEN_KERNEL_LABEL
