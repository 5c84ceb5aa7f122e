"""The step-time prediction of a rewritten step: forward as the user runs it, then the chained
backward pass at serial op times (``remat.step_time``)."""

from __future__ import annotations

import pytest

from graphfit import models
from graphfit.profiler.op_intervals import StepIntervals, op_intervals
from graphfit.profiler.session import serial_config, step_config, user_config
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, Event, RematPlan
from graphfit.remat.step_time import predict_step_time, serial_chain
from graphfit.remat.tf_memory import step_item


def _plan(events):
    return RematPlan(events=[Event(kind, index) for kind, index in events], budget_bytes=0,
                     peak_bytes=0, baseline_compute_us=1.0, compute_us=1.0, method="hand")


def test_forward_as_measured_then_the_chain_at_serial_times():
    names = ["a", "b", "c", "d"]
    # a, b run side by side; the chain starts at c, recomputes a, ends with d.
    plan = _plan([(COMPUTE, 0), (COMPUTE, 1), (COMPUTE, 2), (FREE, 0), (RECOMPUTE, 0),
                  (COMPUTE, 3)])
    # Traced steps take 1.5x the untraced ones.
    concurrent = StepIntervals([{"a": (0, 10), "b": (0, 12), "c": (12, 20), "d": (20, 30)}],
                               [20.0])
    # One at a time: 8 µs each, 2 µs of executor time after each op.
    serial = StepIntervals([{"a": (0, 8), "b": (10, 18), "c": (20, 28), "d": (30, 38)}],
                           [38 / 1.5])
    prediction = predict_step_time(names, plan, 2, concurrent, serial)
    assert prediction.forward_us == pytest.approx(12 / 1.5)  # c starts when b ends
    assert prediction.pinned_serial_us == 24      # c, a again, d
    assert prediction.serial_gap == pytest.approx(38 / 1.5 / 32)
    assert prediction.predicted_step_us == pytest.approx((12 + 24 * 38 / 32) / 1.5)
    assert prediction.vs_user == pytest.approx(prediction.predicted_step_us / 20)


def test_ops_fused_into_their_reader_cost_nothing_and_another_user_step_is_the_reference():
    names = ["matmul", "relu", "grad"]
    plan = _plan([(COMPUTE, 0), (COMPUTE, 1), (COMPUTE, 2), (RECOMPUTE, 0), (RECOMPUTE, 1)])
    concurrent = StepIntervals([{"relu": (0, 5), "grad": (5, 9)}], [9.0])  # matmul in relu
    serial = StepIntervals([{"relu": (0, 5), "grad": (5, 9)}], [9.0])
    user = StepIntervals([{"x": (0, 4), "y": (4, 20)}], [20.0])
    prediction = predict_step_time(names, plan, 2, concurrent, serial, user)
    assert prediction.pinned_serial_us == 4 + 5
    assert prediction.user_step_us == 20


def test_each_round_is_predicted_against_the_user_step_of_the_same_round():
    """A round in which the machine was twice as slow (every wall doubled) predicts the same
    ratio; a prediction from the medians of walls measured apart would not."""
    names = ["a", "b"]
    plan = _plan([(COMPUTE, 0), (COMPUTE, 1), (RECOMPUTE, 0)])
    concurrent = StepIntervals([{"a": (0, 10), "b": (10, 20)}], [20.0, 40.0, 44.0])
    serial = StepIntervals([{"a": (0, 10), "b": (10, 20)}], [20.0, 40.0, 44.0])
    user = StepIntervals([{"x": (0, 20)}], [20.0, 40.0, 22.0])
    prediction = predict_step_time(names, plan, 1, concurrent, serial, user)
    # forward: half the step; then b and a again, each half of the serial step's op times.
    assert prediction.vs_user == pytest.approx(1.5)     # rounds 1.5, 1.5, 3.0
    assert prediction.predicted_step_us == pytest.approx(60.0)
    with pytest.raises(ValueError, match="side by side"):
        predict_step_time(names, plan, 1, concurrent, serial,
                          StepIntervals(user.traced, [20.0]))


def test_the_serial_chain_and_the_serial_configuration_run_one_op_at_a_time():
    """In ``serial_chain`` (every op chained by the rewrite, nothing recomputed) and with
    ``serial_config`` the op times of a traced step add up to at most its wall time; TF's
    defaults overlap them (inter-op threads), even after another session made TF's global
    pool."""
    item = step_item(models.build("resnet", preset="tiny"))
    chain = serial_chain(item)
    assert chain.config["remat"]["clones"] == 0 and chain.config["remat"]["pinned_from"] == 0
    steps = op_intervals({"default": (item, user_config()),
                          "serial": (item, serial_config(user_config())),
                          "chain": (chain, step_config(chain))}, rounds=2, traced=2)

    def overlap(step):
        return sum(end - start for start, end in step.values()) / max(
            end for _, end in step.values())

    one_at_a_time = [overlap(step) for name in ("serial", "chain")
                     for step in steps[name].traced]
    assert max(one_at_a_time) <= 1.0
    assert min(overlap(step) for step in steps["default"].traced) > max(one_at_a_time)
    assert len(steps["chain"].untraced_wall_us) == 2 and min(steps["chain"].untraced_wall_us) > 0
