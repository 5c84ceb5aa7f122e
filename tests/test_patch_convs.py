"""The patchify-convolution pass: gradients of convolutions whose stride is their kernel size
run as matrix products of patches, compute the same step, and need no column buffer."""

import numpy as np
import tensorflow as tf

from graphfit.models.training import build_training_step
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.trace import profile_graph
from graphfit.remat.patch_convs import patchify_conv_gradients
from graphfit.remat.tf_memory import step_item


def _patchify_step(stem_padding: str = "VALID"):
    """A ConvNeXt-style stem (4x4, stride 4) and downsampling layer (2x2, stride 2) on a
    [4, 32, 32, 3] batch, a 3x3 convolution of stride 2 beside them, trained by SGD."""
    def forward(rng: np.random.Generator):
        x = tf.compat.v1.placeholder(tf.float32, [4, 32, 32, 3], name="x")
        init = tf.compat.v1.random_normal_initializer(0, 0.3)
        w1 = tf.compat.v1.get_variable("stem", [4, 4, 3, 16], initializer=init, use_resource=True)
        w2 = tf.compat.v1.get_variable("down", [2, 2, 16, 32], initializer=init,
                                       use_resource=True)
        w3 = tf.compat.v1.get_variable("conv", [3, 3, 32, 8], initializer=init, use_resource=True)
        h = tf.nn.gelu(tf.nn.conv2d(x, w1, 4, stem_padding, name="stem_conv"))
        h = tf.nn.conv2d(h, w2, 2, "VALID", name="down_conv")
        y = tf.nn.conv2d(h, w3, 2, "SAME", name="strided_conv")
        loss = tf.reduce_sum(y * y)
        return loss, {"x:0": rng.standard_normal((4, 32, 32, 3), dtype=np.float32)}

    return build_training_step("patchify", {"optimizer": "sgd", "learning_rate": 1e-3,
                                            "seed": 0}, forward)


def _conv_gradients(item) -> list[str]:
    return [op.name for op in item.graph.get_operations()
            if op.type.startswith("Conv2DBackprop")]


def test_patchify_gradients_become_products_without_a_column_buffer():
    item = _patchify_step()
    patched, record = patchify_conv_gradients(item)
    # Both gradients of the stem (TF builds the input's too, which the step never runs) and
    # of the downsampler; the 3x3 stride-2 ones keep TF's kernels.
    assert record == {"changed": True, "rewritten": 4}
    assert len(_conv_gradients(patched)) == len(_conv_gradients(item)) - 4
    comparison = compare_steps(item, patched, rtol=1e-4, atol_of_max=1e-5)
    assert comparison.equal, comparison
    # TF's default kernel sizes its buffer for 30 MiB of work whatever the batch; the
    # products' working memory is the patches, one copy of the input.
    rewritten = set(_conv_gradients(item)) - set(_conv_gradients(patched))
    ops = [profile_graph(step_item(step), steps=1, warmup=1, trace_every=1,
                         progress=None).ops for step in (item, patched)]
    assert all(ops[0][name].temp_bytes >= 2**20 for name in rewritten
               if "BackpropFilter" in name)
    assert sum(op.temp_bytes for op in ops[1].values()) <= sum(
        op.temp_bytes for name, op in ops[0].items() if name not in rewritten)


def test_convolutions_with_overlapping_or_padded_windows_are_left_alone():
    patched, _ = patchify_conv_gradients(_patchify_step())
    again, record = patchify_conv_gradients(patched)
    assert again is patched and record == {"changed": False, "rewritten": 0}
    # Only VALID windows are rewritten: a SAME stem keeps its kernel, the downsampler changes.
    assert patchify_conv_gradients(_patchify_step("SAME"))[1]["rewritten"] == 2
