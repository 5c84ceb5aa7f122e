"""The registry of graph passes: one list that ``optimize``, ``train --skip_passes`` and the
reports read.

Like Grappler's meta optimizer, each pass is named, independent and skippable: a function
``item -> (item, record)`` whose JSON-ready record says whether it ``changed`` the step. They run
before the step is profiled, in the order listed, so the planner sees the memory they freed:
each frees what no recomputation can (a kernel's scratch buffer, partial weight gradients,
gradients waiting for a sum or for the optimizer) or spends time better. With
``verify_structure`` the structural verifier (``pipeline.verify.verify_step``) runs after each
pass, as XLA's HloVerifier runs between HLO passes.

Adding a pass: a module whose function takes and returns a ``GraphItem`` (``profiler.graph_def_walk``
has the GraphDef plumbing), and one line in ``GRAPH_PASSES``.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Collection

from graphfit.models.graph_item import GraphItem

__all__ = ["GraphPass", "GRAPH_PASSES", "GRAPH_PASS_NAMES", "PASSES", "check_skip",
           "run_graph_passes"]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A graph pass: its name (for ``skip``) and the function that runs it, by module path
    (imported on first use: every pass imports TensorFlow)."""

    name: str
    function: str            # "module:function"
    summary: str

    def load(self) -> Callable[[GraphItem], tuple[GraphItem, dict]]:
        module, function = self.function.split(":")
        return getattr(importlib.import_module(module), function)


GRAPH_PASSES = (
    GraphPass("patch_convs", "graphfit.remat.patch_convs:patchify_conv_gradients",
              "strided convolution gradients over space-to-depth blocks, no column "
              "buffer"),
    GraphPass("conv_grad_kernels", "graphfit.remat.conv_grad_kernels:use_eigen_conv_gradients",
              "stride-1 convolution gradients on TF's kernels that need no im2col buffer"),
    GraphPass("flat_matmuls", "graphfit.remat.flat_matmuls:flatten_shared_matmuls",
              "batch products against one shared matrix as single matrix products"),
    GraphPass("grad_accumulation", "graphfit.remat.grad_accumulation:accumulate_gradients",
              "sum gradient contributions as they arrive"),
    GraphPass("early_updates", "graphfit.remat.early_updates:apply_updates_early",
              "apply each optimizer update as soon as its gradient exists"),
)
GRAPH_PASS_NAMES = tuple(p.name for p in GRAPH_PASSES)
# Every pass ``optimize`` runs, in order: the graph passes, then the remat closed loop and the
# placement (``pipeline.optimize``).
PASSES = GRAPH_PASS_NAMES + ("remat", "place")


def check_skip(skip: Collection[str]) -> frozenset[str]:
    """``skip`` as a set, every name a pass of ``PASSES``.

    Raises:
        errors.ArgumentError: an unknown name (the message lists the passes).
    """
    from graphfit.errors import ArgumentError

    unknown = set(skip) - set(PASSES)
    if unknown:
        raise ArgumentError(f"unknown pass(es) {sorted(unknown)}: the passes are "
                            f"{', '.join(PASSES)}")
    return frozenset(skip)


def run_graph_passes(item: GraphItem, skip: Collection[str] = frozenset(),
                     verify_structure: bool = False) -> tuple[GraphItem, dict[str, dict]]:
    """Run the ``GRAPH_PASSES`` not in ``skip`` over ``item``, in order.

    Returns:
        ``(step, records)``: the rewritten step and, per pass name, its record (``changed``,
        what it rewrote, ``seconds``; ``{"changed": False, "skipped": "skip"}`` when skipped).

    Raises:
        pipeline.verify.VerificationError: with ``verify_structure``, a pass handed back a
            malformed step.
    """
    records = {}
    for graph_pass in GRAPH_PASSES:
        if graph_pass.name in skip:
            records[graph_pass.name] = {"changed": False, "skipped": "skip"}
            continue
        begin = time.perf_counter()
        item, record = graph_pass.load()(item)
        if verify_structure and record["changed"]:
            from graphfit.pipeline.verify import verify_step
            verify_step(item)
        records[graph_pass.name] = {**record, "seconds": round(time.perf_counter() - begin, 3)}
    return item, records
