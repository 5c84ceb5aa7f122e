"""CIFAR-style residual network (He et al. 2016, §4.2): ResNet-8/20/32/44/56/110, depth 6n+2.

A 3x3 convolution with ``base_width`` filters, three stages of ``n`` basic blocks (two 3x3
conv-BN layers and an identity shortcut) with ``base_width`` x 1, 2 and 4 filters on 32x32,
16x16 and 8x8 feature maps, global average pooling and a fully connected softmax layer.
Where a stage halves the map and doubles the width the shortcut is a strided 1x1 conv with
batch norm (the paper's option B; its CIFAR runs used zero-padding, option A — B is what the
TensorFlow and PyTorch reference implementations build). Batch norm runs in training mode
(one fused op, batch statistics). Input is a fixed batch of standard-normal images with random
labels.

Reference: He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graphfit.models import layers
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step

__all__ = ["PRESETS", "build"]

PRESETS = {
    "tiny": dict(batch_size=4, depth=8, base_width=8, image_size=32, num_classes=10),
    "default": dict(batch_size=32, depth=20, base_width=16, image_size=32, num_classes=10),
    "activations": dict(batch_size=128, depth=32, base_width=16, image_size=32, num_classes=10),
}


def _conv_bn(x: tf.Tensor, filters: int, kernel_size: int, stride: int, name: str) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        x = layers.conv2d(x, filters, kernel_size, "conv", stride=stride, use_bias=False)
        return layers.batch_norm(x, "bn")


def _basic_block(x: tf.Tensor, filters: int, stride: int, name: str) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        y = tf.nn.relu(_conv_bn(x, filters, 3, stride, "a"))
        y = _conv_bn(y, filters, 3, 1, "b")
        shortcut = x
        if stride != 1 or x.shape[-1] != filters:
            shortcut = _conv_bn(x, filters, 1, stride, "shortcut")
        return tf.nn.relu(y + shortcut)


def build(
    batch_size: int = 32,
    depth: int = 20,
    base_width: int = 16,
    image_size: int = 32,
    num_classes: int = 10,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The ResNet training step.

    Parameters:
        batch_size: images per step.
        depth: total weighted layers, 6n+2 (8, 20, 32, 44, 56, 110, ...).
        base_width: filters of the first stage (16 in the paper); stages use 1x, 2x, 4x.
        image_size: height and width of the square RGB images (32 for CIFAR-10).
        num_classes: number of output classes.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Raises:
        ValueError: ``depth`` is not 6n+2 with n >= 1.

    Feeds: ``images:0`` float32 [batch_size, image_size, image_size, 3], ``labels:0`` int32
    [batch_size].
    """
    config = dict(locals())
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"resnet depth must be 6n+2 with n >= 1 (8, 20, 32, 56, ...), got {depth}")
    blocks_per_stage = (depth - 2) // 6

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        x, labels = layers.image_batch(feeds, rng, batch_size, image_size, num_classes)
        x = tf.nn.relu(_conv_bn(x, base_width, 3, 1, "stem"))
        for stage, multiplier in enumerate((1, 2, 4)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                x = _basic_block(
                    x, base_width * multiplier, stride, f"stage_{stage}/block_{block}"
                )
        x = tf.reduce_mean(x, axis=[1, 2], name="global_pool")
        logits = layers.dense(x, num_classes, "logits")
        return layers.cross_entropy(logits, labels), feeds

    return build_training_step("resnet", config, forward)
