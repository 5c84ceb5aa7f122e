"""Property tests (hypothesis): the IR algorithms on arbitrary DAGs and training-like graphs.

Each property runs on 200 generated graphs, with zero, tiny and huge costs, sizes, link
costs and limits mixed in. Planners and placers may refuse an instance, but only with their
documented error; whatever they return must pass the checks written here, independently of
their own bookkeeping:

- remat: ``simulate`` and ``plan_for_budget`` plans replay (``remat.validate.replay_plan``)
  without a use-after-free, within the budget, with overhead >= 1; no budget means no
  recomputation and the checkpoint-all peak.
- baechi: groups refine as promised, fusion partitions the ops into acyclic units inside
  groups with conserved costs, placers put every op on a device, keep groups together and stay
  within every limit, and the schedule builder respects dependencies, transfers and devices.

Settings: ``derandomize=True`` (examples derived from each test's source, no random seed
and no example database): CI sees the same 200 graphs on every run, so a failure is
reproducible by anyone and never flickers; new graphs appear when a property or strategy
changes. ``deadline=None``: on 2 shared cores a single slow example is noise, not a bug.
"""

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphfit.baechi.devices import DeviceSet, LinkCost
from graphfit.baechi.fusion import fuse
from graphfit.baechi.grouping import coplacement_groups, tf_colocation_groups
from graphfit.baechi.place import makespan_lower_bound_us, place
from graphfit.baechi.schedule import PlacementError, simulate as simulate_schedule
from graphfit.baechi.units import CONTROL_EDGE_BYTES, UnitGraph
from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.synthetic import training_like
from graphfit.remat.pipeline import BudgetError, plan_for_budget
from graphfit.remat.simulator import (RematError, baseline_peak_bytes, minimum_budget_bytes,
                                      simulate)
from graphfit.remat.validate import replay_plan

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Costs that break naive arithmetic: zero, tiny, ordinary and huge.
COMPUTE_US = st.sampled_from([0.0, 1e-9, 0.5, 1.0, 137.0, 1e4, 1e9])
BYTES = st.one_of(st.sampled_from([0, 1, 4, 4096, 2**20, 2**30, 2**40]),
                  st.integers(0, 2**22))


@st.composite
def dags(draw, max_ops=24):
    """An arbitrary DAG of ops: each reads any outputs of earlier ops, may have control
    inputs, several outputs, persistent and temporary bytes, a shared colocation label,
    variable / stateful / random flags."""
    n = draw(st.integers(1, max_ops))
    specs = []
    for i in range(n):
        num_outputs = draw(st.integers(0, 2))
        inputs, controls = [], []
        for j in draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []:
            outputs = len(specs[j].output_bytes)
            if outputs:
                inputs.append((specs[j].name, draw(st.integers(0, outputs - 1))))
            else:
                controls.append(specs[j].name)
        specs.append(OpSpec(
            f"op{i}", draw(st.sampled_from(["MatMul", "Relu", "AddN", "Const"])),
            inputs=inputs, control_inputs=controls,
            output_bytes=draw(st.lists(BYTES, min_size=num_outputs, max_size=num_outputs)),
            compute_us=draw(COMPUTE_US),
            temp_bytes=draw(st.sampled_from([0, 0, 64, 2**20])),
            persistent_bytes=draw(st.sampled_from([0, 0, 0, 128, 2**24])),
            colocation_group=draw(st.sampled_from([None, None, None, "g0", "g1", "op0"])),
            is_stateful=draw(st.booleans()) and i % 5 == 0,
            is_random=draw(st.booleans()) and i % 7 == 0))
    return CostGraph.from_ops(draw(st.permutations(specs)))


TRAINING_LIKE = st.builds(training_like, st.integers(13, 120), st.integers(0, 2**16),
                          st.integers(1, 5))
GRAPHS = st.one_of(dags(), TRAINING_LIKE)


@st.composite
def device_sets(draw, graph):
    """1-4 devices with limits from zero to far more than the graph needs, and one link cost
    from free to slow."""
    num = draw(st.integers(1, 4))
    total = int(graph.persistent_bytes.sum() + graph.tensor_bytes.sum() + graph.temp_bytes.max(
        initial=0))
    memory = draw(st.lists(st.sampled_from([0, 1, total // 4, total // 2, total, 2**50]),
                           min_size=num, max_size=num))
    link = LinkCost(draw(st.sampled_from([0.0, 1e-9, 1.754e-4, 1.0])),
                    draw(st.sampled_from([0.0, 1e-3, 134.0, 1e6])))
    return DeviceSet([_device(k, m) for k, m in enumerate(memory)], link)


def _device(k, memory):
    from graphfit.baechi.devices import Device
    return Device(f"/device:CPU:{k}", int(memory))


# -- remat ------------------------------------------------------------------------------------

@PROPERTY
@given(GRAPHS, st.sampled_from(["dtr", "dtr_eq", "lru", "size", "belady", "offline"]),
       st.sampled_from([None, 0.0, 0.3, 0.6, 0.9, 1.0, 10.0]), st.data())
def test_simulated_plan_replays_within_budget(graph, heuristic, ratio, data):
    outputs = data.draw(st.lists(st.integers(0, max(0, graph.num_tensors - 1)), max_size=2)
                        if graph.num_tensors else st.just([]))
    baseline = baseline_peak_bytes(graph, outputs=outputs)
    budget = None if ratio is None else int(ratio * baseline)
    try:
        plan = simulate(graph, budget, heuristic, outputs=outputs, overhead_limit=3.0)
    except RematError as error:
        assert budget is not None, f"no budget, yet {error}"
        return
    replay = replay_plan(graph, plan, outputs)
    assert replay.peak_bytes == plan.peak_bytes
    assert budget is None or plan.peak_bytes <= budget
    assert replay.overhead >= 1.0 - 1e-9 and math.isfinite(replay.compute_us)
    assert budget is None or budget >= minimum_budget_bytes(graph, outputs=outputs)
    if budget is None:
        assert plan.num_recomputes == 0 and plan.peak_bytes == baseline


@PROPERTY
@given(st.one_of(st.tuples(dags(), st.sampled_from(["dtr", "offline", "checkpoint_all"])),
                 st.tuples(TRAINING_LIKE, st.sampled_from(["dtr", "offline", "checkpoint_all",
                                                          "chen_sqrt_n", "chen_greedy"]))),
       st.sampled_from([0.2, 0.5, 0.8, 1.0, 4.0]))
def test_planned_frees_replay_within_budget(graph_and_planner, ratio):
    """The plan the rewrite lowers: frees re-derived from the schedule, each tensor freed
    after its last reader as TF does (Chen's baselines need a loss: training-like graphs)."""
    graph, planner = graph_and_planner
    loss = "loss" if "loss" in graph.index else None
    budget = int(ratio * baseline_peak_bytes(graph))
    try:
        plan = plan_for_budget(graph, budget, planner, loss=loss)
    except BudgetError as error:
        assert error.minimum_bytes >= 0 and error.budget_bytes == budget
        return
    replay = replay_plan(graph, plan)
    assert replay.peak_bytes == plan.peak_bytes
    if planner not in ("checkpoint_all", "chen_sqrt_n"):  # these two ignore the budget
        assert plan.peak_bytes <= budget
    assert plan.overhead >= 1.0 - 1e-9


# -- grouping and fusion ----------------------------------------------------------------------

@PROPERTY
@given(GRAPHS)
def test_groups_refine_and_fusion_partitions(graph):
    tf_groups = tf_colocation_groups(graph)
    coplaced = coplacement_groups(graph, tf_groups)
    for label in set(graph.colocation_groups):  # ops sharing a label share a group
        members = [i for i, g in enumerate(graph.colocation_groups) if g == label]
        assert len(set(tf_groups[members].tolist())) == 1
    for g in set(tf_groups.tolist()):  # co-placement only merges groups
        assert len(set(coplaced[tf_groups == g].tolist())) == 1

    units = fuse(graph, coplaced)
    assert sorted(op for u in range(units.num_units) for op in units.ops(u)) == list(
        range(graph.num_ops))
    assert (units.group[units.unit_of_op] == coplaced).all()
    assert math.isclose(units.compute_us.sum(), graph.compute_us.sum(), rel_tol=1e-9)
    assert units.persistent_bytes.sum() == graph.persistent_bytes.sum()
    position = np.empty(units.num_units, dtype=np.int64)
    position[units.topological_order] = np.arange(units.num_units)
    assert sorted(units.topological_order.tolist()) == list(range(units.num_units))
    for u in range(graph.num_ops):  # every dependency goes forward between units
        for p in graph.predecessors(u):
            a, b = units.unit_of_op[p], units.unit_of_op[u]
            assert a == b or position[a] < position[b]


# -- placers and the schedule builder ---------------------------------------------------------

@PROPERTY
@given(GRAPHS, st.sampled_from(["m_topo", "m_etf", "m_sct"]),
       st.sampled_from(["default", "colocation", "fusion"]), st.data())
def test_placement_is_complete_grouped_and_within_limits(graph, method, placer_type, data):
    devices = data.draw(device_sets(graph))
    try:
        placement = place(graph, devices, method=method, placer_type=placer_type)
    except PlacementError as error:
        assert "bytes" in str(error) or "fit" in str(error), str(error)
        return
    index = placement.device_index
    assert len(index) == graph.num_ops and ((0 <= index) & (index < len(devices))).all()
    groups = tf_colocation_groups(graph)
    for g in set(groups.tolist()):
        assert len(set(index[groups == g].tolist())) == 1
    assert (placement.peak_bytes <= devices.memory_bytes).all()
    assert math.isfinite(placement.makespan_us)
    lower = makespan_lower_bound_us(graph, len(devices))
    assert placement.makespan_us >= lower * (1 - 1e-9) - 1e-6


@PROPERTY
@given(GRAPHS, st.data())
def test_schedule_respects_dependencies_transfers_and_devices(graph, data):
    devices = data.draw(device_sets(graph))
    units = UnitGraph.singletons(graph, tf_colocation_groups(graph))
    choice = data.draw(st.lists(st.integers(0, len(devices) - 1), min_size=units.num_groups,
                                max_size=units.num_groups))
    device_of_unit = np.array(choice, dtype=np.int64)[units.group]
    schedule = simulate_schedule(units, devices, device_of_unit)
    start, finish = schedule.start_us, schedule.finish_us
    assert np.isfinite(finish).all() and (finish >= start).all()
    assert math.isclose(schedule.makespan_us, finish.max(initial=0.0), rel_tol=1e-12,
                        abs_tol=1e-9)
    arrival = {}
    for k in range(len(schedule.transfer_tensor)):
        t, dst = int(schedule.transfer_tensor[k]), int(schedule.transfer_dst[k])
        producer = int(units.tensor_producer[t])
        assert schedule.transfer_start_us[k] >= finish[producer] - 1e-6
        size = max(int(units.tensor_bytes[t]), CONTROL_EDGE_BYTES)  # control edges: 4 bytes
        cost = devices.transfer_us(int(schedule.transfer_src[k]), dst, size)
        # Times are absolute: their float rounding grows with the clock, not with the cost.
        assert math.isclose(schedule.transfer_end_us[k] - schedule.transfer_start_us[k], cost,
                            rel_tol=1e-9,
                            abs_tol=1e-6 + 1e-12 * abs(schedule.transfer_end_us[k]))
        arrival[t, dst] = schedule.transfer_end_us[k]
    for u in range(units.num_units):
        for t in units.inputs(u).tolist():
            producer = int(units.tensor_producer[t])
            ready = (finish[producer] if device_of_unit[producer] == device_of_unit[u]
                     else arrival[t, int(device_of_unit[u])])
            assert start[u] >= ready - 1e-6 * max(1.0, ready)
    for d in range(len(devices)):  # a device runs one unit at a time
        on = np.flatnonzero(device_of_unit == d)
        spans = sorted(zip(start[on].tolist(), finish[on].tolist()))
        for (_, end), (begin, _) in zip(spans, spans[1:]):
            assert begin >= end - 1e-6 * max(1.0, end)
