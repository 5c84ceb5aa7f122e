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
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE
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


def _dead_parent_graph():
    """x -> A -> a -> B -> b; G ages b; C needs room; E reads a for the last time while b is
    evicted; D reads b. A costs 100, B 1: once b is evicted, recomputing it needs a."""
    specs = [OpSpec("x", "Placeholder", output_bytes=[10]),
             OpSpec("A", "Conv", inputs=[("x", 0)], output_bytes=[100], compute_us=100.0),
             OpSpec("B", "Relu", inputs=[("A", 0)], output_bytes=[100], compute_us=1.0),
             OpSpec("G", "Shape", inputs=[("x", 0)], output_bytes=[0], compute_us=10.0),
             OpSpec("C", "Conv", inputs=[("x", 0)], output_bytes=[100], compute_us=5.0),
             OpSpec("E", "Add", inputs=[("A", 0), ("C", 0)], output_bytes=[50], compute_us=5.0),
             OpSpec("D", "Mul", inputs=[("B", 0), ("E", 0)], output_bytes=[10], compute_us=5.0)]
    g = CostGraph.from_ops(specs)
    order = [g.index[n] for n in ("x", "A", "B", "G", "C", "E", "D")]
    return g, order, [int(g.op_outputs(g.index["D"])[0])]


def test_a_dead_tensor_is_kept_while_an_evicted_descendant_needs_it():
    g, order, outputs = _dead_parent_graph()
    plan = simulate(g, 300, "dtr", order=order, outputs=outputs)
    names = [(e.kind, g.names[e.index] if e.kind != FREE else g.tensor_name(e.index))
             for e in plan.events]
    # C evicts b (cheap, stale); a dies at E but b still needs it, so a stays and only B
    # is recomputed (1 us, not A's 100).
    assert [n for k, n in names if k == RECOMPUTE] == ["B"]
    assert plan.compute_us == pytest.approx(g.compute_us.sum() + 1.0)
    a = g.tensor_name(int(g.op_outputs(g.index["A"])[0]))
    # Once b is back, a serves nothing: it is freed after D, not held to the end.
    assert names.index((FREE, a)) > names.index((RECOMPUTE, "B"))
    replay_plan(g, plan, outputs)


def test_a_kept_dead_tensor_is_still_evictable():
    g, order, outputs = _dead_parent_graph()
    # 260 bytes: after b is recomputed, D's output only fits if the kept a goes.
    plan = simulate(g, 260, "dtr", order=order, outputs=outputs)
    assert plan.peak_bytes <= 260
    assert [g.names[e.index] for e in plan.events if e.kind == RECOMPUTE] == ["B"]
    replay_plan(g, plan, outputs)


def _chain_state(resident, live, clock=100.0, last_access=None):
    """A SimulationState for x -> A -> a -> B -> b -> C -> c -> D -> d, plus Y reading a
    (-> y): tensor t is the output of op t, ops 0..5 = X, A, B, C, D, Y, all run; cost of op
    k is 10**k (so sums show which ops were counted), 100 bytes each."""
    from types import SimpleNamespace
    inputs = [[], [0], [1], [2], [3], [1]]
    consumers = [[1], [2, 5], [3], [4], [], []]
    cost = [10.0 ** k for k in range(6)]
    state = SimpleNamespace(
        clock=clock, position=6, resident=list(resident), computed=[True] * 6,
        producer=list(range(6)), op_inputs=inputs, op_outputs=[[k] for k in range(6)],
        consumers=consumers, op_cost_us=cost, tensor_cost_us=np.array(cost),
        size_bytes=np.full(6, 100.0), next_use=np.full(6, 99),
        last_access=np.array(last_access if last_access is not None else [50.0] * 6))
    state.is_live = lambda t: live[t]
    return state


def test_dtr_score_counts_dead_evicted_descendants_and_ancestors():
    from graphfit.remat.heuristics import make_heuristic
    # a (1) resident; b (2) evicted and dead, c (3) evicted and live, x (0) evicted.
    state = _chain_state(resident=[False, True, False, False, True, True],
                         live=[False, True, False, True, True, True])
    h = make_heuristic("dtr", 6)
    # e*(a) = evicted ancestor X, evicted descendants B and C (dead b included); D's output
    # is resident, so the walk stops there.
    assert h.refine(state, 1, np.inf) == pytest.approx((10 + 1 + 100 + 1000) / (100 * 50))
    # MSPS counts the evicted ancestors only, and ignores staleness.
    assert make_heuristic("msps", 6).refine(state, 1, np.inf) == pytest.approx((10 + 1) / 100)
    # dtr_local: the tensor's own cost only.
    local = make_heuristic("dtr_local", 6).bounds(state, np.array([1]))
    assert local[0] == pytest.approx(10 / (100 * 50))


def test_a_tensor_touched_now_is_evicted_last():
    from graphfit.remat.heuristics import make_heuristic
    # a (1) was read at the current clock; y (5) is stale and 1000x dearer to recompute.
    state = _chain_state(resident=[True] * 6, live=[True] * 6,
                         last_access=[0, 100.0, 0, 0, 0, 10.0])
    cand = np.array([1, 5])
    for name in ("dtr", "dtr_eq", "dtr_local", "lru"):
        h = make_heuristic(name, 6)
        bounds = h.bounds(state, cand)
        assert bounds[0] > bounds[1], name
        if h.refine is not None:
            assert h.refine(state, 1, np.inf) == np.inf and np.isfinite(h.refine(state, 5, np.inf))
    # When every candidate was touched at the current clock (free ops), one still goes.
    g = CostGraph.from_ops([
        OpSpec("x", "Placeholder", output_bytes=[10]),
        OpSpec("A", "View", inputs=[("x", 0)], output_bytes=[100]),
        OpSpec("B", "View", inputs=[("x", 0)], output_bytes=[100]),
        OpSpec("D", "Conv", inputs=[("x", 0)], output_bytes=[100], compute_us=1.0),
        OpSpec("E", "Add", inputs=[("A", 0), ("B", 0)], output_bytes=[0], compute_us=1.0)])
    order = [g.index[n] for n in "xABDE"]
    for name in ("dtr", "dtr_eq", "dtr_local", "lru"):
        plan = simulate(g, 300, name, order=order)
        assert plan.peak_bytes <= 300 and plan.num_recomputes == 1


def test_dtr_eq_classes_are_merged_on_eviction_and_renewed_on_rematerialization():
    from graphfit.remat.heuristics import make_heuristic
    state = _chain_state(resident=[True] * 6, live=[True] * 6)
    h = make_heuristic("dtr_eq", 6)

    def evict(t):
        state.resident[t] = False
        h.on_evict(state, t)

    def remat(t):
        state.resident[t] = True
        h.on_rematerialize(state, t)

    evict(2)
    evict(3)          # b, c: one class (B + C)
    evict(1)          # a joins it: A + B + C
    # x's only evicted neighbour is a: its class holds A, B and C.
    assert h.refine(state, 0, np.inf) == pytest.approx((1 + 10 + 100 + 1000) / (100 * 50))
    remat(1)
    remat(2)          # the class keeps C only (classes never split)
    # y's producer reads a (resident now): no evicted neighbour.
    assert h.refine(state, 5, np.inf) == pytest.approx(1e5 / (100 * 50))
    evict(1)          # a again: a new class (its neighbours x, b, y are resident)
    assert h.refine(state, 5, np.inf) == pytest.approx((1e5 + 10) / (100 * 50))
    # d's producer reads c, whose class still holds C alone.
    assert h.refine(state, 4, np.inf) == pytest.approx((1e4 + 1000) / (100 * 50))


def test_a_kept_dead_tensor_whose_producer_lost_its_input_is_banished_not_lost():
    # Found by the property test: a dead tensor kept for an evicted descendant, whose producer
    # became unrecomputable (its random input died), was freed like a recomputable one; a
    # later recomputation of a descendant then needed it ("can no longer be recomputed").
    g = random_dag(18, 505)
    budget = 0.625 * baseline_peak_bytes(g)
    for heuristic in ("dtr", "dtr_eq", "dtr_local", "lru"):
        try:
            plan = simulate(g, budget, heuristic, overhead_limit=3.0, seed=505)
        except OutOfMemoryError:
            continue
        replay_plan(g, plan)


def _update_between_reads() -> CostGraph:
    """A weight read by ``fwd``, whose output the last op reads again after the weight's
    update ``update`` (SGD: a stateful op on the handle, nothing returned); ``fwd`` is
    cheap to recompute, the ops between need room. The input ``x`` is a step output (kept),
    so ``fwd`` stays recomputable."""
    size = 1000
    specs = [OpSpec("x", "Placeholder", output_bytes=[size]),
             OpSpec("w", "VarHandleOp", output_bytes=[0], persistent_bytes=size,
                    is_variable=True),
             OpSpec("w_read", "ReadVariableOp", inputs=[("w", 0)], output_bytes=[0],
                    reads_resource=True),
             OpSpec("fwd", "MatMul", inputs=[("x", 0), ("w_read", 0)], output_bytes=[size],
                    compute_us=1.0)]
    previous = "fwd"
    for k in range(4):
        specs.append(OpSpec(f"mid{k}", "Conv2D", inputs=[(previous, 0)], output_bytes=[size],
                            temp_bytes=2 * size, compute_us=100.0))
        previous = f"mid{k}"
    specs += [OpSpec("update", "AssignSubVariableOp", inputs=[("w", 0), (previous, 0)],
                     is_stateful=True),
              OpSpec("late", "AddV2", inputs=[("fwd", 0), (previous, 0)], output_bytes=[size],
                     compute_us=1.0)]
    return CostGraph.from_ops(specs)


@pytest.mark.parametrize("heuristic", ["dtr", "offline"])
def test_a_reader_of_a_weights_old_value_is_not_recomputed_after_its_update(heuristic):
    """TF would copy the weight at the update for such a recomputation (simulator docstring):
    the reader's output is recomputed before the update, or kept."""
    g = _update_between_reads()
    budget = minimum_budget_bytes(g, outputs=[0])
    plan = simulate(g, budget, heuristic, outputs=[0])
    ran = [(kind, g.names[index]) for kind, index in plan.events if kind != FREE]
    update = ran.index((COMPUTE, "update"))
    assert (RECOMPUTE, "fwd") not in ran[update:], ran
    assert plan.peak_bytes <= budget
    replay_plan(g, plan, outputs=[0])


def _chain_with_buffer_reuse(n: int = 8, size: int = 100):
    """A chain of ``n`` activations and its backward pass, in which TF writes each gradient
    into the buffer of the gradient it reads (``MemoryModel.reuses``)."""
    from graphfit.remat.tf_memory import MemoryModel

    specs = [OpSpec("x0", "X", output_bytes=[size], compute_us=1.0)]
    specs += [OpSpec(f"x{i}", "X", inputs=[(f"x{i - 1}", 0)], output_bytes=[size],
                     compute_us=1.0) for i in range(1, n)]
    specs.append(OpSpec(f"g{n}", "G", inputs=[(f"x{n - 1}", 0)], output_bytes=[size],
                        compute_us=1.0))
    specs += [OpSpec(f"g{i}", "G", inputs=[(f"x{i}", 0), (f"g{i + 1}", 0)],
                     output_bytes=[size], compute_us=1.0) for i in range(n - 1, -1, -1)]
    graph = CostGraph.from_ops(specs)
    reuses = {graph.index[f"g{i}"]: [int(graph.output_offset[graph.index[f"g{i + 1}"]])]
              for i in range(n)}
    return MemoryModel(graph, graph, [[i] for i in range(graph.num_ops)], reuses)


def test_a_plan_fills_the_room_tf_buffer_reuse_leaves():
    from graphfit.remat import pipeline
    from graphfit.remat.tf_memory import tf_peak_bytes

    model, budget = _chain_with_buffer_reuse(), 700
    first = pipeline.plan_for_budget(model.plan_graph, budget, "dtr", 3.0, None)
    # The planner's accounting reaches the budget, TF's (gradients in reused buffers) not.
    assert first.peak_bytes == budget
    assert tf_peak_bytes(model, first) < budget * (1 - pipeline.FILL_ROOM)
    filled = pipeline._plan_filling_budget(model, budget, "dtr", 3.0, None)
    assert filled.overhead < first.overhead
    assert filled.stats["planner_budget_bytes"] > budget == filled.budget_bytes
    assert tf_peak_bytes(model, filled) <= budget
    # Wherever it is planned from, a filled plan's TF peak stays within the budget.
    for budget in range(400, 1000, 50):
        assert tf_peak_bytes(model, pipeline._plan_filling_budget(
            model, budget, "dtr", 3.0, None)) <= budget


def test_the_floor_names_the_op_and_what_it_is_made_of():
    """A budget below the minimum is refused with where the minimum is reached and its parts:
    the weights (persistent), a tensor no plan can recompute (a random op's output, alive
    until its last reader) and the op's own working set."""
    from graphfit.remat.simulator import floor

    MB = 1 << 20
    graph = CostGraph.from_ops([
        OpSpec("x", "Placeholder", output_bytes=[MB]),
        OpSpec("w", "VarHandleOp", output_bytes=[0], persistent_bytes=3 * MB, is_variable=True),
        OpSpec("noise", "RandomUniform", inputs=[("x", 0)], output_bytes=[2 * MB],
               is_random=True),
        OpSpec("big", "MatMul", inputs=[("x", 0), ("w", 0)], output_bytes=[4 * MB],
               temp_bytes=MB),
        OpSpec("loss", "Mean", inputs=[("big", 0), ("noise", 0)], output_bytes=[4])])
    found = floor(graph)
    assert found.op == "big" and found.persistent_bytes == 3 * MB
    assert found.unevictable_bytes == 2 * MB + MB       # the noise and the feed, alive at big
    assert found.working_bytes == 4 * MB + MB           # big's output and its scratch
    assert found.total_bytes == minimum_budget_bytes(graph)
    with pytest.raises(BudgetTooSmallError, match=r"at op 'big': 3,145,728 bytes of weights"):
        simulate(graph, found.total_bytes - 1, "dtr")
