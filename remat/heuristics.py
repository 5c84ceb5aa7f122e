"""Eviction heuristics: which resident tensor to evict when a step exceeds its memory budget.

Each heuristic gives every evictable resident tensor a score; the simulator
(``remat.simulator``) evicts the lowest. The online scores are those of Dynamic Tensor
Rematerialization (Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen, Tatlock; ICLR 2021,
"Dynamic Tensor Rematerialization": §3 defines h_DTR and e*; the equivalence-class
approximation and the ablation of the simpler scores are in its appendix); ``belady``
is ours and reads the future, which an offline planner knows (``remat.simulator`` also offers
an ``offline`` planner that replays the step with ``belady`` and ``dtr`` and keeps the cheaper
plan). Notation, for a tensor t:

- c(t): compute time of the op that made t (all of its outputs are recomputed together);
- m(t): its bytes;  s(t): staleness = clock - time t was last accessed (clock = simulated
  compute time so far, recomputations included; the simulator stamps an op's inputs when the
  op starts and its outputs when first made). A tensor with s(t) = 0 scores infinite under
  every staleness-based score, as in DTR: it goes only when nothing else is left;
- e*(t): the evicted neighbourhood: the non-resident ancestors that recomputing t would have
  to recompute first, and the non-resident descendants made from t (both through chains of
  non-resident tensors, dead ones included: for DTR a tensor the program released is one
  more evicted tensor). c(S) sums the op costs of a set, each op once.

The seven DTR scores, as the paper defines them: ``dtr`` (c + c(e*)) / (m s); ``dtr_eq`` the
same with e* approximated by union-find classes; ``dtr_local`` c / (m s); ``lru`` oldest access
first; ``size`` largest first; ``msps`` (c + c(evicted ancestors)) / m; ``random``.

The simulator asks a heuristic for ``bounds`` (vectorized, one per candidate). A heuristic with
``refine = None`` is exact there, and since evicting one tensor changes no other tensor's score,
the simulator evicts several at once. Otherwise ``bounds`` is a lower bound and
``refine(state, t, cutoff)`` the exact score of one tensor — or any value >= ``cutoff`` once the
score is known to reach it, which lets neighbourhood walks stop early; the simulator evicts one
at a time and finds the minimum by branch and bound, refining candidates in bound order until a
bound reaches the best exact score.

A heuristic object holds per-run state (``dtr_eq``'s classes, ``random``'s generator): make a
new one per simulation with ``make_heuristic``.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

__all__ = ["HEURISTICS", "Heuristic", "SimulationState", "make_heuristic",
           "evicted_ancestors_cost", "evicted_neighbourhood_cost"]

HEURISTICS = ("dtr", "dtr_eq", "dtr_local", "lru", "size", "msps", "random", "belady")

class SimulationState(Protocol):
    """What the heuristics read from a running simulation (see ``remat.simulator``)."""

    clock: float                 # simulated compute time so far (us)
    position: int                # position of the op being run, in the execution order
    last_access: np.ndarray      # per tensor: clock when last made or read
    size_bytes: np.ndarray       # per tensor, float
    tensor_cost_us: np.ndarray   # per tensor: compute time of its producer
    next_use: np.ndarray         # per tensor: position of its next use (>= num_ops: none)
    resident: list[bool]
    computed: list[bool]         # per op
    producer: list[int]
    op_inputs: list[list[int]]   # distinct input tensors per op
    op_outputs: list[list[int]]
    consumers: list[list[int]]   # consumer ops per tensor
    op_cost_us: list[float]

    def is_live(self, t: int) -> bool: ...


class Heuristic:
    """Base: a score from vectorized ``bounds``; subclasses set ``refine`` for exact scores
    that depend on the evicted neighbourhood, and may keep state through the hooks."""

    name = ""
    refine = None

    def bounds(self, state: SimulationState, cand: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def on_evict(self, state: SimulationState, t: int) -> None:
        """``t`` was evicted by this heuristic's choice."""

    def on_rematerialize(self, state: SimulationState, t: int) -> None:
        """``t`` became resident again through a recomputation."""


def _ratio(cost: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """cost / weight, infinite where the weight is 0: as in DTR, a tensor touched at the
    current clock (staleness 0) is evicted only when nothing else is left."""
    out = np.full(len(weight), math.inf)
    np.divide(cost, weight, out=out, where=weight > 0)
    return out


def _local(state: SimulationState, cand: np.ndarray) -> np.ndarray:
    """c / (m * s): the part of h_DTR every variant shares."""
    staleness = state.clock - state.last_access[cand]
    return _ratio(state.tensor_cost_us[cand], state.size_bytes[cand] * staleness)


def _weight(state: SimulationState, t: int) -> float:
    """m(t) * s(t) of one tensor (0 when it was touched at the current clock)."""
    return state.size_bytes[t] * (state.clock - state.last_access[t])


def evicted_ancestors_cost(state: SimulationState, t: int, seen: set[int] | None = None,
                           limit: float = math.inf) -> float:
    """c of the non-resident ancestors that recomputing ``t`` would recompute first.

    Walks from t's producer up through non-resident input tensors; each op counted once
    (``seen`` collects the ops, so a caller can continue the count). The walk stops as soon
    as the sum reaches ``limit`` (the caller only needs to know it is that large).
    """
    seen = set() if seen is None else seen
    resident, producer, op_inputs, cost = (state.resident, state.producer, state.op_inputs,
                                           state.op_cost_us)
    total = 0.0
    stack = [producer[t]]
    while stack:
        for s in op_inputs[stack.pop()]:
            if not resident[s]:
                p = producer[s]
                if p not in seen:
                    seen.add(p)
                    total += cost[p]
                    if total >= limit:
                        return total
                    stack.append(p)
    return total


def evicted_neighbourhood_cost(state: SimulationState, t: int, limit: float = math.inf) -> float:
    """c(e*(t)), DTR §3's "evicted neighborhood": the evicted ancestors
    (``evicted_ancestors_cost``) plus every non-resident descendant reachable from ``t``
    through non-resident tensors made by ops already run — dead ones included, as in DTR,
    where a tensor the program released is evicted like any other; stops once the sum
    reaches ``limit``."""
    seen: set[int] = {state.producer[t]}
    total = evicted_ancestors_cost(state, t, seen, limit)
    resident, computed, consumers, op_outputs, cost = (
        state.resident, state.computed, state.consumers, state.op_outputs, state.op_cost_us)
    stack = [t]
    while stack:
        for r in consumers[stack.pop()]:
            if not computed[r] or r in seen:
                continue
            evicted = [w for w in op_outputs[r] if not resident[w]]
            if evicted:
                seen.add(r)
                total += cost[r]
                if total >= limit:
                    return total
                stack.extend(evicted)
    return total


class DTR(Heuristic):
    """h_DTR(t) = (c(t) + c(e*(t))) / (m(t) * s(t)) — DTR §3, with e* computed exactly."""

    name = "dtr"

    def bounds(self, state, cand):
        return _local(state, cand)

    def refine(self, state, t, cutoff):
        c, w = state.tensor_cost_us[t], _weight(state, t)
        if w <= 0:
            return math.inf
        return (c + evicted_neighbourhood_cost(state, t, cutoff * w - c)) / w


class DTREquivalenceClasses(Heuristic):
    """h_DTR_eq(t) = (c(t) + Σ_{classes E next to t} c(E)) / (m(t) * s(t)) — DTR appendix
    ("equivalence class" approximation of e*).

    Each eviction (a tensor freed after its last use included: for DTR a released tensor is
    an evicted one) makes the tensor a new union-find node holding its cost, merged with the
    classes of its evicted neighbours (inputs of its producer, outputs of its consumers).
    Rematerializing a tensor subtracts its cost from its class and detaches it (its next
    eviction makes a new node), but classes never split: the sum over a class may count
    tensors that no longer connect. Cheap, and about as good as exact e*.
    """

    name = "dtr_eq"

    def __init__(self, num_tensors: int):
        self.node = [-1] * num_tensors   # union-find node of an evicted tensor, else -1
        self.parent: list[int] = []
        self.class_cost: list[float] = []

    def _find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def _neighbour_classes(self, state, t: int) -> set[int]:
        """Roots of the classes of t's evicted neighbours."""
        node, resident = self.node, state.resident
        near = [s for s in state.op_inputs[state.producer[t]] if node[s] >= 0 and not resident[s]]
        for r in state.consumers[t]:
            if state.computed[r]:
                near.extend(w for w in state.op_outputs[r] if node[w] >= 0 and not resident[w])
        return {self._find(self.node[x]) for x in near}

    def on_evict(self, state, t):
        root = len(self.parent)
        self.parent.append(root)
        self.class_cost.append(float(state.tensor_cost_us[t]))
        for other in self._neighbour_classes(state, t):
            self.parent[other] = root
            self.class_cost[root] += self.class_cost[other]
        self.node[t] = root

    def on_rematerialize(self, state, t):
        if self.node[t] >= 0:
            self.class_cost[self._find(self.node[t])] -= float(state.tensor_cost_us[t])
            self.node[t] = -1

    def bounds(self, state, cand):
        return _local(state, cand)

    def refine(self, state, t, cutoff):
        w = _weight(state, t)
        if w <= 0:
            return math.inf
        extra = sum(max(0.0, self.class_cost[r]) for r in self._neighbour_classes(state, t))
        return (state.tensor_cost_us[t] + extra) / w


class DTRLocal(Heuristic):
    """h_DTR_local(t) = c(t) / (m(t) * s(t)) — DTR appendix, ablation (e* dropped)."""

    name = "dtr_local"

    def bounds(self, state, cand):
        return _local(state, cand)


class LRU(Heuristic):
    """h_LRU(t): the time t was last made or read — least recently used first (the order of
    1 / s(t)); DTR appendix, ablation."""

    name = "lru"

    def bounds(self, state, cand):
        return state.last_access[cand].copy()


class Size(Heuristic):
    """h_size(t) = 1 / m(t): largest first — DTR appendix, ablation."""

    name = "size"

    def bounds(self, state, cand):
        return 1.0 / state.size_bytes[cand]


class MSPS(Heuristic):
    """h_MSPS(t) = (c(t) + c(evicted ancestors of t)) / m(t) — "memory saved per second",
    after Peng et al., Capuchin (ASPLOS 2020); DTR appendix, ablation."""

    name = "msps"

    def bounds(self, state, cand):
        return state.tensor_cost_us[cand] / state.size_bytes[cand]

    def refine(self, state, t, cutoff):
        c, m = state.tensor_cost_us[t], state.size_bytes[t]
        return (c + evicted_ancestors_cost(state, t, limit=cutoff * m - c)) / m


class Random(Heuristic):
    """A uniformly random resident tensor (seeded) — the floor of DTR's ablation."""

    name = "random"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def bounds(self, state, cand):
        return self.rng.random(len(cand))


class Belady(Heuristic):
    """h_belady(t) = (c(t) + c(evicted ancestors of t)) / (m(t) * d(t)) — ours.

    d(t) = number of ops from now until t's next use in the known execution order (Belady's
    "farthest next use", which is optimal for unit costs and sizes), in place of DTR's
    staleness, which only guesses the future from the past; a tensor with no further use
    scores 0. The numerator is the time recomputing t will cost, as in MSPS and DTR. The
    score is the recompute time paid per byte of memory freed per op of the interval the
    memory is freed for.
    """

    name = "belady"

    def bounds(self, state, cand):
        distance = np.maximum(state.next_use[cand] - state.position, 1).astype(np.float64)
        return state.tensor_cost_us[cand] / (state.size_bytes[cand] * distance)

    def refine(self, state, t, cutoff):
        c = state.tensor_cost_us[t]
        w = state.size_bytes[t] * max(int(state.next_use[t]) - state.position, 1)
        return (c + evicted_ancestors_cost(state, t, limit=cutoff * w - c)) / w


def make_heuristic(name: str, num_tensors: int, seed: int = 0) -> Heuristic:
    """A fresh heuristic (with its own state) for one simulation.

    Parameters:
        name: one of ``HEURISTICS``.
        num_tensors: tensors of the graph (``dtr_eq``'s union-find size).
        seed: ``random``'s seed.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    if name == "dtr_eq":
        return DTREquivalenceClasses(num_tensors)
    if name == "random":
        return Random(seed)
    classes = {cls.name: cls for cls in (DTR, DTRLocal, LRU, Size, MSPS, Belady)}
    if name not in classes:
        raise ValueError(f"unknown heuristic {name!r}; choose one of {', '.join(HEURISTICS)}")
    return classes[name]()
