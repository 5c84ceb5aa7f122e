"""Replay a step under a memory budget the way DTR's runtime would, and return the plan.

Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021, §3) runs a program's ops in order;
when an allocation would exceed the budget it evicts the resident tensor a heuristic scores
lowest, and when an op needs an evicted tensor it recomputes it, recursively. Run offline on a
``CostGraph``, the same procedure yields a ``RematPlan``: the compute / recompute / free events
a rewrite or a memory model can follow.

The memory model (``remat.validate.replay_plan`` checks any plan with the same rules):

- Persistent bytes (variables, constants) are resident for the whole step, never evicted.
- Running (or recomputing) op i needs every input resident, then allocates all its outputs and
  ``temp_bytes[i]`` (temporaries, released when it ends). A recomputation makes all the op's
  outputs, as DTR does; outputs that were still resident keep their version, the duplicate is
  counted as transient memory of the op.
- A tensor is freed right after its last use in the order ("eager eviction"); a tensor nobody
  reads is freed as soon as it is made, unless it is one of the step's ``outputs``, which must
  all be resident when the step ends (they are recomputed then if evicted).
- A dead tensor (past its last use, or recomputed only to recompute another one) is kept,
  evictable, while recomputing an evicted, still-needed tensor would read it (found by a short
  walk down through evicted tensors): holding it costs its bytes only until the heuristic,
  which scores it like any candidate (its e* counts the descendants waiting for it), finds it
  the cheapest to evict, while freeing it would make that recomputation start further up.
  It is freed
  after the op at which no such tensor is left. (DTR's runtime keeps every dead tensor,
  evictable, until the program releases it; here one that serves no evicted tensor is freed
  at its last use, which costs a recomputation only if a descendant is evicted later and its
  recomputation reaches up to it.)
- Staleness, as in DTR's simulator: an op's inputs are accessed when the op starts (before
  the recomputations it triggers), its outputs when first made; a recomputed tensor keeps the
  access time of the read that triggered it.
- Never evicted, never recomputed: outputs of stateful, random, variable and resource-reading
  ops and of ops without data inputs (feeds, constants; their memory is held by the runtime
  anyway). When such a tensor dies, the ops reading it can no longer be recomputed, so their
  resident outputs are pinned from then on (DTR's "banishing"); if one of their outputs is
  evicted and still needed, or pinning them would hold more bytes than the tensor itself, the
  tensor is kept until their last use instead.

- Variable updates: an op that reads a variable's old value and runs again after the
  variable's update makes TF copy the variable at the update (the old buffer is still read),
  bytes no plan counts (measured: an 8 MiB kernel of ``keras.applications.ResNet50`` with
  oneDNN on, 1.07x the plan). So before an update runs, every output of such a reader (or of
  a reader of a view of the value) that a later op or recomputation still needs is recomputed
  if it was evicted; from the update on, those readers and the ops that could only be
  recomputed through their outputs are not recomputed, and their resident outputs are not
  evicted, as DTR's banishing pins them (``reads_before_update`` in the stats counts the
  recomputed outputs). A reader that cannot be recomputed before the update is left as it
  was.

Failures are exceptions: ``BudgetTooSmallError`` when the budget is below a lower bound every
plan of this order needs (the message names it), ``OutOfMemoryError`` when the heuristic runs out
of evictable memory above that bound, ``ThrashError`` when recomputation exceeds
``overhead_limit`` times the step's compute.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Sequence

import numpy as np

from graphfit.errors import ArgumentError, GraphfitError, check_number
from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.heuristics import HEURISTICS, make_heuristic
from graphfit.remat.plan import COMPUTE, FREE, RECOMPUTE, Event, RematPlan

__all__ = ["RematError", "OutOfMemoryError", "BudgetTooSmallError", "ThrashError",
           "InvalidOrderError", "simulate", "minimum_budget_bytes", "Floor", "floor",
           "baseline_peak_bytes", "recomputable_ops", "execution_order", "PLANNERS",
           "OFFLINE_PORTFOLIO"]

# What ``simulate`` accepts: every eviction score, plus the offline portfolio.
PLANNERS = HEURISTICS + ("offline",)
# The scores the ``offline`` planner replays; it keeps the cheapest plan.
OFFLINE_PORTFOLIO = ("belady", "dtr")
# How many evicted tensors a dead tensor's walk to an evicted, still-needed descendant visits.
_SERVE_WALK = 32


class RematError(GraphfitError):
    """A plan cannot be made."""


class InvalidOrderError(RematError, ValueError):
    """The given execution order is not a permutation of the ops consistent with dependencies."""


class OutOfMemoryError(RematError):
    """The simulation found nothing left to evict.

    Attributes: ``budget_bytes``, ``minimum_bytes`` (the lower bound no plan of this order can
    go below), ``op`` (name of the op that could not run, or None).
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, op: str | None):
        super().__init__(message)
        self.budget_bytes, self.minimum_bytes, self.op = budget_bytes, minimum_bytes, op


class BudgetTooSmallError(OutOfMemoryError):
    """The budget is below ``minimum_bytes``: persistent bytes plus the largest working set."""


class ThrashError(RematError):
    """Recomputation exceeded the overhead limit (attributes ``overhead``, ``limit``)."""

    def __init__(self, message: str, overhead: float, limit: float):
        super().__init__(message)
        self.overhead, self.limit = overhead, limit


def recomputable_ops(graph: CostGraph) -> np.ndarray:
    """Mask of ops that may be recomputed: not stateful, random, a variable, a reader of a
    resource, nor an op without data inputs."""
    has_inputs = np.fromiter((len(graph.op_inputs(i)) > 0 for i in range(graph.num_ops)),
                             dtype=bool, count=graph.num_ops)
    return ~(graph.is_stateful | graph.is_random | graph.is_variable | graph.reads_resource) \
        & has_inputs


def _old_value_readers(graph: CostGraph, pos: Sequence[int]) -> dict[int, list[int]]:
    """Per op that writes a variable (a stateful op that takes the variable's handle and
    returns nothing), the ops that read the variable's value from a read that comes before it
    in the order: the ops that read the old value."""
    readers: dict[int, list[int]] = {}
    for w in range(graph.num_ops):
        if not graph.is_stateful[w] or len(graph.op_outputs(w)):
            continue
        handles = [t for t in graph.op_inputs(w).tolist()
                   if graph.is_variable[graph.tensor_producer[t]]]
        frontier = [int(r) for h in handles for r in graph.tensor_consumers(h)
                    if r != w and pos[r] < pos[w] and len(graph.op_outputs(r))]
        found: set[int] = set()
        while frontier:       # through aliases of the value (0-byte outputs: views)
            op = frontier.pop()
            for c in {int(c) for t in graph.op_outputs(op) for c in graph.tensor_consumers(t)}:
                if c not in found:
                    found.add(c)
                    if not graph.output_bytes(c).any():
                        frontier.append(c)
        if found:
            readers[w] = sorted(found)
    return readers


def execution_order(graph: CostGraph, order: Sequence[int] | None = None) -> list[int]:
    """``order`` checked (or the graph's topological ids when None).

    Raises:
        InvalidOrderError: when ``order`` is not a permutation of the op ids, or runs an op
            before one of its data or control predecessors.
    """
    n = graph.num_ops
    if order is None:
        return list(range(n))
    order = [int(i) for i in order]
    if sorted(order) != list(range(n)):
        raise InvalidOrderError(f"the order must list each of the {n} op ids exactly once "
                                f"(got {len(order)} entries, {len(set(order))} distinct)")
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    for i in order:
        for p in graph.predecessors(i):
            if pos[p] > pos[i]:
                raise InvalidOrderError(f"op {graph.names[i]!r} runs before its input "
                                        f"{graph.names[p]!r}")
    return order


def minimum_budget_bytes(graph: CostGraph, order: Sequence[int] | None = None,
                         outputs: Sequence[int] = ()) -> int:
    """A budget every plan following ``order`` needs, whatever it recomputes.

    It is the largest, over the ops, of: persistent bytes + bytes of unevictable tensors alive
    at the op (outputs of ops that cannot be recomputed, from their op to their last use) +
    the op's working set (its distinct inputs, all its outputs, its temporary bytes); and, at
    the end, persistent bytes + unevictable tensors alive + the step's outputs
    (``Floor.total_bytes``).

    Raises:
        InvalidOrderError: for a bad ``order``.
    """
    return floor(graph, order, outputs).total_bytes


@dataclasses.dataclass(frozen=True)
class Floor:
    """What sets ``minimum_budget_bytes``, for an error that says why a budget has no plan:
    at ``op`` (``None``: the step's end, where its outputs are held), the persistent bytes
    (weights, optimizer state), the tensors no plan can free there (outputs of ops that
    cannot be recomputed, alive), and the op's own working set (the step's outputs, at
    the end)."""

    op: str | None
    persistent_bytes: int
    unevictable_bytes: int
    working_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.unevictable_bytes + self.working_bytes

    def __str__(self) -> str:
        where = f"at op {self.op!r}" if self.op is not None else "at the step's end"
        return (f"{where}: {self.persistent_bytes:,} bytes of weights and other persistent "
                f"state, {self.unevictable_bytes:,} of tensors no plan can recompute, "
                f"{self.working_bytes:,} of "
                + ("the op's own inputs, outputs and scratch" if self.op is not None
                   else "the step's outputs"))


def floor(graph: CostGraph, order: Sequence[int] | None = None,
          outputs: Sequence[int] = ()) -> Floor:
    """Where and of what ``minimum_budget_bytes`` is made (``Floor``).

    Raises:
        InvalidOrderError: for a bad ``order``.
    """
    order = execution_order(graph, order)
    n = graph.num_ops
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    pinned_op = ~recomputable_ops(graph)
    pinned_t = pinned_op[graph.tensor_producer]
    is_output = np.zeros(graph.num_tensors, dtype=bool)
    is_output[list(outputs)] = True
    live = np.zeros(n + 2, dtype=np.int64)
    for t in np.flatnonzero(pinned_t & (graph.tensor_bytes > 0)):
        start = pos[graph.tensor_producer[t]]
        uses = pos[graph.tensor_consumers(t)]
        end = n if is_output[t] else (int(uses.max()) if len(uses) else start)
        live[start] += graph.tensor_bytes[t]
        live[end + 1] -= graph.tensor_bytes[t]
    live = np.cumsum(live)
    size = graph.tensor_bytes
    persistent = int(graph.persistent_bytes.sum())
    at_end = int(size[[t for t in outputs if not pinned_t[t]]].sum())
    found = Floor(None, persistent, int(live[n]), at_end)
    for i in range(n):
        ts = list(dict.fromkeys(graph.op_inputs(i).tolist())) + list(graph.op_outputs(i))
        working = int(sum(size[t] for t in ts if not pinned_t[t])) + int(graph.temp_bytes[i])
        if int(live[pos[i]]) + working > found.unevictable_bytes + found.working_bytes:
            found = Floor(graph.names[i], persistent, int(live[pos[i]]), working)
    return found


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every replay of a graph in one order reads and no replay changes, built once per
    graph, order and outputs (``_step``) rather than once per replay: ``offline`` replays a
    budget with each score of its portfolio, and ``remat.pipeline`` plans each traced order
    for several budgets. On a Keras attention step (2026-12-06) 544 replays spent 21 of
    their 45 s building it. Lists are for the replay's scalar access; a replay copies the
    ones it changes (``recomputable``, ``evictable``, ``next_use``)."""

    order: list[int]
    producer: list[int]
    size: list[int]
    size_bytes: np.ndarray
    op_cost_us: list[float]
    tensor_cost_us: np.ndarray
    temp: list[int]
    op_inputs: list[list[int]]
    op_outputs: list[list[int]]
    consumers: list[list[int]]
    use_pos: list[list[int]]
    is_output: list[bool]
    next_use: np.ndarray
    recomputable: list[bool]
    keep_forever: list[bool]
    evictable: list[bool]
    constants: int
    baseline_us: float
    floor: Floor
    old_value_readers: dict[int, list[int]]


# The last ``_Step`` of each graph (a ``CostGraph`` is not changed once built), with the order
# and outputs it was built for.
_STEPS: "weakref.WeakKeyDictionary[CostGraph, tuple[tuple, _Step]]" = weakref.WeakKeyDictionary()


def _step(graph: CostGraph, order: Sequence[int] | None, outputs: Sequence[int]) -> _Step:
    """The ``_Step`` of ``graph`` in ``order`` (checked, ``execution_order``) with ``outputs``
    resident at the end, from ``_STEPS`` when it was built last for the same."""
    key = (None if order is None else tuple(int(i) for i in order),
           tuple(sorted({int(t) for t in outputs})))
    cached = _STEPS.get(graph)
    if cached is not None and cached[0] == key:
        return cached[1]
    order = execution_order(graph, order)
    n, num_t = graph.num_ops, graph.num_tensors
    pos = [0] * n
    for p, i in enumerate(order):
        pos[i] = p
    producer = graph.tensor_producer.tolist()
    size = graph.tensor_bytes.tolist()
    consumers = [graph.tensor_consumers(t).tolist() for t in range(num_t)]
    use_pos = [sorted(pos[j] for j in cons) for cons in consumers]
    is_output = [False] * num_t
    for t in outputs:
        is_output[int(t)] = True
    never = n + 1
    recomputable = recomputable_ops(graph).tolist()
    step = _Step(
        order=order, producer=producer, size=size,
        size_bytes=graph.tensor_bytes.astype(np.float64),
        op_cost_us=graph.compute_us.tolist(),
        tensor_cost_us=graph.compute_us[graph.tensor_producer],
        temp=graph.temp_bytes.tolist(),
        op_inputs=[list(dict.fromkeys(graph.op_inputs(i).tolist())) for i in range(n)],
        op_outputs=[list(graph.op_outputs(i)) for i in range(n)],
        consumers=consumers, use_pos=use_pos, is_output=is_output,
        next_use=np.array([u[0] if u else (n if o else never)
                           for u, o in zip(use_pos, is_output)], dtype=np.int64),
        recomputable=recomputable, keep_forever=graph.is_variable.tolist(),
        evictable=[recomputable[p] and b > 0 for p, b in zip(producer, size)],
        constants=int(graph.persistent_bytes.sum()),
        baseline_us=float(graph.compute_us.sum()),
        floor=floor(graph, order, outputs),
        old_value_readers=_old_value_readers(graph, pos))
    _STEPS[graph] = (key, step)
    return step


class _Simulation:
    """One replay: state in Python lists (scalar access) and numpy arrays (what the
    heuristics score in bulk). Attribute names are the ``SimulationState`` protocol."""

    def __init__(self, graph: CostGraph, step: _Step, budget_bytes: float, heuristic: str,
                 overhead_limit: float, seed: int):
        self.started = time.perf_counter()
        num_t = graph.num_tensors
        self.graph, self.budget = graph, budget_bytes
        self.order = step.order
        self.producer, self.size, self.size_bytes = step.producer, step.size, step.size_bytes
        self.op_cost_us, self.tensor_cost_us = step.op_cost_us, step.tensor_cost_us
        self.temp = step.temp
        self.op_inputs, self.op_outputs = step.op_inputs, step.op_outputs
        self.consumers, self.use_pos, self.is_output = step.consumers, step.use_pos, step.is_output
        self.use_ptr = [0] * num_t
        self.end = graph.num_ops
        self.next_use = step.next_use.copy()
        self.recomputable = list(step.recomputable)
        self.keep_forever = step.keep_forever
        self.evictable = list(step.evictable)
        self.resident = [False] * num_t
        self.computed = [False] * graph.num_ops
        self.locks = [0] * num_t
        self.candidate = np.zeros(num_t, dtype=bool)
        self.last_access = np.zeros(num_t, dtype=np.float64)
        self.heuristic = make_heuristic(heuristic, num_t, seed)
        self.constants = step.constants
        self.current = self.peak = self.constants
        self.clock = 0.0
        self.position = 0
        self.baseline_us = step.baseline_us
        self.recompute_us = 0.0
        self.limit = overhead_limit
        self.events: list[Event] = []
        self.scratch: dict[int, int] = {}  # dead tensor kept, evictable -> a tensor it serves
        self.retry: dict[int, list[int]] = {}
        self.stats = {"evictions": 0, "banished": 0, "deferred_banishments": 0,
                      "reads_before_update": 0}
        self.floor = step.floor
        self.minimum = step.floor.total_bytes
        self.old_value_readers = step.old_value_readers

    # -- liveness ---------------------------------------------------------------------------
    def is_live(self, t: int) -> bool:
        """Still read by a later op of the order, or a step output."""
        return self.use_ptr[t] < len(self.use_pos[t]) or self.is_output[t]

    # -- the candidate set ------------------------------------------------------------------
    def _lock(self, t: int) -> None:
        self.locks[t] += 1
        self.candidate[t] = False

    def _unlock(self, t: int) -> None:
        self.locks[t] -= 1
        if self.locks[t] == 0 and self.resident[t] and self.evictable[t]:
            self.candidate[t] = True

    def _drop(self, t: int) -> None:
        self.resident[t] = False
        self.candidate[t] = False
        self.current -= self.size[t]
        self.events.append(Event(FREE, t))

    # -- eviction ---------------------------------------------------------------------------
    def _make_room(self, need: int, op: int) -> None:
        h = self.heuristic
        cand = np.flatnonzero(self.candidate)
        excess = self.current + need - self.budget
        if not len(cand) or self.size_bytes[cand].sum() < excess:
            self._out_of_memory(op, need)
        bounds = h.bounds(self, cand)
        ranked = cand[np.argsort(bounds, kind="stable")]
        if h.refine is None:
            freed = np.cumsum(self.size_bytes[ranked])
            k = int(np.searchsorted(freed, excess)) + 1
            for t in ranked[:k].tolist():
                self._evict(t)
            return
        bounds_sorted = np.sort(bounds, kind="stable").tolist()
        ranked = ranked.tolist()
        start = 0
        while self.current + need > self.budget:
            while not self.candidate[ranked[start]]:
                start += 1
            best, best_score = -1, math.inf
            for k in range(start, len(ranked)):
                if bounds_sorted[k] >= best_score:
                    break
                t = ranked[k]
                if self.candidate[t]:
                    score = h.refine(self, t, best_score)
                    if score < best_score:
                        best, best_score = t, score
            # Every score infinite (all touched at the current clock): the first one goes.
            self._evict(best if best >= 0 else ranked[start])

    def _evict(self, t: int) -> None:
        self._drop(t)
        self.stats["evictions"] += 1
        self.heuristic.on_evict(self, t)

    def _out_of_memory(self, op: int, need: int):
        name = self.graph.names[op] if op >= 0 else None
        what = f"op {name!r}" if name else "the step's outputs"
        raise OutOfMemoryError(
            f"heuristic {self.heuristic.name!r} ran out of evictable memory at {what} with "
            f"budget {self.budget:,.0f} bytes ({self.current:,} resident, {need:,} needed, "
            f"{int(self.size_bytes[self.candidate].sum()):,} evictable); no plan in this order "
            f"fits below {self.minimum:,} bytes: raise the budget above that, or try another "
            "heuristic", int(self.budget), self.minimum, name)

    # -- running ops ------------------------------------------------------------------------
    def _run(self, q: int, recompute: bool) -> None:
        """Allocate q's outputs and temporaries (evicting as needed) and advance the clock."""
        outs = self.op_outputs[q]
        need = self.temp[q] + sum(self.size[w] for w in outs)
        if self.current + need > self.budget:
            for w in outs:
                self._lock(w)
            self._make_room(need, q)
            for w in outs:
                self._unlock(w)
        self.peak = max(self.peak, self.current + need)
        self.clock += self.op_cost_us[q]
        for w in outs:
            if not self.resident[w]:
                self.resident[w] = True
                self.current += self.size[w]
                if self.evictable[w] and not self.locks[w]:
                    self.candidate[w] = True
                if recompute:
                    self.heuristic.on_rematerialize(self, w)
                    if not self.is_live(w):
                        self.scratch[w] = -1
            if not recompute:
                self.last_access[w] = self.clock
        self.computed[q] = True
        self.events.append(Event(RECOMPUTE if recompute else COMPUTE, q))
        if recompute:
            self.recompute_us += self.op_cost_us[q]
            if self.baseline_us + self.recompute_us > self.limit * self.baseline_us:
                overhead = 1.0 + self.recompute_us / self.baseline_us
                raise ThrashError(
                    f"heuristic {self.heuristic.name!r} thrashes at budget {self.budget:,.0f} "
                    f"bytes: recomputation reached {overhead:.2f}x the step's compute (limit "
                    f"{self.limit}x); raise the budget or the overhead limit", overhead,
                    self.limit)

    def _execute(self, op: int, inputs: list[int]) -> None:
        """Make ``inputs`` resident (recomputing evicted ones, recursively, with an explicit
        stack), then run ``op`` (-1: only lock the inputs, for the end of the step)."""
        frames = [[op, inputs, 0]]
        self.last_access[inputs] = self.clock
        while frames:
            frame = frames[-1]
            q, ins, k = frame
            if k < len(ins):
                t = ins[k]
                if self.resident[t]:
                    self._lock(t)
                    frame[2] = k + 1
                else:
                    p = self.producer[t]
                    if not self.recomputable[p] or not self.computed[p]:
                        raise RematError(f"internal error: {self.graph.tensor_name(t)} is needed "
                                         "but can no longer be recomputed")
                    frames.append([p, self.op_inputs[p], 0])
                    self.last_access[self.op_inputs[p]] = self.clock
                continue
            frames.pop()
            if q < 0:
                return
            self._run(q, recompute=bool(frames) or self.computed[q])
            for t in ins:
                self._unlock(t)

    def _clean_scratch(self) -> None:
        """After each op: free the kept dead tensors that no recomputation can read any more."""
        kept = {}
        for t, witness in self.scratch.items():
            if self.is_live(t) or not self.resident[t]:
                continue
            if witness < 0 or not self._serves(witness):
                witness = self._served_by(t)
            if witness >= 0:
                kept[t] = witness
            elif not self.recomputable[self.producer[t]]:
                # Its producer lost an input while t was kept: t goes as an unrecomputable
                # tensor does, pinning what is made from it.
                self._banish(t)
            else:
                self._drop(t)
                self.heuristic.on_evict(self, t)
        self.scratch = kept

    def _serves(self, w: int) -> bool:
        """``w`` is evicted and still needed: recomputing it will read its ancestors."""
        return not self.resident[w] and self.is_live(w)

    def _served_by(self, t: int) -> int:
        """A tensor dead ``t`` may still serve (``_serves``), made from it through ops already
        run and their non-resident outputs; -1 if none within ``_SERVE_WALK`` tensors."""
        resident, computed = self.resident, self.computed
        seen, stack = {t}, [t]
        while stack:
            for r in self.consumers[stack.pop()]:
                if not computed[r]:
                    continue
                for w in self.op_outputs[r]:
                    if w in seen:
                        continue
                    if self._serves(w):
                        return w
                    if resident[w]:
                        continue
                    if len(seen) >= _SERVE_WALK:
                        return -1
                    seen.add(w)
                    stack.append(w)
        return -1

    def _use(self, t: int) -> None:
        """Op at the current position read ``t``: advance its next use, free it if dead."""
        self.use_ptr[t] += 1
        uses = self.use_pos[t]
        if self.use_ptr[t] < len(uses):
            self.next_use[t] = uses[self.use_ptr[t]]
        else:
            self.next_use[t] = self.end if self.is_output[t] else self.end + 1
            if not self.is_output[t]:
                self._release(t)

    def _release(self, t: int) -> None:
        """``t`` is dead: free it now (or banish it, if it cannot be recomputed)."""
        if not self.resident[t] or self.locks[t]:
            return
        if self.recomputable[self.producer[t]]:
            witness = self._served_by(t) if self.budget < math.inf else -1
            if witness >= 0:
                self.scratch[t] = witness
            else:
                self._drop(t)
                self.heuristic.on_evict(self, t)
        elif not self.keep_forever[self.producer[t]]:
            self._banish(t)

    def _banish(self, u: int) -> None:
        """Free unrecomputable ``u`` if no evicted, still-needed tensor depends on it through
        evicted ones, and pin the resident outputs of the ops that lose their input — unless
        those are larger than u. Otherwise retry after the last use of the tensors that block
        it (or would be pinned)."""
        ops, pin, blocked_until, pinned_bytes, pin_until = [], [], -1, 0, -1
        seen, stack = {u}, [u]
        while stack:
            for r in self.consumers[stack.pop()]:
                if not self.recomputable[r]:
                    continue
                ops.append(r)
                for w in self.op_outputs[r]:
                    if self.resident[w]:
                        pin.append(w)
                        if self.is_live(w) and self.evictable[w]:
                            pinned_bytes += self.size[w]
                            last = self.end if self.is_output[w] else self.use_pos[w][-1]
                            pin_until = max(pin_until, last)
                    elif self.is_live(w):
                        last = self.end if self.is_output[w] else self.use_pos[w][-1]
                        blocked_until = max(blocked_until, last)
                    elif w not in seen:
                        seen.add(w)
                        stack.append(w)
        if pinned_bytes > self.size[u] and self.budget < math.inf:
            # Keeping u costs less memory than pinning what it feeds (without a budget,
            # nothing is ever evicted, so pinning is free).
            blocked_until = max(blocked_until, pin_until)
        if blocked_until >= 0:
            self.stats["deferred_banishments"] += 1
            self.retry.setdefault(blocked_until, []).append(u)
            return
        self._drop(u)
        self.stats["banished"] += 1
        for r in ops:
            self.recomputable[r] = False
        for w in pin:
            self.evictable[w] = False
            self.candidate[w] = False

    def _recomputable_now(self, t: int) -> bool:
        """Whether evicted ``t`` can be recomputed from what is resident or recomputable."""
        seen, stack = {t}, [t]
        while stack:
            p = self.producer[stack.pop()]
            if not self.recomputable[p] or not self.computed[p]:
                return False
            for u in self.op_inputs[p]:
                if not self.resident[u] and u not in seen:
                    seen.add(u)
                    stack.append(u)
        return True

    def _last_reads_of_old_value(self, readers: list[int]) -> None:
        """Before a variable's update: recompute every evicted output of the ops that read its
        old value that a later op or recomputation still needs, then forbid recomputing those
        ops, and every op that could only be recomputed through an output of theirs that is
        gone, and keep their resident outputs (module docstring, "Variable updates")."""
        readers = [r for r in readers if self.recomputable[r] and self.computed[r]]
        needed = {r: [w for w in self.op_outputs[r] if not self.resident[w]
                      and (self.is_live(w) or self._served_by(w) >= 0)] for r in readers}
        # A reader whose evicted output cannot be recomputed here (an input of it is gone)
        # stays as it was: TF then copies the variable if it runs again.
        readers = [r for r in readers if all(map(self._recomputable_now, needed[r]))]
        again = [w for r in readers for w in needed[r]]
        if again:
            self.stats["reads_before_update"] += len(again)
            self._execute(-1, again)
            for w in again:
                self._unlock(w)
        for r in readers:
            ops, pin = self._recomputed_through(r)
            for op in ops:
                self.recomputable[op] = False
            for w in pin:
                self.evictable[w] = False
                self.candidate[w] = False

    def _recomputed_through(self, r: int) -> tuple[list[int], list[int]]:
        """The ops that would recompute ``r`` or need it recomputed (through its outputs that
        are gone) and their resident outputs; nothing if an evicted, still-needed tensor is
        among them (it must stay recomputable)."""
        ops, pin, seen, stack = [], [], {r}, [r]
        while stack:
            op = stack.pop()
            ops.append(op)
            for w in self.op_outputs[op]:
                if self.resident[w]:
                    pin.append(w)
                    continue
                if self.is_live(w):
                    return [], []
                for c in self.consumers[w]:
                    if self.recomputable[c] and self.computed[c] and c not in seen:
                        seen.add(c)
                        stack.append(c)
        return ops, pin

    def run(self) -> RematPlan:
        if self.budget < self.minimum:
            raise BudgetTooSmallError(
                f"budget {self.budget:,.0f} bytes is below the minimum of {self.minimum:,} "
                f"bytes this step needs in this order, {self.floor}", int(self.budget),
                self.minimum, None)
        for p, i in enumerate(self.order):
            self.position = p
            if i in self.old_value_readers:
                self._last_reads_of_old_value(self.old_value_readers[i])
            self._execute(i, self.op_inputs[i])
            for t in self.op_inputs[i]:
                self._use(t)
            for w in self.op_outputs[i]:
                if not self.use_pos[w] and not self.is_output[w]:
                    self._release(w)
            self._clean_scratch()
            for u in self.retry.pop(p, ()):
                self._release(u)
        self.position = self.end
        self._execute(-1, [t for t, o in enumerate(self.is_output) if o])
        for t in self.scratch:
            if self.resident[t] and not self.is_live(t):
                self._drop(t)
        stats = dict(self.stats, heuristic=self.heuristic.name, minimum_bytes=self.minimum,
                     planning_s=time.perf_counter() - self.started)
        return RematPlan(events=self.events, budget_bytes=int(min(self.budget, 2**63 - 1)),
                         peak_bytes=int(self.peak), baseline_compute_us=self.baseline_us,
                         compute_us=self.baseline_us + self.recompute_us,
                         method=self.heuristic.name, stats=stats)


def simulate(graph: CostGraph, budget_bytes: float | None, heuristic: str = "dtr", *,
             order: Sequence[int] | None = None, outputs: Sequence[int] = (),
             overhead_limit: float = 2.0, seed: int = 0) -> RematPlan:
    """Plan a step under ``budget_bytes`` with a DTR eviction heuristic.

    Parameters:
        graph: the step's cost graph.
        budget_bytes: memory budget including persistent bytes (None: unlimited, which gives
            the checkpoint-all plan).
        heuristic: one of ``PLANNERS``: an eviction score of ``remat.heuristics``, or
            ``"offline"``, which replays the step with each score of ``OFFLINE_PORTFOLIO``
            (``belady`` reads the known future) and returns the cheapest plan (fewest
            recomputed microseconds, then lowest peak) — possible only offline, and never
            worse than ``dtr`` by construction.
        order: the execution order (op ids); default: the graph's topological ids.
        outputs: tensor ids that must be resident when the step ends (fetches).
        overhead_limit: fail as thrashing when compute with recomputation exceeds this
            multiple of the step's compute.
        seed: seed of the ``random`` heuristic. Everything else is deterministic.

    Returns:
        The plan; ``stats`` holds evictions, banishments, the minimum budget and planning time.

    Raises:
        BudgetTooSmallError: the budget is below ``minimum_budget_bytes`` (named in the message).
        OutOfMemoryError: nothing left to evict although the budget is above the minimum.
        ThrashError: the overhead limit was exceeded.
        InvalidOrderError: for a bad ``order``; ValueError for an unknown heuristic.

    Examples:
        >>> from graphfit.profiler.synthetic import training_like
        >>> g = training_like(60, seed=1)
        >>> full = simulate(g, None)
        >>> (full.overhead, full.num_recomputes, full.peak_bytes == baseline_peak_bytes(g))
        (1.0, 0, True)
        >>> try:
        ...     simulate(g, full.peak_bytes // 2, "dtr")
        ... except BudgetTooSmallError as e:
        ...     print(e.minimum_bytes == minimum_budget_bytes(g))
        True

    References:
        Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021, §3 (the runtime
        algorithm and h_DTR) and its simulator (uwsampl/dtr-prototype, simrd).
    """
    if budget_bytes is not None:
        check_number(budget_bytes, "budget_bytes", minimum=0)
    check_number(overhead_limit, "overhead_limit", minimum=1, allow_inf=True)
    bad = [t for t in outputs if not 0 <= t < graph.num_tensors]
    if bad:
        raise ArgumentError(f"outputs {bad[:5]} are not tensor ids of the graph (it has "
                            f"{graph.num_tensors} tensors: 0 .. {graph.num_tensors - 1})")
    budget = math.inf if budget_bytes is None else float(budget_bytes)
    step = _step(graph, order, outputs)
    if heuristic != "offline":
        return _Simulation(graph, step, budget, heuristic, overhead_limit, seed).run()
    plans, errors = [], []
    for member in OFFLINE_PORTFOLIO:
        try:
            plans.append(_Simulation(graph, step, budget, member, overhead_limit, seed).run())
        except (OutOfMemoryError, ThrashError) as e:
            errors.append(e)
    if not plans:
        raise errors[0]
    best = min(plans, key=lambda plan: (plan.compute_us, plan.peak_bytes))
    best.stats.update(chosen=best.method, tried=list(OFFLINE_PORTFOLIO),
                      planning_s=sum(plan.stats["planning_s"] for plan in plans))
    best.method = "offline"
    return best


def baseline_peak_bytes(graph: CostGraph, order: Sequence[int] | None = None,
                        outputs: Sequence[int] = ()) -> int:
    """Peak of the checkpoint-all plan (no budget, nothing recomputed), the reference budget
    ratios are taken of."""
    return simulate(graph, None, "lru", order=order, outputs=outputs).peak_bytes
