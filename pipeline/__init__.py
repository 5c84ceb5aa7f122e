"""The orchestration floor: every way in (the ``train`` binary, a library call on a graph, a
Keras model) runs the same passes through ``optimize``.

- ``passes``: the registry of graph passes, each named and skippable, with a verifier after it;
- ``optimize``: graph passes, the remat closed loop (``remat.closed_loop``), placement;
- ``joint``: the search for a remat budget and a placer together, whose winner ``optimize`` runs;
- ``keras_fit``: a Keras model in, its training step optimized;
- ``report`` and ``verify``: what a person reads, and the structural checks between passes.

It imports from ``remat``, ``baechi``, ``profiler`` and ``models``; nothing imports it but the
tools, the benches and the tests. ``optimize`` imports TensorFlow, so it loads on first use.
"""

__all__ = ["optimize"]


def __getattr__(name):
    if name == "optimize":
        from graphfit.pipeline.meta_optimizer import optimize
        return optimize
    raise AttributeError(f"module 'graphfit.pipeline' has no attribute {name!r}")
