"""The unit of work every pass takes and returns: a training step as Grappler sees it.

A ``GraphItem`` is a ``tf.Graph`` plus the names that make it a training step: what to run
(``train_op``), what to compare (``loss`` and ``gradients``), what to feed (a fixed batch the
model generated) and how to initialise variables. Passes rewrite the graph and hand back a new
item, so the original stays untouched for side-by-side measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["GraphItem"]


@dataclasses.dataclass
class GraphItem:
    """A training-step graph with its fetches, feeds and initialiser.

    Attributes:
        graph: the ``tf.Graph`` holding the step.
        train_op: name of the op that applies one optimizer step.
        loss: name of the scalar loss tensor (``"op:0"`` form).
        gradients: names of the gradient tensors, one per trainable variable, in variable order.
        init_op: name of the op that initialises every variable.
        feeds: placeholder tensor name -> the batch fed at every step.
        name: model name, for reports.
        config: the model's size knobs, for reports.
    """

    graph: tf.Graph
    train_op: str
    loss: str
    gradients: list[str]
    init_op: str
    feeds: dict[str, np.ndarray]
    name: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def graph_def(self) -> tf.compat.v1.GraphDef:
        """The serialised graph (deterministic for a deterministic builder)."""
        return self.graph.as_graph_def()

    def feed_dict(self) -> dict[tf.Tensor, np.ndarray]:
        """The feeds keyed by this item's own tensors, as ``Session.run`` wants them."""
        return {self.graph.get_tensor_by_name(name): value for name, value in self.feeds.items()}

    def with_graph(self, graph: tf.Graph) -> "GraphItem":
        """The same step on a rewritten graph that kept every fetched and fed name."""
        return dataclasses.replace(self, graph=graph)
