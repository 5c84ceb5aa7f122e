"""The DTR simulator, its heuristics, plan checking and DTR log replay (remat/)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.synthetic import random_dag, training_like
from graphfit.remat.dtr_logs import DtrLogError, default_logs_path, load_trace, load_traces, read_log
from graphfit.remat.plan import COMPUTE, RECOMPUTE
from graphfit.remat.validate import PlanError, replay_plan
from graphfit.remat.simulator import (PLANNERS, BudgetTooSmallError, InvalidOrderError, OutOfMemoryError,
                             ThrashError, baseline_peak_bytes, minimum_budget_bytes, simulate)

EXCERPT = Path(__file__).parent / "data" / "dtr_excerpt.jsonl"


def _graph(kind: str, size: int, seed: int) -> CostGraph:
    """A generated graph with room for rematerialization. training_like's weight reads read a
    resource, so the simulator pins them and activations are a small part of the peak; here
    they are plain ops, as if the weights were constants."""
    if kind == "random":
        return random_dag(size, seed)
    specs = training_like(size, seed).to_specs()
    return CostGraph.from_ops([dataclasses.replace(s, reads_resource=False) for s in specs])


def _between(g: CostGraph, fraction: float, outputs=()) -> float:
    """A budget ``fraction`` of the way from the minimum to the checkpoint-all peak."""
    low = minimum_budget_bytes(g, outputs=outputs)
    return low + fraction * (baseline_peak_bytes(g, outputs=outputs) - low)


def _checkpoint_all_peak(g: CostGraph, outputs=()) -> int:
    """Reference liveness peak: outputs live from their op to their last reader (or to the
    end for step outputs, or only while their op runs when nobody reads them)."""
    n = g.num_ops
    end = np.full(g.num_tensors, -1)
    for t in range(g.num_tensors):
        readers = g.tensor_consumers(t)
        end[t] = n if t in set(outputs) else (readers.max() if len(readers) else -1)
    peak = 0
    for i in range(n):
        live = sum(int(g.tensor_bytes[t]) for t in range(g.num_tensors)
                   if g.tensor_producer[t] < i and end[t] >= i)
        working = int(g.output_bytes(i).sum()) + int(g.temp_bytes[i])
        peak = max(peak, live + working)
    return int(g.persistent_bytes.sum()) + peak


def _chain(n: int, size: int = 1000) -> CostGraph:
    specs = [OpSpec("x", "Placeholder", output_bytes=[size])]
    specs += [OpSpec(f"op{k}", "Relu", inputs=[("x" if k == 0 else f"op{k - 1}", 0)],
                     output_bytes=[size], compute_us=10.0) for k in range(n)]
    return CostGraph.from_ops(specs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["training", "random"]), size=st.integers(15, 90),
       seed=st.integers(0, 10_000), heuristic=st.sampled_from(PLANNERS),
       ratio=st.floats(0.05, 1.0))
def test_plans_follow_the_rules_and_the_budget(kind, size, seed, heuristic, ratio):
    g = _graph(kind, size, seed)
    budget = ratio * baseline_peak_bytes(g)
    minimum = minimum_budget_bytes(g)
    try:
        plan = simulate(g, budget, heuristic, overhead_limit=3.0, seed=seed)
    except BudgetTooSmallError as e:
        assert budget < minimum == e.minimum_bytes
        return
    except (OutOfMemoryError, ThrashError):
        assert budget >= minimum
        return
    replay = replay_plan(g, plan)  # every op once, in dependency order, inputs resident
    assert [e.index for e in plan.events if e.kind == COMPUTE] == list(range(g.num_ops))
    assert replay.peak_bytes == plan.peak_bytes <= budget
    assert replay.compute_us == pytest.approx(plan.compute_us)
    assert plan.overhead >= 1.0
    assert plan.num_recomputes == sum(e.kind == RECOMPUTE for e in plan.events)


@pytest.mark.parametrize("kind,seed", [("training", 0), ("training", 3), ("random", 1)])
def test_unlimited_budget_is_checkpoint_all(kind, seed):
    g = _graph(kind, 60, seed)
    for heuristic in ("dtr", "belady", "offline"):
        plan = simulate(g, None, heuristic)
        assert plan.num_recomputes == 0 and plan.overhead == 1.0
        assert plan.peak_bytes == _checkpoint_all_peak(g) == baseline_peak_bytes(g)


def test_budget_below_the_minimum_names_it():
    g = _graph("training", 80, seed=2)
    minimum = minimum_budget_bytes(g)
    assert minimum <= baseline_peak_bytes(g)
    for heuristic in PLANNERS:
        with pytest.raises(BudgetTooSmallError, match=f"{minimum:,}") as info:
            simulate(g, minimum - 1, heuristic)
        assert info.value.minimum_bytes == minimum


def test_minimum_budget_is_enough_on_a_chain():
    g = _chain(30)
    minimum = minimum_budget_bytes(g, outputs=[g.num_tensors - 1])
    assert minimum == 2000  # one input and one output resident
    for heuristic in PLANNERS:
        plan = simulate(g, minimum, heuristic, outputs=[g.num_tensors - 1])
        assert plan.peak_bytes == minimum and plan.num_recomputes == 0


def test_recomputation_recovers_evicted_inputs():
    # x -> a -> b -> c -> loss and a backward that reads a and b again: tight budgets force
    # recomputation of evicted activations.
    specs = [OpSpec("x", "Placeholder", output_bytes=[100])]
    prev = "x"
    for k in range(6):
        specs.append(OpSpec(f"f{k}", "Relu", inputs=[(prev, 0)], output_bytes=[100],
                            compute_us=5.0))
        prev = f"f{k}"
    grad = prev
    for k in reversed(range(6)):
        specs.append(OpSpec(f"g{k}", "ReluGrad", inputs=[(grad, 0), (f"f{k}", 0)],
                            output_bytes=[100], compute_us=5.0))
        grad = f"g{k}"
    g = CostGraph.from_ops(specs)
    full = simulate(g, None)
    plan = simulate(g, 400, "dtr", overhead_limit=5.0)
    assert plan.peak_bytes <= 400 < full.peak_bytes
    assert plan.num_recomputes > 0 and plan.overhead > 1.0
    replay_plan(g, plan)


def test_unrecomputable_ops_are_never_recomputed():
    specs = [OpSpec("x", "Placeholder", output_bytes=[100]),
             OpSpec("noise", "RandomUniform", inputs=[("x", 0)], output_bytes=[100],
                    compute_us=1.0, is_random=True)]
    prev = "noise"
    for k in range(5):
        specs.append(OpSpec(f"f{k}", "Mul", inputs=[(prev, 0), ("noise", 0)],
                            output_bytes=[100], compute_us=5.0))
        prev = f"f{k}"
    specs += [OpSpec(f"b{k}", "Add", inputs=[(prev if k == 0 else f"b{k - 1}", 0), (f"f{k}", 0)],
                     output_bytes=[100], compute_us=5.0) for k in range(5)]
    g = CostGraph.from_ops(specs)
    for heuristic in PLANNERS:
        try:
            plan = simulate(g, minimum_budget_bytes(g) + 100, heuristic, overhead_limit=10.0)
        except OutOfMemoryError:
            continue
        recomputed = {g.names[e.index] for e in plan.events if e.kind == RECOMPUTE}
        assert not recomputed & {"x", "noise"}
        replay_plan(g, plan)


def test_thrashing_is_reported():
    g = _graph("training", 120, seed=5)
    budget = _between(g, 0.3)
    overhead = simulate(g, budget, "dtr", overhead_limit=10.0).overhead
    assert overhead > 1.0
    limit = 1.0 + (overhead - 1.0) / 2
    with pytest.raises(ThrashError) as info:
        simulate(g, budget, "dtr", overhead_limit=limit)
    assert info.value.overhead > limit == info.value.limit


def test_plans_are_deterministic():
    g = _graph("training", 120, seed=4)
    budget = _between(g, 0.3)
    for heuristic in ("dtr", "dtr_eq", "random", "offline"):
        first = simulate(g, budget, heuristic, overhead_limit=10.0, seed=7)
        second = simulate(g, budget, heuristic, overhead_limit=10.0, seed=7)
        assert first.events == second.events and first.peak_bytes == second.peak_bytes


def test_offline_is_never_worse_than_dtr():
    for seed in range(4):
        g = _graph("training", 150, seed)
        budget = _between(g, 0.3)
        assert simulate(g, budget, "offline").compute_us <= simulate(g, budget, "dtr").compute_us


def test_custom_order_and_bad_orders():
    g = random_dag(40, seed=2)
    reversed_sources = sorted(range(g.num_ops), key=lambda i: (len(g.predecessors(i)) > 0, -i))
    with pytest.raises(InvalidOrderError):
        simulate(g, None, order=reversed_sources[::-1])
    with pytest.raises(InvalidOrderError):
        simulate(g, None, order=[0, 0] + list(range(2, g.num_ops)))
    plan = simulate(g, None, order=list(range(g.num_ops)))
    assert plan.num_recomputes == 0


def test_plan_check_rejects_broken_plans():
    g = _graph("training", 40, seed=0)
    plan = simulate(g, _between(g, 0.3), "dtr", overhead_limit=10.0)
    frees = [k for k, e in enumerate(plan.events) if e.kind != COMPUTE]
    broken = type(plan)(**{**plan.__dict__, "events": plan.events[:frees[0]] + [
        plan.events[frees[0]]] * 2 + plan.events[frees[0] + 1:]})
    with pytest.raises(PlanError):
        replay_plan(g, broken)


def test_plan_round_trips_through_json():
    g = _graph("training", 40, seed=1)
    plan = simulate(g, _between(g, 0.3), "belady", overhead_limit=10.0)
    again = type(plan).from_json(json.loads(json.dumps(plan.to_json())))
    assert again.events == plan.events and again.overhead == plan.overhead


def test_excerpt_is_read_into_a_cost_graph():
    trace = load_trace(EXCERPT)
    g = trace.graph
    types = {t: g.op_types.count(t) for t in set(g.op_types)}
    assert types["Constant"] == 35 and types["cudnn_convolution"] == 5 and types["add_"] == 4
    constants = [i for i, t in enumerate(g.op_types) if t == "Constant"]
    assert g.is_variable[constants].all() and g.persistent_bytes[constants].min() > 0
    assert not g.output_bytes(constants[0]).any()  # constants hold persistent bytes, not outputs
    view = g.op_types.index("view")
    assert g.output_bytes(view).tolist() == [0]  # an alias has no storage of its own
    reader = g.tensor_consumers(g.op_outputs(view)[0])[0]
    root = g.op_inputs(view)[0]
    assert root in g.op_inputs(reader)  # readers of a view also read its storage
    mutate = g.op_types.index("add_")
    (mutated,) = g.op_outputs(mutate)
    assert g.tensor_bytes[mutated] == g.tensor_bytes[g.op_inputs(mutate)[0]]
    assert trace.outputs and trace.backward_start == g.num_ops  # the excerpt ends mid-forward
    plan = simulate(g, None, outputs=trace.outputs)
    replay_plan(g, plan, trace.outputs)
    # The excerpt is a prefix: what autograd still holds at its end counts as output, so no
    # budget below the checkpoint-all peak fits, and the error says so.
    minimum = minimum_budget_bytes(g, outputs=trace.outputs)
    assert 0.9 * plan.peak_bytes < minimum <= plan.peak_bytes
    with pytest.raises(BudgetTooSmallError, match=f"{minimum:,}"):
        simulate(g, 0.9 * plan.peak_bytes, "dtr", outputs=trace.outputs)


def test_malformed_logs_are_rejected():
    good = EXCERPT.read_text().splitlines()
    with pytest.raises(DtrLogError, match="never defined"):
        read_log(['{"ARGS":["nope"],"INSTRUCTION":"CALL","NAME":"relu","RESULT":["y"],'
                  '"TIME":"1"}', '{"INSTRUCTION":"MEMORY","MEMORY":"4","NAME":"y"}',
                  '{"ALIAS":"-1","INSTRUCTION":"ALIAS","NAME":"y"}'])
    with pytest.raises(DtrLogError, match="not JSON"):
        read_log(good[:5] + ["{oops"])
    with pytest.raises(DtrLogError, match="expected MEMORY"):
        read_log(['{"INSTRUCTION":"CONSTANT","NAME":"c"}', '{"INSTRUCTION":"RELEASE","NAME":"c"}'])


@pytest.mark.skipif(not default_logs_path().exists(), reason="DTR's logs.zip is not present")
def test_resnet_trace_from_the_zip():
    trace = load_traces(names=["ResNet-32 (56)"])["ResNet-32 (56)"]
    g = trace.graph
    assert g.num_ops > 400
    base = baseline_peak_bytes(g, outputs=trace.outputs)
    plan = simulate(g, 0.5 * base, "dtr", outputs=trace.outputs)
    assert plan.overhead <= 1.2
    assert replay_plan(g, plan, trace.outputs).peak_bytes <= 0.5 * base


def test_release_peak_frees_at_release_events_not_at_last_use():
    import json

    def call(arg, res, mem):
        return [json.dumps({"INSTRUCTION": "CALL", "NAME": "relu", "ARGS": [arg],
                            "RESULT": [res], "TIME": "1000"}),
                json.dumps({"INSTRUCTION": "MEMORY", "NAME": res, "MEMORY": str(mem)}),
                json.dumps({"INSTRUCTION": "ALIAS", "NAME": res, "ALIAS": "-1"})]

    lines = [json.dumps({"INSTRUCTION": "CONSTANT", "NAME": "x"}),
             json.dumps({"INSTRUCTION": "MEMORY", "NAME": "x", "MEMORY": "10"})]
    lines += call("x", "a", 100) + call("a", "b", 100)
    late = lines + call("b", "c", 100) + [json.dumps({"INSTRUCTION": "RELEASE", "NAME": n})
                                          for n in ("a", "b")]
    early = (lines + [json.dumps({"INSTRUCTION": "RELEASE", "NAME": "a"})] + call("b", "c", 100)
             + [json.dumps({"INSTRUCTION": "RELEASE", "NAME": "b"})])
    from graphfit.remat.dtr_logs import release_peak_bytes
    kept, freed = read_log(late), read_log(early)
    # a is last read by the op making b; the log drops it only after c (late) or before (early).
    assert release_peak_bytes(kept) == 10 + 300
    assert release_peak_bytes(freed) == 10 + 200
    assert baseline_peak_bytes(kept.graph, outputs=kept.outputs) == 10 + 200
