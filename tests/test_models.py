"""The model zoo: every model builds, trains, and builds the same graph twice."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow as tf

from graphfit import models
from graphfit.models import training

ACTIVATIONS_MODELS = ("mlp", "cifarnet", "resnet", "transformer")


def _run_steps(item: models.GraphItem, steps: int, fetch_gradients: bool = False) -> list[float]:
    """Losses of ``steps`` training steps on the item's fixed batch, in a fresh session."""
    losses = []
    with tf.compat.v1.Session(graph=item.graph) as session:
        item.initialize(session)
        feeds = item.feed_dict()
        if fetch_gradients:
            for gradient in session.run(item.gradients, feeds):
                assert np.all(np.isfinite(gradient))
        for _ in range(steps):
            _, loss = session.run([item.train_op, item.loss], feeds)
            losses.append(float(loss))
    return losses


@pytest.fixture(scope="module", params=models.MODEL_NAMES)
def tiny_item(request) -> models.GraphItem:
    return models.build(request.param, preset="tiny")


def test_tiny_preset_builds_and_trains(tiny_item):
    losses = _run_steps(tiny_item, steps=2, fetch_gradients=True)
    assert all(np.isfinite(losses)), losses


def test_item_names_match_graph(tiny_item):
    graph = tiny_item.graph
    with graph.as_default():
        variables = tf.compat.v1.trainable_variables()
    assert len(tiny_item.gradients) == len(variables)
    for gradient, variable in zip(tiny_item.gradients, variables):
        assert graph.get_tensor_by_name(gradient).shape == variable.shape
    assert graph.get_tensor_by_name(tiny_item.loss).shape == ()
    graph.get_operation_by_name(tiny_item.train_op)
    graph.get_operation_by_name(tiny_item.init_op)
    for name, value in tiny_item.feeds.items():
        placeholder = graph.get_tensor_by_name(name)
        assert placeholder.op.type == "Placeholder"
        assert placeholder.shape == value.shape and placeholder.dtype == value.dtype
    assert tiny_item.config == models.preset_config(
        tiny_item.name, "tiny", optimizer="sgd", learning_rate=None, seed=0
    )


def test_graph_def_is_deterministic(tiny_item):
    again = models.build(tiny_item.name, preset="tiny")
    # Protobuf serialises map fields (node attrs) in arbitrary order unless asked not to.
    assert tiny_item.graph_def().SerializeToString(
        deterministic=True
    ) == again.graph_def().SerializeToString(deterministic=True)
    assert tiny_item.feeds.keys() == again.feeds.keys()
    for name, value in tiny_item.feeds.items():
        np.testing.assert_array_equal(value, again.feeds[name])


def test_seed_changes_batch_and_initial_loss():
    first = models.build("mlp", preset="tiny", seed=0)
    second = models.build("mlp", preset="tiny", seed=1)
    assert not np.array_equal(first.feeds["inputs:0"], second.feeds["inputs:0"])
    assert _run_steps(first, 1) != _run_steps(second, 1)


@pytest.mark.parametrize("name", ["mlp", "cifarnet"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_loss_decreases_on_fixed_batch(name, optimizer):
    losses = _run_steps(models.build(name, preset="tiny", optimizer=optimizer), steps=30)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("optimizer", training.OPTIMIZER_NAMES)
def test_every_optimizer_builds_and_steps(optimizer):
    item = models.build("mlp", preset="tiny", optimizer=optimizer)
    assert item.config["optimizer"] == optimizer
    assert all(np.isfinite(_run_steps(item, steps=2)))


def test_every_preset_matches_its_builder():
    for name in models.MODEL_NAMES:
        presets = models.PRESETS[name]
        assert {"tiny", "default"} <= presets.keys()
        if name in ACTIVATIONS_MODELS:
            assert "activations" in presets
        signature = inspect.signature(getattr(models, name).build)
        for knobs in presets.values():
            signature.bind(**knobs)


def test_overrides_replace_preset_knobs():
    item = models.build("resnet", preset="tiny", depth=20)
    assert item.config["depth"] == 20 and item.config["batch_size"] == 4
    assert models.build("mlp", preset=None, batch_size=3).feeds["labels:0"].shape == (3,)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*mlp, cifarnet, resnet"):
        models.build("vgg")


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lamb'.*sgd, momentum, adam"):
        models.build("mlp", preset="tiny", optimizer="lamb")


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown preset 'activations'.*tiny, default"):
        models.build("gnmt_v2", preset="activations")


@pytest.mark.parametrize(
    "name, knobs, message",
    [
        ("resnet", dict(depth=21), "6n\\+2"),
        ("inception_v3", dict(image_size=64), "75x75"),
        ("gnmt_v2", dict(num_layers=1), "num_layers >= 2"),
        ("transformer", dict(num_heads=3), "must divide d_model"),
    ],
)
def test_invalid_knobs_are_clear_errors(name, knobs, message):
    with pytest.raises(ValueError, match=message):
        models.build(name, preset="tiny", **knobs)


def test_encoder_only_transformer_trains():
    item = models.build("transformer", preset="tiny", decoder_layers=0)
    assert "target_input:0" not in item.feeds
    assert all(np.isfinite(_run_steps(item, steps=2)))


def test_gnmt_unidirectional_without_residual_trains():
    item = models.build(
        "gnmt_v2", preset="tiny", num_layers=3, bidirectional=False, residual=False
    )
    assert all(np.isfinite(_run_steps(item, steps=2)))
