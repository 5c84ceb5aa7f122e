"""The executor model a step-time prediction replays a step on (``remat.executor_model``)."""

from __future__ import annotations

import pytest

from graphfit.remat.executor_model import fit_sharing, simulate_step


def test_the_executor_model_overlaps_ops_by_their_sharing():
    inputs = {"a": [], "b": [], "c": ["a", "b"], "fused": ["c"], "d": ["fused", "outside"]}
    durations = {"a": 10, "b": 10, "c": 5, "d": 1}          # "fused": no time of its own
    assert simulate_step(inputs, durations, 2, 0.0).wall_us == 16      # a and b side by side
    assert simulate_step(inputs, durations, 2, 1.0).wall_us == 26      # they split the cores
    half = simulate_step(inputs, durations, 2, 0.5)
    assert half.wall_us == 21 and half.start_us == {"a": 0, "b": 0, "c": 15, "fused": 20,
                                                    "d": 20}
    assert simulate_step(inputs, durations, 1, 0.0).start_us["b"] == 10  # one thread
    assert fit_sharing(inputs, durations, 2, 21) == pytest.approx(0.5, abs=1e-3)
    assert fit_sharing(inputs, durations, 2, 100) == pytest.approx(2.0, abs=1e-3)
    with pytest.raises(ValueError, match="cycle through 'x'"):
        simulate_step({"x": ["y"], "y": ["x"]}, {}, 2, 0.0)
