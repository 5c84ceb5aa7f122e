"""One step of two graphs from identical initial variables (profiler.step_compare)."""

import dataclasses

import numpy as np
import pytest

from graphfit import models
from graphfit.profiler.step_compare import StepMismatchError, compare_steps, tensors_close


def test_other_seed_starts_from_the_reference_variables():
    item = models.build("mlp", preset="tiny", seed=0)
    other = dataclasses.replace(models.build("mlp", preset="tiny", seed=1), feeds=item.feeds)
    comparison = compare_steps(item, other)
    comparison.check()
    assert comparison.max_abs_gradient_diff == 0.0 < comparison.max_abs_gradient


def test_different_batch_is_a_mismatch():
    item = models.build("mlp", preset="tiny")
    other = dataclasses.replace(item, feeds={**item.feeds,
                                             "inputs:0": item.feeds["inputs:0"] + 1.0})
    comparison = compare_steps(item, other)
    assert not comparison.equal and comparison.loss_candidate != comparison.loss_reference
    with pytest.raises(StepMismatchError, match="max \\|gradient difference\\|"):
        comparison.check()


def test_tolerance_is_relative_to_the_tensors_largest_magnitude():
    # A sum summed in another order: large terms cancelling to ~0 keep the large terms' rounding.
    reference = np.array([113.0, 1e-7])
    assert tensors_close(reference + [0.0, 6.4e-5], reference, rtol=1e-5, atol=1e-6)
    assert not np.allclose(reference + [0.0, 6.4e-5], reference, rtol=1e-5, atol=1e-6)
    # A real error (a wrong value, a wrong shape) is still one.
    assert not tensors_close(reference + [0.0, 0.01], reference, rtol=1e-5, atol=1e-6)
    assert not tensors_close(reference[:1], reference, rtol=1e-5, atol=1e-6)
