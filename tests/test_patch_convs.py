"""The space-to-depth pass: strided convolution gradients run over blocks of ``s x s`` pixels,
as matrix products or stride-1 gradients, compute the same step, and need no column buffer."""

import numpy as np
import tensorflow as tf

from graphfit.models.training import build_training_step
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.tf_import import cost_graph_from_graph, step_operations
from graphfit.profiler.trace import profile_graph
from graphfit.remat.conv_grad_kernels import use_eigen_conv_gradients
from graphfit.remat.patch_convs import patchify_conv_gradients
from graphfit.remat.plan import COMPUTE, Event, RematPlan
from graphfit.remat.rewrite import backward_start, rewrite
from graphfit.remat.tf_memory import step_item


def _strided_step():
    """Strided convolutions of every kind the pass meets, on a [4, 32, 32, 3] batch trained
    by SGD: a 7x7 stem of stride 2 (``SAME``: 2 pixels of padding before, one block), a 3x3
    of stride 2 beside a 1x1 shortcut of stride 2, a 2x2 patchify downsampler, and a 5x5 of
    stride 2 whose ``SAME`` padding (1 pixel before) falls inside a block."""
    def forward(rng: np.random.Generator):
        x = tf.compat.v1.placeholder(tf.float32, [4, 32, 32, 3], name="x")
        init = tf.compat.v1.random_normal_initializer(0, 0.3)

        def conv(name, h, k, outputs, padding):
            w = tf.compat.v1.get_variable(name, [k, k, h.shape[-1], outputs], initializer=init,
                                          use_resource=True)
            return tf.nn.conv2d(h, w, 2, padding, name=f"{name}_conv")

        h = tf.nn.gelu(conv("stem", x, 7, 8, "SAME"))
        h = tf.nn.gelu(conv("conv", h, 3, 16, "SAME") + conv("shortcut", h, 1, 16, "VALID"))
        h = conv("down", h, 2, 32, "VALID")
        y = conv("wide", h, 5, 8, "SAME")
        return tf.reduce_sum(y * y), {"x:0": rng.standard_normal((4, 32, 32, 3),
                                                                 dtype=np.float32)}

    return build_training_step("strided", {"optimizer": "sgd", "learning_rate": 1e-3,
                                           "seed": 0}, forward)


def _strided_gradients(item) -> set[str]:
    return {op.name for op in item.graph.get_operations() if op.type.startswith("Conv2DBackprop")
            and list(op.node_def.attr["strides"].list.i) != [1, 1, 1, 1]}


def test_strided_gradients_run_over_blocks_without_a_column_buffer():
    item = _strided_step()
    blocked, record = patchify_conv_gradients(item)
    # Filter and input gradients of four convolutions (TF builds the stem's input gradient
    # too, which the step never runs); the 1x1 and 2x2 ones as products; the 5x5 one's two
    # keep TF's kernels.
    assert record == {"changed": True, "rewritten": 8, "as_products": 4, "left": 2}
    left = _strided_gradients(blocked)
    assert left == {name for name in _strided_gradients(item) if name.startswith("gradients/wide")}
    comparison = compare_steps(item, blocked, rtol=1e-4, atol_of_max=1e-5)
    assert comparison.equal, comparison
    # The 1x1 shortcut's filter gradient is one product of the filter's size, over the pixels
    # it reads (over whole blocks it would be 4 times that), and nothing pads its filter.
    shortcut = [op for op in blocked.graph.get_operations()
                if op.name.startswith("gradients/shortcut_conv_grad/")]
    assert [op.outputs[0].shape.num_elements() for op in shortcut
            if op.type == "MatMul" and "BackpropFilter" in op.name] == [8 * 16]
    assert all(op.inputs[0].shape.rank != 4 or op.inputs[0].shape[:2] != [1, 1]
               for op in shortcut if op.type == "Pad")
    # After conv_grad_kernels (as the pipeline runs them) the stride-1 gradients over blocks
    # take Eigen's kernel: TF's default kernels sized their buffers for 30 MiB of work whatever
    # the batch; the only gradients left holding temporaries are the 5x5 ones.
    relabelled, _ = use_eigen_conv_gradients(blocked)
    ops = [profile_graph(step_item(step), steps=1, warmup=1, trace_every=1,
                         progress=None).ops for step in (item, relabelled)]
    rewritten = _strided_gradients(item) - left
    assert all(ops[0][name].temp_bytes >= 2**20 for name in rewritten
               if name in ops[0] and "BackpropFilter" in name)
    assert {name for name, op in ops[1].items()
            if op.temp_bytes and name.startswith("gradients/")} == left


def test_gradients_on_blocks_already_or_padded_inside_a_block_are_left_alone():
    blocked, _ = patchify_conv_gradients(_strided_step())
    again, record = patchify_conv_gradients(blocked)
    assert again is blocked
    assert record == {"changed": False, "rewritten": 0, "as_products": 0, "left": 2}


def test_a_reshaped_filter_does_not_start_the_backward_pass():
    """The 1x1 input gradient's reshaped filter (``.../pixels/w``) reads only a weight, so a
    plan may compute it in the forward pass; the rewrite's chain must not start there, or
    every later forward node gets an ordering edge and Grappler no longer regroups the
    forward sums as in the user's step (``keras.applications.ResNet50``, oneDNN off: loss
    3.3e-6, updates 2.0e-4 off; ``remat.rewrite.backward_start``)."""
    item, _ = patchify_conv_gradients(_strided_step())
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    (reshape,) = [i for i, name in enumerate(graph.names) if name.endswith("/pixels/w")]
    traced = backward_start(item, graph, range(graph.num_ops))
    # The reshape and what it reads (the filter's handle and read, a shape) first, as a plan
    # may order them, then the traced order.
    first, stack = set(), [reshape]
    while stack:
        op = stack.pop()
        if op not in first:
            first.add(op)
            stack.extend(int(graph.tensor_producer[t]) for t in graph.op_inputs(op))
    order = sorted(first) + [i for i in range(graph.num_ops) if i not in first]
    assert backward_start(item, graph, order) == traced == "gradients/mul_grad/Mul"
    plan = RematPlan([Event(COMPUTE, i) for i in order], 0, 0, 1.0, 1.0, "hand")
    rewritten = rewrite(item, graph, plan)
    forward = {op.name for op in step_operations(item.graph, [item.loss])}
    assert rewritten.config["remat"]["pinned_from"] > order.index(reshape)
    assert not [op.name for op in rewritten.graph.get_operations() if op.name in forward and
                {c.name for c in op.control_inputs} -
                {c.name for c in item.graph.get_operation_by_name(op.name).control_inputs}]
