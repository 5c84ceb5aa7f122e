"""Calibrating a run target's step cost, per-op cost and parallelism on real TF, and predicting
a placed step with them."""

import math

import numpy as np
import pytest

from graphfit.baechi.calibrate import NOISE, calibrate_runtime
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place import place
from graphfit.baechi.run import local_target
from graphfit.baechi.schedule import RuntimeCosts
from graphfit.profiler import synthetic


@pytest.mark.slow
def test_calibration_on_virtual_cpu_devices_measures_each_cost():
    target = local_target(2)
    costs, raw = calibrate_runtime(target, repeats=5, chain_ops=(8, 3000), matmuls=8,
                                   matmul_size=64, hops=200)
    median = raw["median_us"]
    assert set(median) == {"step", "chain8", "chain3000", "matmuls1", "matmuls2", "hops200"}
    assert costs.step_us == median["step"] > 0
    # 2,992 more dependent ops take longer, and the per-op cost is what is left of the slope
    # after the ops' own traced time
    assert median["chain3000"] > median["chain8"]
    assert costs.op_us == pytest.approx(max(0.0, raw["slope_us_per_op"]
                                            - raw["traced_chain_op_us"]))
    assert costs.transfer_us == max(0.0, raw["hop_us"])
    assert 1 <= costs.cores <= 2
    assert costs.cores == min(2, max(1, math.ceil(raw["chains_at_once"] - NOISE)))


def test_prediction_adds_the_costs_to_the_plan():
    graph = synthetic.random_dag(200, seed=1)
    devices = DeviceSet.uniform([f"/device:CPU:{i}" for i in range(4)], "4GiB", "0,0")
    p = place(graph, devices, method="m_etf")
    assert p.predict(RuntimeCosts(0.0, 0.0, 4)).makespan_us == pytest.approx(p.makespan_us)
    one_core = p.predict(RuntimeCosts(step_us=500.0, op_us=2.0, cores=1))
    # one core runs every op, with its dispatch cost, one after the other
    assert one_core.makespan_us >= 500 + graph.compute_us.sum() + 2.0 * graph.num_ops - 1e-6
    assert one_core.makespan_us > p.makespan_us
    assert np.array_equal(one_core.device, p.schedule.device)
