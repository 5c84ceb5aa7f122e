"""The user-path matrix: every way in, on every zoo model's tiny preset and two small Keras models.

Each cell runs the path as a user would and checks what a user relies on: it ends without an
error, the step computes the user's loss and gradients, and measured peaks stay within their
limits. Placement cells run on perturbed costs too, so a placer that depends on ties or on an
order the costs only happen to give fails here (``test_placement_perturbed`` has the IR-level
half on synthetic graphs).

The ways in: ``optimize`` with a ratio (remat, closed loop); ``optimize`` on several devices
with each placer x placer type x grouper (12 combinations, two per zoo model, so each runs on
TF once; all on the IR of every model with noise); joint mode; a Keras ``tf.function`` step and
``keras_fit.optimize_model``. The ``train`` binary's flags reach the same calls
(``test_train_tool``, ``test_joint``'s demo, ``test_cluster``'s gRPC run).
"""

import itertools

import numpy as np
import pytest

from graphfit import models
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.grouping import GROUPERS
from graphfit.baechi.place import METHODS, PLACER_TYPES, place
from graphfit.baechi.run import local_target
from graphfit.pipeline.joint import JointSpace
from graphfit.pipeline.meta_optimizer import optimize
from graphfit.remat.closed_loop import PEAK_TOLERANCE

COMBOS = list(itertools.product(METHODS, PLACER_TYPES, GROUPERS))
ZOO = models.MODEL_NAMES


def _within_limits(placement: dict) -> None:
    assert placement["equal_to_single_device"]
    for name, limit in placement["limit_bytes"].items():
        assert placement["measured_peak_bytes"][name] <= limit * (1 + PEAK_TOLERANCE), name


def _devices(n: int, memory="256MiB") -> tuple:
    target = local_target(n)
    return target, DeviceSet.uniform(list(target.devices), memory, "0.0001754,134")


@pytest.fixture(scope="module", params=range(len(ZOO)), ids=ZOO)
def zoo(request):
    """(the model's index in the zoo, its tiny preset's step)."""
    return request.param, models.build(ZOO[request.param], preset="tiny")


def test_every_placer_places_the_model_on_noisy_costs(zoo):
    _, zoo_item = zoo
    from graphfit.profiler.cost_graph import CostGraph
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.profiler.trace import step_fetches

    graph = cost_graph_from_graph(zoo_item.graph, step_fetches(zoo_item), None)
    _, devices = _devices(4, "1GiB")
    for seed in range(2):
        rng = np.random.default_rng(seed)
        specs = graph.to_specs()
        for spec in specs:
            spec.compute_us = float(spec.compute_us) * float(rng.lognormal(0.0, 1.0))
        noisy = CostGraph.from_ops(specs)
        for method, placer_type, grouper in COMBOS:
            placement = place(noisy, devices, method=method, placer_type=placer_type,
                              grouper=grouper)
            assert (placement.peak_bytes <= devices.memory_bytes).all()


@pytest.mark.slow
def test_placed_step_equals_one_device_within_limits(zoo):
    """Two placer combinations per model, rotated over the zoo: each of the 12 runs on TF."""
    k, zoo_item = zoo
    target, devices = _devices(2)
    for method, placer_type, grouper in COMBOS[2 * k:2 * k + 2]:
        result = optimize(zoo_item, target=target, devices=devices, progress=None,
                          place_options={"method": method, "placer_type": placer_type,
                                         "grouper": grouper})
        _within_limits(result.placement)


@pytest.mark.slow
def test_joint_mode_trains_equal_to_one_device(zoo):
    _, zoo_item = zoo
    target, devices = _devices(2, "64MiB")
    result = optimize(zoo_item, joint=JointSpace((1.0, 0.6), ("m_etf",)), target=target,
                      devices=devices, progress=None)
    _within_limits(result.placement)
    assert result.report()["joint"]["built"]["fits"]


# The remat closed loop on inception_v3 and gnmt_v2 took 78 s and 43 s here (2 cores, loaded):
# they run in ``bench.reach``'s zoo rows instead of every CI run. The tiny mlp needs 0.95 of its
# peak at the least (weights); ``test_pipeline`` runs the closed loop on a larger one.
REMAT_CELLS = ("cifarnet", "resnet", "transformer")


@pytest.mark.slow
@pytest.mark.parametrize("name", REMAT_CELLS)
def test_remat_ratio_fits_and_keeps_the_gradients(name):
    """0.85 of the peak with the planner every README table uses."""
    remat = optimize(models.build(name, preset="tiny"), memory_ratio=0.85,
                     remat_heuristic="offline", progress=None).report()["remat"]
    assert remat["loss_match"] and remat["gradients_match"]
    assert remat["measured_peak_bytes"] <= remat["budget_bytes"] * (1 + PEAK_TOLERANCE)


def _keras_resnet(keras):
    """A ResNet-style net with BatchNorm: two residual blocks, 16x16 images."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, padding="same")(inputs)
    for _ in range(2):
        y = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same")(x)))
        y = layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same")(y))
        x = layers.ReLU()(layers.Add()([x, y]))
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x))), (16, 16, 3)


def _keras_transformer(keras):
    """A transformer block: 4-head attention, LayerNorm, MLP, over 32 tokens of width 32."""
    layers = keras.layers
    inputs = keras.Input((32, 32))
    y = layers.MultiHeadAttention(4, 8)(inputs, inputs)
    x = layers.LayerNormalization()(layers.Add()([inputs, y]))
    y = layers.Dense(32)(layers.Dense(128, activation="relu")(x))
    x = layers.LayerNormalization()(layers.Add()([x, y]))
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling1D()(x))), (32, 32)


def _check_remat(remat: dict) -> None:
    assert remat["loss_match"] and remat["gradients_match"]
    assert remat["measured_peak_bytes"] <= remat["budget_bytes"] * (1 + PEAK_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("build, own_step", [(_keras_resnet, False), (_keras_transformer, True)],
                         ids=["resnet_bn", "transformer"])
def test_keras_steps_fit_through_both_keras_ways_in(build, own_step):
    """The one-call ``optimize_model`` on a compiled model and, for the transformer, the user's
    own ``tf.function`` step (``graph_item_from_function``), at 0.8. (A ResNet-style step with
    BatchNorm takes the ``tf.function`` way in ``test_remat_onednn``, with oneDNN on and off.)"""
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from graphfit.bench.reach import keras_step_item
    from graphfit.pipeline.keras_fit import optimize_model

    keras.utils.set_random_seed(0)
    model, shape = build(keras)
    x = np.random.default_rng(0).standard_normal((16, *shape), dtype=np.float32)
    y = np.arange(16) % 10
    if own_step:
        item = keras_step_item("keras_cell", model, keras.optimizers.SGD(1e-2), x, y)
        _check_remat(optimize(item, memory_ratio=0.8, progress=None).report()["remat"])

    model.compile(optimizer=keras.optimizers.SGD(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = optimize_model(model, x, y, memory_ratio=0.8, progress=None)
    _check_remat(step.result.report()["remat"])
