"""What every model shares: optimizers by name and turning a loss into a ``GraphItem``.

A model file only describes its forward pass: a function that, inside a fresh seeded graph,
creates placeholders (with the batch to feed them), variables and a scalar loss.
:func:`build_training_step` wraps it into a training step:

    loss -> tf.compat.v1.gradients(loss, trainable variables) -> optimizer.apply_gradients

and returns the :class:`~models.graph_item.GraphItem` with the names of the train op, the loss,
the gradients and the initialiser. Graph names are fixed (``loss``, ``train_op``, ``init``,
``gradients/...``), so two builds of one configuration give identical GraphDef bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from graphfit.models.graph_item import GraphItem

__all__ = ["DEFAULT_LEARNING_RATES", "OPTIMIZER_NAMES", "build_training_step", "make_optimizer"]

OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adagrad", "rmsprop")

# Conventional starting points for each rule; a model's `learning_rate` knob overrides them.
DEFAULT_LEARNING_RATES = {
    "sgd": 0.05,
    "momentum": 0.01,
    "adam": 1e-3,
    "adagrad": 0.05,
    "rmsprop": 1e-3,
}

# Builds the forward pass inside the step's graph: given the seeded numpy RNG for the batch,
# returns the scalar loss and the feeds (placeholder tensor name -> batch).
ForwardFn = Callable[[np.random.Generator], tuple[tf.Tensor, dict[str, np.ndarray]]]


def _check_optimizer_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(
            f"unknown optimizer {name!r}; valid optimizers: {', '.join(OPTIMIZER_NAMES)}"
        )


def make_optimizer(name: str, learning_rate: float | None = None) -> tf.compat.v1.train.Optimizer:
    """The ``tf.compat.v1.train`` optimizer called ``name``.

    Parameters:
        name: one of :data:`OPTIMIZER_NAMES`.
        learning_rate: step size; ``None`` takes :data:`DEFAULT_LEARNING_RATES` ``[name]``.

    Raises:
        ValueError: ``name`` is not a known optimizer (the message lists the valid ones).
    """
    _check_optimizer_name(name)
    rate = DEFAULT_LEARNING_RATES[name] if learning_rate is None else learning_rate
    v1 = tf.compat.v1.train
    if name == "sgd":
        return v1.GradientDescentOptimizer(rate)
    if name == "momentum":
        return v1.MomentumOptimizer(rate, momentum=0.9)
    if name == "adam":
        return v1.AdamOptimizer(rate)
    if name == "adagrad":
        return v1.AdagradOptimizer(rate)
    return v1.RMSPropOptimizer(rate)


def build_training_step(name: str, config: dict[str, Any], forward: ForwardFn) -> GraphItem:
    """Build ``forward`` in a new graph and add gradients, the optimizer step and the initialiser.

    Parameters:
        name: the model's name, recorded in the item.
        config: the model's knobs; must hold ``optimizer``, ``learning_rate`` and ``seed``
            (the graph seed, and the seed of the numpy RNG that makes the batch).
        forward: builds placeholders, variables and the loss; see :data:`ForwardFn`.

    Returns:
        The training step as a ``GraphItem``; ``config`` is copied into it.

    Raises:
        ValueError: unknown optimizer name, or a trainable variable the loss does not depend on.

    Notes:
        Gradients of embedding lookups come back from ``tf.compat.v1.gradients`` as
        ``IndexedSlices``; they are converted to dense tensors so that every variable has exactly
        one named gradient tensor, at the price of a dense [vocabulary, width] update.
    """
    _check_optimizer_name(config["optimizer"])
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(config["seed"])
        optimizer = make_optimizer(config["optimizer"], config["learning_rate"])
        loss, feeds = forward(np.random.default_rng(config["seed"]))
        loss = tf.identity(loss, name="loss")
        variables = tf.compat.v1.trainable_variables()
        gradients = tf.compat.v1.gradients(loss, variables)
        unused = [v.op.name for v, g in zip(variables, gradients) if g is None]
        if unused:
            raise ValueError(f"{name}: the loss does not depend on variables {unused}")
        with tf.name_scope("gradients/dense"):
            gradients = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                for g in gradients
            ]
        train_op = optimizer.apply_gradients(zip(gradients, variables), name="train_op")
        init_op = tf.compat.v1.global_variables_initializer()
    return GraphItem(
        graph=graph,
        train_op=train_op.name,
        loss=loss.name,
        gradients=[g.name for g in gradients],
        init_op=init_op.name,
        feeds=feeds,
        name=name,
        config=dict(config),
    )
