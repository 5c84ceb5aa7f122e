"""Which plan events may float: run as soon as their inputs exist, beside the pinned chain,
without raising the plan's peak.

The rewrite (``remat.rewrite``) pins the backward pass to the plan's order with control edges,
because the plan's memory prediction assumes one op at a time. A strict chain also takes
away TF's inter-op parallelism: on a Keras attention step at 0.5 of its peak the chain alone
(a checkpoint-all plan, nothing recomputed) cost 1.21-1.24x the user's step. Most events are
far below the plan's peak, though, and an event whose output is small can run early without
the peak noticing. This module finds those events; the rewrite gives them no pin (only their
data edges order them) and makes the next pinned event wait for them (a join), so a floating
event is never late either.

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
with it in 4 of 20). The bound still misses on that step: 12 of 32 runs of eight plans
measured 0.25-1 MiB over (2026-12-05), which is why ``pipeline.optimize`` measures every
floating step and falls back to the strict chain when one misses its budget, or its plan by
more than 5%. The
rewrite may still pin an event chosen here (a ``Mul`` or ``Add``, which Grappler regroups
unless it has a control edge, or an op oneDNN may merge with another: ``remat.rewrite.
NEVER_FLOATING_OP_TYPES``): pinning only delays an event, which the bound allows.

A stateful op never floats. A variable's update that runs before a planned read of the old
value (a recomputed reader of the weight's read, which no edge orders before the update) makes
TF copy the variable, bytes no plan counts: on a Keras attention step with Adam, letting
updates float measured 1.112 of the budget (one run); with them pinned 0.996 and 0.998 (two
runs, new plans), the strict chain 0.996-1.022.

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

import numpy as np

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import FREE, RematPlan

__all__ = ["floating_events", "expanded_positions"]


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


def floating_events(graph: CostGraph, plan: RematPlan, limit_bytes: int | None = None
                    ) -> set[int]:
    """Positions (in ``plan.events``) of the (re)compute events that may float (module
    docstring): not stateful, and within the bound.

    Parameters:
        graph: the cost graph ``plan`` was made on (the planning graph of
            ``remat.tf_memory.MemoryModel``, whose chains are single events).
        plan: the plan.
        limit_bytes: the memory the bound may reach; default the plan's replayed peak.

    Returns:
        Event positions, chosen greedily in plan order.
    """
    rows = _alone_bytes(graph, plan)
    alone = np.array([bytes_ for _, bytes_ in rows], dtype=np.int64)
    if limit_bytes is None:
        limit_bytes = int(alone.max(initial=0))
    ahead = np.zeros(len(rows), dtype=np.int64)   # bytes of floating events run ahead of m
    start_after = np.full(len(rows), -1, dtype=np.int64)
    floats = np.zeros(len(rows), dtype=bool)
    newest: dict[int, int] = {}          # op -> ordinal of its newest (re)computation
    first: dict[int, int] = {}           # op -> ordinal of its computation
    chosen = set()
    for k, (position, _) in enumerate(rows):
        op = plan.events[position].index
        # Data inputs read the newest version; a control input names the original node.
        deps = [newest[p] for p in set(graph.tensor_producer[graph.op_inputs(op)].tolist())]
        deps += [first[p] for p in graph.control_inputs(op).tolist()]
        start_after[k] = max((start_after[d] if floats[d] else d for d in deps), default=-1)
        over = slice(start_after[k] + 1, k)
        own = int(graph.output_bytes(op).sum()) + int(graph.temp_bytes[op])
        if (k > 0 and not graph.is_stateful[op]
                and (alone[over] + ahead[over] + own <= limit_bytes).all()):
            floats[k] = True
            ahead[over] += own
            chosen.add(position)
        newest[op] = k
        first.setdefault(op, k)
    return chosen


def expanded_positions(members: list[list[int]], plan: RematPlan, positions: set[int]
                       ) -> dict[int, int]:
    """``positions`` of ``plan``'s events (over a planning graph whose node ``i`` stands for
    the ops ``members[i]``) as positions in the expanded plan (``remat.tf_memory.
    expand_plan``: a chain's (re)computation becomes its ops' in order, a free stays one
    event): the positions of all of each chosen event's ops (a chain floats whole), each
    mapped to the position of its chain's first op. The bound takes a chain's start from all
    of the chain's inputs, so the rewrite holds every floating op of a chain until each of
    them exists: its first op alone could start earlier."""
    expanded, offset = {}, 0
    for position, (kind, index) in enumerate(plan.events):
        size = 1 if kind == FREE else len(members[index])
        if position in positions:
            expanded.update(dict.fromkeys(range(offset, offset + size), offset))
        offset += size
    return expanded
