"""One step of two graphs from identical initial variables (profiler.step_compare)."""

import dataclasses

import numpy as np
import pytest

from graphfit import models
from graphfit.profiler.step_compare import StepMismatchError, compare_steps


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
