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
        init_feeds: placeholder tensor name -> the value the initialiser assigns from it. A
            traced step's weights are fed to its initialiser, not held as constants: every new
            session's Grappler pass walks the constants of the graph it runs, and the 95 MB
            of ``keras.applications.ResNet50``'s weights made each session's first
            initialisation take 1.3-4 s instead of 0.3-0.6 s (2026-12-07).
    """

    graph: tf.Graph
    train_op: str
    loss: str
    gradients: list[str]
    init_op: str
    feeds: dict[str, np.ndarray]
    name: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_feeds: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def graph_def(self) -> tf.compat.v1.GraphDef:
        """The serialised graph (deterministic for a deterministic builder)."""
        return self.graph.as_graph_def()

    def feed_dict(self) -> dict[tf.Tensor, np.ndarray]:
        """The feeds keyed by this item's own tensors, as ``Session.run`` wants them."""
        return {self.graph.get_tensor_by_name(name): value for name, value in self.feeds.items()}

    def init_feed_dict(self) -> dict[tf.Tensor, np.ndarray]:
        """``init_feeds`` keyed by this item's own tensors."""
        return {self.graph.get_tensor_by_name(name): value
                for name, value in self.init_feeds.items()}

    def initialize(self, session: tf.compat.v1.Session) -> None:
        """Run the initialiser in ``session`` (every variable to its initial value)."""
        session.run(self.init_op, self.init_feed_dict())

    def with_graph(self, graph: tf.Graph) -> "GraphItem":
        """The same step on a rewritten graph that kept every fetched and fed name."""
        return dataclasses.replace(self, graph=graph)
