"""Inception-V3 (Szegedy et al. 2016), the topology of TF-slim's ``nets/inception_v3.py``.

Stem (five convolutions, two max-pools), three 35x35 Inception-A blocks (``Mixed_5b``-``5d``),
the grid reduction ``Mixed_6a``, four 17x17 blocks with factorised 1x7/7x1 convolutions
(``Mixed_6b``-``6e``), the reduction ``Mixed_7a``, two 8x8 blocks with expanded 1x3/3x1
filter banks (``Mixed_7b``, ``7c``), average pooling, dropout and a 1x1-conv classifier; the
auxiliary classifier on ``Mixed_6e`` adds 0.4 x its loss. Map sizes are for 299x299 input;
the network accepts any size from 75x75 up (pooling kernels shrink to fit small maps, as in
slim).

Every convolution is conv (no bias) - batch norm - ReLU, as in slim. Batch norm is one fused
op in training mode with the batch's statistics and a learned offset only (slim's
``scale=False``); no moving averages are kept (training steps only). ``depth_multiplier``
scales every layer's filter count (never below ``min_depth`` = 16), so a tiny configuration
keeps the full topology — every branch and op — at a fraction of the cost.

Reference: Szegedy, Vanhoucke, Ioffe, Shlens & Wojna, "Rethinking the Inception Architecture
for Computer Vision", CVPR 2016.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from graphfit.models import layers
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step

__all__ = ["PRESETS", "build"]

PRESETS = {
    "tiny": dict(
        batch_size=2, image_size=75, depth_multiplier=0.1, num_classes=10, dropout=0.2,
        aux_logits=True,
    ),
    "default": dict(
        batch_size=8, image_size=149, depth_multiplier=1.0, num_classes=1000, dropout=0.2,
        aux_logits=True,
    ),
}

MIN_DEPTH = 16
AUX_LOSS_WEIGHT = 0.4


def _conv(x, filters, kernel_size, name, stride=1, padding="SAME"):
    with tf.compat.v1.variable_scope(name):
        x = layers.conv2d(
            x, filters, kernel_size, "conv", stride=stride, padding=padding, use_bias=False,
            initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.1),
        )
        return tf.nn.relu(layers.batch_norm(x, "bn", scale=False))


def _max_pool(x, name, kernel_size=3, stride=2, padding="VALID"):
    return tf.nn.max_pool2d(x, ksize=kernel_size, strides=stride, padding=padding, name=name)


def _avg_pool(x, name, kernel_size=3, stride=1, padding="SAME"):
    return tf.nn.avg_pool2d(x, ksize=kernel_size, strides=stride, padding=padding, name=name)


def _mixed(name: str, x: tf.Tensor, branches: list[Callable[[tf.Tensor], tf.Tensor]]):
    """An Inception block: each branch in its own ``Branch_k`` scope, outputs concatenated."""
    with tf.compat.v1.variable_scope(name):
        outputs = []
        for k, branch in enumerate(branches):
            with tf.compat.v1.variable_scope(f"Branch_{k}"):
                outputs.append(branch(x))
        return tf.concat(outputs, axis=3)


def _inception_a(x, name, d, pool_filters):
    """35x35 block (Mixed_5b-5d): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""
    return _mixed(name, x, [
        lambda x: _conv(x, d(64), 1, "Conv2d_0a_1x1"),
        lambda x: _conv(_conv(x, d(48), 1, "Conv2d_0a_1x1"), d(64), 5, "Conv2d_0b_5x5"),
        lambda x: _conv(
            _conv(_conv(x, d(64), 1, "Conv2d_0a_1x1"), d(96), 3, "Conv2d_0b_3x3"),
            d(96), 3, "Conv2d_0c_3x3",
        ),
        lambda x: _conv(_avg_pool(x, "AvgPool_0a_3x3"), d(pool_filters), 1, "Conv2d_0b_1x1"),
    ])


def _reduction_a(x, name, d):
    """35x35 -> 17x17 (Mixed_6a)."""
    return _mixed(name, x, [
        lambda x: _conv(x, d(384), 3, "Conv2d_1a_1x1", stride=2, padding="VALID"),
        lambda x: _conv(
            _conv(_conv(x, d(64), 1, "Conv2d_0a_1x1"), d(96), 3, "Conv2d_0b_3x3"),
            d(96), 3, "Conv2d_1a_1x1", stride=2, padding="VALID",
        ),
        lambda x: _max_pool(x, "MaxPool_1a_3x3"),
    ])


def _inception_b(x, name, d, mid):
    """17x17 block (Mixed_6b-6e): 1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | avgpool-1x1."""

    def double_factorised(x):
        x = _conv(x, d(mid), 1, "Conv2d_0a_1x1")
        x = _conv(x, d(mid), (7, 1), "Conv2d_0b_7x1")
        x = _conv(x, d(mid), (1, 7), "Conv2d_0c_1x7")
        x = _conv(x, d(mid), (7, 1), "Conv2d_0d_7x1")
        return _conv(x, d(192), (1, 7), "Conv2d_0e_1x7")

    return _mixed(name, x, [
        lambda x: _conv(x, d(192), 1, "Conv2d_0a_1x1"),
        lambda x: _conv(
            _conv(_conv(x, d(mid), 1, "Conv2d_0a_1x1"), d(mid), (1, 7), "Conv2d_0b_1x7"),
            d(192), (7, 1), "Conv2d_0c_7x1",
        ),
        double_factorised,
        lambda x: _conv(_avg_pool(x, "AvgPool_0a_3x3"), d(192), 1, "Conv2d_0b_1x1"),
    ])


def _reduction_b(x, name, d):
    """17x17 -> 8x8 (Mixed_7a)."""

    def factorised(x):
        x = _conv(x, d(192), 1, "Conv2d_0a_1x1")
        x = _conv(x, d(192), (1, 7), "Conv2d_0b_1x7")
        x = _conv(x, d(192), (7, 1), "Conv2d_0c_7x1")
        return _conv(x, d(192), 3, "Conv2d_1a_3x3", stride=2, padding="VALID")

    return _mixed(name, x, [
        lambda x: _conv(
            _conv(x, d(192), 1, "Conv2d_0a_1x1"), d(320), 3, "Conv2d_1a_3x3",
            stride=2, padding="VALID",
        ),
        factorised,
        lambda x: _max_pool(x, "MaxPool_1a_3x3"),
    ])


def _inception_c(x, name, d):
    """8x8 block (Mixed_7b, 7c): 1x1 | 1x1-(1x3, 3x1) | 1x1-3x3-(1x3, 3x1) | avgpool-1x1."""

    def expanded(x, suffix):
        return tf.concat([
            _conv(x, d(384), (1, 3), f"Conv2d_0{suffix}_1x3"),
            _conv(x, d(384), (3, 1), f"Conv2d_0{suffix}_3x1"),
        ], axis=3)

    return _mixed(name, x, [
        lambda x: _conv(x, d(320), 1, "Conv2d_0a_1x1"),
        lambda x: expanded(_conv(x, d(384), 1, "Conv2d_0a_1x1"), "b"),
        lambda x: expanded(
            _conv(_conv(x, d(448), 1, "Conv2d_0a_1x1"), d(384), 3, "Conv2d_0b_3x3"), "c"
        ),
        lambda x: _conv(_avg_pool(x, "AvgPool_0a_3x3"), d(192), 1, "Conv2d_0b_1x1"),
    ])


def _classifier(x, num_classes, name):
    """1x1 convolution with bias to ``num_classes``, squeezed to [batch, num_classes]."""
    x = layers.conv2d(
        x, num_classes, 1, name,
        initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.001),
    )
    return tf.squeeze(x, axis=[1, 2], name=f"{name}/squeeze")


def _spatial(x: tf.Tensor) -> tuple[int, int]:
    return int(x.shape[1]), int(x.shape[2])


def _aux_logits(x, d, num_classes):
    """Auxiliary classifier on the 17x17 map (Mixed_6e)."""
    with tf.compat.v1.variable_scope("AuxLogits"):
        height, width = _spatial(x)
        x = _avg_pool(x, "AvgPool_1a_5x5", (min(5, height), min(5, width)), 3, "VALID")
        x = _conv(x, d(128), 1, "Conv2d_1b_1x1")
        x = _conv(x, d(768), _spatial(x), "Conv2d_2a_5x5", padding="VALID")
        return _classifier(x, num_classes, "Conv2d_2b_1x1")


def build(
    batch_size: int = 8,
    image_size: int = 299,
    depth_multiplier: float = 1.0,
    num_classes: int = 1000,
    dropout: float = 0.2,
    aux_logits: bool = True,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The Inception-V3 training step.

    Parameters:
        batch_size: images per step.
        image_size: height and width of the square RGB images, >= 75 (299 in the paper).
        depth_multiplier: scales every layer's filters (floor ``MIN_DEPTH`` = 16).
        num_classes: number of output classes.
        dropout: drop probability before the classifier (slim keeps 0.8); 0 removes the op.
        aux_logits: add the auxiliary classifier and 0.4 x its loss.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Raises:
        ValueError: ``image_size`` < 75 or ``depth_multiplier`` <= 0.

    Feeds: ``images:0`` float32 [batch_size, image_size, image_size, 3], ``labels:0`` int32
    [batch_size].
    """
    config = dict(locals())
    if image_size < 75:
        raise ValueError(f"inception_v3 needs images of at least 75x75, got {image_size}")
    if depth_multiplier <= 0:
        raise ValueError(f"depth_multiplier must be positive, got {depth_multiplier}")

    def d(filters: int) -> int:
        return max(int(filters * depth_multiplier), MIN_DEPTH)

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        x, labels = layers.image_batch(feeds, rng, batch_size, image_size, num_classes)
        with tf.compat.v1.variable_scope("InceptionV3"):
            x = _conv(x, d(32), 3, "Conv2d_1a_3x3", stride=2, padding="VALID")
            x = _conv(x, d(32), 3, "Conv2d_2a_3x3", padding="VALID")
            x = _conv(x, d(64), 3, "Conv2d_2b_3x3")
            x = _max_pool(x, "MaxPool_3a_3x3")
            x = _conv(x, d(80), 1, "Conv2d_3b_1x1", padding="VALID")
            x = _conv(x, d(192), 3, "Conv2d_4a_3x3", padding="VALID")
            x = _max_pool(x, "MaxPool_5a_3x3")
            x = _inception_a(x, "Mixed_5b", d, pool_filters=32)
            x = _inception_a(x, "Mixed_5c", d, pool_filters=64)
            x = _inception_a(x, "Mixed_5d", d, pool_filters=64)
            x = _reduction_a(x, "Mixed_6a", d)
            for name, mid in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160),
                              ("Mixed_6e", 192)):
                x = _inception_b(x, name, d, mid)
            aux = _aux_logits(x, d, num_classes) if aux_logits else None
            x = _reduction_b(x, "Mixed_7a", d)
            x = _inception_c(x, "Mixed_7b", d)
            x = _inception_c(x, "Mixed_7c", d)
            with tf.compat.v1.variable_scope("Logits"):
                x = _avg_pool(x, "AvgPool_1a", _spatial(x), padding="VALID")
                x = layers.dropout(x, dropout)
                logits = _classifier(x, num_classes, "Conv2d_1c_1x1")
        loss = layers.cross_entropy(logits, labels)
        if aux is not None:
            loss += AUX_LOSS_WEIGHT * layers.cross_entropy(aux, labels)
        return loss, feeds

    return build_training_step("inception_v3", config, forward)
