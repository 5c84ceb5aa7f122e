"""Classic rematerialization baselines: checkpoint-all and Chen et al.'s segment checkpointing.

- ``checkpoint_all``: no rematerialization. Ops run once in id (topological) order and every
  tensor is freed after its last read: the baseline peak every budget ratio refers to.
- ``chen_sqrt_n``: checkpoint every ⌈√k⌉-th of the k articulation points of the forward pass;
  the other forward activations are dropped after the forward pass and recomputed from the
  nearest checkpoint right before the backward op that first needs them.
- ``chen_greedy``: close a segment at the first articulation point after the activation bytes
  accumulated since the last checkpoint exceed a threshold; the threshold is searched to meet
  a budget at the least recomputation.

Forward and backward (``forward_ops``): the forward pass is the loss op and its ancestors when
the loss is named. Otherwise, if the graph has TF gradient ops (a name scope ``gradients``,
``gradients_N`` or ``gradient_tape``), those and everything depending on them are the backward
pass (and updates), and the forward pass is every other op they depend on. Otherwise an op
whose last name component is ``loss`` is taken as the loss.

An articulation point is a recomputable forward op whose outputs are the only activations
crossing it: no activation made before it is read by a forward op after it (outputs of
non-recomputable ops, such as variable reads, never count: they stay resident anyway). On a
chain every op is one; inside a residual block none is.

Memory accounting and plan checks are ``remat.validate``'s; frees follow from liveness
(``remat.schedule.plan_from_schedule``).

References:
    Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost",
    arXiv:1604.06174, 2016 (Section 4: segmenting at articulation points, the √n strategy
    and the greedy memory planning with a threshold searched for the budget).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import RematPlan
from graphfit.remat.schedule import plan_from_schedule
from graphfit.remat.validate import InfeasibleBudgetError, recomputable_ops

__all__ = [
    "articulation_points",
    "checkpoint_all",
    "chen_greedy",
    "chen_sqrt_n",
    "forward_ops",
    "segment_schedule",
]

_GRADIENT_SCOPE = re.compile(r"(^|/)(gradients(_\d+)?|gradient_tape)/")


def _loss_op(graph: CostGraph, loss: str | int) -> int:
    if isinstance(loss, (int, np.integer)):
        if not 0 <= loss < graph.num_ops:
            raise ValueError(f"loss op id {loss} is outside 0..{graph.num_ops - 1}")
        return int(loss)
    name = loss.split(":")[0]
    if name not in graph.index:
        raise ValueError(f"loss {loss!r} names no op of the graph")
    return graph.index[name]


def _ancestors_of(graph: CostGraph, roots: np.ndarray) -> np.ndarray:
    """``roots`` and every op they depend on (ids are topological: one backward sweep)."""
    mask = roots.copy()
    for j in range(graph.num_ops - 1, -1, -1):
        if mask[j]:
            mask[graph.predecessors(j)] = True
    return mask


def forward_ops(graph: CostGraph, loss: str | int | None = None) -> np.ndarray:
    """The forward-pass ops, as a boolean mask over op ids (rule in the module docstring).

    Args:
        graph: a training step's cost graph.
        loss: the loss op (name, ``"op:port"`` tensor name or id); ``None`` to derive it.

    Raises:
        ValueError: ``loss`` names no op, or no rule tells forward from backward.
    """
    n = graph.num_ops
    if loss is not None:
        roots = np.zeros(n, dtype=bool)
        roots[_loss_op(graph, loss)] = True
        return _ancestors_of(graph, roots)
    gradient = np.array([bool(_GRADIENT_SCOPE.search(name)) for name in graph.names], dtype=bool)
    if gradient.any():
        backward = gradient.copy()
        for j in range(n):
            if not backward[j] and any(backward[p] for p in graph.predecessors(j)):
                backward[j] = True
        forward = np.zeros(n, dtype=bool)
        for j in np.flatnonzero(backward):
            forward[graph.predecessors(int(j))] = True
        return _ancestors_of(graph, forward & ~backward) & ~backward
    named = [i for i, name in enumerate(graph.names) if name.rsplit("/", 1)[-1] == "loss"]
    if len(named) == 1:
        return forward_ops(graph, named[0])
    raise ValueError(
        "cannot tell the forward pass from the backward pass: no op is under a `gradients/` "
        f"scope and {len(named)} ops are named `loss`; pass loss=<the loss op's name>")


def articulation_points(graph: CostGraph, forward: np.ndarray) -> np.ndarray:
    """Op ids (ascending) of the forward pass's articulation points (module docstring)."""
    recomputable = recomputable_ops(graph)
    positions = np.flatnonzero(forward)
    position_of = np.full(graph.num_ops, -1, dtype=np.int64)
    position_of[positions] = np.arange(len(positions))
    crossing = np.zeros(len(positions) + 1, dtype=np.int64)
    own = np.zeros(len(positions), dtype=np.int64)
    for p, op in enumerate(positions):
        if not recomputable[op]:
            continue
        for t in graph.op_outputs(int(op)):
            readers = position_of[graph.tensor_consumers(t)]
            last = int(readers.max(initial=-1))
            if last > p:
                crossing[p] += 1
                crossing[last] -= 1
                own[p] += 1
    crossing = np.cumsum(crossing)[:-1]
    cut = (own > 0) & (crossing == own)
    return positions[cut]


def segment_schedule(graph: CostGraph, forward: np.ndarray, dropped: np.ndarray) -> list[int]:
    """The execution order when the forward ops in ``dropped`` are not kept for backward.

    Ops run in id order. Before a non-forward op reads the output of a dropped op whose value
    was not yet rebuilt, that op is recomputed, after its own dropped, not yet rebuilt inputs
    (recursively, so a segment is rebuilt from its checkpoint). Forward ops read the originals.

    Args:
        graph: the cost graph.
        forward: boolean mask of the forward ops.
        dropped: boolean mask of recomputable forward ops whose outputs are not kept.
    """
    rebuilt = np.zeros(graph.num_ops, dtype=bool)
    schedule: list[int] = []

    def missing_inputs(op: int) -> list[int]:
        producers = dict.fromkeys(graph.tensor_producer[graph.op_inputs(op)].tolist())
        return [p for p in producers if dropped[p] and not rebuilt[p]]

    def rebuild(op: int) -> None:
        stack = [(op, False)]
        while stack:
            i, inputs_ready = stack.pop()
            if rebuilt[i]:
                continue
            if inputs_ready:
                schedule.append(i)
                rebuilt[i] = True
                continue
            stack.append((i, True))
            stack.extend((p, False) for p in reversed(missing_inputs(i)))

    for j in range(graph.num_ops):
        if not forward[j]:
            for p in missing_inputs(j):
                rebuild(p)
        schedule.append(j)
    return schedule


def checkpoint_all(graph: CostGraph, *, outputs: Sequence[int] = ()) -> RematPlan:
    """No rematerialization: every op once, in id order, each tensor freed after its last read.

    Args:
        graph: the cost graph.
        outputs: tensor ids kept resident until the step ends (fetches).

    Returns:
        The plan; its ``peak_bytes`` is the baseline peak and its ``budget_bytes`` equals it.
    """
    return plan_from_schedule(graph, range(graph.num_ops), None, "checkpoint_all",
                              outputs=outputs)


def _plan_with_checkpoints(graph: CostGraph, forward: np.ndarray, checkpoints: np.ndarray,
                           budget_bytes: int | None, method: str, stats: dict,
                           outputs: Sequence[int]) -> RematPlan:
    """Keep the checkpoints and the forward ops after the last one (their backward comes
    first, so dropping them would only recompute them at once); drop the other recomputable
    forward ops."""
    dropped = forward & recomputable_ops(graph)
    if len(checkpoints):
        dropped[checkpoints] = False
        dropped[int(checkpoints[-1]):] = False
    else:
        dropped[:] = False
    return plan_from_schedule(graph, segment_schedule(graph, forward, dropped), budget_bytes,
                              method, {**stats, "num_checkpoints": int(len(checkpoints))},
                              outputs)


def chen_sqrt_n(graph: CostGraph, loss: str | int | None = None,
                forward: np.ndarray | None = None, *, outputs: Sequence[int] = ()) -> RematPlan:
    """Chen et al.'s √n strategy: checkpoint every ⌈√k⌉-th of the k articulation points.

    Args:
        graph: a training step's cost graph.
        loss: the loss op for ``forward_ops``; ignored when ``forward`` is given.
        forward: boolean mask of the forward ops (default: ``forward_ops(graph, loss)``).
        outputs: tensor ids kept resident until the step ends (fetches).

    Returns:
        The plan (budget-agnostic: ``budget_bytes`` is its own peak).

    Raises:
        ValueError: the forward pass cannot be determined (see ``forward_ops``).
    """
    forward = forward_ops(graph, loss) if forward is None else forward
    candidates = articulation_points(graph, forward)
    step = max(1, math.ceil(math.sqrt(len(candidates))))
    checkpoints = candidates[step - 1::step]
    return _plan_with_checkpoints(graph, forward, checkpoints, None, "chen_sqrt_n",
                                  {"num_articulation_points": int(len(candidates))}, outputs)


def _greedy_checkpoints(graph: CostGraph, forward: np.ndarray, candidates: np.ndarray,
                        threshold_bytes: float) -> np.ndarray:
    """Chen's greedy planning: accumulate forward output bytes; at an articulation point past
    the threshold, checkpoint it and start a new segment."""
    is_candidate = np.zeros(graph.num_ops, dtype=bool)
    is_candidate[candidates] = True
    accumulated, chosen = 0, []
    for op in np.flatnonzero(forward & recomputable_ops(graph)).tolist():
        accumulated += int(graph.output_bytes(op).sum())
        if is_candidate[op] and accumulated > threshold_bytes:
            chosen.append(op)
            accumulated = 0
    return np.array(chosen, dtype=np.int64)


def chen_greedy(graph: CostGraph, budget_bytes: int | None = None,
                loss: str | int | None = None, forward: np.ndarray | None = None,
                num_thresholds: int = 48, *, outputs: Sequence[int] = ()) -> RematPlan:
    """Chen et al.'s greedy segmenting, with the threshold searched to meet ``budget_bytes``.

    Thresholds are tried on a geometric grid from the smallest to the total forward activation
    bytes (the largest closes no segment: checkpoint-all). Of the plans within the budget the
    one with least compute wins (ties: lower peak); with no budget, the lowest peak.

    Args:
        graph: a training step's cost graph.
        budget_bytes: the memory budget (``None``: minimise the peak).
        loss: the loss op for ``forward_ops``; ignored when ``forward`` is given.
        forward: boolean mask of the forward ops (default: ``forward_ops(graph, loss)``).
        num_thresholds: grid size of the threshold search.
        outputs: tensor ids kept resident until the step ends (fetches).

    Raises:
        InfeasibleBudgetError: no threshold meets the budget; names the lowest peak found.
        ValueError: the forward pass cannot be determined (see ``forward_ops``).
    """
    forward = forward_ops(graph, loss) if forward is None else forward
    candidates = articulation_points(graph, forward)
    sizes = np.array([graph.output_bytes(int(op)).sum()
                      for op in np.flatnonzero(forward & recomputable_ops(graph))], dtype=float)
    sizes = sizes[sizes > 0]
    low, high = (float(sizes.min()), float(sizes.sum())) if len(sizes) else (1.0, 1.0)
    best, lowest = None, None
    seen = set()
    for threshold in np.geomspace(low, high, num_thresholds):
        checkpoints = _greedy_checkpoints(graph, forward, candidates, threshold)
        key = tuple(checkpoints.tolist())
        if key in seen:
            continue
        seen.add(key)
        plan = _plan_with_checkpoints(graph, forward, checkpoints, budget_bytes, "chen_greedy",
                                      {"threshold_bytes": float(threshold),
                                       "num_articulation_points": int(len(candidates))},
                                      outputs)
        if lowest is None or plan.peak_bytes < lowest.peak_bytes:
            lowest = plan
        if budget_bytes is not None and plan.peak_bytes <= budget_bytes and (
                best is None or (plan.compute_us, plan.peak_bytes)
                < (best.compute_us, best.peak_bytes)):
            best = plan
    if budget_bytes is None:
        return lowest
    if best is None:
        raise InfeasibleBudgetError(
            f"Chen greedy cannot meet a budget of {budget_bytes} bytes: its lowest peak over "
            f"{len(seen)} segmentations is {lowest.peak_bytes} bytes",
            budget_bytes, lowest.peak_bytes)
    return best
