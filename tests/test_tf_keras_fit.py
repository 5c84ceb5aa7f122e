"""One call for Keras users: a compiled Keras 3 model (no hand-written step) through the passes.

(Named to run after ``test_profiler``: the traced steps keep the models' variables alive in the
process's CPU allocator, whose peak ``test_profiler`` compares with a step's own.)"""

import os
import re

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from graphfit.pipeline.keras_fit import KerasFitError, optimize_model  # noqa: E402

BATCH, FEATURES, CLASSES = 1024, 256, 10



def _model(seed=5):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,))]
                             + [keras.layers.Dense(256, activation="relu") for _ in range(8)]
                             + [keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(batches=2, seed=5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batches * BATCH, FEATURES), dtype=np.float32),
            rng.integers(0, CLASSES, batches * BATCH).astype(np.int32))


@pytest.mark.slow
def test_compiled_model_trains_like_keras_own_step_within_the_budget():
    """``optimize_model`` builds the step from the compiled loss and optimizer, fits the
    budget on a real run, and trains the user's model exactly as ``train_on_batch`` does."""
    x, y = _data()
    model, reference = _model(), _model()
    step = optimize_model(model, x[:BATCH], y[:BATCH], memory_ratio=0.7)
    remat = step.result.report()["remat"]
    assert remat["changed"] and remat["num_recomputes"] > 0
    assert remat["loss_match"] and remat["gradients_match"]
    assert remat["measured_peak_bytes"] < 0.85 * remat["baseline_peak_bytes"]
    assert abs(remat["prediction_error"]) < 0.10, remat

    history = step.fit(x, y, epochs=2)                 # 2 batches per epoch
    expected = [np.mean([reference.train_on_batch(x[k * BATCH:(k + 1) * BATCH],
                                                  y[k * BATCH:(k + 1) * BATCH])
                         for k in range(2)]) for _ in range(2)]
    np.testing.assert_allclose(history["loss"], expected, rtol=1e-4)
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-6)


def test_errors_speak_the_keywords_the_caller_used():
    x, y = _data(1)
    uncompiled = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(KerasFitError, match=r"model.compile\(optimizer=\.\.\., loss=\.\.\.\)"):
        optimize_model(uncompiled, x, y, memory_ratio=0.5)
    with pytest.raises(KerasFitError, match="memory_ratio=1.5 must lie in"):
        optimize_model(_model(), x, y, memory_ratio=1.5)
    with pytest.raises(KerasFitError, match="one of memory_budget and memory_ratio"):
        optimize_model(_model(), x, y, memory_budget="10MiB", memory_ratio=0.5)
    with pytest.raises(KerasFitError, match=r"memory_ratio='0.5' must lie in \(0, 1\]: .* a "
                                            r"number such as 0.6"):
        optimize_model(_model(), x, y, memory_ratio="0.5")
    frozen = _model()
    frozen.trainable = False
    with pytest.raises(KerasFitError, match=r"has no trainable variables .* set trainable=True"):
        optimize_model(frozen, x, y, memory_ratio=0.5)


def test_a_minimum_above_the_measured_peak_asks_for_no_ratio():
    """Issue 32: with data-dependent shapes the planner's minimum can exceed the measured peak;
    the message advised memory_ratio >= 1.10, which optimize_model refuses. Where no budget
    below the peak has a plan, no ratio is suggested."""
    from graphfit.pipeline.keras_fit import _budget_message
    from graphfit.remat.pipeline import BudgetError

    above = BudgetError("", budget_bytes=50 * 2**20, minimum_bytes=110 * 2**20, cause="floor")
    above.baseline_bytes, above.resident_bytes = 100 * 2**20, 20 * 2**20
    message = _budget_message(above, None, 0.5, 2.0)
    assert "smaller batch" in message and "memory_ratio=" not in message.replace(
        "memory_ratio=0.5", "")


@pytest.mark.slow
def test_a_budget_below_the_minimum_names_the_smallest_budget_and_it_plans():
    """The error says why (the floor) and names the smallest budget with a plan, in bytes and
    as a ratio; that budget, passed back, does plan. It suggests no keyword value the caller
    already gave (the planner), and no command-line flag."""
    x, y = _data(1)
    with pytest.raises(KerasFitError, match=r"memory_ratio=0.02 \(.*\) has no plan: the budget "
                       r"is below what the step holds at once.*The smallest budget with a plan "
                       r"is .* of what the step adds above it, measured in this call.*"
                       r"memory_budget=(\d+) .*"
                       r"memory_ratio=0\.\d\d or more") as error:
        optimize_model(_model(), x, y, memory_ratio=0.02, verify=False, progress=None)
    message = str(error.value)
    assert "--" not in message and "remat_heuristic" not in message
    smallest = int(re.search(r"memory_budget=(\d+)", message)[1])
    step = optimize_model(_model(), x, y, memory_budget=smallest, verify=False, progress=None)
    assert step.result.report()["remat"]["planned_peak_bytes"] <= smallest


@pytest.mark.slow
def test_min_ratio_fits_the_smallest_budget_with_a_plan():
    x, y = _data(1)
    step = optimize_model(_model(), x, y, memory_ratio="min", verify=False, progress=None)
    remat = step.result.report()["remat"]
    assert remat["changed"] and remat["planned_peak_bytes"] <= remat["budget_bytes"]
    assert remat["budget_bytes"] < 0.75 * step.result.plan.stats["baseline_peak_bytes"]


@pytest.mark.slow
def test_a_dict_of_inputs_and_sample_weight_train_like_keras():
    """Inputs as keras-hub backbones take them (a dict) and per-example weights: the
    optimized step trains the model as ``train_on_batch`` does with the same arguments."""
    def model(seed=3):
        keras.utils.set_random_seed(seed)
        a, b = keras.Input((32,), name="a"), keras.Input((32,), name="b")
        h = keras.layers.Concatenate()([keras.layers.Dense(256, activation="relu")(a),
                                        keras.layers.Dense(256, activation="relu")(b)])
        for _ in range(6):
            h = keras.layers.Dense(256, activation="relu")(h)
        built = keras.Model({"a": a, "b": b}, keras.layers.Dense(CLASSES)(h))
        built.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return built

    rng = np.random.default_rng(3)
    x = {k: rng.standard_normal((BATCH, 32), dtype=np.float32) for k in "ab"}
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    w = rng.random(BATCH, dtype=np.float32)
    ours, reference = model(), model()
    step = optimize_model(ours, x, y, sample_weight=w, memory_ratio=0.6, progress=None)
    assert step.result.report()["remat"]["changed"]
    np.testing.assert_allclose(step(x, y, w), reference.train_on_batch(x, y, sample_weight=w),
                               rtol=1e-4)
    with pytest.raises(KerasFitError, match="with sample_weight"):
        step(x, y)
    for a, b in zip(ours.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_without_a_budget_the_step_is_the_users_own_function():
    """Nothing to recompute: the optimized step is the traced ``tf.function`` itself (TF's
    defaults, no imported graph), so it is exactly as fast as the user's, and it trains."""
    x, y = _data(1)
    model, reference = _model(), _model()
    step = optimize_model(model, x, y)
    assert not any(record.changed for record in step.result.passes)
    assert hasattr(step._step, "get_concrete_function")     # a tf.function, not an import
    np.testing.assert_allclose(step(x, y), reference.train_on_batch(x, y), rtol=1e-4)
