"""CifarNet: the small CIFAR-10 convolutional network of TF-slim and the TensorFlow tutorial.

conv 5x5x64 - max-pool - LRN - conv 5x5x64 - LRN - max-pool - fc 384 - dropout - fc 192 -
logits, on 32x32x3 images. The layout follows TF-slim's ``nets/cifarnet.py``, itself the
network of the TensorFlow CIFAR-10 tutorial after Krizhevsky's cuda-convnet layers-18pct
configuration. Input is a fixed batch of standard-normal images with random labels.

References: Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", 2009;
Krizhevsky, Sutskever & Hinton, "ImageNet Classification with Deep Convolutional Neural
Networks", NIPS 2012 (local response normalisation).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graphfit.models import layers
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step

__all__ = ["PRESETS", "build"]

PRESETS = {
    "tiny": dict(batch_size=8, image_size=32, num_classes=10, dropout=0.5),
    "default": dict(batch_size=64, image_size=32, num_classes=10, dropout=0.5),
    "activations": dict(batch_size=512, image_size=32, num_classes=10, dropout=0.5),
}


def _local_response_norm(x: tf.Tensor, name: str) -> tf.Tensor:
    return tf.nn.local_response_normalization(
        x, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name=name
    )


def _max_pool(x: tf.Tensor, name: str) -> tf.Tensor:
    return tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID", name=name)


def build(
    batch_size: int = 64,
    image_size: int = 32,
    num_classes: int = 10,
    dropout: float = 0.5,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The CifarNet training step.

    Parameters:
        batch_size: images per step.
        image_size: height and width of the square RGB images (32 for CIFAR-10).
        num_classes: number of output classes.
        dropout: drop probability after ``fc3`` (TF-slim keeps 0.5); 0 removes the op.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Feeds: ``images:0`` float32 [batch_size, image_size, image_size, 3], ``labels:0`` int32
    [batch_size].
    """
    config = dict(locals())

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        x, labels = layers.image_batch(feeds, rng, batch_size, image_size, num_classes)
        # TF-slim's initialisers: truncated normal 5e-2 for convs, 0.04 for fc layers.
        conv_init = tf.compat.v1.truncated_normal_initializer(stddev=5e-2)
        fc_init = tf.compat.v1.truncated_normal_initializer(stddev=0.04)
        x = tf.nn.relu(layers.conv2d(x, 64, 5, "conv1", initializer=conv_init))
        x = _local_response_norm(_max_pool(x, "pool1"), "norm1")
        x = tf.nn.relu(layers.conv2d(x, 64, 5, "conv2", initializer=conv_init))
        x = _max_pool(_local_response_norm(x, "norm2"), "pool2")
        x = tf.reshape(x, [batch_size, -1], name="flatten")
        x = layers.dense(x, 384, "fc3", activation=tf.nn.relu, initializer=fc_init)
        x = layers.dropout(x, dropout)
        x = layers.dense(x, 192, "fc4", activation=tf.nn.relu, initializer=fc_init)
        logits = layers.dense(
            x, num_classes, "logits",
            initializer=tf.compat.v1.truncated_normal_initializer(stddev=1 / 192.0),
        )
        return layers.cross_entropy(logits, labels), feeds

    return build_training_step("cifarnet", config, forward)
