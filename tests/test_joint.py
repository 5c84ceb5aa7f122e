"""Joint remat + placement (``pipeline.joint``) on the IR, and the joint demo end to end: the train
binary with ``--joint --report_dir`` on four virtual CPU devices, planned against measured."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from graphfit.baechi.devices import DeviceSet
from graphfit.pipeline.joint import JointSpace, search
from graphfit.pipeline.meta_optimizer import optimize
from graphfit.pipeline.report import REPORT_FILES
from graphfit.baechi.schedule import MIN_DURATION_US, simulate
from graphfit.baechi.units import UnitGraph
from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.sizes import format_bytes
from graphfit.remat.baselines import checkpoint_all
from graphfit.remat.closed_loop import PEAK_TOLERANCE
from graphfit.remat.pipeline import cheapest_plan, plan_for_budget
from graphfit.remat.plan import Event, RematPlan
from graphfit.remat.recompute_graph import recompute_graph, take_over_buffers
from graphfit.remat.tf_memory import MemoryModel

MB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chain(layers=12):
    """A deep, narrow training step: 1 MB activations saved for the backward pass, small
    weights (1/16 MB) updated at the end."""
    specs = [OpSpec("x", "Placeholder", output_bytes=[MB])]
    previous = "x"
    for i in range(layers):
        specs += [OpSpec(f"w{i}", "VarHandleOp", output_bytes=[0], persistent_bytes=MB // 16,
                         is_variable=True),
                  OpSpec(f"f{i}", "MatMul", inputs=[(previous, 0), (f"w{i}", 0)],
                         output_bytes=[MB], compute_us=100)]
        previous = f"f{i}"
    specs.append(OpSpec("loss", "Mean", inputs=[(previous, 0)], output_bytes=[4], compute_us=5))
    gradient = "loss"
    for i in reversed(range(layers)):
        below = f"f{i - 1}" if i else "x"
        specs += [OpSpec(f"g{i}", "MatMulGrad", inputs=[(gradient, 0), (below, 0), (f"w{i}", 0)],
                         output_bytes=[MB], compute_us=200),
                  OpSpec(f"u{i}", "Apply", inputs=[(f"w{i}", 0), (f"g{i}", 0)], compute_us=10,
                         is_stateful=True)]
        gradient = f"g{i}"
    return CostGraph.from_ops(specs)


@pytest.fixture(scope="module")
def chain():
    graph = _chain()
    return graph, MemoryModel(graph, graph, [[i] for i in range(graph.num_ops)])


def test_unrolled_plan_on_one_device_is_the_plan(chain):
    """The unrolled graph replayed in plan order on one device has the plan's peak and compute:
    clones read the newest versions, so the originals die where the plan frees them."""
    graph, _ = chain
    plan = plan_for_budget(graph, int(0.5 * checkpoint_all(graph).peak_bytes), "dtr",
                           loss="loss:0")
    assert plan.num_recomputes > 0
    unrolled = recompute_graph(graph, plan, "loss:0")
    assert unrolled.graph.num_ops == graph.num_ops + plan.num_recomputes
    position = {source: k for k, source in enumerate(unrolled.source)}
    order = sorted(range(unrolled.graph.num_ops), key=lambda n: position[unrolled.source[n]])
    one = DeviceSet.uniform(["/device:CPU:0"], 1 << 30, "0,0")
    schedule = simulate(UnitGraph.singletons(unrolled.graph, np.arange(unrolled.graph.num_ops)),
                        one, np.zeros(unrolled.graph.num_ops, dtype=np.int64), order)
    assert int(schedule.peak_bytes[0]) == plan.peak_bytes
    # Ops without compute take MIN_DURATION_US in the simulator.
    assert schedule.makespan_us == pytest.approx(
        plan.compute_us, abs=MIN_DURATION_US * unrolled.graph.num_ops)


def test_a_last_reader_takes_its_input_buffer_over_on_the_producers_device():
    """The backward pass reads the clone ``n/remat_1``, so ``n``'s only reader ``r`` takes its
    buffer over (TF's element-wise forwarding): one buffer, charged to ``n``'s device while
    ``r``'s readers run. ``a`` runs after ``g``, the other reader of ``r``'s output: it takes
    that buffer (``n``'s) over too. ``b`` reads a tensor ``c`` reads after it: no."""
    planned = CostGraph.from_ops([
        OpSpec("x", "Placeholder", output_bytes=[0], persistent_bytes=MB),
        OpSpec("n", "FusedBatchNormV3", inputs=[("x", 0)], output_bytes=[MB, 64]),
        OpSpec("r", "Relu", inputs=[("n", 0)], output_bytes=[MB]),
        OpSpec("g", "ReluGrad", inputs=[("r", 0), ("n", 0)], output_bytes=[MB]),
        OpSpec("a", "AddN", inputs=[("g", 0), ("r", 0)], output_bytes=[MB]),
        OpSpec("b", "Neg", inputs=[("a", 0)], output_bytes=[MB]),
        OpSpec("c", "Mul", inputs=[("a", 0), ("b", 0)], output_bytes=[MB])])
    events = [Event("compute", 0), Event("compute", 1), Event("compute", 2), Event("free", 1),
              Event("recompute", 1)] + [Event("compute", i) for i in (3, 4, 5, 6)]
    plan = RematPlan(events, 3 * MB, 3 * MB, 1, 4, "x")
    unrolled = recompute_graph(planned, plan)
    taken = take_over_buffers(unrolled, planned, {2: [1], 4: [3], 5: [5]})   # tensor ids
    graph = taken.graph

    def inputs(name):
        return {(graph.names[graph.tensor_producer[t]], int(graph.tensor_port[t]))
                for t in graph.op_inputs(graph.index[name])}

    assert graph.output_bytes(graph.index["r"]).tolist() == [0]
    assert graph.output_bytes(graph.index["a"]).tolist() == [0]
    assert graph.output_bytes(graph.index["b"]).tolist() == [MB]
    assert ("n", 0) in inputs("g") and ("n", 0) in inputs("b") and ("n", 0) in inputs("c")
    group = graph.colocation_groups[graph.index["n"]]
    assert graph.colocation_groups[graph.index["r"]] == graph.colocation_groups[
        graph.index["a"]] == group != graph.colocation_groups[graph.index["b"]]
    assert dict(zip(graph.names, taken.source)) == dict(zip(unrolled.graph.names,
                                                             unrolled.source))
    # without a listed reuse the unrolled graph is returned as it is
    assert take_over_buffers(unrolled, planned, {}) is unrolled


def test_a_relu_fused_into_its_batch_norm_is_planned_in_the_batch_norms_buffer():
    """With oneDNN, Grappler runs ``FusedBatchNormV3 + Relu`` as one kernel under the batch
    norm's name: the trace shows the batch norm writing the activation's output and no
    ``Relu``. The calibrated model lists the ``Relu`` as taking that buffer over, so the
    unrolled step holds one buffer where it counted two (the zoo resnet's joint plan read 2 MiB
    over its measured peak at such ``Relu``s). A ``Relu`` the trace shows in a buffer of its
    own keeps it."""
    from graphfit.remat.tf_memory import StepTrace, _calibrated

    base = CostGraph.from_ops([
        OpSpec("x", "Placeholder", output_bytes=[MB]),
        OpSpec("n", "FusedBatchNormV3", inputs=[("x", 0)], output_bytes=[MB, 64]),
        OpSpec("r", "Relu", inputs=[("n", 0)], output_bytes=[MB]),
        OpSpec("c", "Conv2D", inputs=[("r", 0)], output_bytes=[MB]),
        OpSpec("g", "FusedBatchNormGradV3", inputs=[("c", 0), ("r", 0), ("n", 1)],
               output_bytes=[MB])])

    def model(traced_relu: bool) -> MemoryModel:
        ops = ["x", "n", "c", "g"] + (["r"] if traced_relu else [])
        return _calibrated(base, StepTrace(
            start_us={name: k for k, name in enumerate(ops)},
            allocated={name: {p: True for p in range(2 if name == "n" else 1)}
                       for name in ops},
            address={name: {p: 100 * k + p for p in range(2 if name == "n" else 1)}
                     for k, name in enumerate(ops)}))

    fused = model(traced_relu=False)
    relu, n = fused.plan_graph.index["r"], fused.plan_graph.index["n"]
    assert fused.reuses == {relu: [int(fused.plan_graph.output_offset[n])]}
    plan = RematPlan([Event("compute", i) for i in range(5)], 3 * MB, 3 * MB, 1, 0, "x")
    unrolled = take_over_buffers(recompute_graph(fused.plan_graph, plan),
                                 fused.plan_graph, fused.reuses).graph
    assert unrolled.output_bytes(unrolled.index["r"]).tolist() == [0]
    assert model(traced_relu=True).reuses == {}


def test_a_batch_norm_read_twice_runs_without_the_fused_workspace():
    """Grappler runs ``FusedBatchNormV3 + Relu`` as one kernel only where the ``Relu`` is the
    batch norm output's only reader; the fused kernel's activation workspace (output 5, 1/8
    of the activation, as calibrated on the fused step) is planned then. A plan that
    recomputes the ``Relu`` from the kept batch norm reads that output twice: TF runs the
    batch norm alone, with no workspace (the zoo resnet's joint run: 256 KiB planned and not
    measured on a device, 2026-12-07)."""
    planned = CostGraph.from_ops([
        OpSpec("x", "Placeholder", output_bytes=[0], persistent_bytes=MB),
        OpSpec("n", "FusedBatchNormV3", inputs=[("x", 0)],
               output_bytes=[MB, 64, 64, 64, 64, MB // 8]),
        OpSpec("r", "Relu", inputs=[("n", 0)], output_bytes=[MB]),
        OpSpec("c", "Conv2D", inputs=[("r", 0)], output_bytes=[MB]),
        OpSpec("g", "FusedBatchNormGradV3", inputs=[("c", 0), ("r", 0), ("n", 5)],
               output_bytes=[MB])])
    reuses = {2: [int(planned.output_offset[1])]}       # r takes n:0 over, as fused

    def workspace(events):
        plan = RematPlan([Event(kind, i) for kind, i in events], 3 * MB, 3 * MB, 1, 1, "x")
        graph = take_over_buffers(recompute_graph(planned, plan), planned, reuses).graph
        return int(graph.output_bytes(graph.index["n"])[5])

    once = [("compute", i) for i in range(5)]
    assert workspace(once) == MB // 8
    twice = [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("free", 2),
             ("recompute", 2), ("compute", 4)]
    assert workspace(twice) == 0


def test_search_fits_where_neither_one_pass_option_does(chain):
    graph, model = chain
    peak = checkpoint_all(graph).peak_bytes
    # 0.3: placing alone fits at 0.35 since the repair step sends just in time, spreads the
    # variables first and tests the fit at each op's start
    devices = DeviceSet.uniform([f"/device:CPU:{i}" for i in range(4)], int(0.3 * peak),
                                "0.0001754,134")
    found = search(model, devices, peak, "loss:0", progress=False)
    assert not found.place_only.fits and found.place_only.reason
    assert not found.remat_only.fits and found.remat_only.reason
    winner = found.winner
    assert winner is not None and winner.fits and winner.num_recomputes > 0
    assert all(p <= limit for p, limit in zip(winner.peak_bytes, devices.memory_bytes))
    assert winner.makespan_us == min(o.makespan_us for o in found.options if o.fits)
    assert all(o.fits or o.reason for o in found.options)
    assert any(not o.fits and o.ratio > winner.ratio for o in found.options)
    summary = found.to_json()
    assert json.loads(json.dumps(summary))["winner"]["method"] == winner.method
    assert "did not fit" in summary["explanation"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The train binary's joint demo on a small mlp: 12.5 MiB on one device, four devices of
    4.5 MiB."""
    out = tmp_path_factory.mktemp("joint")
    result = subprocess.run(
        [sys.executable, "-m", "graphfit.tools.train", "--model_name=mlp",
         "--batch_size=1024", "--model_arg=depth=8", "--model_arg=width=256",
         "--model_arg=input_dim=256", "--num_devices=4", "--device_memory=4.5MiB", "--joint",
         "--remat_heuristic=offline", "--steps=2", "--warmup_steps=1",
         f"--report_path={out / 'train.json'}", f"--report_dir={out / 'report'}"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_joint_demo_trains_and_measures_what_it_planned(demo):
    out, result = demo
    report = json.loads((out / "train.json").read_text())
    search_report = report["joint"]["search"]
    # One device cannot hold the step (6 MiB at the least, rematerialized), four can. Whether
    # placing without remat fits too depends on the measured op times the placer schedules by
    # (it misses by a few hundred KiB or fits, from run to run): then it must not beat the
    # winner. test_search_fits_where_neither_one_pass_option_does pins that case down.
    assert not search_report["remat_only"]["fits"]
    winner, place_only = search_report["winner"], search_report["place_only"]
    assert winner["fits"]
    assert not place_only["fits"] or winner["makespan_us"] <= place_only["makespan_us"]
    place = report["place"]
    assert place["equal_to_single_device"]
    # Planned = measured to the byte on most devices in most runs. TF's executor does not
    # follow the simulated schedule exactly across devices (the forward pass is not pinned,
    # and a remote reader may run later than simulated on a loaded machine), so a device can
    # hold one more activation (1 MiB here) than planned, and end up to the tolerance
    # ``optimize`` allows a measured peak over its limit (a fresh-clone CI run on 2026-12-05
    # measured one device 12 KB over 4.5 MiB, as
    # test_placed_step_with_its_memory_order_runs_within_the_limits saw on 12-04).
    for device in place["devices"]:
        planned = place["planned_peak_bytes"][device]
        measured = place["measured_peak_bytes"][device]
        assert abs(measured - planned) <= 0.05 * planned + MB, (device, planned, measured)
        assert measured <= place["limit_bytes"][device] * (1 + PEAK_TOLERANCE)
    assert "place only  " in result.stderr and "joint       fits" in result.stderr


@pytest.mark.slow
def test_report_dir_holds_every_file_a_person_reads(demo):
    import matplotlib.image

    directory = demo[0] / "report"
    assert sorted(os.listdir(directory)) == sorted(REPORT_FILES)
    data = json.loads((directory / "report.json").read_text())
    assert data["joint"]["search"]["winner"]["fits"] and data["run"]["losses"]
    for image in ("memory.png", "placement_gantt.png"):
        pixels = matplotlib.image.imread(directory / image)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0
    trace = json.loads((directory / "schedule_trace.json").read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert processes == {f"/device:CPU:{i}" for i in range(4)}
    recomputed = data.get("remat", {}).get("recomputed_ops", [])
    assert any("/remat_" in e["name"] for e in trace["traceEvents"] if e["ph"] == "X") == bool(
        recomputed)
    plan = (directory / "remat_plan.md").read_text()
    assert plan.count("\n| `") == len(recomputed)
    assert recomputed or "Nothing is recomputed" in plan
    summary = (directory / "summary.md").read_text()
    assert "| /device:CPU:3 |" in summary and "place only" in summary
    assert all(f"({name})" in summary for name in REPORT_FILES if name != "summary.md")
    # One run, one count of recomputations and one baseline everywhere a person reads them,
    # and the search's winner is the option built.
    count = data["remat"].get("num_recomputes", 0)
    assert data["joint"]["built"] == data["joint"]["search"]["winner"]
    assert data["joint"]["built"]["num_recomputes"] == count
    if count:
        assert f"{count} recomputations" in plan and f"{count} recomputations" in summary
        baseline = format_bytes(data["remat"]["baseline_peak_bytes"])
        assert f"baseline {baseline}" in plan and f"peak {baseline} ->" in summary
    assert f"Placer: {data['place']['plan']['method']}." in summary
    assert "Measured step time" in summary and "your step under TF's defaults" in summary


def test_placing_the_step_as_it_is_competes_with_the_searched_options(chain):
    """With room to spare, no recomputation and no rewrite (hence no ordering edges) is the
    fastest option, and the search keeps it."""
    graph, model = chain
    peak = checkpoint_all(graph).peak_bytes
    devices = DeviceSet.uniform([f"/device:CPU:{i}" for i in range(4)], peak, "0.0001754,134")
    found = search(model, devices, peak, "loss:0", ratios=(1.0, 0.8), progress=False)
    assert found.place_only.fits
    assert found.winner.makespan_us <= min(o.makespan_us for o in found.options if o.fits)
    assert found.winner.makespan_us <= found.place_only.makespan_us


@pytest.mark.slow
def test_placed_step_with_its_memory_order_runs_within_the_limits():
    """The mlp of the demo placed alone over four 5 MiB virtual CPUs (m-ETF, memory
    planned as the devices share it; at 4.5 MiB, since joint mode orders every update after
    its variable's reads, no placement fitted in 3 of 9 runs, by 22 KB of measured costs),
    the plan's memory order written into the graph
    (``Placement.memory_order``): the step computes the single device's values and each
    device's measured peak is within its plan, to the tolerance ``optimize`` allows a measured
    peak (``PEAK_TOLERANCE``; some devices measure less, down to 0.73 of the plan, where TF
    runs the devices' ops in another order than simulated). Until 2026-12-07 a device held up to 788 KiB more in some
    runs: weight gradients of four layers at once, since the step was measured fetching its
    gradients, which the plan (of the update and the loss) frees after their updates
    (``check_placement(fetch_gradients=False)``)."""
    from graphfit import models
    from graphfit.baechi.run import local_target

    item = models.build("mlp", preset="tiny", batch_size=1024, depth=8, width=256,
                        input_dim=256)
    target = local_target(4)
    devices = DeviceSet.uniform(list(target.devices), "5MiB", "0.0001754,134")
    result = optimize(item, joint=JointSpace((1.0,), ("m_etf",)), target=target,
                      devices=devices, progress=None)
    place = result.report()["place"]
    assert place["memory_order_edges"] > 0 and place["equal_to_single_device"]
    for device in place["devices"]:
        planned, measured = place["planned_peak_bytes"][device], place["measured_peak_bytes"][device]
        assert measured <= planned * (1 + PEAK_TOLERANCE), (device, planned, measured)
        assert measured <= place["limit_bytes"][device] * (1 + PEAK_TOLERANCE)


@pytest.mark.slow
def test_no_variable_update_of_the_built_step_overtakes_a_read_of_the_old_value():
    """Every op that reads a variable's old value runs before the variable's update in the
    placed step. An update that overtakes such a read (a layer's input gradient reads its
    kernel as the weight gradient does) makes TF copy the variable, bytes no plan counts:
    the zoo resnet's joint run read 144 KiB over its plan on a device (+6%, 2026-12-07).
    Without the ordering, 1-3 readers of this step were not before their update in each of
    three runs (oneDNN off; the tiny preset had none in about half its runs)."""
    import networkx as nx

    from graphfit import models
    from graphfit.baechi.run import local_target
    from graphfit.remat.early_updates import VARIABLE_WRITE_OP_TYPES

    target = local_target(4)
    devices = DeviceSet.uniform(list(target.devices), "64MiB", "0.0001754,134")
    result = optimize(models.build("resnet"), target=target, devices=devices,
                      joint=JointSpace((0.4,), ("m_etf",)), progress=None)
    assert result.report()["joint"]["update_order"]["ordering_edges"] > 0
    graph = result.item.graph
    dag = nx.DiGraph([(t.op.name, op.name) for op in graph.get_operations() for t in op.inputs])
    dag.add_edges_from((c.name, op.name) for op in graph.get_operations()
                       for c in op.control_inputs)
    step = nx.ancestors(dag, result.item.train_op)

    def variable(op):
        while op.type == "Identity":
            op = op.inputs[0].op
        return op.name

    readers: dict[str, list[str]] = {}
    for read in graph.get_operations():
        if read.type == "ReadVariableOp" and read.name in step:
            views = list(read.outputs[0].consumers())
            while views:
                op = views.pop()
                if op.type == "Identity":
                    views += op.outputs[0].consumers()
                elif op.name in step:
                    readers.setdefault(variable(read.inputs[0].op), []).append(op.name)
    updates = [op for op in graph.get_operations()
               if op.type in VARIABLE_WRITE_OP_TYPES and op.name in step]
    assert updates
    for update in updates:
        before = nx.ancestors(dag, update.name)
        late = [r for r in readers[variable(update.inputs[0].op)] if r not in before]
        assert not late, (update.name, late)


def test_search_plans_every_order_it_is_given_and_keeps_the_cheapest(chain):
    """Each budget is planned on every memory model (an order of the step), as
    ``remat.rematerialize`` plans; the option remembers the model its plan belongs to."""
    graph, model = chain
    twin = MemoryModel(graph, graph, [[i] for i in range(graph.num_ops)])
    peak = checkpoint_all(graph).peak_bytes
    devices = DeviceSet.uniform([f"/device:CPU:{i}" for i in range(4)], int(0.3 * peak),
                                "0.0001754,134")
    found = search([model, twin], devices, peak, "loss:0", ratios=(0.6, 0.5), progress=False)
    planned = [o for o in found.options if o.plan is not None]
    assert planned
    for option in planned:
        assert len(option.plan.stats["orders"]) == 2 and option.model in (model, twin)
        cheapest = min(o for o in option.plan.stats["orders"] if o is not None)
        assert option.overhead == pytest.approx(cheapest, abs=1e-4)     # orders are rounded


def test_the_order_search_stops_at_a_plan_that_recomputes_next_to_nothing(chain):
    """No order can beat a plan within ``ORDER_SEARCH_SLACK`` of no recomputation by more than
    that, so ``cheapest_plan`` plans no further order; below, it plans every order."""
    from graphfit.remat.pipeline import ORDER_SEARCH_SLACK

    graph, model = chain
    twin = MemoryModel(graph, graph, [[i] for i in range(graph.num_ops)])
    peak = checkpoint_all(graph).peak_bytes
    _, ample = cheapest_plan([model, twin], peak, "dtr", 2.0, "loss:0")
    assert ample.overhead == 1.0 and ample.stats["orders"] == [1.0]
    _, tight = cheapest_plan([model, twin], int(0.5 * peak), "dtr", 2.0, "loss:0")
    assert tight.overhead > 1 + ORDER_SEARCH_SLACK and len(tight.stats["orders"]) == 2


def test_after_the_first_two_orders_the_search_stops_at_a_plan_that_recomputes_little(chain):
    """Past the first model's two plans, ``cheapest_plan`` traces no further order for a plan
    within ``FIRST_MODEL_SLACK``; a plan that recomputes more tries every order."""
    from graphfit.remat.pipeline import FIRST_MODEL_SLACK, ORDER_SEARCH_SLACK

    graph, model = chain
    models = [model, MemoryModel(graph, graph, [[i] for i in range(graph.num_ops)]), model]
    peak = checkpoint_all(graph).peak_bytes
    _, little = cheapest_plan(models, int(0.95 * peak), "dtr", 2.0, "loss:0")
    assert 1 + ORDER_SEARCH_SLACK < little.overhead <= 1 + FIRST_MODEL_SLACK
    assert len(little.stats["orders"]) == 2
    _, more = cheapest_plan(models, int(0.8 * peak), "dtr", 2.0, "loss:0")
    assert more.overhead > 1 + FIRST_MODEL_SLACK and len(more.stats["orders"]) == 3


def test_an_option_measured_over_its_limits_gives_way_to_the_next(monkeypatch):
    """Joint mode's closed loop: the fastest option, measured over a device's limit, is not
    returned; the next fastest is built and measured instead."""
    from graphfit import models
    from graphfit.baechi.run import local_target
    from graphfit.pipeline import meta_optimizer

    real, built = meta_optimizer.check_placement, []

    def check_placement(item, placed, placement, target, **kwargs):
        report = real(item, placed, placement, target, **kwargs)
        built.append(placement.options["method"])
        if len(built) == 1:                        # the first option measures 10% over
            name = placement.devices.names[0]
            report["measured_peak_bytes"][name] = int(report["limit_bytes"][name] * 1.1)
        return report

    monkeypatch.setattr(meta_optimizer, "check_placement", check_placement)
    target = local_target(2)
    devices = DeviceSet.uniform(list(target.devices), "64MiB", "0.0001754,134")
    result = optimize(models.build("mlp", preset="tiny"), target=target, devices=devices,
                      joint=JointSpace((1.0,), ("m_etf", "m_topo")), progress=None)
    tried = result.report()["joint"]["tried"]
    assert len(built) == 2 and tried[0]["over_limit_bytes"] and not tried[1]["over_limit_bytes"]
    assert result.report()["joint"]["built"]["method"] == built[1]
