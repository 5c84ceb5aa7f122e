"""The step simulator on hand-made graphs: exact makespans, transfers, memory peaks, trace."""

import json

import numpy as np
import pytest

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.memory import colive_lower_bound_bytes, device_timelines
from graphfit.baechi.schedule import PlacementError, RuntimeCosts, ScheduleBuilder, simulate
from graphfit.baechi.units import UnitGraph
from graphfit.profiler import synthetic
from graphfit.profiler.cost_graph import CostGraph, OpSpec


def _units(specs):
    g = CostGraph.from_ops(specs)
    return UnitGraph.singletons(g, np.arange(g.num_ops))


def _devices(n=2, coeffs="0.01,2", memory="1GiB"):
    return DeviceSet.uniform([f"/GPU:{i}" for i in range(n)], memory, coeffs)


def test_chain_on_one_device_is_the_sum():
    units = _units([OpSpec("a", "X", output_bytes=[100], compute_us=3),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[100], compute_us=4),
                    OpSpec("c", "X", inputs=[("b", 0)], compute_us=5)])
    s = simulate(units, _devices(), [0, 0, 0])
    assert s.makespan_us == 12 and s.start_us.tolist() == [0, 3, 7]
    assert len(s.transfer_tensor) == 0


def test_cross_device_edge_pays_the_link():
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=10),
                    OpSpec("b", "X", inputs=[("a", 0)], compute_us=5)])
    s = simulate(units, _devices(), [0, 1])
    assert s.makespan_us == pytest.approx(10 + (0.01 * 1000 + 2) + 5)


def test_transfers_serialise_per_link_direction_and_copies_are_reused():
    # a and b on device 0 each send 1000 bytes to device 1 (12 us each on the link);
    # c reads both, d reads a again: one copy of a, no second transfer.
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("b", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("c", "X", inputs=[("a", 0), ("b", 0)], compute_us=1),
                    OpSpec("d", "X", inputs=[("a", 0)], compute_us=1)])
    s = simulate(units, _devices(), [0, 0, 1, 1])
    # a: [0,1], b: [1,2]; a's copy [1,13], b's copy waits for the link: [13,25]; c [25,26].
    assert sorted(s.transfer_start_us.tolist()) == [1, 13]
    assert s.start_us[2] == 25 and s.makespan_us == 27
    assert len(s.transfer_tensor) == 2


def test_opposite_directions_share_a_channel_under_contention_only():
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("b", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("c", "X", inputs=[("a", 0)], compute_us=1),
                    OpSpec("d", "X", inputs=[("b", 0)], compute_us=1)])
    # one channel per device (Baechi's model): b's copy [13, 25] waits for a's [1, 13]
    assert simulate(units, _devices(), [0, 1, 1, 0]).makespan_us == 1 + 12 + 12 + 1
    parallel = _devices().with_link_model("parallel")
    assert simulate(units, parallel, [0, 1, 1, 0]).makespan_us == 1 + 12 + 1


def test_liveness_and_static_peaks():
    # a (100 B) -> b (10 B) -> c on device 0; b's output is also sent to device 1 (d).
    units = _units([OpSpec("a", "X", output_bytes=[100], compute_us=1, persistent_bytes=7),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[10], compute_us=1,
                           temp_bytes=50),
                    OpSpec("c", "X", inputs=[("b", 0)], output_bytes=[1], compute_us=1),
                    OpSpec("d", "X", inputs=[("b", 0)], output_bytes=[1000], compute_us=1)])
    s = simulate(units, _devices(coeffs="0,1"), [0, 0, 0, 1])
    # device 0 during b: 7 persistent + 100 (a) + 10 (b) + 50 temp; device 1: copy 10 + d 1000
    assert s.peak_bytes.tolist() == [167, 1010]
    static = simulate(units, _devices(coeffs="0,1"), [0, 0, 0, 1], memory_model="static")
    assert static.peak_bytes.tolist() == [7 + 100 + 10 + 50 + 1, 10 + 1000]


def test_order_must_be_topological():
    units = _units([OpSpec("a", "X", output_bytes=[1]), OpSpec("b", "X", inputs=[("a", 0)])])
    with pytest.raises(PlacementError, match="topological"):
        simulate(units, _devices(), [0, 0], order=[1, 0])
    with pytest.raises(PlacementError, match="device index"):
        simulate(units, _devices(), [0, 5])


def test_chrome_trace(tmp_path):
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=10),
                    OpSpec("b", "X", inputs=[("a", 0)], compute_us=5)])
    s = simulate(units, _devices(), [0, 1])
    path = tmp_path / "trace.json"
    s.write_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    compute = [e for e in events if e.get("cat") == "compute"]
    transfers = [e for e in events if e.get("cat") == "transfer"]
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in compute] == [
        ("a", 0, 0.0, 10.0), ("b", 1, 22.0, 5.0)]
    assert transfers[0]["args"]["bytes"] == 1000 and transfers[0]["dur"] == pytest.approx(12)
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"/GPU:0", "/GPU:1"}


def _fan(link_model):
    """a on device 0 sends 1000 B to b (device 1) and c (device 2); d on 3 reads b and c."""
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[1000], compute_us=1),
                    OpSpec("c", "X", inputs=[("a", 0)], output_bytes=[1000], compute_us=1),
                    OpSpec("d", "X", inputs=[("b", 0), ("c", 0)], compute_us=1)])
    devs = DeviceSet.uniform([f"/GPU:{i}" for i in range(4)], "1GiB", "0.01,2",
                             link_model=link_model)
    return simulate(units, devs, [0, 1, 2, 3])


def test_contention_serialises_sends_of_one_device_and_receives_of_another():
    # each transfer takes 12 us; a ends at 1
    s = _fan("contention")
    # a -> b [1, 13], a -> c waits for a's send queue [13, 25]; b ends 14, c ends 26;
    # b -> d [14, 26], c -> d waits for d's receive queue [26, 38]; d runs [38, 39]
    assert sorted(s.transfer_start_us.tolist()) == [1, 13, 14, 26]
    assert s.makespan_us == 39
    p = _fan("parallel")
    # every pair its own link: both sends at 1, both receives of d at 14
    assert sorted(p.transfer_start_us.tolist()) == [1, 1, 14, 14] and p.makespan_us == 27


def test_default_link_model_follows_the_devices():
    assert _devices().link_model == "contention"
    cpus = DeviceSet.uniform(["/device:CPU:0", "/device:CPU:1"], "1GiB", "0,1")
    assert cpus.link_model == "parallel"
    workers = DeviceSet.uniform([f"/job:worker/task:{i}/device:CPU:0" for i in range(2)],
                                "1GiB", "0,1")
    assert workers.link_model == "contention"


def test_a_gated_send_starts_after_its_gate_and_so_does_the_copy():
    # a (1000 B) and x run on device 0; b on device 1 reads a. Ungated, a's copy is sent at 1
    # and held on device 1 from then; gated on x (ends at 101), it is sent at 101.
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("x", "X", output_bytes=[10], compute_us=100),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[1], compute_us=1)])
    early = simulate(units, _devices(), [0, 0, 1])
    assert early.transfer_start_us.tolist() == [1] and early.start_us[2] == 13
    key = 0 * units.num_units + 2  # tensor of a, read by b
    late = simulate(units, _devices(), [0, 0, 1], gates={key: 1})
    assert late.transfer_start_us.tolist() == [101] and late.start_us[2] == 113
    assert late.transfer_gate.tolist() == [1] and late.gates() == {key: 1}
    times, level = device_timelines(late)[1]
    assert level[times < 101].max() == 0 and level.max() == 1001
    with pytest.raises(PlacementError, match="comes after its reader"):
        simulate(units, _devices(), [0, 1, 1], order=[0, 2, 1], gates={key: 1})


def test_late_sends_arrive_when_the_reader_could_start():
    # device 1 is busy with y until 200; b (after y on device 1) reads a from device 0, where
    # x runs until 101: the placer gates a's send on x, so it arrives at 113, not at 13.
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("y", "X", output_bytes=[10], compute_us=200),
                    OpSpec("x", "X", output_bytes=[10], compute_us=100),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[1], compute_us=1)])
    builder = ScheduleBuilder(units, _devices(), late_sends=True)
    for u, d in ((0, 0), (1, 1), (2, 0), (3, 1)):
        builder.commit(u, d)
    s = builder.finish_schedule()
    assert s.transfer_gate.tolist() == [2] and s.transfer_start_us.tolist() == [101]
    assert s.start_us[3] == 200
    again = simulate(units, _devices(), s.device, s.order, **s.replay_options())
    assert again.start_us.tolist() == s.start_us.tolist()
    assert again.peak_bytes.tolist() == s.peak_bytes.tolist()


def test_a_tensor_received_twice_is_held_twice_for_its_own_readers():
    # b and c on device 1 read a; the copy is freed after b and fetched again for c.
    units = _units([OpSpec("a", "X", output_bytes=[1000], compute_us=1),
                    OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[1], compute_us=1),
                    OpSpec("y", "X", output_bytes=[5000], compute_us=50),
                    OpSpec("c", "X", inputs=[("a", 0), ("y", 0)], output_bytes=[1],
                           compute_us=1)])
    builder = ScheduleBuilder(units, _devices(), transient_copies=True)
    for u, d in ((0, 0), (1, 1)):
        builder.commit(u, d)
    builder.advance(14)  # b ended at 14: its copy of a is released (y waits for it)
    for u, d in ((2, 1), (3, 1)):
        builder.commit(u, d)
    s = builder.finish_schedule()
    assert len(s.transfer_tensor) == 2 and s.transient_copies
    # device 1: the first copy lives [1, 14] (b's read), the second from 13 to c's end (65),
    # y [14, 65]: peak 1000 + 5000 + c's output during c; the first copy is not held to c
    assert sorted(s.transfer_start_us.tolist()) == [1, 13]
    assert s.peak_bytes[1] == 1000 + 5000 + 1
    again = simulate(units, _devices(), s.device, s.order, **s.replay_options())
    assert again.peak_bytes.tolist() == s.peak_bytes.tolist()
    assert len(again.transfer_tensor) == 2


def test_runtime_costs_add_a_step_cost_a_cost_per_op_and_share_the_cores():
    specs = [OpSpec("a", "X", output_bytes=[10], compute_us=3),
             OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[10], compute_us=4),
             OpSpec("c", "X", output_bytes=[10], compute_us=6),
             OpSpec("d", "X", inputs=[("c", 0)], compute_us=2)]
    units, devs = _units(specs), _devices(coeffs="0,0")
    order = [0, 2, 1, 3]
    plain = simulate(units, devs, [0, 0, 1, 1], order)
    assert plain.makespan_us == 8  # c, d on the second device beside a, b
    costs = RuntimeCosts(step_us=100.0, op_us=1.5, cores=2)
    with_costs = simulate(units, devs, [0, 0, 1, 1], order, runtime=costs)
    assert with_costs.makespan_us == pytest.approx(100 + 6 + 2 + 2 * 1.5)
    # one core: the two devices take turns, the step takes every op's time
    one_core = simulate(units, devs, [0, 0, 1, 1], order, runtime=RuntimeCosts(0.0, 0.0, 1))
    assert one_core.makespan_us == pytest.approx(sum(s.compute_us for s in specs))
    finish = sorted(zip(one_core.start_us.tolist(), one_core.finish_us.tolist()))
    assert all(b[0] >= a[1] for a, b in zip(finish, finish[1:]))  # never two at once


def test_colive_lower_bound_by_hand():
    # at c: the variable's 1000 persistent bytes, a's output (read by c), b's and c's outputs
    # (not the variable's handle: nobody reads it, it died with v)
    g = CostGraph.from_ops([
        OpSpec("v", "VarHandleOp", output_bytes=[8], persistent_bytes=1000, is_variable=True),
        OpSpec("a", "X", output_bytes=[100], compute_us=1),
        OpSpec("b", "X", inputs=[("a", 0)], output_bytes=[10], compute_us=1),
        OpSpec("c", "X", inputs=[("a", 0), ("b", 0)], output_bytes=[1], compute_us=1)])
    bound, at = colive_lower_bound_bytes(g, 2)
    assert (bound, g.names[at]) == (-(-(1000 + 100 + 10 + 1) // 2), "c")


@pytest.mark.parametrize("seed", range(6))
def test_no_placement_peaks_below_the_colive_lower_bound(seed):
    graph = (synthetic.training_like(120, seed=seed) if seed % 2
             else synthetic.random_dag(80, seed=seed, window=8))
    rng = np.random.default_rng(seed)
    devices = _devices(3)
    bound, _ = colive_lower_bound_bytes(graph, 3)
    units = UnitGraph.singletons(graph, np.arange(graph.num_ops))
    for _ in range(5):
        s = simulate(units, devices, rng.integers(0, 3, size=graph.num_ops))
        assert s.peak_bytes.max() >= bound
