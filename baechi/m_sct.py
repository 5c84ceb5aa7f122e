"""m-SCT: SCT's favourite children, from an LP, guiding memory-constrained list scheduling.

Hanen & Munier's SCT algorithm solves an LP relaxation that picks for each task at most one
"favourite child" to run on its processor without communication, rounds it, and list-schedules
with that preference. Baechi's m-SCT (Jeon et al., SoCC 2020, §3.4) adds the memory constraint
and colocation. Here the LP is ``baechi.lp`` (sparse, HiGHS by default), the rounding is the
greedy matching of ``baechi.lp.round_favourites`` (never two favourites per parent or per
child), and the list scheduling is ``baechi.m_etf.m_etf`` with SCT's rule as Baechi applies it:
when a unit's favourite parent is the last unit on its device, and that device has room for it
and would start it no later than any other, the device is held for it (it runs next there, and
nothing else starts there before its inputs are in). (Sending every favourite child to its
parent's device whenever it had room made the makespans of 2k-8k-op random and layered graphs
1.08-1.15 x longer in Baechi's simulator, 1.12-1.23 x with contention. Sending it there only
when no other device starts it earlier, but behind any unit with a longer path to the end, made
the 1,000-op fork-join with 16 short branches 1.00-1.05 x Baechi's makespan in Baechi's
simulator over four seeds, 0.99-1.01 x with the device held.)
"""

from __future__ import annotations

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.lp import round_favourites, solve_favourite_lp
from graphfit.baechi.m_etf import m_etf
from graphfit.baechi.schedule import Schedule
from graphfit.baechi.units import UnitGraph

__all__ = ["m_sct"]


def m_sct(units: UnitGraph, devices: DeviceSet, memory_model: str = "liveness",
          threshold: float = 0.5, lp_solver: str = "highs",
          memory_first_only: bool = False) -> Schedule:
    """Place and schedule ``units`` with m-SCT.

    Parameters:
        units: the unit graph.
        devices: devices, memory limits and link costs (the LP charges the mean link cost).
        memory_model: ``"liveness"`` (default) or ``"static"`` for the fit test.
        threshold: LP value below which an edge may become a favourite (``--sct_threshold``).
        lp_solver: ``"highs"`` (default), ``"cvxopt"`` or ``"mosek"``.
        memory_first_only: as in ``baechi.m_etf.m_etf``.

    Returns:
        The ``Schedule``; ``info`` holds the LP's rows, columns, non-zeros, solve seconds,
        LP makespan, window size and the number of favourite edges.

    Raises:
        LPSolverError: the LP solver is unavailable or failed (the message names alternatives).
        PlacementError: ready units fit on no device and no memory will be released.

    References:
        Hanen & Munier, Discrete Applied Mathematics 108(3), 2001.
        Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020.
    """
    lp = solve_favourite_lp(units, devices.mean_link(), lp_solver)
    _, favourite_parent = round_favourites(lp.edges, lp.x, units.num_units, threshold, lp.comm_us)
    schedule = m_etf(units, devices, memory_model, favourite_parent=favourite_parent,
                     method="m_sct", memory_first_only=memory_first_only)
    schedule.info.update(lp_rows=lp.num_rows, lp_cols=lp.num_cols, lp_nnz=lp.nnz,
                         lp_solve_s=lp.solve_s, lp_solver=lp.solver,
                         lp_window_units=lp.window_units,
                         lp_makespan_us=lp.makespan_us,
                         favourite_edges=int((favourite_parent >= 0).sum()))
    return schedule
