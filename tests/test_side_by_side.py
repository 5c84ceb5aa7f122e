"""Running the step as fast as the user's: plan events that float beside the chain only where
the plan's peak allows it, the rewrite's joins, the configuration an untouched step runs with,
and side-by-side timing."""

from __future__ import annotations

import collections
import functools
import random
import time

import numpy as np
import pytest

from graphfit import models
from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary
from graphfit.profiler.session import EXACT_GRAPH, session_config, step_config, user_config
from graphfit.remat.plan import COMPUTE, FREE
from graphfit.remat.schedule import plan_from_schedule
from graphfit.remat.side_by_side import (Unpinned, expanded_joins, expanded_positions,
                                         unpinned_events)
from graphfit.remat.validate import replay_plan


def _graph(big_c: int, stateful_b: bool = False) -> CostGraph:
    """a and b independent (10 bytes each); c (``big_c`` bytes) reads a; d reads b and c."""
    return CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[10]),
        OpSpec("b", "X", output_bytes=[10], is_stateful=stateful_b),
        OpSpec("c", "X", inputs=[("a", 0)], output_bytes=[big_c]),
        OpSpec("d", "X", inputs=[("b", 0), ("c", 0)], output_bytes=[1])])


def _positions(plan, names, graph):
    return {p for p, e in enumerate(plan.events)
            if e.kind != FREE and graph.names[e.index] in names}


def test_events_float_only_while_the_bound_stays_within_the_limit():
    graph = _graph(big_c=100)
    plan = plan_from_schedule(graph, [0, 1, 2, 3], None, "hand")
    assert replay_plan(graph, plan).peak_bytes == 120        # c runs with a and b alive
    # b may run before a (20 bytes); c beside b once a exists (a, b, c: 120, the peak itself);
    # d may start once c exists, while c's 100 bytes are ahead of b: 121, over the peak.
    assert unpinned_events(graph, plan).floating == _positions(plan, {"b", "c"}, graph)
    # Under 110, c stays pinned; d then waits only for c, the event before it: nothing ahead.
    assert unpinned_events(graph, plan, limit_bytes=110).floating == _positions(
        plan, {"b", "d"}, graph)
    # A stateful op (a variable's update) keeps its place: run early, it would write a
    # variable that a tensor still to be read holds, and TF would copy the variable; unless
    # edges order it against every other access of its variable (``movable_stateful``).
    stateful = _graph(big_c=100, stateful_b=True)
    assert unpinned_events(stateful, plan).floating == _positions(plan, {"c"}, graph)
    assert unpinned_events(stateful, plan, movable_stateful=frozenset({"X"})).floating == \
        _positions(plan, {"b", "c"}, graph)


def _late_join_graph(y_reads_a: bool) -> CostGraph:
    """x reads a; p1 and p2 (stateful, large temporary bytes) read only the source; y reads
    x, p1, p2 and, if ``y_reads_a``, a too."""
    return CostGraph.from_ops([
        OpSpec("s", "X", output_bytes=[1]),
        OpSpec("a", "X", inputs=[("s", 0)], output_bytes=[10]),
        OpSpec("x", "X", inputs=[("a", 0)], output_bytes=[1]),
        OpSpec("p1", "X", inputs=[("s", 0)], output_bytes=[1], temp_bytes=100, is_stateful=True),
        OpSpec("p2", "X", inputs=[("s", 0)], output_bytes=[1], temp_bytes=100, is_stateful=True),
        OpSpec("y", "X", inputs=[("x", 0), ("p1", 0), ("p2", 0)] + [("a", 0)] * y_reads_a,
               output_bytes=[1])])


def test_a_floating_event_is_joined_later_where_what_it_holds_fits():
    """a and x float; p1 and p2 stay pinned. Joined by p2 instead of p1, x may still be
    running beside p1 and p2, the plan's peak: that fits only if x holds nothing the plan has
    freed by then, i.e. when y still reads a (a itself then holds nothing either)."""
    for y_reads_a, join in ((False, "p1"), (True, "p2")):
        graph = _late_join_graph(y_reads_a)
        plan = plan_from_schedule(graph, list(range(graph.num_ops)), None, "hand")
        unpinned = unpinned_events(graph, plan)
        assert unpinned.floating == _positions(plan, {"a", "x", "y"}, graph)
        (joined,) = _positions(plan, {join}, graph)
        assert unpinned.joins == dict.fromkeys(_positions(plan, {"a", "x"}, graph), joined)
        assert unpinned.late_joins == 2 * y_reads_a


def _random_plan(rng: np.random.Generator, num_ops: int = 40):
    """A random graph (0-3 inputs from the 8 ops before, now and then a control input, random
    output and temporary bytes) and a plan of its topological order with 6 recomputations
    (of ops with inputs: only those may run again)."""
    specs = []
    for i in range(num_ops):
        sources = sorted(set(rng.integers(max(0, i - 8), i, size=int(rng.integers(1, 4)))
                             .tolist())) if i else []
        control = ([f"op{int(rng.integers(0, i))}"] if i and rng.random() < 0.15 else [])
        specs.append(OpSpec(f"op{i}", "X", inputs=[(f"op{j}", 0) for j in sources],
                            control_inputs=[c for c in control if int(c[2:]) not in sources],
                            output_bytes=[int(rng.integers(1, 100))],
                            temp_bytes=int(rng.integers(0, 30))))
    graph = CostGraph.from_ops(specs)
    schedule = list(range(num_ops))
    with_inputs = [i for i in range(num_ops) if len(graph.op_inputs(i))]
    for _ in range(6):
        op = int(rng.choice(with_inputs))
        schedule.insert(int(rng.integers(schedule.index(op) + 1, len(schedule) + 1)), op)
    return graph, plan_from_schedule(graph, schedule, None, "hand")


def _executed_peak(graph: CostGraph, plan, unpinned: Unpinned, rng: random.Random,
                   workers: int) -> int:
    """The peak of one random execution of ``plan`` as the rewrite orders it: a pinned event
    starts once every earlier pinned event and every floating one joined to it or to an
    earlier pinned event finished, a floating one once its inputs' events did;
    ``workers`` events run at once at most, in random order and for random durations. A
    version of a tensor is freed when it and every event reading it have finished."""
    events = [(p, e.index) for p, e in enumerate(plan.events) if e.kind != FREE]
    newest, first, deps, reads = {}, {}, [], []
    for k, (_, op) in enumerate(events):
        data = {newest[p] for p in graph.tensor_producer[graph.op_inputs(op)].tolist()}
        reads.append(data)
        deps.append(data | {first[p] for p in graph.control_inputs(op).tolist()})
        newest[op] = k
        first.setdefault(op, k)
    readers = collections.defaultdict(set)
    for k, data in enumerate(reads):
        for version in data:
            readers[version].add(k)
    ordinal = {p: k for k, (p, _) in enumerate(events)}
    floats = {ordinal[p] for p in unpinned.floating}
    join = {ordinal[p]: ordinal[j] for p, j in unpinned.joins.items()}
    waits = [deps[k] if k in floats else
             {j for j in range(k) if j not in floats or join.get(j, len(events)) <= k}
             for k in range(len(events))]
    finished, running, live, now, peak = set(), {}, {}, 0.0, 0
    while len(finished) < len(events):
        ready = [k for k in range(len(events)) if k not in finished and k not in running
                 and waits[k] <= finished]
        rng.shuffle(ready)
        for k in ready[:workers - len(running)]:
            running[k] = now + rng.uniform(0.1, 1.0)
            op = events[k][1]
            live[("out", k)] = int(graph.output_bytes(op).sum())
            live[("temp", k)] = int(graph.temp_bytes[op])
            peak = max(peak, sum(live.values()))
        k = min(running, key=running.get)
        now = running.pop(k)
        finished.add(k)
        del live[("temp", k)]
        for version in reads[k] | {k}:
            if version in finished and readers[version] <= finished:
                live.pop(("out", version), None)
    return peak


def test_no_execution_the_joins_allow_exceeds_the_floating_bound():
    """Random graphs and plans, random executions: floating events, joined late or not, never
    take the step above the plan's replayed peak (or a higher limit given); letting every
    event float, never joined, does."""
    rng, order = np.random.default_rng(7), random.Random(7)
    exceeded_when_all_float = late_joins = 0
    for _ in range(30):
        graph, plan = _random_plan(rng)
        peak = replay_plan(graph, plan).peak_bytes
        assert _executed_peak(graph, plan, Unpinned(set(), {}), order, workers=1) == peak
        for limit in (peak, int(peak * 1.1)):
            unpinned = unpinned_events(graph, plan, limit)
            assert unpinned.floating and set(unpinned.joins) <= unpinned.floating
            late_joins += unpinned.late_joins
            for workers in (2, 4, 64):
                assert _executed_peak(graph, plan, unpinned, order, workers) <= limit
        everything = {p for p, e in enumerate(plan.events) if e.kind != FREE}
        exceeded_when_all_float += _executed_peak(graph, plan, Unpinned(everything, {}),
                                                  order, 64) > peak
    assert exceeded_when_all_float > 0 and late_joins > 0


def test_expanded_positions_cover_every_op_of_a_chain():
    graph = _graph(big_c=100)
    plan = plan_from_schedule(graph, [0, 1, 2, 3], None, "hand")
    members = [[0], [1, 2], [3, 4], [5]]      # b and c stand for two ops each
    chosen = _positions(plan, {"b", "c"}, graph)
    expanded = expanded_positions(members, plan, chosen)
    offsets, offset = [], 0
    for kind, index in plan.events:
        offsets.append(offset)
        offset += 1 if kind == FREE else len(members[index])
    assert expanded == {offsets[p] + i: offsets[p] for p in chosen for i in range(2)}
    # b joined by d: both of b's ops map to d's first op.
    (b,), (d,) = (_positions(plan, {name}, graph) for name in "bd")
    assert expanded_joins(members, plan, {b: d}) == {offsets[b] + i: offsets[d]
                                                    for i in range(2)}


def test_rewrite_leaves_a_floating_event_unpinned_and_joins_it():
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.remat.rewrite import rewrite

    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    relu = graph.index["layer_0/Relu"]
    plan = plan_from_schedule(graph, list(range(graph.num_ops)) + [relu], None, "hand")
    op = "gradients/logits/MatMul_grad/MatMul_1"
    position = next(p for p, e in enumerate(plan.events)
                    if e == (COMPUTE, graph.index[op]))
    following = next(graph.names[e.index] for e in plan.events[position + 1:]
                     if e.kind != FREE)
    strict = rewrite(item, graph, plan)
    floating = rewrite(item, graph, plan, floating={position: position})
    assert strict.graph.get_operation_by_name(op).control_inputs
    assert not floating.graph.get_operation_by_name(op).control_inputs
    after = floating.graph.get_operation_by_name(following)
    assert op in ({c.name for c in after.control_inputs} | {t.op.name for t in after.inputs})
    compare_steps(item, floating).check()
    # A chain floats whole, and none of its ops starts before all of the chain's inputs
    # exist: the input gradient waits for the activation its chained ReluGrad reads.
    grad, relu_grad = (next(p for p, e in enumerate(plan.events) if e == (COMPUTE, graph.index[n]))
                       for n in (op.replace("MatMul_1", "MatMul"),
                                 "gradients/layer_1/Relu_grad/ReluGrad"))
    chained = rewrite(item, graph, plan, floating={grad: grad, relu_grad: grad})
    first = chained.graph.get_operation_by_name(graph.names[plan.events[grad].index])
    assert any(c.name.startswith("layer_1/Relu") for c in first.control_inputs)  # or its gate
    compare_steps(item, chained).check()


def test_rewrite_joins_a_floating_event_to_the_pinned_node_it_is_given():
    """A floating event joined later (``remat.side_by_side``'s late joins): the pinned node it
    is joined to waits for it, those before do not, and the step computes the same."""
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.remat.rewrite import rewrite

    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    plan = plan_from_schedule(graph, list(range(graph.num_ops)), None, "hand")
    op = "gradients/logits/MatMul_grad/MatMul_1"          # the last layer's weight gradient
    position = next(p for p, e in enumerate(plan.events) if e == (COMPUTE, graph.index[op]))
    later = [p for p, e in enumerate(plan.events[position + 1:], position + 1)
             if e.kind != FREE]
    for join in later[:4]:
        joined = rewrite(item, graph, plan, floating={position: position},
                         joins={position: join})
        waiters = [o.name for o in joined.graph.get_operations()
                   if op in {c.name for c in o.control_inputs}]
        assert waiters == [graph.names[plan.events[join].index]]
    compare_steps(item, joined).check()


def test_a_floating_recomputed_chain_holds_its_clones_until_all_its_inputs_exist():
    """The hold edges reach the clones in the rewritten graph, not copies of them: the
    recomputed ``Relu``, chained with the recomputed ``MatMul`` that reads it, waits for the
    ``MatMul``'s weight. (Added to the clones after they were copied into the graph, the edges
    were lost, and on a Keras DenseNet-style step a batch norm's recomputed ``Mul`` ran in the
    forward pass and held 16 MiB over the plan, 2026-12-07.)"""
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.remat.plan import RECOMPUTE
    from graphfit.remat.rewrite import clone_name, rewrite

    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    relu, matmul = graph.index["layer_0/Relu"], graph.index["layer_1/MatMul"]
    plan = plan_from_schedule(graph, list(range(graph.num_ops)) + [relu, matmul], None, "hand")
    first, second = (p for p, e in enumerate(plan.events) if e.kind == RECOMPUTE)
    chained = rewrite(item, graph, plan, floating={first: first, second: first})
    clone = chained.graph.get_operation_by_name(clone_name("layer_0/Relu", 1))
    assert "layer_1/MatMul/ReadVariableOp" in {c.name for c in clone.control_inputs}
    compare_steps(item, chained).check()


def test_the_optimizers_arithmetic_floats_and_is_joined():
    """With ``float_updates`` what only feeds variable updates (here the weight gradients,
    read only by the optimizer) runs as soon as its inputs exist, and the next pinned event
    still waits for it; variable reads and updates keep their pins."""
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.remat.rewrite import rewrite, update_math

    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    relu = graph.index["layer_0/Relu"]
    plan = plan_from_schedule(graph, list(range(graph.num_ops)) + [relu], None, "hand")
    math = update_math(item.graph.as_graph_def())
    op = "gradients/logits/MatMul_grad/MatMul_1"
    assert op in math and "gradients/logits/MatMul_grad/MatMul" not in math
    assert not {o.name for o in item.graph.get_operations() if o.op_def.is_stateful} & math
    strict = rewrite(item, graph, plan)
    floating = rewrite(item, graph, plan, float_updates=True)
    assert strict.graph.get_operation_by_name(op).control_inputs
    assert not floating.graph.get_operation_by_name(op).control_inputs
    assert floating.config["remat"]["updates_floating"] >= 2          # both layers' weights
    position = next(p for p, e in enumerate(plan.events) if e == (COMPUTE, graph.index[op]))
    following = next(graph.names[e.index] for e in plan.events[position + 1:]
                     if e.kind != FREE and graph.names[e.index] not in math)
    after = floating.graph.get_operation_by_name(following)
    assert op in ({c.name for c in after.control_inputs} | {t.op.name for t in after.inputs})
    compare_steps(item, floating).check()


def test_an_untouched_step_runs_as_the_user_runs_it():
    from graphfit.pipeline.meta_optimizer import optimize

    item = models.build("mlp", preset="tiny")
    result = optimize(item, progress=None)
    assert result.item is item
    assert step_config(result.item) == user_config()
    rewritten = item.with_graph(item.graph)
    rewritten.config = {**item.config, EXACT_GRAPH: True}
    assert step_config(rewritten) == session_config()


def test_paired_step_times_alternate_the_order_and_summarise_ratios():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("user", "ours")}
    times = paired_step_times(steps, rounds=4, warmup=1)
    assert calls == ["user", "ours", "user", "ours", "ours", "user", "user", "ours",
                     "ours", "user"]
    assert {name: len(t) for name, t in times.items()} == {"user": 4, "ours": 4}
    summary = ratio_summary({"user": [1.0, 2.0, 1.0, 2.0], "ours": [1.1, 2.4, 1.0, 2.2]},
                            "user")
    assert summary["user"]["median"] == 1.0
    assert summary["ours"]["median"] == pytest.approx(1.1)
    assert summary["ours"]["q1"] <= summary["ours"]["median"] <= summary["ours"]["q3"]


def test_paired_step_times_add_rounds_until_the_steps_took_min_seconds():
    steps = {name: functools.partial(time.sleep, 0.01) for name in ("user", "ours")}
    times = paired_step_times(steps, rounds=1, warmup=0, min_seconds=0.1)
    assert len(times["user"]) == len(times["ours"]) >= 5   # 0.02 s a round
    assert sum(times["user"]) + sum(times["ours"]) >= 0.1
