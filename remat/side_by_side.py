"""Which plan events may float: run as soon as their inputs exist, beside the pinned chain,
without raising the plan's peak.

The rewrite (``remat.rewrite``) pins the backward pass to the plan's order with control edges,
because the plan's memory prediction assumes one op at a time. A strict chain also takes
away TF's inter-op parallelism: on a Keras attention step at 0.5 of its peak the chain alone
(a checkpoint-all plan, nothing recomputed) cost 1.21-1.24x the user's step. Most events are
far below the plan's peak, though, and an event whose output is small can run early without
the peak noticing. This module finds those events; the rewrite gives them no pin (only their
data edges order them) and makes a pinned event wait for each of them (a join): the next
pinned event, or a later one where the late bound below allows.

The bound. Let ``e_1, e_2, ...`` be the (re)compute events of the plan, and ``m`` the first
event not finished at some moment. Every event before ``m`` has finished; no pinned event
after ``m`` has started (it waits for every event before it, through its pin and the joins);
so besides ``m`` only floating events after ``m`` may have run. A floating event ``x`` can run
only once its inputs exist: once every event up to ``s(x)`` has finished, where ``s(x)`` is
the latest of its inputs' events (for an input made by a floating event, that event's own
``s``). The memory at that moment is at most, in the shared replay's accounting
(``remat.validate.replay_plan``)::

    alone(m) + sum of outputs(x) + temporary(x) over floating x with s(x) < m < x

where ``alone(m)`` is persistent bytes, the bytes live once every event before ``m`` ran and
the frees after them, and ``m``'s outputs and temporaries (a floating event that has run
early frees its inputs early too, which the bound ignores). Walking the plan in order, an
event floats if this stays within the limit (the plan's own predicted peak) for every ``m``
it may run ahead of. So a floating plan predicts no higher peak than the strict chain. An
event of the planning graph may stand for a chain of ops; its ``s`` is taken from all of the
chain's inputs, so the rewrite holds every floating op of a chain until each of them exists
(``remat.rewrite._hold_floating_chains``; without that, a chain's first op ran ahead and the
mlp ``activations`` step measured 1 MiB over its plan in 11 of 20 traced runs of five plans,
with it in 4 of 20). The bound still missed on that step in 12 of 32 runs of eight plans
(0.25-1 MiB over, 2026-12-05). Until 2026-12-07 the rewrite lost the hold edges of
recomputed chains (it added them to the clones after copying the clones into the graph):
a batch norm's recomputed ``Mul`` of ``bench.reach``'s Keras DenseNet-style step then ran in
the forward pass and held up to 17 MiB beyond the bound, 1.02-1.27 of the plan by the records;
with the edges kept it read 1.000 in 13 runs of 13. ``pipeline.optimize`` still measures every
floating step and falls back to the strict chain when one misses its budget, or its plan by
more than 5%. The rewrite may still pin an event chosen here (one of a pair oneDNN may
merge, ``remat.rewrite._fusable_pairs``, or a ``Mul`` or ``Add`` it finds no guard edge for):
pinning only delays an event, which the bound allows.

Late joins. Joined by the first pinned event after it, a floating event finishes before
that event starts, and then every pinned event after it waits for a strict chain's worth of
floating work: on ``keras.applications.ConvNeXtTiny`` at 0.5 the step ran 1.196x the
user's with these joins and 1.039x with none (one process, the same plans; without joins
the step also missed its budget in one run of two, 2026-12-07). So each floating event ``x``
is joined as late as a second bound allows, in plan order after the floating set is chosen.
Moments are now taken at the first unfinished pinned event ``P``: every pinned event before
it has finished, and so has every floating event joined to one of them; a floating ``x``
before ``P`` joined by ``P`` or later may still be running or waiting, and then holds, beyond
``alone(P)``, its temporary bytes and those of its inputs and outputs the plan has freed by
``P``. A join moves later, to pinned events up to the first pinned reader of ``x``'s outputs,
while at every event from ``x`` to the new join ``alone + ahead`` plus what every such
floating event holds there stays within the limit (the span up to the first join included:
``x`` may then run beside it too). Where no moved join covers a moment, the first bound
holds as before. Random executions check both (``tests/test_side_by_side.py``).

A stateful op floats only where edges order it against every other access of its state:
variable reads and writes once ``remat.early_updates.order_updates_after_reads`` ran
(``movable_stateful``). A variable's update that runs before a planned read of the old
value (a recomputed reader of the weight's read, which no edge orders before the update) makes
TF copy the variable, bytes no plan counts: on a Keras attention step with Adam, letting
updates float before those edges existed measured 1.112 of the budget (one run); with them
pinned 0.996 and 0.998 (two runs, new plans), the strict chain 0.996-1.022.

Measured (one plan at 0.5 of the measured peak, ``offline``, oneDNN off, idle VM, timed side
by side with the user's step, ``bench.side_by_side``): see that benchmark's JSON and
the README. On the Keras attention step (4 heads, seq 128, batch 16, SGD) 536 events
floated; the step took 1.402x the user's against 1.492x with the strict chain, at its plan's
peak (2026-12-05 00:29; a plan of 2026-12-04: 1.300x against 1.402x).

Where the rest goes (2026-12-05 05:20, the Keras attention step of ``bench.reach``, with
Adam; one plan at 0.5 recomputing 1.146x, rewritten several ways and timed side by side with
the user's step, 11 rounds): strict chain 1.408x, floating 1.343x; with every event floating
that is not stateful (the bound off: about 45 more, the large products of the tightest
moments) 1.231x, but at 1.25 of the budget; with no ordering edge at all 1.118x at 2.0 of it.
So the chain's remaining cost is memory the bound rightly refuses. Floating variable reads
(240 more events) or ``Mul``/``Add`` as well measured no gain (1.38x and 1.383x), and planning
for 0.9-0.95 of the budget to let events float up to it cost more than it freed (1.21-1.29x
compute, no more events floating).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import FREE, RematPlan

__all__ = ["Unpinned", "unpinned_events", "expanded_positions", "expanded_joins"]


def _alone_bytes(graph: CostGraph, plan: RematPlan) -> list[tuple[int, int]]:
    """Per (re)compute event, in plan order: ``(position in plan.events, bytes while it runs
    after every event before it finished)``, persistent bytes included."""
    persistent = int(graph.persistent_bytes.sum())
    resident = set()
    live = 0
    rows = []
    for position, (kind, index) in enumerate(plan.events):
        if kind == FREE:
            if index in resident:
                resident.discard(index)
                live -= int(graph.tensor_bytes[index])
            continue
        made = 0
        for t in graph.op_outputs(index):
            if t in resident:
                made += int(graph.tensor_bytes[t])   # a duplicate version, as the replay counts
            else:
                resident.add(t)
                live += int(graph.tensor_bytes[t])
        rows.append((position, persistent + live + made + int(graph.temp_bytes[index])))
    return rows


class Unpinned(NamedTuple):
    """The events the rewrite does not hold to the strict chain: ``floating`` positions (in
    ``plan.events``) run as soon as their inputs exist, and ``joins`` maps each floating
    position to the position of the pinned event that waits for it (none after the last
    pinned event); ``late_joins`` counts the joins later than the first pinned event after
    their floating event."""

    floating: set[int]
    joins: dict[int, int]
    late_joins: int = 0


def unpinned_events(graph: CostGraph, plan: RematPlan, limit_bytes: int | None = None,
                    movable_stateful: frozenset[str] = frozenset()) -> Unpinned:
    """The (re)compute events that may float, and the pinned event each is joined by
    (module docstring): not stateful, and within the bound.

    Parameters:
        graph: the cost graph ``plan`` was made on (the planning graph of
            ``remat.tf_memory.MemoryModel``, whose chains are single events).
        plan: the plan.
        limit_bytes: the memory the bound may reach; default the plan's replayed peak.
        movable_stateful: types of stateful ops that may move all the same, because edges of
            the graph order them against every other access of their state (variable reads
            and writes once ``remat.early_updates.order_updates_after_reads`` ran).

    Returns:
        Floating positions, chosen greedily in plan order, and their joins, each as late as
        the late bound allows, also greedily in plan order.
    """
    rows = _alone_bytes(graph, plan)
    alone = np.array([bytes_ for _, bytes_ in rows], dtype=np.int64)
    if limit_bytes is None:
        limit_bytes = int(alone.max(initial=0))
    ahead = np.zeros(len(rows), dtype=np.int64)   # bytes of floating events run ahead of m
    start_after = np.full(len(rows), -1, dtype=np.int64)
    floats = np.zeros(len(rows), dtype=bool)
    source = np.zeros(len(rows), dtype=bool)
    # The first pinned event that reads each event's outputs: it waits for the event anyway.
    first_reader = np.full(len(rows), len(rows), dtype=np.int64)
    reads = []
    newest: dict[int, int] = {}          # op -> ordinal of its newest (re)computation
    first: dict[int, int] = {}           # op -> ordinal of its computation
    for k, (position, _) in enumerate(rows):
        op = plan.events[position].index
        # Data inputs read the newest version; a control input names the original node.
        data = [newest[p] for p in set(graph.tensor_producer[graph.op_inputs(op)].tolist())]
        deps = data + [first[p] for p in graph.control_inputs(op).tolist()]
        reads.append(data)
        source[k] = not deps
        start_after[k] = max((start_after[d] if floats[d] else d for d in deps), default=-1)
        over = slice(start_after[k] + 1, k)
        own = int(graph.output_bytes(op).sum()) + int(graph.temp_bytes[op])
        if (k > 0 and (not graph.is_stateful[op] or graph.op_types[op] in movable_stateful)
                and (alone[over] + ahead[over] + own <= limit_bytes).all()):
            floats[k] = True
            ahead[over] += own
        newest[op] = k
        first.setdefault(op, k)
    for k in np.flatnonzero(~floats):
        first_reader[reads[k]] = np.minimum(first_reader[reads[k]], k)
    joins, late = _late_joins(graph, plan, rows, alone + ahead, floats, source, first_reader,
                              limit_bytes)
    return Unpinned({rows[k][0] for k in np.flatnonzero(floats)},
                    {rows[k][0]: rows[j][0] for k, j in joins.items()}, late)


def _late_joins(graph: CostGraph, plan: RematPlan, rows: list[tuple[int, int]],
                bound: np.ndarray, floats: np.ndarray, source: np.ndarray,
                first_reader: np.ndarray, limit_bytes: int) -> tuple[dict[int, int], int]:
    """Per floating row, the row of the pinned event that waits for it (module docstring,
    "Late joins"): the first pinned event after it, or a later one while every moment in
    between stays within ``limit_bytes`` with the floating event still to run. ``bound``:
    per row, the floating bound's bytes (``alone`` + ``ahead``). Also returns how many
    joins are later than the first."""
    n = len(rows)
    positions = np.array([position for position, _ in rows], dtype=np.int64)
    pinned = np.flatnonzero(~floats & ~source)
    frees: dict[int, list[int]] = {}     # tensor -> positions of its frees
    for position, (kind, index) in enumerate(plan.events):
        if kind == FREE:
            frees.setdefault(index, []).append(position)

    def extra(k: int, lo: int, hi: int) -> np.ndarray:
        # Bytes a floating event still running holds at rows lo..hi-1 beyond the plan's: its
        # temporary bytes, and its inputs and outputs where the plan has freed them by then.
        position = rows[k][0]
        op = plan.events[position].index
        held = np.zeros(hi - lo + 1, dtype=np.int64)
        held[0] = graph.temp_bytes[op]
        for t in set(graph.op_inputs(op).tolist()) | set(graph.op_outputs(op)):
            later = [p for p in frees.get(t, ()) if p > position]
            if later:
                freed = int(np.searchsorted(positions, later[0]))
                held[min(max(freed - lo, 0), hi - lo)] += graph.tensor_bytes[t]
        return np.cumsum(held)[:-1]

    first_join = {}
    late = np.zeros(n, dtype=np.int64)
    for k in np.flatnonzero(floats):
        after = np.searchsorted(pinned, k, side="right")
        if after < len(pinned):
            first_join[k] = j = int(pinned[after])
            late[k + 1:j + 1] += extra(k, k + 1, j + 1)
    joins, late_joins = {}, 0
    for k, j in first_join.items():
        last = int(min(first_reader[k], n - 1))
        # Joined later, it may also still run beside its first join (the old bound's window).
        if last > j and (bound[k + 1:j + 1] + late[k + 1:j + 1] <= limit_bytes).all():
            held = extra(k, j + 1, last + 1)
            fits = bound[j + 1:last + 1] + late[j + 1:last + 1] + held <= limit_bytes
            stop = j + 1 + int(np.argmin(fits)) if not fits.all() else last + 1
            candidates = pinned[(pinned > j) & (pinned < stop)]
            if len(candidates):
                later = int(candidates[-1])
                late[j + 1:later + 1] += held[:later - j]
                j = later
                late_joins += 1
        joins[k] = j
    return joins, late_joins


def _offsets(members: list[list[int]], plan: RematPlan) -> list[tuple[int, int]]:
    """Per event of ``plan``: its position in the expanded plan (``remat.tf_memory.
    expand_plan``: a chain's (re)computation becomes its ops' in order, a free stays one
    event) and how many ops it expands to."""
    rows, offset = [], 0
    for kind, index in plan.events:
        size = 1 if kind == FREE else len(members[index])
        rows.append((offset, size))
        offset += size
    return rows


def expanded_positions(members: list[list[int]], plan: RematPlan, positions: set[int]
                       ) -> dict[int, int]:
    """``positions`` of ``plan``'s events (over a planning graph whose node ``i`` stands for
    the ops ``members[i]``) as positions in the expanded plan (``_offsets``): the positions
    of all of each chosen event's ops (a chain floats whole), each mapped to the position of
    its chain's first op. The bound takes a chain's start from all of the chain's inputs, so
    the rewrite holds every floating op of a chain until each of them exists: its first op
    alone could start earlier."""
    return {offset + i: offset for position, (offset, size) in enumerate(_offsets(members, plan))
            if position in positions for i in range(size)}


def expanded_joins(members: list[list[int]], plan: RematPlan, joins: dict[int, int]
                   ) -> dict[int, int]:
    """``joins`` (floating event -> the event that waits for it, positions in ``plan.events``)
    as positions in the expanded plan: each op of a floating event mapped to the position of
    the first op of its join."""
    offsets = _offsets(members, plan)
    return {offsets[position][0] + i: offsets[join][0]
            for position, join in joins.items() for i in range(offsets[position][1])}
