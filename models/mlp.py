"""A multilayer perceptron: ``depth`` ReLU layers of ``width`` units, then softmax logits.

The simplest training step of the zoo, and the kind DESIGN.md §4 rematerialised by hand: with a
large batch (the ``activations`` preset: batch 8192, 32 layers of 256) the saved activations,
not the weights or the input, set the peak memory (weights and input are 16 MiB of a ~280 MiB
peak), as in real training. Input is a fixed batch of standard-normal vectors with
uniformly random labels, so the loss falls as the network memorises the batch.

Reference: Rumelhart, Hinton & Williams, "Learning representations by back-propagating
errors", Nature 1986.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graphfit.models import layers
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step

__all__ = ["PRESETS", "build"]

PRESETS = {
    "tiny": dict(batch_size=32, depth=2, width=64, input_dim=32, num_classes=10),
    "default": dict(batch_size=256, depth=4, width=512, input_dim=784, num_classes=10),
    "activations": dict(batch_size=8192, depth=32, width=256, input_dim=256, num_classes=10),
}


def build(
    batch_size: int = 256,
    depth: int = 4,
    width: int = 512,
    input_dim: int = 784,
    num_classes: int = 10,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The MLP training step.

    Parameters:
        batch_size: examples per step.
        depth: number of hidden ReLU layers (``layer_0`` ... ``layer_{depth-1}``).
        width: units per hidden layer.
        input_dim: length of each input vector.
        num_classes: number of output classes.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Feeds: ``inputs:0`` float32 [batch_size, input_dim], ``labels:0`` int32 [batch_size].
    """
    config = dict(locals())

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        x = layers.input_placeholder(
            feeds, "inputs", rng.standard_normal((batch_size, input_dim), dtype=np.float32)
        )
        labels = layers.input_placeholder(
            feeds, "labels", rng.integers(0, num_classes, batch_size, dtype=np.int32)
        )
        for i in range(depth):
            x = layers.dense(x, width, f"layer_{i}", activation=tf.nn.relu)
        logits = layers.dense(x, num_classes, "logits")
        return layers.cross_entropy(logits, labels), feeds

    return build_training_step("mlp", config, forward)
