"""Convolution gradients without a scratch buffer: TF's Eigen kernels where they are as fast.

TF's default CPU kernels for ``Conv2DBackpropFilter`` and ``Conv2DBackpropInput`` (oneDNN off)
unfold patches into a column buffer (im2col) and multiply it with a matrix. They size the
buffer for a shard of images that fits a working set of 30 MiB whatever the batch
(``conv_grad_filter_ops.cc``, ``conv_grad_input_ops.cc``: ``target_working_set_size``), so it
is a fixed cost no plan can shrink: on ``bench.reach``'s Keras ResNet-style step (32²,
batch 32, Adam) each first-stage filter gradient took 27 MiB of temporaries beside its two
4 MiB inputs, the planner's lower bound was 0.40-0.43 of the step's peak, and at 0.5 a plan
had 9 MiB of room at those ops. Splitting the batch does not help (measured: a piece of 3
images still took 27 MiB).

TF registers a second CPU kernel for both ops under the label ``eigen_tensor`` (Eigen's
``SpatialConvolutionBackward*``, ``profiler.conv_kernels``): it contracts the patches without
materialising them.
Measured on this 2-core machine, one op, float32, against the default (2026-12-05; ms and
temporary MiB, filter gradient | input gradient):

===========================  =========================  =========================
input, filter, stride        default                    ``eigen_tensor``
===========================  =========================  =========================
32x32²x32, 3x3x32x32, 1      12.4, 27.0 | 11.7, 1.1     10.3, 0 | 6.1, 0
32x16²x64, 3x3x64x64, 1      6.9, 22.5 | 9.5, 0.6       5.4, 0 | 5.2, 0
32x8²x128, 3x3x128x128, 1    6.6, 9.8 | 13.4, 0.3       5.0, 0 | 5.2, 0
8x16²x256, 3x3x256x256, 1    21.9, 15.8 | 31.4, 2.2     19.0, 0 | 19.1, 0
8x64²x64, 1x1x64x256, 1      38.3, 6.0 | 51.2, 1.0      37.4, 0 | 46.3, 0
32x32²x3, 3x3x3x32, 1        3.7, 13.6 | 3.9, 13.6      4.9, 0 | 3.1, 0
32x32²x32, 3x3x32x64, 2      5.1, 20.5 | 7.2, 20.5      15.0, 0 | 10.6, 0
16x64²x3, 7x7x3x32, 2        7.9, 24.1 | 6.2, 0.6       33.9, 0 | 43.2, 0
===========================  =========================  =========================

Both agree with a float64 reference to 1-8e-7 (relative). Measured again on 2026-12-05 at
11:00 (same machine, one op per session, fed inputs), the filter gradients of 1x1
(pointwise) convolutions and of a 3-channel input were slower on the Eigen kernel, and the
1x1x64x256 row above did not reproduce (ms and temporary MiB, filter | input gradient):

===========================  =========================  =========================
input, filter, stride        default                    ``eigen_tensor``
===========================  =========================  =========================
32x32²x32, 1x1x32x32, 1      4.2-4.9, 14.9 | 1.9, 14.9  3.4-3.9, 0 | 2.2, 0
32x16²x32, 1x1x32x64, 1      1.4-1.5, 9.2 | 0.9, 9.2    2.1-2.3, 0 | 1.0, 0
32x16²x64, 1x1x64x128, 1     2.4-3.6, 8.6 | 2.1, 8.6    4.7-5.7, 0 | 1.5, 0
32x8²x128, 1x1x128x128, 1    1.2-1.6, 7.5 | 1.2, 7.5    1.3-1.7, 0 | 1.0, 0
8x64²x64, 1x1x64x256, 1      41-47, 6.0 | 42.9, 1.0     75-78, 0 | 40.2, 0
32x32²x3, 3x3x3x32, 1        2.2-2.6, 13.6 | 2.6, 13.6  5.3-5.9, 0 | 2.8, 0
32x32²x32, 3x3x32x32, 1      12.5-13.6, 27.0 | 10.4, 1.1  9.7-10.7, 0 | 5.7, 0
===========================  =========================  =========================

So the pass gives the Eigen kernel (a ``_kernel`` attribute, as
``tf.Graph._kernel_label_map`` sets it) to every convolution gradient of stride 1 and no
dilation, which frees every such temporary (6-27 MiB each above): the gradients of 3x3
convolutions over 32 channels run faster (0.55-0.86x the default's time), those of 1x1
convolutions and of a 3-channel input are mixed: input gradients 0.7-1.2x, filter gradients
0.8-1.8x, and 2.3x for the 3-channel filter gradient. That is memory bought
with time, without asking the planner (the Keras MobileNet-style step's filter gradients took
19-25 ms of op time against the user's 13 ms, 2026-12-05): choosing per op, by what the budget
needs, is not built. Strided gradients, on which the default kernels are 1.5-7x faster, are
``remat.patch_convs``': it runs them as stride-1 gradients over space-to-depth blocks, which
this pass then labels.

Skipped with oneDNN on: its layout pass replaces both ops with its own kernels.
Postconditions: the rewritten graph imports and keeps every node, name and edge.
"""

from __future__ import annotations

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.conv_kernels import (CONV_GRADIENT_OP_TYPES, EIGEN_KERNEL_LABEL,
                                            takes_eigen_kernel)
from graphfit.profiler.session import onednn_enabled
from graphfit.profiler.graph_def_walk import rebuild

__all__ = ["use_eigen_conv_gradients"]


def use_eigen_conv_gradients(item: GraphItem) -> tuple[GraphItem, dict]:
    """Run every stride-1 convolution gradient of ``item`` with TF's Eigen kernel, which needs
    no column buffer (module docstring).

    Returns:
        ``(step, record)``: the rewritten step (``item`` itself when nothing matched or oneDNN
        is on) and a JSON-ready record: ``changed``, ``relabelled`` ops, ``strided`` ones left
        on the default kernels (ops with a kernel chosen already are not counted).
    """
    record = {"changed": False, "relabelled": 0, "strided": 0}
    if onednn_enabled():
        return item, {**record, "skipped": "oneDNN on: its own kernels replace the ops"}
    graph_def = item.graph.as_graph_def()
    for node in graph_def.node:
        if node.op in CONV_GRADIENT_OP_TYPES and "_kernel" not in node.attr:
            if takes_eigen_kernel(node):
                node.attr["_kernel"].s = EIGEN_KERNEL_LABEL
                record["relabelled"] += 1
            else:
                record["strided"] += 1
    if not record["relabelled"]:
        return item, record
    record["changed"] = True
    return rebuild(item, graph_def, "conv_grad_kernels", record, exact_graph=False), record
