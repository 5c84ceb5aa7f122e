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
flags; a budget that cannot be met names the smallest that can (searched on the same traced
step, so the hint holds), and why.

Inputs are what ``model.fit`` takes: ``x`` an array, a tuple or a dict of arrays (keras-hub
backbones take a dict), ``y`` likewise, and an optional ``sample_weight``; the batch size is
the leading dimension of every array.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from graphfit.errors import ArgumentError, GraphfitError, check_number
from graphfit.pipeline.meta_optimizer import SMALLEST, OptimizeResult, optimize
from graphfit.profiler.sizes import format_bytes
from graphfit.remat.pipeline import CAUSES, HINT_ROOM, BudgetError

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
    weighted: bool = False

    def __call__(self, x: Any, y: Any, sample_weight: Any = None) -> float:
        """Train the model on one batch of ``batch_size`` examples; returns the loss."""
        if (sample_weight is not None) != self.weighted:
            raise KerasFitError("the step was optimized " + ("with" if self.weighted else
                                "without") + " sample_weight: call it the same way")
        sizes = _batch_sizes(x, y, sample_weight)
        if set(sizes.values()) != {self.batch_size}:
            raise KerasFitError(f"the step was optimized for batches of {self.batch_size} "
                                f"examples; got {_describe(sizes)}")
        args = (x, y, sample_weight) if self.weighted else (x, y)
        return float(self._step(*args))

    def fit(self, x: Any, y: Any, epochs: int = 1,
            sample_weight: Any = None) -> dict[str, list[float]]:
        """Train on ``x``, ``y`` (and ``sample_weight``) in batches of ``batch_size`` (a last,
        smaller batch is left out: the step's shapes are fixed), ``epochs`` times; returns
        ``{"loss": [...]}``, the mean loss per epoch, like ``keras.Model.fit``'s history."""
        sizes = _batch_sizes(x, y, sample_weight)
        batches = min(sizes.values()) // self.batch_size
        if batches == 0 or len(set(sizes.values())) != 1:
            raise KerasFitError(f"fit needs inputs of one length and at least one batch of "
                                f"{self.batch_size} examples; got {_describe(sizes)}")
        history = []
        for _ in range(epochs):
            losses = [self(*_slice((x, y, sample_weight), k * self.batch_size,
                                   (k + 1) * self.batch_size))
                      for k in range(batches)]
            history.append(float(np.mean(losses)))
        return {"loss": history}


def _leaves(value: Any) -> list[Any]:
    import tensorflow as tf

    return [] if value is None else tf.nest.flatten(value)


def _batch_sizes(x: Any, y: Any, sample_weight: Any = None) -> dict[str, int]:
    """The leading dimension of every array of the batch, by argument (an array, a tuple or a
    dict of arrays each)."""
    sizes = {}
    for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for k, leaf in enumerate(_leaves(value)):
            shape = np.shape(leaf)
            if not shape:
                raise KerasFitError(f"{name} holds a scalar; every input must be an array "
                                    "whose first dimension is the batch")
            sizes[name if len(_leaves(value)) == 1 else f"{name}[{k}]"] = int(shape[0])
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name} of {size}" for name, size in sizes.items())


def _slice(values: Any, begin: int, end: int) -> Any:
    import tensorflow as tf

    return tf.nest.map_structure(lambda leaf: None if leaf is None else leaf[begin:end], values)


def _train_step(model, weighted: bool):
    """The step a Keras user writes by hand: forward pass under a tape, the compiled loss
    (``compute_loss``: the loss, its ``sample_weight`` and the model's regularization losses),
    the compiled optimizer."""
    import tensorflow as tf

    def step(x, y, sample_weight=None):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    if weighted:
        return tf.function(lambda x, y, sample_weight: step(x, y, sample_weight))
    return tf.function(lambda x, y: step(x, y))


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
    if memory_ratio is not None and memory_ratio != SMALLEST:
        try:
            check_number(memory_ratio, "memory_ratio", above=0, maximum=1)
        except ArgumentError:
            raise KerasFitError(f"memory_ratio={memory_ratio!r} must lie in (0, 1]: the "
                                "fraction of the step's measured peak memory it may use, a "
                                "number such as 0.6, or 'min' for the smallest with a "
                                "plan") from None
    sizes = _batch_sizes(x, y)
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise KerasFitError(f"x and y must be one non-empty batch of equal length; got "
                            f"{_describe(sizes)}")


def _budget_message(error: BudgetError, memory_budget, memory_ratio,
                    overhead_limit: float) -> str:
    """A budget error in this function's words: the keyword and value the caller gave, why it
    has no plan, and the smallest budget that has one (``remat.pipeline.with_smallest_budget``
    searched it on the same traced step), as a ratio and in bytes. It never suggests a keyword
    value the caller already passed."""
    asked = (f"memory_ratio={memory_ratio}" if memory_ratio is not None
             else f"memory_budget={memory_budget!r}")
    if not error.cause:          # measured over the budget round after round
        return f"{asked} cannot be held on a real run: {error}"
    text = f"{asked} ({format_bytes(error.budget_bytes)}) has no plan: {CAUSES[error.cause]}"
    if error.cause == "floor":
        text += f", at least {format_bytes(error.minimum_bytes)}"
    if error.smallest_bytes is None:
        more = (f"; or a remat_overhead_limit above {overhead_limit}"
                if error.cause in ("overhead", "evictable") else "")
        return (f"{text}. No budget below the measured peak "
                f"({format_bytes(error.baseline_bytes or 0)}) has a plan: recomputation "
                f"cannot shrink this step; use a smaller batch{more}")
    room = int(error.smallest_bytes * (1 + HINT_ROOM))
    ratio = math.ceil(error.ratio_of(room) * 100) / 100
    return (f"{text}. The smallest budget with a plan is {format_bytes(error.smallest_bytes)}: "
            f"{format_bytes(error.resident_bytes)} resident and "
            f"{error.ratio_of(error.smallest_bytes):.3f} of what the step adds above it, "
            f"measured in this call. Pass "
            f"memory_budget={room} ({HINT_ROOM:.0%} above it: the next call traces the step "
            f"again, and its plans can need a little more), memory_ratio='min' (the smallest "
            f"budget with a plan, searched again), or memory_ratio={ratio:.2f} or more (a "
            f"ratio of what the step adds, measured again on each call; it moves between calls "
            f"by up to a tenth)")


# ``progress=TERMINAL``: progress lines on stderr when it is a terminal, nothing in a log.
TERMINAL = "terminal"


def optimize_model(model, x, y, *, sample_weight: Any = None,
                   memory_budget: int | str | None = None,
                   memory_ratio: float | str | None = None, remat_heuristic: str = "offline",
                   remat_overhead_limit: float = 2.0, verify: bool = True,
                   progress: Callable[[str], None] | str | None = TERMINAL) -> OptimizedStep:
    """The training step of a compiled Keras 3 ``model``, optimized to a memory budget.

    Parameters:
        model: a ``keras.Model`` after ``model.compile(optimizer=..., loss=...)``.
        x, y: one batch as ``model.fit`` takes it: arrays or tensors, or tuples or dicts of
            them (a keras-hub backbone's dict of inputs); the step is traced for its shapes.
        sample_weight: per-example weights of that batch (``None``: unweighted); the step
            then takes them on every call.
        memory_budget: bytes (or a size such as ``"8GiB"``) the step may use at its peak;
            or ``memory_ratio``, a fraction of what the step adds above its resident bytes, or ``"min"``: the smallest
            budget with a plan within ``remat_overhead_limit``. Neither: no remat.
        remat_heuristic: the planner (``remat.pipeline.PLANNERS``; ``offline`` plans best).
        remat_overhead_limit: compute multiple beyond which the planner gives up.
        verify: check the optimized step against the original on a real run (loss,
            gradients, planned vs measured peak) before returning it.
        progress: called with a line per pass, ending with planned against measured (peak,
            compute, and step time against your own step); the default prints them on a
            terminal only; ``None``: quiet.

    Returns:
        An ``OptimizedStep``: ``step(x, y)`` trains ``model`` on one batch and returns the
        loss; ``step.fit(x, y, epochs)`` trains over a data set; ``step.result`` holds the
        passes' report (``step.result.save(directory)`` writes the report a person reads).

    Raises:
        KerasFitError: the model is not compiled, a keyword is out of range, or no plan fits
            the budget (the message names why and the smallest budget that has a plan).

    Examples:
        >>> model.compile(optimizer="sgd", loss="mse")          # doctest: +SKIP
        >>> step = optimize_model(model, x[:256], y[:256], memory_ratio=0.6)  # doctest: +SKIP
        >>> step.fit(x, y, epochs=3)                           # doctest: +SKIP
    """
    import tensorflow as tf

    from graphfit.pipeline.report import remat_line
    from graphfit.profiler.sizes import parse_bytes
    from graphfit.profiler.tf_function import graph_item_from_function, to_callable
    from graphfit.profiler.trace import print_progress

    _check_model(model, x, y, memory_budget, memory_ratio)
    asked_budget = memory_budget
    if isinstance(memory_budget, str):
        try:
            memory_budget = parse_bytes(memory_budget)
        except ValueError as error:
            raise KerasFitError(f"memory_budget={memory_budget!r}: {error}") from error
    weighted = sample_weight is not None
    if weighted and len(set(_batch_sizes(x, y, sample_weight).values())) != 1:
        raise KerasFitError(f"sample_weight must have one weight per example of the batch; "
                            f"got {_describe(_batch_sizes(x, y, sample_weight))}")
    if progress == TERMINAL:
        progress = print_progress if sys.stderr.isatty() else None
    if not model.built:
        model(tf.nest.map_structure(lambda leaf: tf.convert_to_tensor(leaf[:1]), x))
    if not model.trainable_variables:
        raise KerasFitError(f"model {model.name!r} has no trainable variables (its layers are "
                            "frozen or have no weights): there is no training step to optimize; "
                            "set trainable=True on the layers to train")
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    train_step = _train_step(model, weighted)
    batch = (x, y, sample_weight) if weighted else (x, y)
    item = graph_item_from_function(train_step, *batch, name=model.name)
    try:
        result = optimize(item, memory_budget=memory_budget, memory_ratio=memory_ratio,
                          remat_heuristic=remat_heuristic,
                          remat_overhead_limit=remat_overhead_limit, verify=verify,
                          progress=progress)
    except BudgetError as error:
        raise KerasFitError(_budget_message(error, asked_budget, memory_ratio,
                                            remat_overhead_limit)) from error
    if progress is not None and remat_line(result):
        progress(remat_line(result))
    # Nothing rewritten (no budget): the user's own tf.function is the optimized step, as
    # fast as the user's by construction.
    return OptimizedStep(result, next(iter(_batch_sizes(x, y).values())),
                         train_step if result.item is item else to_callable(result.item, item),
                         weighted)
