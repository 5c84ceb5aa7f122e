"""Which plan events may run beside the event before them without raising the plan's peak.

The rewrite (``remat.rewrite``) pins the backward pass to the plan's order with control edges,
because the plan's memory prediction assumes one op at a time. A strict chain also takes
away TF's inter-op parallelism (two threads on this 2-core machine): on a DenseNet-style Keras
net, chaining alone cost about 0.2 of the step's wall time. Most events are far below the
plan's peak, though, and running two of them side by side there costs no memory the peak
would notice. This module finds those events; the rewrite then pins them one event further
back (a window of two events), and keeps the strict chain only where the peak needs it.

The window. Let ``e_1, e_2, ...`` be the (re)compute events of the plan. An event pinned
"beside" may start once every event up to ``e_{k-2}`` has finished, so at most the two
events ``e_{k-1}`` and ``e_k`` run at once, and no later event has started (a later event
waits at least for ``e_{k-1}``). Memory while both run, in the shared replay's accounting
(``remat.validate.replay_plan``):

    persistent + live(after e_{k-2} and the frees that follow it)
               + outputs(e_{k-1}) + temporary(e_{k-1}) + outputs(e_k) + temporary(e_k)

(tensors whose last reader is ``e_{k-1}`` or ``e_k`` are still live: TF frees a tensor when
its last reader has finished). An event is pinned beside its predecessor only if this is at
most the plan's own replayed peak, so the window never predicts a higher peak than the plan.
An event that reads an output of the event before it cannot overlap it anyway and keeps the
strict pin (its data edge is the pin).

Measured (``tools.bench_side_by_side``: one plan at 0.5, oneDNN off, lowered both ways and
timed side by side with the user's step): measured peak / plan 1.000 both ways on the mlp,
resnet, Keras conv, depthwise, attention and DenseNet-style steps, 0.997 on the zoo
transformer (after ``remat.grappler_pins`` made the pins hold through Grappler). Step time:
the DenseNet-style step, many small ops that leave a core idle, 1.181 -> 1.050 of the user's
step; the other six within -2% and +6% of the strict chain, the sign changing between runs
(their ops use both cores through intra-op threads). But on a Keras attention step with Adam
``optimize`` measured 1.04-1.19 of the plan in 4 of 11 runs with the window (the strict chain
1.000; cause not found), so the window is used only where a run checks it: ``baechi.optimize``
with ``verify``, which falls back to the strict chain when the measured peak exceeds the plan.
"""

from __future__ import annotations

from graphfit.profiler.cost_graph import CostGraph
from graphfit.remat.plan import FREE, RematPlan

__all__ = ["side_by_side_events", "window_peak_bytes", "expanded_positions"]


def _window_memory(graph: CostGraph, plan: RematPlan) -> list[tuple[int, int, int]]:
    """Per (re)compute event, in plan order: ``(position in plan.events, bytes while it runs
    alone after its predecessor, bytes while it runs beside its predecessor)``; the second
    and third include persistent bytes (the first event's third equals its second)."""
    persistent = int(graph.persistent_bytes.sum())
    resident = set()
    live = 0
    rows = []
    live_after: list[int] = []       # live bytes after each (re)compute event and its frees
    running: list[int] = []          # outputs + temporary of each (re)compute event
    for position, (kind, index) in enumerate(plan.events):
        if kind == FREE:
            if index in resident:
                resident.discard(index)
                live -= int(graph.tensor_bytes[index])
                live_after[-1] = live
            continue
        made = 0
        for t in graph.op_outputs(index):
            if t in resident:
                made += int(graph.tensor_bytes[t])   # a duplicate version, as the replay counts
            else:
                resident.add(t)
                live += int(graph.tensor_bytes[t])
        own = int(graph.output_bytes(index).sum()) + int(graph.temp_bytes[index])
        alone = persistent + live + made + int(graph.temp_bytes[index])
        beside = (persistent + (live_after[-2] if len(live_after) > 1 else 0) + running[-1] + own
                  if running else alone)
        rows.append((position, alone, max(alone, beside)))
        running.append(own)
        live_after.append(live)
    return rows


def side_by_side_events(graph: CostGraph, plan: RematPlan,
                        limit_bytes: int | None = None) -> set[int]:
    """Positions (in ``plan.events``) of the (re)compute events that may run beside the
    (re)compute event before them (module docstring).

    Parameters:
        graph: the cost graph ``plan`` was made on (the planning graph of
            ``remat.tf_memory.MemoryModel``, whose chains are single events).
        plan: the plan.
        limit_bytes: the memory the pair may use; default the plan's replayed peak.

    Returns:
        Event positions. An event reading its predecessor's output is never one: the data
        edge orders the pair, and marking it would let the event after it start early.
    """
    rows = _window_memory(graph, plan)
    if limit_bytes is None:
        limit_bytes = max((alone for _, alone, _ in rows), default=0)
    chosen = set()
    for k, (position, _, beside) in enumerate(rows):
        if k == 0:
            continue
        previous = plan.events[rows[k - 1][0]].index
        reads_previous = previous in graph.predecessors(plan.events[position].index)
        if not reads_previous and beside <= limit_bytes:
            chosen.add(position)
    return chosen


def window_peak_bytes(graph: CostGraph, plan: RematPlan, beside: set[int]) -> int:
    """The replayed peak of ``plan`` when the events at positions ``beside`` may run beside
    the event before them: what ``side_by_side_events`` keeps at or below the plan's peak."""
    return max((b if position in beside else alone
                for position, alone, b in _window_memory(graph, plan)), default=0)


def expanded_positions(members: list[list[int]], plan: RematPlan, positions: set[int]
                       ) -> set[int]:
    """``positions`` of ``plan``'s events (over a planning graph whose node ``i`` stands for
    the ops ``members[i]``) as positions in the expanded plan (``remat.tf_memory.
    expand_plan``: a chain's (re)computation becomes its ops' in order, a free stays one
    event): the position of each chosen event's first op, the one that waits."""
    expanded, offset = set(), 0
    for position, (kind, index) in enumerate(plan.events):
        if position in positions:
            expanded.add(offset)
        offset += 1 if kind == FREE else len(members[index])
    return expanded
