"""``baechi.optimize``: the passes in sequence on a real step, each checked against TF."""

import pytest

from graphfit import baechi
from graphfit import models
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.run import local_target


@pytest.fixture(scope="module")
def item():
    # Activations (batch x width x depth) outweigh the weights, as in real training.
    return models.build("mlp", preset="default", batch_size=2048, depth=12, width=512)


def test_remat_then_place_keeps_the_step_and_meets_the_plan(item):
    target = local_target(2)
    devices = DeviceSet.uniform(list(target.devices), 1 << 30, "0.0001754,134")
    result = baechi.optimize(item, memory_ratio=0.6, target=target, devices=devices,
                             place_options={"method": "m_etf"}, progress=None)
    report = result.report()
    remat = report["remat"]
    assert remat["changed"] and result.plan.num_recomputes > 0
    assert remat["loss_match"] and remat["gradients_match"]
    assert remat["planned_peak_bytes"] <= remat["budget_bytes"]
    assert remat["measured_peak_bytes"] < remat["baseline_peak_bytes"]
    assert abs(remat["prediction_error"]) <= 0.10
    place = report["place"]
    assert place["changed"] and place["equal_to_single_device"]
    assert set(place["devices"]) == set(target.devices)
    assert not any(place["over_limit_bytes"].values())
    # Every op of the final graph carries a device.
    assert all(op.device for op in result.item.graph.get_operations())


def test_passes_are_skippable_and_say_why(item):
    result = baechi.optimize(item, memory_ratio=0.7, skip=["remat"], progress=None)
    report = result.report()
    assert report["remat"] == {"changed": False, "seconds": 0.0, "skipped": "skip"}
    assert report["place"]["skipped"] == "one device"
    assert result.item is item and result.plan is None


def test_unknown_pass_and_conflicting_budgets_are_errors(item):
    with pytest.raises(ValueError, match="unknown pass"):
        baechi.optimize(item, skip=["fuse_everything"], progress=None)
    with pytest.raises(ValueError, match="not both"):
        baechi.optimize(item, memory_budget=1 << 20, memory_ratio=0.5, progress=None)
