"""Checkmate's LP relaxation with two-phase rounding (remat.checkmate_lp)."""

import pytest

from graphfit.profiler.synthetic import training_like
from graphfit.remat import baselines
from graphfit.remat.checkmate import NoScheduleFoundError
from graphfit.remat.checkmate_lp import checkmate_lp
from graphfit.remat.validate import InfeasibleBudgetError, minimum_budget_bytes, replay_plan
from graphfit.tools.bench_remat_milp import activation_heavy


@pytest.mark.slow
def test_rounded_plan_fits_the_budget_and_costs_at_least_the_lp_bound():
    g = activation_heavy(training_like(80, seed=0))
    budget = int(0.95 * baselines.checkpoint_all(g).peak_bytes)
    plan = checkmate_lp(g, budget)
    replay = replay_plan(g, plan)
    assert replay.peak_bytes == plan.peak_bytes <= budget
    assert plan.num_recomputes > 0
    assert plan.overhead >= plan.stats["lp_bound_overhead"] - 1e-9
    assert plan.method == "checkmate_lp"


def test_budget_below_the_minimum_is_named():
    g = training_like(40, seed=1)
    low = minimum_budget_bytes(g) - 1
    with pytest.raises(InfeasibleBudgetError, match="below the minimum"):
        checkmate_lp(g, low)


@pytest.mark.slow
def test_no_rounding_that_fits_is_an_error_not_a_plan_over_budget():
    g = activation_heavy(training_like(80, seed=0))
    budget = int(0.9 * baselines.checkpoint_all(g).peak_bytes)
    try:
        plan = checkmate_lp(g, budget, time_limit_s=30)
    except NoScheduleFoundError as e:
        assert "no rounding" in str(e) or "did not solve" in str(e)
    else:
        assert plan.peak_bytes <= budget
