"""One call for Keras 3 users: a compiled model and a batch in, an optimized training step out.

``optimize_model(model, x, y, memory_ratio=0.6)`` writes the training step a Keras user would
otherwise write by hand (forward pass under a ``GradientTape``, ``model.compute_loss`` with the
compiled loss and the model's own regularization losses, ``model.optimizer.apply_gradients``),
traces it for the batch's shapes (``profiler.tf_function.graph_item_from_function``), runs the
passes (``pipeline.optimize``: rematerialize to the budget, checked against a real run) and
returns an ``OptimizedStep`` that trains the user's model in place, one batch per call or over
a whole data set with ``fit``. The hand-written ``@tf.function`` step path
(``graph_item_from_function`` + ``to_callable``) stays for steps that do more.

Errors name this function's keywords and the numbers the caller gave, never the command line's
flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from graphfit.errors import GraphfitError
from graphfit.pipeline.meta_optimizer import OptimizeResult, optimize
from graphfit.remat.pipeline import BudgetError

__all__ = ["KerasFitError", "OptimizedStep", "optimize_model"]


class KerasFitError(GraphfitError, ValueError):
    """The model, the data or a keyword cannot be used (the message says what to change)."""


@dataclasses.dataclass
class OptimizedStep:
    """The optimized training step of a Keras model.

    Attributes:
        result: what the passes did (``OptimizeResult``: ``report()``, ``save(directory)``).
        batch_size: the batch size the step was traced for; every call takes batches of it.
    """

    result: OptimizeResult
    batch_size: int
    _step: Callable[..., Any] = dataclasses.field(repr=False)

    def __call__(self, x: Any, y: Any) -> float:
        """Train the model on one batch of ``batch_size`` examples; returns the loss."""
        if len(x) != self.batch_size or len(y) != self.batch_size:
            raise KerasFitError(f"the step was optimized for batches of {self.batch_size} "
                                f"examples; got x of {len(x)} and y of {len(y)}")
        return float(self._step(x, y))

    def fit(self, x: Any, y: Any, epochs: int = 1) -> dict[str, list[float]]:
        """Train on ``x``, ``y`` in batches of ``batch_size`` (a last, smaller batch is left
        out: the step's shapes are fixed), ``epochs`` times; returns ``{"loss": [...]}``, the
        mean loss per epoch, like ``keras.Model.fit``'s history."""
        batches = len(x) // self.batch_size
        if batches == 0 or len(x) != len(y):
            raise KerasFitError(f"fit needs x and y of equal length and at least one batch of "
                                f"{self.batch_size}; got {len(x)} and {len(y)} examples")
        history = []
        for _ in range(epochs):
            losses = [self(x[k * self.batch_size:(k + 1) * self.batch_size],
                           y[k * self.batch_size:(k + 1) * self.batch_size])
                      for k in range(batches)]
            history.append(float(np.mean(losses)))
        return {"loss": history}


def _train_step(model):
    import tensorflow as tf

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return train_step


def _check_model(model, x, y, memory_budget, memory_ratio) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise KerasFitError(f"optimize_model needs a keras.Model; got {type(model).__name__}")
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise KerasFitError("optimize_model needs a compiled model: call "
                            "model.compile(optimizer=..., loss=...) first")
    if memory_budget is not None and memory_ratio is not None:
        raise KerasFitError(f"give one of memory_budget and memory_ratio, not both (got "
                            f"memory_budget={memory_budget!r}, memory_ratio={memory_ratio!r})")
    if memory_ratio is not None and not 0.0 < memory_ratio <= 1.0:
        raise KerasFitError(f"memory_ratio={memory_ratio!r} must lie in (0, 1]: the fraction "
                            "of what the step adds above its resident bytes it may use")
    if len(x) != len(y) or len(x) == 0:
        raise KerasFitError(f"x and y must be one non-empty batch of equal length; got "
                            f"{len(x)} and {len(y)} examples")


def _budget_message(error: BudgetError, memory_budget, memory_ratio,
                    overhead_limit: float) -> str:
    """A budget error in this function's words: the keyword and value the caller gave, and
    what to pass instead."""
    asked = (f"memory_ratio={memory_ratio}" if memory_ratio is not None
             else f"memory_budget={memory_budget}")
    if error.minimum_bytes > error.budget_bytes:
        smallest = (f"memory_budget >= {error.minimum_bytes}" if memory_ratio is None else
                    f"memory_ratio >= {error.smallest_ratio:.2f}")
        return (f"{asked} ({error.budget_bytes / 2**20:.1f} MiB) is below what "
                f"rematerialization can reach for this model and batch "
                f"({error.minimum_bytes / 2**20:.1f} MiB): pass {smallest} or a smaller batch")
    return (f"{asked} ({error.budget_bytes / 2**20:.1f} MiB) needs more recomputation than "
            f"remat_overhead_limit={overhead_limit} allows (or more memory than the planner "
            f"could free): pass a larger {asked.split('=')[0]}, a higher remat_overhead_limit, "
            f"or remat_heuristic='offline'")


def optimize_model(model, x, y, *, memory_budget: int | str | None = None,
                   memory_ratio: float | None = None, remat_heuristic: str = "dtr",
                   remat_overhead_limit: float = 2.0, verify: bool = True,
                   progress: Callable[[str], None] | None = None) -> OptimizedStep:
    """The training step of a compiled Keras 3 ``model``, optimized to a memory budget.

    Parameters:
        model: a ``keras.Model`` after ``model.compile(optimizer=..., loss=...)``.
        x, y: one batch (numpy arrays or tensors); the step is traced for its shapes.
        memory_budget: bytes (or a size such as ``"300MiB"``) the step may use at its peak;
            or ``memory_ratio``, a fraction of what the step adds above its resident bytes
            (``pipeline.optimize``). Neither: no remat.
        remat_heuristic: the planner (``remat.pipeline.PLANNERS``).
        remat_overhead_limit: compute multiple beyond which the planner gives up.
        verify: check the optimized step against the original on a real run (loss,
            gradients, planned vs measured peak) before returning it.
        progress: called with a line per pass (``None``: quiet).

    Returns:
        An ``OptimizedStep``: ``step(x, y)`` trains ``model`` on one batch and returns the
        loss; ``step.fit(x, y, epochs)`` trains over a data set; ``step.result`` holds the
        passes' report (``step.result.save(directory)`` writes the report a person reads).

    Raises:
        KerasFitError: the model is not compiled, a keyword is out of range, or no plan fits
            the budget (the message gives the smallest ``memory_ratio`` that can work).

    Examples:
        >>> model.compile(optimizer="sgd", loss="mse")          # doctest: +SKIP
        >>> step = optimize_model(model, x[:256], y[:256], memory_ratio=0.6)  # doctest: +SKIP
        >>> step.fit(x, y, epochs=3)                           # doctest: +SKIP
    """
    import tensorflow as tf

    from graphfit.profiler.sizes import parse_bytes
    from graphfit.profiler.tf_function import graph_item_from_function, to_callable

    _check_model(model, x, y, memory_budget, memory_ratio)
    if isinstance(memory_budget, str):
        try:
            memory_budget = parse_bytes(memory_budget)
        except ValueError as error:
            raise KerasFitError(f"memory_budget={memory_budget!r}: {error}") from error
    if not model.built:
        model(tf.convert_to_tensor(x[:1]))
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    train_step = _train_step(model)
    item = graph_item_from_function(train_step, x, y, name=model.name)
    try:
        result = optimize(item, memory_budget=memory_budget, memory_ratio=memory_ratio,
                          remat_heuristic=remat_heuristic,
                          remat_overhead_limit=remat_overhead_limit, verify=verify,
                          progress=progress)
    except BudgetError as error:
        raise KerasFitError(_budget_message(error, memory_budget, memory_ratio,
                                            remat_overhead_limit)) from error
    # Nothing rewritten (no budget): the user's own tf.function is the optimized step, as
    # fast as the user's by construction.
    return OptimizedStep(result, len(x), train_step if result.item is item
                         else to_callable(result.item, item))
