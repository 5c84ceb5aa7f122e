"""The planner's backward-pass order (``remat.backward_order``): ready ops that add the fewest
bytes first, and a memory model renumbered in it that plans and lowers like any other."""

from __future__ import annotations

from graphfit import models
from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.remat import simulator
from graphfit.remat.backward_order import memory_greedy_order, reorder_backward


def _two_branches() -> CostGraph:
    """a feeds two branches, each a large tensor read by a small one; d joins them. The ids
    interleave the branches, as a traced order may: both large tensors are alive at once."""
    return CostGraph.from_ops([
        OpSpec("a", "X", output_bytes=[10]),
        OpSpec("b1", "X", inputs=[("a", 0)], output_bytes=[100]),
        OpSpec("c1", "X", inputs=[("a", 0)], output_bytes=[100]),
        OpSpec("b2", "X", inputs=[("b1", 0)], output_bytes=[1]),
        OpSpec("c2", "X", inputs=[("c1", 0)], output_bytes=[1]),
        OpSpec("d", "X", inputs=[("b2", 0), ("c2", 0)], output_bytes=[1])])


def test_the_greedy_order_finishes_a_branch_before_it_starts_the_next():
    graph = _two_branches()
    order = memory_greedy_order(graph, start=1)
    assert [graph.names[i] for i in order] == ["a", "b1", "b2", "c1", "c2", "d"]
    peak = {name: simulator.simulate(graph, None, order=o).peak_bytes
            for name, o in (("ids", None), ("greedy", order))}
    assert peak["greedy"] < peak["ids"]
    # Ops before ``start`` keep their order.
    assert memory_greedy_order(graph, start=3)[:3] == [0, 1, 2]


def test_a_reordered_model_plans_and_lowers_to_the_same_step():
    from graphfit.profiler.step_compare import compare_steps
    from graphfit.remat.measure import measure_step
    from graphfit.remat.pipeline import rematerialize
    from graphfit.remat.tf_memory import step_item, tf_memory_model

    item = step_item(models.build("mlp", preset="default", batch_size=2048, depth=12,
                                  width=256))
    model = tf_memory_model(item, measure_step(item, steps=2, warmup=1).profile)
    reordered = reorder_backward(item, model)
    assert reordered.plan_graph.num_ops == model.plan_graph.num_ops
    assert sorted(map(tuple, reordered.members)) == sorted(map(tuple, model.members))
    assert list(reordered.plan_graph.names) != list(model.plan_graph.names)
    # The forward pass keeps its order: the first ops are the model's.
    assert reordered.members[:5] == model.members[:5]
    rewritten, plan = rematerialize(item, [reordered], budget_ratio=0.7, heuristic="offline")
    assert plan.num_recomputes > 0
    compare_steps(item, rewritten).check()
