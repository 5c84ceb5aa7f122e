"""Running the step as fast as the user's: two plan events side by side only where the plan's
peak allows it, the rewrite's window of pins, the backward pass's start, the configuration an
untouched step runs with, and side-by-side timing."""

from __future__ import annotations

import functools
import random
import time

import pytest

from graphfit import models
from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.paired_timing import paired_step_times, ratio_summary
from graphfit.profiler.session import session_config, step_config, user_config
from graphfit.remat.plan import COMPUTE, FREE
from graphfit.remat.rewrite import _window_anchors
from graphfit.remat.schedule import plan_from_schedule
from graphfit.remat.side_by_side import (expanded_positions, side_by_side_events,
                                         window_peak_bytes)
from graphfit.remat.validate import replay_plan


def _graph(big_c: int) -> CostGraph:
    """a and b independent (10 bytes each); c (``big_c`` bytes) reads a; d reads b and c."""
    return CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[10]),
        OpSpec("b", "X", output_bytes=[10]),
        OpSpec("c", "X", inputs=[("a", 0)], output_bytes=[big_c]),
        OpSpec("d", "X", inputs=[("b", 0), ("c", 0)], output_bytes=[1])])


def _positions(plan, names, graph):
    return {p for p, e in enumerate(plan.events)
            if e.kind != FREE and graph.names[e.index] in names}


def test_side_by_side_only_below_the_plans_peak_and_never_after_a_data_edge():
    graph = _graph(big_c=100)
    plan = plan_from_schedule(graph, [0, 1, 2, 3], None, "hand")
    peak = replay_plan(graph, plan).peak_bytes
    beside = side_by_side_events(graph, plan)
    # b beside a: 20 bytes, far below the peak (c's 100 with a and b alive); c beside b: a, b
    # and c (120) is the peak itself, so allowed; d reads c, its predecessor: never.
    assert beside == _positions(plan, {"b", "c"}, graph)
    assert window_peak_bytes(graph, plan, beside) <= peak
    # A tighter limit keeps c strict (beside b: a, b and c, 120 bytes).
    tight = side_by_side_events(graph, plan, limit_bytes=110)
    assert tight == _positions(plan, {"b"}, graph)


def test_expanded_positions_point_at_each_chains_first_op():
    graph = _graph(big_c=100)
    plan = plan_from_schedule(graph, [0, 1, 2, 3], None, "hand")
    members = [[0], [1, 2], [3, 4], [5]]      # b and c stand for two ops each
    chosen = _positions(plan, {"b", "c"}, graph)
    expanded = expanded_positions(members, plan, chosen)
    offsets, offset = [], 0
    for kind, index in plan.events:
        offsets.append(offset)
        offset += 1 if kind == FREE else len(members[index])
    assert expanded == {offsets[p] for p in chosen}


def test_window_anchors_keep_every_event_two_back_finished():
    """Whatever events run beside their predecessor, an event starts only after every event
    up to the one before it (beside: two before) has finished, through the anchors' edges."""
    rng = random.Random(3)
    for _ in range(50):
        flags = [rng.random() < 0.6 for _ in range(30)]
        run, waits = [], []
        for k, beside in enumerate(flags):
            waits.append([int(a) for a in _window_anchors(run, beside)])
            run.append((str(k), beside))
        finished_before = []                   # transitive predecessors of each event
        for k in range(len(flags)):
            done = set()
            for anchor in waits[k]:
                done |= {anchor} | finished_before[anchor]
            finished_before.append(done)
            back = 2 if flags[k] else 1
            assert set(range(k - back + 1)) <= done, (k, flags[:k + 1])
            assert len(waits[k]) <= 2


def test_rewrite_pins_side_by_side_events_two_back():
    from graphfit.profiler.tf_import import cost_graph_from_graph
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.remat.rewrite import rewrite

    item = models.build("mlp", preset="tiny")
    graph = cost_graph_from_graph(item.graph, [item.train_op, item.loss])
    relu = graph.index["layer_0/Relu"]
    plan = plan_from_schedule(graph, list(range(graph.num_ops)) + [relu], None, "hand")
    weight_grad = graph.index["gradients/logits/MatMul_grad/MatMul_1"]
    position = next(p for p, e in enumerate(plan.events)
                    if e == (COMPUTE, weight_grad))
    previous = next(graph.names[e.index] for e in reversed(plan.events[:position])
                    if e.kind != FREE)
    strict = rewrite(item, graph, plan)
    window = rewrite(item, graph, plan, beside={position})
    op = "gradients/logits/MatMul_grad/MatMul_1"
    waits = {c.name for c in window.graph.get_operation_by_name(op).control_inputs}
    reads = {t.op.name for t in window.graph.get_operation_by_name(op).inputs}
    assert previous in ({c.name for c in strict.graph.get_operation_by_name(op).control_inputs}
                        | reads)
    assert previous not in waits | reads
    compare_steps(item, window).check()


def test_an_untouched_step_runs_as_the_user_runs_it():
    from graphfit.baechi.pipeline import optimize

    item = models.build("mlp", preset="tiny")
    result = optimize(item, progress=None)
    assert result.item is item
    assert step_config(result.item) == user_config()
    rewritten = item.with_graph(item.graph)
    rewritten.config = {**item.config, "remat": {"clones": 0}}
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
