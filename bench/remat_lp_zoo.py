"""Benchmark: Checkmate's LP relaxation with rounding (``remat.checkmate_lp``) on every zoo
model's presets beside ``dtr`` and ``offline`` (``bench_remat_milp.zoo``): whether the LP was
full or grouped, its size, HiGHS and planning time, LP value, rounded and filled plan.

Writes ``out/bench/remat_lp_zoo.json`` and ``remat_lp_zoo.txt``; about 20 min on 2 shared
cores (profiling every preset included).

    python -m graphfit.bench.remat_lp_zoo
"""

from __future__ import annotations

from graphfit.bench.remat_milp import zoo

__all__ = ["main"]


def main() -> dict:
    """Run the zoo benchmark (``bench_remat_milp.zoo``)."""
    return zoo()


if __name__ == "__main__":
    main()
