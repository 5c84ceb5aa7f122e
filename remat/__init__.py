"""Rematerialization: plan what to recompute under a memory budget, and rewrite TF graphs.

``remat.rematerialize`` (``remat.pipeline.rematerialize``) is the one-call entry; it is loaded
on first use so that importing ``remat`` (or its TF-free planners) stays cheap.
"""

__all__ = ["rematerialize"]


def __getattr__(name):
    if name == "rematerialize":
        from graphfit.remat.pipeline import rematerialize
        return rematerialize
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
