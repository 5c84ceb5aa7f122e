"""The convolution-gradient kernel pass: stride-1 gradients run with TF's Eigen kernels, which
need no column buffer, and compute the same step."""

import numpy as np
import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.conv_kernels import EIGEN_KERNEL_LABEL
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.trace import profile_graph
from graphfit.remat.conv_grad_kernels import use_eigen_conv_gradients
from graphfit.remat.tf_memory import step_item


def _conv_step() -> GraphItem:
    """Two 3x3 convolutions, the first of stride 1, the second of stride 2, trained by SGD."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 8], name="x")
        init = tf.compat.v1.random_normal_initializer(0, 0.1)
        w1 = tf.compat.v1.get_variable("w1", [3, 3, 8, 16], initializer=init, use_resource=True)
        w2 = tf.compat.v1.get_variable("w2", [3, 3, 16, 16], initializer=init, use_resource=True)
        h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME", name="conv1"))
        y = tf.nn.conv2d(h, w2, 2, "SAME", name="conv2")
        loss = tf.identity(tf.reduce_sum(y * y), name="loss")
        gradients = tf.compat.v1.gradients(loss, [w1, w2])
        train = tf.compat.v1.train.GradientDescentOptimizer(1e-3).apply_gradients(
            zip(gradients, [w1, w2]), name="train_op")
        initializer = tf.compat.v1.global_variables_initializer()
    batch = np.random.default_rng(0).standard_normal((8, 16, 16, 8), dtype=np.float32)
    return GraphItem(graph, train.name, loss.name, [g.name for g in gradients],
                     initializer.name, {"x:0": batch}, name="conv")


def test_stride_one_gradients_get_the_eigen_kernel_without_a_column_buffer():
    item = _conv_step()
    relabelled, record = use_eigen_conv_gradients(item)
    # conv1's filter and input gradients (the latter unused) are of stride 1, conv2's of
    # stride 2.
    assert record == {"changed": True, "relabelled": 2, "strided": 2}
    kernels = {op.name: op.node_def.attr["_kernel"].s if "_kernel" in op.node_def.attr else None
               for op in relabelled.graph.get_operations() if op.type.startswith("Conv2DBackprop")}
    assert sorted(kernels.values(), key=str) == [None, None] + [EIGEN_KERNEL_LABEL] * 2
    assert compare_steps(item, relabelled).equal
    name = next(n for n, kernel in kernels.items()
                if kernel == EIGEN_KERNEL_LABEL and "BackpropFilter" in n)
    before, after = (profile_graph(step_item(step), steps=1, warmup=1, trace_every=1,
                                   progress=None).ops[name].temp_bytes
                     for step in (item, relabelled))
    # The default kernel's buffer is sized for 30 MiB of work whatever the batch.
    assert before > 2**20 and after == 0


def test_a_step_without_stride_one_convolution_gradients_is_left_alone():
    item = _conv_step()
    once, _ = use_eigen_conv_gradients(item)
    again, record = use_eigen_conv_gradients(once)
    assert again is once and record == {"changed": False, "relabelled": 0, "strided": 2}
