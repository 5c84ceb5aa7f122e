"""Raw-op building blocks shared by the model zoo: variables, dense, conv, batch norm, dropout.

Keras 3 ships with TensorFlow 2.21, so ``tf.compat.v1.layers`` and the v1 RNN cells are gone
(DESIGN.md §6). These helpers build the same graphs from ``tf.nn``, ``tf.matmul`` and
``tf.compat.v1.get_variable``: one variable scope per layer, resource variables, float32.

Every helper must be called inside ``with graph.as_default():`` of a graph whose seed is set
(``models.training.build_training_step`` does both): initializers take no explicit seed, so
TensorFlow derives each op seed from the graph seed and the op's position in the graph, which
makes two builds of one model give identical variables and identical GraphDef bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

__all__ = [
    "batch_norm",
    "conv2d",
    "cross_entropy",
    "dense",
    "dropout",
    "embedding",
    "input_placeholder",
    "variable",
]


def variable(name: str, shape: Sequence[int], initializer) -> tf.Variable:
    """A trainable float32 resource variable in the current variable scope."""
    return tf.compat.v1.get_variable(
        name, shape=list(shape), dtype=tf.float32, initializer=initializer, use_resource=True
    )


def input_placeholder(feeds: dict[str, np.ndarray], name: str, value: np.ndarray) -> tf.Tensor:
    """A placeholder shaped like ``value``; records ``value`` as its feed in ``feeds``."""
    tensor = tf.compat.v1.placeholder(tf.as_dtype(value.dtype), shape=value.shape, name=name)
    feeds[tensor.name] = value
    return tensor


def image_batch(feeds: dict[str, np.ndarray], rng: np.random.Generator, batch_size: int,
                image_size: int, num_classes: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Placeholders ``images`` (standard-normal NHWC RGB) and ``labels`` (uniform classes) with
    their generated batch recorded in ``feeds``: the input of every image classifier here."""
    images = input_placeholder(
        feeds, "images",
        rng.standard_normal((batch_size, image_size, image_size, 3), dtype=np.float32))
    labels = input_placeholder(
        feeds, "labels", rng.integers(0, num_classes, batch_size, dtype=np.int32))
    return images, labels


def dense(
    x: tf.Tensor,
    units: int,
    name: str,
    activation=None,
    use_bias: bool = True,
    initializer=None,
) -> tf.Tensor:
    """``activation(x @ W + b)`` for a 2-D ``x``; Glorot-uniform ``W`` unless told otherwise."""
    with tf.compat.v1.variable_scope(name):
        kernel = variable(
            "kernel",
            [x.shape[-1], units],
            initializer or tf.compat.v1.glorot_uniform_initializer(),
        )
        y = tf.matmul(x, kernel)
        if use_bias:
            y = tf.nn.bias_add(y, variable("bias", [units], tf.compat.v1.zeros_initializer()))
        return activation(y) if activation is not None else y


def conv2d(
    x: tf.Tensor,
    filters: int,
    kernel_size: int | tuple[int, int],
    name: str,
    stride: int = 1,
    padding: str = "SAME",
    use_bias: bool = True,
    initializer=None,
) -> tf.Tensor:
    """A 2-D convolution over NHWC ``x``; He-normal weights unless told otherwise."""
    kernel_h, kernel_w = (
        (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    )
    he_normal = tf.compat.v1.variance_scaling_initializer(
        scale=2.0, distribution="truncated_normal"
    )
    with tf.compat.v1.variable_scope(name):
        kernel = variable(
            "kernel", [kernel_h, kernel_w, x.shape[-1], filters], initializer or he_normal
        )
        y = tf.nn.conv2d(x, kernel, strides=[1, stride, stride, 1], padding=padding)
        if use_bias:
            y = tf.nn.bias_add(y, variable("bias", [filters], tf.compat.v1.zeros_initializer()))
        return y


def batch_norm(x: tf.Tensor, name: str, scale: bool = True, epsilon: float = 1e-3) -> tf.Tensor:
    """Training-mode batch normalisation of NHWC ``x`` with the batch's own statistics.

    One ``FusedBatchNormV3`` op, as Keras and TF-slim emit on CPU and GPU. Moving averages are
    not kept: the graphs here are training steps only, and the extra assign ops would be state
    that no pass needs. ``scale=False`` drops gamma (TF-slim's Inception-V3 does).
    """
    channels = x.shape[-1]
    with tf.compat.v1.variable_scope(name):
        beta = variable("beta", [channels], tf.compat.v1.zeros_initializer())
        gamma = (
            variable("gamma", [channels], tf.compat.v1.ones_initializer())
            if scale
            else tf.ones([channels], tf.float32, name="gamma")
        )
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=epsilon, is_training=True
        )
        return y


def dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
    """Inverted dropout with drop probability ``rate``; no op at all when ``rate`` is 0."""
    return tf.nn.dropout(x, rate=rate) if rate > 0 else x


def embedding(ids: tf.Tensor, table: tf.Variable) -> tf.Tensor:
    """Rows of ``table`` for integer ``ids`` (a ``ResourceGather``)."""
    return tf.nn.embedding_lookup(table, ids)


def cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy of ``logits`` [N, classes] against int ``labels`` [N]."""
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )
