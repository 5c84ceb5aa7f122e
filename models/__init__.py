"""The model zoo: training-step graphs built from raw TensorFlow ops, as ``GraphItem`` s.

Every model is a ``tf.compat.v1`` graph-mode training step (forward, ``tf.compat.v1.gradients``,
a ``tf.compat.v1.train`` optimizer) built from ``tf.nn`` / ``tf.matmul`` / ``get_variable``
only, with a fixed, seeded batch to feed. Building one configuration twice gives identical
GraphDef bytes.

Models (one module each; ``models.<name>.build`` documents its knobs):

=============== ==========================================================================
``mlp``         ReLU multilayer perceptron
``cifarnet``    the TF-slim CIFAR-10 conv net: conv-pool-conv-pool-fc-fc-logits
``resnet``      CIFAR ResNet (He et al. 2016), depth 6n+2
``inception_v3`` Inception-V3 (Szegedy et al. 2016) with image size and width multiplier
``gnmt_v2``     GNMT encoder-decoder LSTM with attention (Wu et al. 2016), statically unrolled
``transformer`` Transformer encoder-decoder or encoder-only (Vaswani et al. 2017)
=============== ==========================================================================

Presets (``PRESETS[name][preset]`` holds the knob values):

- ``tiny``: builds and runs a step on a CPU in about a second; for tests.
- ``default``: training-sized, a few steps per second or so on a 2-core CPU.
- ``activations`` (mlp, cifarnet, resnet, transformer): large batch relative to the weights, so
  saved activations dominate peak memory; the rematerialisation workload.

Usage::

    from graphfit import models
    item = models.build("resnet", preset="tiny")                  # a preset as is
    item = models.build("resnet", depth=32, optimizer="adam")     # default preset, overridden
    item = models.build("mlp", preset=None, batch_size=8)         # the builder's own defaults

Every builder also takes ``optimizer`` (one of ``OPTIMIZER_NAMES``), ``learning_rate``
(``None``: the optimizer's default) and ``seed`` (graph seed and batch seed).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from graphfit.errors import ArgumentError, check_number
from graphfit.models import cifarnet, gnmt_v2, inception_v3, mlp, resnet, transformer
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import OPTIMIZER_NAMES, make_optimizer

__all__ = [
    "MODEL_NAMES",
    "OPTIMIZER_NAMES",
    "PRESETS",
    "GraphItem",
    "build",
    "check_knobs",
    "make_optimizer",
    "preset_config",
]

_MODULES: dict[str, ModuleType] = {
    "mlp": mlp,
    "cifarnet": cifarnet,
    "resnet": resnet,
    "inception_v3": inception_v3,
    "gnmt_v2": gnmt_v2,
    "transformer": transformer,
}

MODEL_NAMES: tuple[str, ...] = tuple(_MODULES)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    name: module.PRESETS for name, module in _MODULES.items()
}


def _module(name: str) -> ModuleType:
    if name not in _MODULES:
        raise ArgumentError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    return _MODULES[name]


# Integer knobs are counts and sizes (>= 1) except these; float knobs are > 0 except rates.
_ZERO_ALLOWED = {"seed", "decoder_layers"}
_RATES = {"dropout"}


def check_knobs(name: str, knobs: dict[str, Any]) -> None:
    """Check knob names and values against model ``name``'s builder before building anything.

    A knob must be a parameter of the builder, of its default's type (an integer for an
    integer knob, a finite number for a float knob), and a count or size must be positive.

    Raises:
        ArgumentError: the message names the knob and lists the model's knobs.
    """
    parameters = inspect.signature(_module(name).build).parameters
    unknown = sorted(set(knobs) - set(parameters))
    if unknown:
        raise ArgumentError(f"model {name!r} has no knob {', '.join(map(repr, unknown))}; its "
                            f"knobs are {', '.join(parameters)}")
    for key, value in knobs.items():
        default, label = parameters[key].default, f"{name} knob {key}"
        if key == "optimizer" and value not in OPTIMIZER_NAMES:
            raise ArgumentError(f"unknown optimizer {value!r}; valid optimizers: "
                                f"{', '.join(OPTIMIZER_NAMES)}")
        if isinstance(default, bool) or isinstance(default, str):
            if not isinstance(value, type(default)):
                raise ArgumentError(f"{label}={value!r}: must be a {type(default).__name__}")
        elif isinstance(default, int):
            check_number(value, label, minimum=0 if key in _ZERO_ALLOWED else 1, integer=True)
        elif key in _RATES:
            check_number(value, label, minimum=0, maximum=0.999)
        elif isinstance(default, float) or value is not None:
            check_number(value, label, above=0)


def preset_config(name: str, preset: str | None = "default", **overrides: Any) -> dict[str, Any]:
    """The knobs ``build(name, preset, **overrides)`` passes to the model's builder.

    Raises:
        ValueError: unknown model or preset name (the message lists the valid ones).
        ArgumentError: an unknown knob or a bad value (``check_knobs``).
    """
    check_knobs(name, overrides)
    presets = _module(name).PRESETS
    if preset is None:
        return dict(overrides)
    if preset not in presets:
        raise ArgumentError(
            f"unknown preset {preset!r} for model {name!r}; valid presets: {', '.join(presets)}"
        )
    return {**presets[preset], **overrides}


def build(name: str, preset: str | None = "default", **overrides: Any) -> GraphItem:
    """Build model ``name``'s training step.

    Parameters:
        name: one of :data:`MODEL_NAMES`.
        preset: a key of ``PRESETS[name]``, or ``None`` for the builder's own defaults.
        overrides: knobs that replace the preset's (see ``models.<name>.build``), including
            ``optimizer``, ``learning_rate`` and ``seed``.

    Raises:
        ValueError: unknown model, preset or optimizer name, or knob values the model rejects.
        TypeError: a knob the model does not have.

    Examples:
        >>> item = build("mlp", preset="tiny", optimizer="adam")
        >>> item.name, item.config["depth"], item.loss
        ('mlp', 2, 'loss:0')
    """
    return _module(name).build(**preset_config(name, preset, **overrides))
