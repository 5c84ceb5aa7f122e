"""Baechi's memory-constrained placement, and the pipeline entry point ``baechi.optimize``.

The algorithm modules (grouping, fusion, placers, LP, schedule) read the cost-graph IR and never
import TensorFlow; ``optimize`` (``baechi.pipeline``) does, so it is loaded on first use.
"""

__all__ = ["optimize"]


def __getattr__(name):
    if name == "optimize":
        from graphfit.baechi.pipeline import optimize
        return optimize
    raise AttributeError(f"module 'baechi' has no attribute {name!r}")
