"""Checkmate's LP relaxation with two-phase rounding (remat.checkmate_lp)."""

import numpy as np
import pytest

from graphfit.profiler.synthetic import training_like
from graphfit.remat import baselines, checkmate_lp as lp_module, simulator
from graphfit.remat.checkmate import NoScheduleFoundError, checkmate_milp, stages
from graphfit.remat.checkmate_lp import checkmate_lp
from graphfit.remat.schedule import plan_from_schedule, schedule_cost
from graphfit.remat.validate import InfeasibleBudgetError, minimum_budget_bytes, replay_plan
from graphfit.bench.remat_milp import activation_heavy


def _between(graph, fraction: float) -> int:
    """A budget ``fraction`` of the way from the minimum to the checkpoint-all peak."""
    minimum = minimum_budget_bytes(graph)
    return int(minimum + fraction * (baselines.checkpoint_all(graph).peak_bytes - minimum))


@pytest.mark.parametrize("graph, budget", [
    (activation_heavy(training_like(30, seed=30), 256), None),
    (activation_heavy(training_like(40, seed=1), 256), None),
    (training_like(40, seed=5), 0.2),
])
def test_lp_bound_below_the_milp_optimum_below_the_rounded_plan(graph, budget):
    """Without groups the LP relaxes the MILP on the same stages: bound <= optimum <= rounding."""
    budget = (int(0.95 * baselines.checkpoint_all(graph).peak_bytes) if budget is None
              else _between(graph, budget))
    milp = checkmate_milp(graph, budget, time_limit_s=20)
    assert milp.stats["status"] == "optimal"
    plan = checkmate_lp(graph, budget)
    assert plan.stats["lp_is_bound"] and not plan.stats["grouped"]
    assert plan.stats["lp_overhead"] <= milp.overhead + 1e-6
    assert milp.overhead <= plan.overhead + 1e-9
    replay = replay_plan(graph, plan)
    assert replay.peak_bytes == plan.peak_bytes <= budget
    assert plan.method == "checkmate_lp"
    # Filling only removes recomputations of the best rounding.
    assert plan.overhead <= plan.stats["rounded_overhead"] + 1e-12
    # The bound holds against any plan within the budget, the simulator's too.
    for heuristic in ("dtr", "offline"):
        try:
            other = simulator.simulate(graph, budget, heuristic)
        except simulator.RematError:
            continue
        assert plan.stats["lp_overhead"] <= other.overhead + 1e-6


def test_groups_only_when_the_nonzeros_demand_them():
    """By default the LP has one stage per decision op; above ``max_nonzeros`` it groups,
    and says so (its value is then no bound)."""
    g = activation_heavy(training_like(120, seed=3), 64)
    budget = int(0.95 * baselines.checkpoint_all(g).peak_bytes)
    full = checkmate_lp(g, budget)
    assert not full.stats["grouped"] and full.stats["lp_is_bound"]
    assert full.stats["num_stages"] >= full.stats["num_decision_ops"]
    small = checkmate_lp(g, budget, max_nonzeros=full.stats["num_nonzeros"] / 4)
    assert small.stats["grouped"] and not small.stats["lp_is_bound"]
    assert small.stats["num_stages"] < full.stats["num_decision_ops"]
    assert small.stats["num_nonzeros"] < full.stats["num_nonzeros"] / 2
    assert replay_plan(g, small).peak_bytes <= budget


def test_grouped_relaxation_is_small_and_its_plan_is_valid():
    """Above max_groups decision ops, stages and checkpoint units are capped; the rounding
    still recomputes op by op and the plan replays within the budget."""
    g = activation_heavy(training_like(120, seed=3), 64)
    budget = int(0.95 * baselines.checkpoint_all(g).peak_bytes)
    full = checkmate_lp(g, budget)
    grouped = checkmate_lp(g, budget, max_groups=30)
    assert not full.stats["grouped"] and grouped.stats["grouped"]
    assert not grouped.stats["lp_is_bound"]
    assert grouped.stats["num_stages"] <= 31 < full.stats["num_stages"]
    assert grouped.stats["num_variables"] < full.stats["num_variables"] / 4
    for plan in (full, grouped):
        assert replay_plan(g, plan).peak_bytes == plan.peak_bytes <= budget
    # The ungrouped LP is a bound on any plan of the full model, the grouped plan included.
    assert full.stats["lp_overhead"] <= grouped.overhead + 1e-9


def test_variables_exist_only_where_they_can_be_nonzero():
    """S only while a reader may still run, R only after the op's own stage: far fewer than
    Checkmate's dense stages x ops."""
    g = activation_heavy(training_like(120, seed=3), 64)
    relax = lp_module._relaxation(g, baselines.checkpoint_all(g).peak_bytes, (), 10**6)
    stages = len(relax.layout.blocks)
    assert all(g_ < s for (s, g_) in relax.R)
    units = int(relax.unit_of.max()) + 1
    assert len(relax.S) < stages * units / 2 and len(relax.R) < stages * stages / 2
    need = relax.layout.needed_until
    for (s, u) in relax.S:
        tensors = np.flatnonzero(relax.unit_of == u)
        assert max(need[tensors]) >= relax.layout.blocks[s].start


def test_budget_below_the_minimum_is_named():
    g = training_like(40, seed=1)
    low = minimum_budget_bytes(g) - 1
    with pytest.raises(InfeasibleBudgetError, match="below the minimum"):
        checkmate_lp(g, low)


def test_a_tight_budget_gives_an_error_or_a_plan_within_it_never_one_over():
    g = activation_heavy(training_like(80, seed=0))
    for fraction in (0.0, 0.05, 0.3):
        budget = _between(g, fraction)
        try:
            plan = checkmate_lp(g, budget, time_limit_s=20)
        except (NoScheduleFoundError, InfeasibleBudgetError) as error:
            assert "raise the budget" in str(error)
        else:
            assert replay_plan(g, plan).peak_bytes <= budget


def test_an_infeasible_grouped_lp_is_no_proof_of_infeasibility():
    """Grouping restricts the model: when its LP has no solution the error says so and does not
    claim that the budget is infeasible (the full LP plans at the same budget)."""
    g = activation_heavy(training_like(60, seed=2))
    budget = _between(g, 0.1)
    plan = checkmate_lp(g, budget)
    assert replay_plan(g, plan).peak_bytes <= budget
    with pytest.raises(NoScheduleFoundError, match="grouped LP .* full model may have one"):
        checkmate_lp(g, budget, max_groups=4)


def test_schedule_cost_is_the_replayed_peak_and_compute():
    """``schedule_cost`` (arrays, no checks) agrees exactly with ``plan_from_schedule`` and its
    replay on the schedules the rounding makes: none, some and all checkpoints kept."""
    g = activation_heavy(training_like(60, seed=4), 64)
    outputs = [g.num_tensors - 1]
    budget = baselines.checkpoint_all(g, outputs=outputs).peak_bytes
    relax = lp_module._relaxation(g, budget, outputs, None)
    rng = np.random.default_rng(0)
    for fraction in (0.0, 0.2, 0.6, 1.0):
        schedule = lp_module._round(g, relax, rng.random(len(relax.cost)) < fraction)[0]
        plan = plan_from_schedule(g, schedule, None, "test", {}, outputs)
        peak, compute = schedule_cost(g, schedule, outputs)
        assert peak == plan.peak_bytes
        assert compute == pytest.approx(plan.compute_us, rel=1e-12)


def test_warm_resolves_without_presolve_match_cold_solves():
    """The solver keeps one HiGHS model and re-solves it from its last basis at lower
    capacities (presolve off): each optimum equals that of a cold solve with presolve
    (scipy's linprog) at the same capacity, and each solution satisfies the rows."""
    from scipy.optimize import linprog

    g = activation_heavy(training_like(60, seed=4), 64)
    budget = int(0.9 * baselines.checkpoint_all(g).peak_bytes)
    relax = lp_module._relaxation(g, budget, (), None)
    solver = lp_module._Solver(relax)
    persistent = float(g.persistent_bytes.sum())
    solved = infeasible = 0
    for scale in (1.0, 0.9, 0.8, 0.6, 0.3, 0.95):
        capacity = scale * budget - persistent
        x, objective = solver.solve(capacity, 60)
        b = relax.b_fixed.copy()
        b[relax.memory_rows] = capacity / relax.unit_bytes - relax.memory_const
        cold = linprog(relax.cost, A_ub=relax.matrix, b_ub=b, bounds=(0.0, 1.0), method="highs")
        if cold.status == 2:
            assert x is None
            infeasible += 1
            continue
        assert cold.status == 0 and x is not None
        assert objective == pytest.approx(cold.fun, abs=1e-7)
        assert (relax.matrix @ x <= b + 1e-6).all()
        solved += 1
    assert solved >= 3 and infeasible >= 1


def test_regrouping_ends_when_one_group_fewer_changes_nothing():
    """Just above ``max_nonzeros`` the LP is grouped and has fewer stages (one group fewer than
    stage ends once merged nothing and regrouped forever)."""
    g = activation_heavy(training_like(60, seed=4), 64)
    budget = baselines.checkpoint_all(g).peak_bytes
    full = lp_module._relaxation(g, budget, (), None)
    assert not full.grouped
    small = lp_module._relaxation(g, budget, (), None, full.first_estimate - 1)
    assert small.grouped and len(small.layout.blocks) < len(full.layout.blocks)
    assert small.matrix.nnz < full.matrix.nnz


def test_stages_grouped_equals_stages_built_grouped():
    g = activation_heavy(training_like(60, seed=4), 64)
    ungrouped = stages(g, None, (), None)
    for max_stages in (None, 40, 7, 1):
        direct, regrouped = stages(g, None, (), max_stages), ungrouped.grouped(max_stages)
        assert direct.blocks == regrouped.blocks and direct.coarsened == regrouped.coarsened
