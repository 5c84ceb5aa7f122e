"""A model of TensorFlow's executor running one step, to predict the step's wall time.

TF starts an op as soon as its data and control inputs are done, on one of its inter-op
threads (as many as the machine has cores), and every running op shares the cores through the
intra-op pool. A rewritten step mixes both regimes: its forward pass runs ops side by side as
the user's step does, its chained backward pass one at a time, and floating events
(``remat.side_by_side``) beside the chain. Summing op times per regime (what
``remat.step_time`` did before) cannot say how much a floating event overlaps the chain; a
replay of the step's dependency graph can.

``simulate_step`` replays a step as list scheduling on ``threads`` threads (ready ops in the
order they became ready, ties in graph order) with processor sharing: while ``k`` ops run, each
progresses at ``1 / (1 + sharing * (k - 1))`` of its speed alone. ``sharing`` 0 is free
overlap (ops that use one core each), 1 a fair split of the cores (ops that scale over all of
them), above 1 ops that slow each other beyond that (memory bandwidth). ``fit_sharing`` finds
the value that replays a measured step's wall time; a step's ops give 0.73-1.05 on this
machine class (2026-12-06: zoo mlp, transformer and resnet presets, Keras attention, conv and
depthwise steps).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["SimulatedStep", "fit_sharing", "simulate_step"]


class SimulatedStep(NamedTuple):
    """The replayed step: its wall time and when each op started (µs from the step's start)."""

    wall_us: float
    start_us: dict[str, float]


def simulate_step(inputs: Mapping[str, Sequence[str]], durations: Mapping[str, float],
                  threads: int, sharing: float) -> SimulatedStep:
    """Replay a step on ``threads`` inter-op threads with processor sharing (module docstring).

    Parameters:
        inputs: op -> the ops it waits for (data and control inputs); its keys are the ops
            the step runs, in graph order (the tie-break), and inputs that are not keys are
            ignored (they ran before the step or not at all).
        durations: op -> its time running alone (µs); a missing or zero time (an op Grappler
            fused into its reader or removed) completes as soon as it is ready, on no thread.
        threads: inter-op threads (at least 1); ``sharing``: at least 0.

    Raises:
        ValueError: the dependencies have a cycle, or bad ``threads`` / ``sharing``.
    """
    if threads < 1 or sharing < 0:
        raise ValueError(f"threads {threads} must be at least 1 and sharing {sharing} at "
                         f"least 0")
    position = {op: i for i, op in enumerate(inputs)}
    producers = {op: {i for i in inputs[op] if i in position} for op in inputs}
    waiting = {op: len(ops) for op, ops in producers.items()}
    readers: dict[str, list[str]] = {op: [] for op in inputs}
    for op, ops in producers.items():
        for producer in ops:
            readers[producer].append(op)
    ready = [(0.0, position[op], op) for op in inputs if waiting[op] == 0]
    heapq.heapify(ready)
    running: dict[str, float] = {}           # op -> its time alone still to run
    start: dict[str, float] = {}
    now = 0.0

    def finish(op: str) -> None:
        for reader in readers[op]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (now, position[reader], reader))

    while ready or running:
        while ready and (len(running) < threads or durations.get(ready[0][2], 0.0) <= 0):
            _, _, op = heapq.heappop(ready)
            start[op] = now
            if durations.get(op, 0.0) > 0:
                running[op] = durations[op]
            else:
                finish(op)
        if not running:
            continue
        rate = 1.0 / (1.0 + sharing * (len(running) - 1))
        step = min(running.values()) / rate
        now += step
        done = []
        for op in running:
            running[op] -= step * rate
            if running[op] <= 1e-9:
                done.append(op)
        for op in done:
            del running[op]
            finish(op)
    if len(start) != len(inputs):
        stuck = next(op for op in inputs if op not in start)
        raise ValueError(f"the step's dependencies have a cycle through {stuck!r}")
    return SimulatedStep(now, start)


def fit_sharing(inputs: Mapping[str, Sequence[str]], durations: Mapping[str, float],
                threads: int, wall_us: float, most: float = 2.0) -> float:
    """The ``sharing`` in ``[0, most]`` with which ``simulate_step`` replays the step in
    ``wall_us`` (bisection: the replayed wall grows with ``sharing``); the nearest end where
    none does."""
    low, high = 0.0, most
    for _ in range(16):
        middle = (low + high) / 2
        if simulate_step(inputs, durations, threads, middle).wall_us < wall_us:
            low = middle
        else:
            high = middle
    return (low + high) / 2
