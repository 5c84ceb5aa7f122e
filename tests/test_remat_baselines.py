"""Checkpoint-all, Chen's baselines, the Checkmate MILP and the shared plan validator."""

from __future__ import annotations

import numpy as np
import pytest

from graphfit.profiler.cost_graph import CostGraph, OpSpec
from graphfit.profiler.synthetic import random_dag, training_like
from graphfit.remat import baselines, checkmate, simulator
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, Event
from graphfit.remat.validate import InfeasibleBudgetError, PlanError, minimum_budget_bytes, replay_plan

ACT = 1000


def chain(layers: int, cost_us: float = 10.0) -> CostGraph:
    """x -> f0 -> ... -> loss, then TF-style `gradients/` ops reading each saved activation."""
    specs = [OpSpec("x", "Placeholder", output_bytes=[ACT])]
    previous = "x"
    for k in range(layers):
        specs.append(OpSpec(f"f{k}", "Relu", inputs=[(previous, 0)], output_bytes=[ACT],
                            compute_us=cost_us))
        previous = f"f{k}"
    specs.append(OpSpec("loss", "Mean", inputs=[(previous, 0)], output_bytes=[4], compute_us=1))
    grad = ("loss", 0)
    for k in reversed(range(layers)):
        saved = f"f{k - 1}" if k else "x"
        specs.append(OpSpec(f"gradients/b{k}", "ReluGrad", inputs=[grad, (saved, 0)],
                            output_bytes=[ACT], compute_us=cost_us))
        grad = (f"gradients/b{k}", 0)
    return CostGraph.from_ops(specs)


def two_output_graph() -> CostGraph:
    """A batch-norm-like op with a big and a small output; only the small one is read late."""
    specs = [
        OpSpec("x", "Placeholder", output_bytes=[ACT]),
        OpSpec("bn", "FusedBatchNormV3", inputs=[("x", 0)], output_bytes=[4 * ACT, 8],
               compute_us=20),
        OpSpec("relu", "Relu", inputs=[("bn", 0)], output_bytes=[4 * ACT], compute_us=5),
        OpSpec("sq", "Square", inputs=[("relu", 0)], output_bytes=[4 * ACT], compute_us=5),
        OpSpec("loss", "Mean", inputs=[("sq", 0)], output_bytes=[4], compute_us=1),
        OpSpec("gradients/sq", "Mul", inputs=[("loss", 0), ("relu", 0)],
               output_bytes=[4 * ACT], compute_us=5),
        OpSpec("gradients/relu", "ReluGrad", inputs=[("gradients/sq", 0), ("relu", 0)],
               output_bytes=[4 * ACT], compute_us=5),
        OpSpec("gradients/bn", "FusedBatchNormGradV3",
               inputs=[("gradients/relu", 0), ("x", 0), ("bn", 1)], output_bytes=[ACT],
               compute_us=20),
    ]
    return CostGraph.from_ops(specs)


# -- the validator ------------------------------------------------------------------------------

def test_replay_measures_peak_and_rejects_broken_plans():
    g = chain(2)  # x f0 f1 loss b1 b0: ops 0..5, tensor t = op t
    plan = baselines.checkpoint_all(g)
    replay = replay_plan(g, plan)
    assert (replay.peak_bytes, replay.num_recomputes, replay.overhead) == (plan.peak_bytes, 0, 1.0)
    events = list(plan.events)
    broken = {
        "computed twice": events + [Event(COMPUTE, 1)],
        "never computed": [e for e in events if e not in (Event(COMPUTE, 5), Event(FREE, 5))],
        "reads x:0, which is not resident": [Event(COMPUTE, 0), Event(FREE, 0)] + events[1:],
        "frees tensor 3, which is not resident": events + [Event(FREE, 3)],
        "may not be recomputed": events + [Event(RECOMPUTE, 0)],
        "unknown event kind": events + [Event("evict", 1)],
        "runs before its predecessor": [Event(COMPUTE, 1)] + events,
    }
    for message, bad in broken.items():
        with pytest.raises(PlanError, match=message):
            replay_plan(g, bad)
    with pytest.raises(PlanError, match="not resident at the end"):
        replay_plan(g, plan, outputs=[1])


def test_checkpoint_all_recomputes_nothing_and_agrees_with_the_simulator():
    for g in (chain(8), training_like(120, seed=3), random_dag(150, seed=2)):
        plan = baselines.checkpoint_all(g)
        assert plan.num_recomputes == 0 and plan.overhead == 1.0
        assert [e.index for e in plan.events if e.kind == COMPUTE] == list(range(g.num_ops))
        assert replay_plan(g, plan).peak_bytes == plan.peak_bytes
        assert plan.peak_bytes == simulator.baseline_peak_bytes(g)
    # At the loss: x and f0..f3 are resident, f3 is freed only once the loss is made.
    assert baselines.checkpoint_all(chain(4)).peak_bytes == 5 * ACT + 4


# -- forward pass and Chen's baselines ----------------------------------------------------------

def test_forward_ops_rules():
    g = chain(3)
    forward = baselines.forward_ops(g)
    assert [g.names[i] for i in np.flatnonzero(forward)] == ["x", "f0", "f1", "f2", "loss"]
    assert (baselines.forward_ops(g, "f1:0") == (np.arange(g.num_ops) <= g.index["f1"])).all()
    t = training_like(60, seed=1)
    tf_forward = baselines.forward_ops(t)  # an op named `loss`
    assert tf_forward[t.index["layer0/relu"]] and not tf_forward[t.index["layer0/relu_grad"]]
    with pytest.raises(ValueError, match="pass loss="):
        baselines.forward_ops(random_dag(20, seed=0))
    assert [g.names[i] for i in baselines.articulation_points(g, forward)] == ["f0", "f1", "f2"]


def test_chen_plans_are_valid_and_lower_the_peak_of_a_long_chain():
    g = chain(64)
    full = baselines.checkpoint_all(g)
    sqrt_n = baselines.chen_sqrt_n(g)
    greedy = baselines.chen_greedy(g)
    for plan in (sqrt_n, greedy):
        replay = replay_plan(g, plan)
        assert replay.peak_bytes == plan.peak_bytes < full.peak_bytes / 3
        assert 1.0 < plan.overhead < 2.0 and plan.num_recomputes > 0
    assert sqrt_n.stats["num_checkpoints"] == 8  # every 8th of 64 articulation points
    within = baselines.chen_greedy(g, budget_bytes=full.peak_bytes // 2)
    assert within.peak_bytes <= full.peak_bytes // 2 and within.overhead <= greedy.overhead
    with pytest.raises(InfeasibleBudgetError, match=str(greedy.peak_bytes)) as error:
        baselines.chen_greedy(g, budget_bytes=greedy.peak_bytes - 1)
    assert error.value.minimum_bytes == greedy.peak_bytes


# -- the MILP -----------------------------------------------------------------------------------

def _heuristic_overheads(g: CostGraph, budget: int) -> dict[str, float]:
    """Overhead of every other planner that meets ``budget``."""
    plans = {"chen_sqrt_n": baselines.chen_sqrt_n(g)}
    try:
        plans["chen_greedy"] = baselines.chen_greedy(g, budget)
    except InfeasibleBudgetError:
        pass
    for heuristic in simulator.PLANNERS:
        try:
            plans[heuristic] = simulator.simulate(g, budget, heuristic)
        except simulator.RematError:
            pass
    return {name: p.overhead for name, p in plans.items() if p.peak_bytes <= budget}


@pytest.mark.parametrize("graph, fraction", [(chain(10), 0.5), (chain(16), 0.8),
                                             (training_like(40, seed=5), 0.2)])
def test_milp_optimum_is_valid_and_no_worse_than_any_heuristic(graph, fraction):
    """At a budget ``fraction`` of the way from the minimum to the checkpoint-all peak."""
    minimum = minimum_budget_bytes(graph)
    budget = int(minimum + fraction * (baselines.checkpoint_all(graph).peak_bytes - minimum))
    plan = checkmate.checkmate_milp(graph, budget, time_limit_s=20)
    assert plan.stats["status"] == "optimal"
    replay = replay_plan(graph, plan)
    assert replay.peak_bytes == plan.peak_bytes <= budget
    assert plan.overhead == pytest.approx(plan.stats["objective_overhead"])
    assert plan.overhead >= 1.0
    others = _heuristic_overheads(graph, budget)
    assert others, "no heuristic meets the budget: the test compares nothing"
    for name, overhead in others.items():
        assert plan.overhead <= overhead + 1e-9, name


def test_milp_checkpoints_tensors_not_whole_ops():
    """bn's 8-byte statistic is read by the gradient long after its 4000-byte output died: an
    op-level model would keep both and need recomputation at the checkpoint-all peak."""
    g = two_output_graph()
    full = baselines.checkpoint_all(g)
    plan = checkmate.checkmate_milp(g, full.peak_bytes, time_limit_s=20)
    assert plan.stats["status"] == "optimal"
    assert plan.num_recomputes == 0 and plan.peak_bytes == full.peak_bytes


def test_budget_below_the_minimum_is_an_error_naming_it():
    g = chain(4)
    minimum = minimum_budget_bytes(g)
    with pytest.raises(InfeasibleBudgetError, match=f"minimum of {minimum} bytes") as error:
        checkmate.checkmate_milp(g, minimum - 1)
    assert error.value.minimum_bytes == minimum
    plan = checkmate.checkmate_milp(g, minimum, time_limit_s=20)
    assert plan.peak_bytes <= minimum


def test_restricted_milps_are_valid_and_no_better_than_the_full_one():
    g = chain(10)
    minimum = minimum_budget_bytes(g)
    budget = int(minimum + 0.5 * (baselines.checkpoint_all(g).peak_bytes - minimum))
    full = checkmate.checkmate_milp(g, budget, time_limit_s=20)
    forward = checkmate.checkmate_milp(g, budget, time_limit_s=20,
                                       candidates=baselines.forward_ops(g))
    # Recomputations only at stage starts hold more at once: roomier budget, or no schedule.
    with pytest.raises(checkmate.NoScheduleFoundError, match="restricted model"):
        checkmate.checkmate_milp(g, budget, time_limit_s=20, max_stages=4)
    coarse = checkmate.checkmate_milp(g, budget + 2 * ACT, time_limit_s=20, max_stages=4)
    assert coarse.stats["num_stages"] <= 5 < full.stats["num_stages"]
    assert replay_plan(g, forward).peak_bytes <= budget
    assert replay_plan(g, coarse).peak_bytes <= budget + 2 * ACT
    assert forward.overhead >= full.overhead - 1e-9
