"""m-ETF: memory-constrained earliest-task-first list scheduling.

ETF (Hwang, Chow, Anger & Lee, SIAM J. Comput. 1989) repeatedly starts the ready task that can
start earliest, on the processor where it starts earliest, with communication delays on the
edges. Baechi's m-ETF (Jeon et al., SoCC 2020, §3.4) adds memory: a device whose free memory
cannot hold the op is excluded, and a colocation group is pinned to the device of its first
placed op.

This implementation keeps two heaps per device: ready units whose inputs are not there yet,
keyed by data-ready time, and units that could start as soon as the device is free, keyed by
priority (longest compute path to the end, "bottom level"). The earliest (unit, device) pair is
the best of the D heap tops, so a step costs O(D log n) instead of scanning every ready unit on
every device. Entries go stale lazily (a unit committed elsewhere, a group pinned elsewhere, a
link that got busier) and are re-checked when they reach a top; a newly ready unit enters
every device with its last input's end as the key and is asked where it reaches a top. With
contending links most stale entries are held back by the device's one receiving channel; a
third heap parks those by the cost of their sends, which that channel's progress does not
change, until channel + cost fits (``ScheduleBuilder.receive_bound``), and a device whose
earliest start is after the best candidate so far is not asked that turn. When a ready
unit fits on no allowed device, it waits for the next memory release; if nothing will ever be
released the instance is reported with the shortfall instead of deadlocking (Baechi's m-ETF
could hang here with co-placement under tight memory). To make that rarer, the last 20% of each
device's memory is a reserve: a unit that would grow a device into it (allocating more than it
releases) waits while any other unit can run, so the consumers that release memory run first.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.memory_first import memory_first
from graphfit.baechi.schedule import PlacementError, Schedule, ScheduleBuilder
from graphfit.baechi.units import UnitGraph
from graphfit.profiler.cost_graph import gc_paused

__all__ = ["m_etf"]

_EPS_US = 1e-9
RESERVE_FRACTION = 0.2


def _shortfall_message(builder: ScheduleBuilder, blocked: list[int], method: str) -> str:
    units, names = builder.units, builder.devices.names
    best = min(((builder.shortfall_bytes(u, d), u, d) for u in blocked
                for d in range(builder.num_devices)))
    short, u, d = best
    return (f"{method}: {len(blocked)} ready units fit on no device and no memory will be "
            f"released; unit {units.unit_name(u)!r} misses {short} bytes on {names[d]} "
            f"(limit {builder.limit[d]} bytes, {builder.level[d]} in use). Raise the device "
            f"memory by at least {short} bytes, rematerialize, or use fewer colocation "
            "constraints (placer_type='default').")


def m_etf(units: UnitGraph, devices: DeviceSet, memory_model: str = "liveness",
          favourite_parent: np.ndarray | None = None, method: str = "m_etf",
          memory_first_only: bool = False) -> Schedule:
    """Place and schedule ``units`` on ``devices`` with memory-constrained ETF.

    Parameters:
        units: the unit graph (one op per unit, or fused units).
        devices: the devices, their memory limits and link costs.
        memory_model: ``"liveness"`` (default) or ``"static"`` for the fit test.
        favourite_parent: per unit, the parent whose device it should run on (-1: none).
            m-SCT passes its rounded LP solution here. When a unit becomes ready and its
            favourite parent is the last unit committed on its device, that device has room
            for it and would start it no later than any other device, the device is held for
            it (SCT's rule as Baechi's m-SCT applies it: the favourite child runs right after
            its parent): the child goes before any other unit startable there, and no other
            unit starts there before the child's inputs are in. Otherwise it is placed as in
            plain ETF.
        method: name used in error messages.
        memory_first_only: skip list scheduling and go straight to the repair step (a caller
            that already saw list scheduling fail at a higher limit).

    Returns:
        The ``Schedule`` (device, start and finish per unit; exact per-device peak bytes).

    Raises:
        PlacementError: when ready units fit on no device and no memory will be released,
            even in sequential order (``baechi.memory_first``, the repair step); the message
            names the unit, the device and the missing bytes.

    References:
        Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020.
        Hwang et al., "Scheduling precedence graphs in systems with interprocessor
        communication times", SIAM J. Comput. 18(2), 1989.
    """
    # List scheduling allocates millions of small tuples and lists and no cycles: the cyclic
    # collections their number triggers took 0.5-0.9 s of 6 on the 100k random graph
    with gc_paused():
        if not memory_first_only:
            try:
                return _earliest_task_first(units, devices, memory_model, favourite_parent,
                                            method)
            except PlacementError:
                pass
        return memory_first(units, devices, memory_model, favourite_parent, method)


def _earliest_task_first(units: UnitGraph, devices: DeviceSet, memory_model: str,
                         favourite_parent: np.ndarray | None, method: str) -> Schedule:
    builder = ScheduleBuilder(units, devices, memory_model)
    num_devices = len(devices)
    priority = (-units.bottom_level_us()).tolist()
    group = units.group.tolist()
    fav = favourite_parent.tolist() if favourite_parent is not None else None
    all_devices = range(num_devices)
    # Per device: units whose data is not there yet, keyed by data-ready time; units that could
    # start as soon as the device is free, keyed by priority. Entries go stale lazily.
    waiting = [[] for _ in all_devices]      # (data ready us, priority, unit)
    startable = [[] for _ in all_devices]    # (priority, data ready us, unit)
    # units kept from starting by d's receiving channel: (cost of their sends, priority, data
    # ready us, unit), and per u * D + d the live entry (an unparked one stays in the heap)
    parked_on = [[] for _ in all_devices]
    parked_entry: dict[int, tuple[float, float, float, int]] = {}
    queued = [0] * units.num_units           # bit d: unit is in device d's heaps
    blocked: list[set[int]] = [set() for _ in all_devices]
    # Memory reserve: a unit that would grow a device into its last RESERVE_FRACTION waits
    # while anything else can run, so consumers that release memory get room first.
    reserve = (RESERVE_FRACTION * devices.memory_bytes).tolist()
    held: list[set[int]] = [set() for _ in all_devices]
    use_reserve = False

    # m-SCT: per device, the favourite child it is held for and when its inputs are there.
    awaited: list[tuple[int, float] | None] = [None] * num_devices
    touched: set[int] = set()  # devices whose heaps got a unit since their candidate was taken

    placed, group_device = builder.device, builder.group_device
    data_ready_us, receive_bound = builder.data_ready_us, builder.receive_bound
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace

    def enqueue(u: int, devs, ready: list[float] | float | None = None,
                first: bool = False) -> None:
        """Queue u on devs. ready: per device, when its inputs would be there; one number, a
        lower bound on every device (asked when it reaches a top); None: asked now."""
        prio = -math.inf if first else priority[u]
        lower_bound = isinstance(ready, float)
        key = u * num_devices
        bits = queued[u]
        for d in devs:
            if not bits >> d & 1:
                bits |= 1 << d
                touched.add(d)
                if lower_bound:
                    when = ready
                    confirmed[key + d] = -1
                else:
                    when = ready[d] if ready is not None else data_ready_us(u, d)
                    confirmed[key + d] = builder.ready_epoch(d)
                heappush(waiting[d], (when, prio, u))
        queued[u] = bits

    def on_ready(u: int, produced_us: float) -> None:
        """u's last input is produced at produced_us: no device has it earlier. Without a
        favourite parent that is its key everywhere, and only the devices where it reaches a
        top ask when its inputs would really be there (it is committed on one, and on the
        others it seldom gets that far)."""
        pinned = builder.group_device[group[u]]
        if pinned != -1:
            enqueue(u, (pinned,), produced_us)
            return
        if fav is None or fav[u] == -1:
            enqueue(u, all_devices, produced_us)
            return
        # SCT's rule: the favourite child runs right after its parent unless that delays it
        ready = [data_ready_us(u, d) for d in all_devices]
        d = placed[fav[u]]
        free, clock = builder.device_free, builder.clock
        start = [max(free[e], clock, ready[e]) for e in all_devices]
        if builder.units_on[d][-1] == fav[u] and start[d] <= min(start) + _EPS_US and \
                builder.shortfall_bytes(u, d) <= 0:
            awaited[d] = (u, ready[d])
            enqueue(u, (d,), ready, first=True)
            return
        enqueue(u, all_devices, ready)

    def drop(u: int, d: int, heap: list) -> None:
        """Remove u's entry, normally the top (a requeue may have pushed a smaller one)."""
        if heap[0][2] == u:
            heappop(heap)
        else:
            k = next(k for k, entry in enumerate(heap) if entry[2] == u)
            heap[k] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
        queued[u] &= ~(1 << d)

    def earliest() -> list[float]:
        """When each device can start its next unit at the soonest: free, and past the clock
        (a held device: once its favourite child's inputs are there)."""
        clock = builder.clock
        lower = [free if free >= clock else clock for free in builder.device_free]
        if fav is not None:
            for d in all_devices:
                if awaited[d] is not None:
                    if placed[awaited[d][0]] == -1:
                        # nothing else starts before the child can
                        lower[d] = max(lower[d], awaited[d][1])
                    else:
                        awaited[d] = None
        return lower

    def park(d: int, cost: float, prio: float, ready: float, u: int) -> None:
        """Park u on d until d's receiving channel plus u's sends' cost is no later than d is
        free (``ScheduleBuilder.receive_bound``)."""
        entry = (cost, prio, ready, u)
        parked_entry[u * num_devices + d] = entry
        heappush(parked_on[d], entry)

    def held_back(u: int, d: int, prio: float, ready: float, receive: float,
                  free: float) -> bool:
        """Whether d's receiving channel alone keeps u from starting when d is free
        (``ScheduleBuilder.receive_bound``): then u is parked, or back in waiting at the
        floor of its inputs' arrival."""
        bound = receive_bound(u, d)
        if bound is None:
            return False
        floor, cost = bound
        if receive + cost > free:
            park(d, cost, prio, ready, u)
        elif floor > free:
            heappush(waiting[d], (floor, prio, u))
        else:
            return False
        return True

    def unpark(d: int) -> tuple | None:
        """Take d's parked top off; None if it was unparked already (``unpark_readers``)."""
        entry = heappop(parked_on[d])
        key = entry[3] * num_devices + d
        if parked_entry.get(key) is not entry:
            return None
        del parked_entry[key]
        return entry

    def candidate(d: int, free: float):
        """(start, priority, data ready, device, unit, heap) of device d's best unit, d being
        free at ``free`` (``earliest()[d]``).

        A top whose estimate was not confirmed since d's last ``ready_epoch`` is asked again
        (links only get busier, so an estimate is a lower bound unless a copy of an input
        arrived) and goes back to ``waiting`` when it got later: every device's candidate is
        then exact. Before asking, ``ScheduleBuilder.receive_bound`` says whether d's
        receiving channel alone keeps the unit from starting when d is free; such a unit is
        parked by the total cost of its sends, which does not change while that channel gets
        busier, and comes back once channel + cost fits (under contention nine in ten stale
        estimates are of this kind, and each was otherwise asked again after every commit)."""
        epoch = builder.ready_epoch(d)
        receive = builder.receive_free_us(d)
        wait, ok, parked = waiting[d], startable[d], parked_on[d]
        while True:
            while parked and receive + parked[0][0] <= free:
                entry = unpark(d)
                if entry is not None:
                    heappush(wait, (entry[2], entry[1], entry[3]))
            while wait and wait[0][0] <= free:
                ready, prio, u = heappop(wait)
                if placed[u] != -1:  # committed elsewhere
                    queued[u] &= ~(1 << d)
                    continue
                if not held_back(u, d, prio, ready, receive, free):
                    heappush(ok, (prio, ready, u))
            if ok:
                heap, (prio, ready, u) = ok, ok[0]
            elif parked and (not wait or receive + parked[0][0] < wait[0][0]):
                # the earliest lower bound is a parked unit's: to waiting, to be asked
                entry = unpark(d)
                if entry is not None:
                    cost, prio, ready, u = entry
                    heappush(wait, (max(ready, receive + cost), prio, u))
                continue
            elif wait:
                heap, (ready, prio, u) = wait, wait[0]
            else:
                return None
            pinned = group_device[group[u]]
            if placed[u] != -1 or pinned != -1 and pinned != d:
                # committed, or its group went to another device
                drop(u, d, heap)
                if placed[u] == -1:
                    enqueue(u, (pinned,))
                continue
            key = u * num_devices + d
            if confirmed[key] != epoch:
                if heap is ok and held_back(u, d, prio, ready, receive, free):
                    heappop(ok)  # it cannot start when d is free
                    continue
                confirmed[key] = epoch
                now_ready = data_ready_us(u, d)
                if now_ready > ready + _EPS_US:  # a link got busier since the estimate
                    if heap is wait:
                        heapreplace(wait, (now_ready, prio, u))
                    elif now_ready <= free:  # still startable when d is free
                        heapreplace(ok, (prio, now_ready, u))
                    else:
                        heappop(ok)
                        heappush(wait, (now_ready, prio, u))
                    continue
            return (free if heap is ok else max(ready, free)), prio, ready, d, u, heap

    def best_candidate():
        """The earliest (start, priority, ...) candidate over the devices. A device whose
        earliest start is later than the best so far is not asked (it cannot win, and its
        stale estimates wait for a turn it can win: with four devices, a third of the asks)."""
        lower = earliest()
        candidates = [None] * num_devices
        asked = [False] * num_devices
        touched.clear()
        best = None
        again = True
        by_lower = sorted(all_devices, key=lower.__getitem__)
        while again:
            again = False
            for d in by_lower:
                if best is not None and lower[d] > best[0]:
                    break
                if asked[d] and d not in touched:
                    continue
                touched.discard(d)  # a unit moved to its group's device: ask that one again
                asked[d] = again = True
                previous, candidates[d] = candidates[d], candidate(d, lower[d])
                if previous is not None and previous is best:  # d asked again: the best of all
                    best = min(filter(None, candidates), default=None)  # devices differ
                elif candidates[d] is not None and (best is None or candidates[d] < best):
                    best = candidates[d]
        return best

    def unpark_readers(first_transfer: int) -> None:
        """A copy that reached a device makes its readers' parked bounds too high there:
        back to waiting with their old estimates (as if never parked)."""
        for t, _, dst, *_ in builder.transfers[first_transfer:]:
            for v in builder.readers(t):
                entry = parked_entry.pop(v * num_devices + dst, None)
                if entry is not None:
                    heappush(waiting[dst], (entry[2], entry[1], v))

    remaining = units.num_units
    # confirmed[u * D + d]: d's ready_epoch when u's estimate on d was last computed (it
    # holds while the epoch does).
    confirmed = [-1] * (units.num_units * num_devices)
    for u in builder.initially_ready():
        on_ready(u, 0.0)
    while remaining:
        best = best_candidate()
        if best is None:
            if any(held):  # nothing else can run: let the held-back units use all memory
                _requeue(held, enqueue)
                use_reserve = True
                continue
            next_free = builder.next_free_us()
            if next_free is not None:
                builder.advance(next_free)
                _requeue(blocked, enqueue)
                continue
            # No release ahead; a unit's need may still have shrunk (a copy of its input
            # arrived meanwhile) or it may fit on a device it was not tried on.
            stuck = sorted(set().union(*blocked))
            fits = {u: [d for d in all_devices if builder.shortfall_bytes(u, d) <= 0]
                    for u in stuck}
            if not any(fits.values()):
                raise PlacementError(_shortfall_message(builder, stuck, method))
            for u, devs in fits.items():
                if devs:
                    for b in blocked:
                        b.discard(u)
                    enqueue(u, devs)
            continue
        start, _, ready, d, u, heap = best
        drop(u, d, heap)
        if builder.advance(start) and any(blocked):  # memory was released, and units wait
            _requeue(blocked, enqueue)
        short = builder.shortfall_bytes(u, d)
        if short > 0:
            blocked[d].add(u)
            if not queued[u] and builder.group_device[group[u]] == -1:
                # e.g. its favourite parent's device is full: try the devices not yet tried
                enqueue(u, [e for e in all_devices if u not in blocked[e]])
            continue
        if not use_reserve and short > -reserve[d] and builder.growth_bytes(u, d) > 0:
            held[d].add(u)
            continue
        use_reserve = False
        remaining -= 1
        sent = len(builder.transfers)
        for v in builder.commit(u, d):
            on_ready(v, builder.finish[u])
        if parked_entry:
            unpark_readers(sent)
    return builder.finish_schedule()


def _requeue(blocked: list[set[int]], enqueue) -> None:
    """Give units that did not fit another chance after memory was released."""
    for d, units in enumerate(blocked):
        for u in units:
            enqueue(u, (d,))
        units.clear()
