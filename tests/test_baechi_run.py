"""Placed graphs run: apply a placement, run it on 4 virtual CPU devices and on a local gRPC
cluster, compare with one device, measure per-device memory; the communication benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from graphfit import models
from graphfit.baechi.apply import ColocationError, apply_placement, enforced_colocation_groups
from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.place import place
from graphfit.baechi.place_and_run import place_and_check
from graphfit.baechi.cluster import LocalCluster
from graphfit.baechi.run import (PLACEMENT_RTOL, MemoryLimitError, local_target,
                        measure_placed_run)
from graphfit.baechi.schedule import PlacementError
from graphfit.profiler.step_compare import compare_steps
from graphfit.profiler.remapper_fusions import DONE_SUFFIX
from graphfit.profiler.tf_import import cost_graph_from_graph, step_operations
from graphfit.profiler.trace import step_fetches

LIMIT_BYTES = 256 * 2**20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _by_layer(item: models.GraphItem, devices) -> dict[str, str]:
    """A hand-made placement: the step's ops in graph order cut into len(devices) slices,
    each colocation group on the device of its first op."""
    groups = enforced_colocation_groups(item.graph)
    ops = step_operations(item.graph, step_fetches(item))
    group_device: dict[str, str] = {}
    for k, op in enumerate(ops):
        group_device.setdefault(groups[op.name], devices[k * len(devices) // len(ops)])
    return {op.name: group_device[groups[op.name]] for op in ops}


def _placer_devices(item: models.GraphItem, devices, **options) -> dict[str, str]:
    """The real placer's placement on estimated costs."""
    cost_graph = cost_graph_from_graph(item.graph, step_fetches(item))
    device_set = DeviceSet.uniform(list(devices), LIMIT_BYTES, "0.0001754,134")
    return place(cost_graph, device_set, **options).op_devices()


@pytest.mark.parametrize("model_name, options", [
    pytest.param("mlp", dict(method="m_topo"), id="mlp-m_topo"),
    pytest.param("cifarnet", dict(method="m_etf", placer_type="colocation", grouper="coplace"),
                 id="cifarnet-m_etf-coplace"),
    pytest.param("resnet", dict(method="m_sct", placer_type="fusion", grouper="coplace"),
                 id="resnet-m_sct-fusion"),
    pytest.param("gnmt_v2", dict(method="m_etf", placer_type="fusion"), id="gnmt_v2-m_etf-fusion"),
])
def test_placed_step_equals_single_device_on_4_virtual_cpus(model_name, options):
    item = models.build(model_name, preset="tiny")
    target = local_target(4)
    op_devices = _placer_devices(item, target.devices, **options)
    assert len(set(op_devices.values())) > 1, "the placer used a single device"
    placed = apply_placement(item, op_devices)
    for op in placed.graph.get_operations():
        assert op.device in target.devices, op.name
    comparison = compare_steps(item, placed, target.session, rtol=PLACEMENT_RTOL)
    comparison.check()
    assert comparison.max_abs_gradient > 0
    run = measure_placed_run(placed, target, {d: LIMIT_BYTES for d in target.devices},
                             steps=1, warmup=1, trace_every=1)
    run.check_limits()
    used = set(op_devices.values())
    assert set(run.peak_bytes) == used
    assert all(run.peak_bytes[d] > 0 for d in used)


def test_place_and_check_reports_plan_against_measurement():
    item = models.build("mlp", preset="tiny")
    target = local_target(2)
    devices = DeviceSet.uniform(list(target.devices), "64MiB", "0.0001754,134")
    placed, report = place_and_check(item, target, devices, method="m_etf")
    assert report["equal_to_single_device"] and not report["over_limit_bytes"]
    assert set(report["measured_peak_bytes"]) <= set(target.devices)
    assert sum(report["ops_per_device"].values()) == report["plan"]["num_ops"]
    assert report["plan"]["makespan_us"] > 0
    json.dumps(report)  # the train report is JSON
    assert {op.device for op in placed.graph.get_operations()} <= set(target.devices)


def test_allocations_are_attributed_to_the_device_that_made_them():
    item = models.build("mlp", preset="tiny", batch_size=512, width=1024)
    target = local_target(2)
    op_devices = {name: "/device:CPU:0" for name in _by_layer(item, target.devices)}
    # The first layer's forward ops and their gradients on CPU:1: its [512, 1024] float32
    # activations (2 MiB) are allocated there.
    groups = enforced_colocation_groups(item.graph)
    moved = {g for name, g in groups.items() if name.startswith(("layer_0/", "gradients/layer_0"))}
    op_devices.update({name: "/device:CPU:1" for name in op_devices if groups[name] in moved})
    run = measure_placed_run(apply_placement(item, op_devices), target, steps=1, warmup=1,
                             trace_every=1)
    activation_bytes = 512 * 1024 * 4
    assert run.peak_bytes["/device:CPU:1"] >= activation_bytes
    assert set(run.stats_devices.values()) == {
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)}


def test_memory_limit_violation_is_reported():
    item = models.build("mlp", preset="tiny")
    target = local_target(2)
    placed = apply_placement(item, _by_layer(item, target.devices))
    run = measure_placed_run(placed, target, {"/device:CPU:0": 1000}, steps=1, warmup=1,
                             trace_every=1)
    assert set(run.over_limit_bytes) == {"/device:CPU:0"}
    with pytest.raises(MemoryLimitError, match="/device:CPU:0: peak"):
        run.check_limits()


def test_split_colocation_group_is_refused():
    item = models.build("mlp", preset="tiny", optimizer="momentum")
    op_devices = {name: "/device:CPU:0" for name in _by_layer(item, ["/device:CPU:0"])}
    # A resource read away from its variable: TF would silently move it back.
    op_devices["layer_0/MatMul/ReadVariableOp"] = "/device:CPU:1"
    with pytest.raises(ColocationError, match="layer_0/kernel"):
        apply_placement(item, op_devices)
    # A `_class` group: the momentum slot is colocated with its variable.
    op_devices["layer_0/MatMul/ReadVariableOp"] = "/device:CPU:0"
    op_devices["layer_0/kernel/Momentum"] = "/device:CPU:1"
    with pytest.raises(ColocationError):
        apply_placement(item, op_devices)


def test_incomplete_or_foreign_placement_is_refused():
    item = models.build("mlp", preset="tiny")
    op_devices = _by_layer(item, ["/device:CPU:0", "/device:CPU:1"])
    missing = dict(op_devices)
    del missing["loss"]
    with pytest.raises(PlacementError, match="have no device"):
        apply_placement(item, missing)
    with pytest.raises(PlacementError, match="not in graph"):
        apply_placement(item, {**op_devices, "no_such_op": "/device:CPU:0"})
    with pytest.raises(PlacementError, match="malformed"):
        apply_placement(item, {**op_devices, "loss": "CPU one"})


def test_an_unplaced_op_goes_with_its_colocation_group():
    """An op of the step the placement does not name, but which TF colocates with a placed op
    (a variable's update, with the variable), goes to that op's device; one without such a
    group is still refused."""
    item = models.build("mlp", preset="tiny", optimizer="momentum")
    op_devices = _by_layer(item, ["/device:CPU:0", "/device:CPU:1"])
    update = next(op.name for op in item.graph.get_operations()
                  if op.type in ("ResourceApplyKerasMomentum", "ResourceApplyMomentum"))
    device = op_devices.pop(update)
    placed = apply_placement(item, op_devices)
    assert placed.graph.get_operation_by_name(update).device.endswith(device[-5:])
    del op_devices["loss"]
    with pytest.raises(PlacementError, match="have no device"):
        apply_placement(item, op_devices)


def test_outside_step_ops_follow_their_variable():
    item = models.build("mlp", preset="tiny")
    op_devices = _by_layer(item, ["/device:CPU:0", "/device:CPU:1"])
    placed = apply_placement(item, op_devices)
    graph = placed.graph
    for name in ("layer_0", "logits"):
        variable = graph.get_operation_by_name(f"{name}/kernel")
        initialiser = graph.get_operation_by_name(f"{name}/kernel/Assign")
        assert initialiser.device == variable.device == op_devices[f"{name}/kernel"]
    assert item.graph.get_operation_by_name("loss").device == ""  # original untouched


@pytest.mark.grpc
def test_two_grpc_workers_run_tiny_mlp():
    item = models.build("mlp", preset="tiny")
    with LocalCluster(2, lifetime_s=300, startup_timeout_s=180) as cluster:
        target = cluster.run_target
        op_devices = _placer_devices(item, target.devices, method="m_sct")
        placed = apply_placement(item, op_devices)
        compare_steps(item, placed, target.session, rtol=PLACEMENT_RTOL).check()
        run = measure_placed_run(placed, target, steps=2, warmup=1, trace_every=2)
        pids = cluster.worker_pids
    assert set(run.peak_bytes) == set(op_devices.values())
    assert np.isfinite(run.step_time_ms_median)
    for pid in pids:  # terminated and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_communication_benchmark_writes_the_link_json(tmp_path):
    # Virtual devices are zero-copy: a "transfer" is executor noise around 0 µs, and the fit
    # needs two positive sizes. With 5 sizes that failed about one run in five; with 19,
    # about one in 25,000.
    output = tmp_path / "comm.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "graphfit.tools.communication_benchmark", "--transport=virtual",
         "--max_power=18", "--repeats=3", f"--output={output}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--comm_cost_coeffs=" in result.stdout
    data = json.loads(output.read_text())
    assert data["zero_copy"] is True and len(data["measurements"]) == 19
    assert output.with_suffix(".png").exists()
    devices = DeviceSet.from_json(["/device:CPU:0", "/device:CPU:1"], "1GiB", str(output))
    assert devices.links[0, 1].a_us_per_byte >= 0 and devices.links[0, 1].b_us >= 0


@pytest.mark.slow
def test_gated_sends_of_the_repair_step_leave_after_their_gate():
    import tensorflow as tf
    from graphfit.baechi.place_and_run import place_item
    from graphfit.baechi.schedule import simulate as simulate_step
    from graphfit.baechi.units import UnitGraph

    item = models.build("resnet", preset="tiny")
    target = local_target(4)
    graph = cost_graph_from_graph(item.graph, step_fetches(item))
    zeros = np.zeros(graph.num_ops, dtype=np.int64)
    one = DeviceSet.uniform(["/device:CPU:0"], "64GiB", "0,0")
    seq = int(simulate_step(UnitGraph.singletons(graph, zeros), one, zeros).peak_bytes[0])
    devices = DeviceSet.uniform(list(target.devices), int(1.6 * seq / 4), "0.0001754,134")
    placed, placement = place_item(item, devices, method="m_etf")
    reads = placement.gated_reads()
    assert placement.unit_schedule.info.get("memory_first") and reads
    ops = {op.name: op for op in placed.graph.get_operations()}
    gates = {name: op for name, op in ops.items() if "/gated_send_" in name}
    assert len(gates) == len(reads)
    for op in gates.values():  # on the sending device, after its gate, read by the readers
        read = reads[int(op.name.rsplit("_", 1)[1])]
        # the gate, or the end of the remapper group it fused into (profiler.remapper_fusions
        # moves control readers of a group's members there when ordering edges are written)
        gate = [c.name for c in op.control_inputs]
        assert op.device == read["src"] and len(gate) == 1
        assert gate[0] == read["after"] or gate[0].endswith(DONE_SUFFIX)
        assert all(op.outputs[0] in ops[r].inputs for r in read["readers"])
    compare_steps(item, placed, target.session, rtol=PLACEMENT_RTOL).check()
    # in a traced step each gated send's Identity starts after its gate ended
    with target.session(placed.graph) as session:
        placed.initialize(session)
        metadata = tf.compat.v1.RunMetadata()
        session.run(step_fetches(placed), placed.feed_dict(),
                    options=tf.compat.v1.RunOptions(trace_level=3), run_metadata=metadata)
    times = {n.node_name: (n.all_start_micros, n.all_start_micros + n.all_end_rel_micros)
             for d in metadata.step_stats.dev_stats for n in d.node_stats}
    checked = [(name, read) for name, read in
               ((name, reads[int(name.rsplit("_", 1)[1])]) for name in gates)
               if name in times and read["after"] in times]
    assert checked
    assert all(times[name][0] >= times[read["after"]][1] for name, read in checked)
