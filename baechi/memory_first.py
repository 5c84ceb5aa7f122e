"""The repair step of m-ETF and m-SCT under tight memory: list scheduling in a memory-lean order.

Earliest-task-first lets the ready set run far ahead of the topological order: on a wide graph
it starts many branches at once, every branch's outputs wait for consumers that have not run,
copies of them pile up on the devices that read them, and at a limit near (sequential peak /
devices) the schedule deadlocks, with every device full and nothing releasable. When that
happens m-ETF and m-SCT fall back to this scheduler, which fixes the order first and then only
chooses devices.

The order (``release_first_order``) is list scheduling on identical workers, compute times
only, where a free worker takes a ready unit that releases at least as many bytes as it
allocates before any other (the last reader of its inputs: a join, a chain's next op), else the
earliest unit of the topological order. A join then runs as soon as its inputs exist instead of
after every sibling branch: on fork-join graphs (64 branches joined by a tree of adds) the
topological order holds every branch's output at once, and at 1.1 x (sequential peak / 4) each
device's slack was about one tensor, too little for a join's output plus a copy of an input; in
this order the peak is about 0.6 of that limit. The workers keep that many units side by side.
Orders, in turn: as many workers as devices (the most parallel order), then one fewer, down
to one (``release_first/1`` finishes a branch and its joins before starting the next: the
fewest tensors alive at once, and the least fragmented devices; on fork-join graphs with 16
short branches, where one join's inputs and output are 0.95-1.09 of (sequential peak / 4), some
instances fit at 1.1 x that only in this order); last, the topological order (the one that
defines the sequential peak). Each order is tried with the reserves of ``RESERVES`` (below) in
turn, under m-SCT first with the favourite parents and then without them; the first attempt
that fits wins. Which reserve fits at a limit near the floor is hard to foresee (on those
fork-join graphs at 1.1 x, three workers fitted with a reserve of 0.15 or 0.2 and with no
other), and the one-worker order is slower than m-TOPO's near-serial step at its tightest
limit (consecutive units on different devices wait for transfers): with reserves of 0 and 0.1
only, five of 16 such placements fell to one worker and took 1.08-1.17 x m-TOPO's makespan;
with the finer reserves, and without favourites, an order of 2-4 workers fits in all 16,
within 0.71-0.96 x. m-SCT's favourites are only a preference, and at such limits the favourite
parent's device is often too full for the join to come.

When no reserve fits an order, the order is tried again with restarts before the next
(``_place_with_restarts``): an attempt that gets stuck names a culprit, the last unit placed
by choice on the device where the stuck unit misses the fewest bytes whose outputs, still held
there for later readers, would have made room, and the next attempt keeps that unit off that
device. The greedy device choice cannot see that a tensor it puts on a device will, many units
later, leave too little room there for a unit whose inputs live there; random graphs where
each op reads 1-3 of the 50 ops before it keep about 0.84 of the sequential peak alive and
leave each device at 1.1 x (sequential peak / 4) a slack of about one op's working set, and no
order and reserve fitted seed 0 with idle links (``parallel``), and with contention only the
one-worker order did. With restarts all of seeds 0-3 fit in both link models at 2-4 workers,
after 0-25 restarts, at 0.72-0.86 x m-TOPO's makespan at its tightest limit. The restarts
are bounded (``RESTARTS``, and ``RESTART_WORK`` units committed per unit), so an instance
that cannot fit fails in bounded time; still, proving that a limit is too low now takes longer
(bisecting a 300-op random graph's tightest limit: about twice as long).

Devices, in that order:

- the variables (colocation groups with persistent bytes) are spread over the devices first,
  since they are held all step;
- each unit is committed on a device where it fits when it would start there
  (``ScheduleBuilder.start_shortfall_bytes``: the level at its start, after the releases due
  by then, and, for copies sent just in time before the clock, what the device held since
  they began; if they fit nowhere the copies wait for the clock, ``hold_sends``); so the bytes
  alive across all devices are those alive in the order run sequentially, plus copies, plus
  what the devices running side by side have in flight;
- among the devices where it fits, a unit goes where it starts earliest (its favourite
  parent's device first, under m-SCT), unless that would push the device into its last
  ``reserve`` of memory while another device stays below it; then the device with the most
  room left wins. A reserve keeps the resident bytes balanced, so no device fills up while
  another has room (the failure of filling devices one after another, as m-TOPO does); no
  reserve keeps more chains on one device (fewer transfers);
- a unit that fits nowhere waits for the next release; if none is pending the attempt fails,
  and the last attempt reports the instance with its shortfall.

Copies are kept short-lived: a tensor read on another device is sent just in time for its
reader (``ScheduleBuilder``'s ``late_sends``: the send waits for a "gate" unit on the sending
device), and a received copy is freed after the readers committed so far (``transient_copies``;
a later reader receives it again). Without late sends, idle links (the ``parallel`` link model)
copy every tensor to its readers' devices as soon as it exists, and the copies alone exceed
a limit near (sequential peak / devices).

Every unit waits for the previous one to start (a monotone clock), so the schedule is as
parallel as the order allows; this is the price of the memory guarantee, and why it is only a
fallback. The schedule records its gates, transient copies and waits for memory
(``Schedule.replay_options``), so ``simulate`` replays it exactly; a TF run gets them as
ordering edges (``Placement.gated_reads`` and ``Placement.memory_order``, written by
``baechi.apply.apply_placement``).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.schedule import PlacementError, Schedule, ScheduleBuilder
from graphfit.baechi.units import UnitGraph

__all__ = ["RESERVES", "memory_first", "release_first_order"]

# The device choice's reserves (fractions of each limit, module docstring), tried in turn.
RESERVES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
# The restarts' bounds, per order (module docstring): restarts, and units committed in all
# failed attempts, as a multiple of the units.
RESTARTS = 32
RESTART_WORK = 8


def memory_first(units: UnitGraph, devices: DeviceSet, memory_model: str = "liveness",
                 favourite_parent: np.ndarray | None = None, method: str = "m_etf") -> Schedule:
    """Place units in a memory-lean order (``release_first_order`` on as many workers as
    devices, then fewer, down to one, else the topological order) on the device where each
    fits and starts earliest, keeping every device's resident bytes balanced, restarting
    with a stuck attempt's culprit moved (module docstring).

    Parameters:
        units: the unit graph.
        devices: devices, memory limits, link costs and link model.
        memory_model: ``"liveness"`` (default) or ``"static"``.
        favourite_parent: per unit, the parent whose device it prefers (-1: none).
        method: name used in error messages.

    Returns:
        The ``Schedule`` of the first attempt that fits (orders as above; in each, the
        reserves in turn with the favourite parents, then without them, then restarts);
        ``info["memory_first"]`` is True, ``info["memory_first_order"]`` names the order
        (``"release_first/<workers>"`` or ``"topological"``),
        ``info["memory_first_reserve"]`` its reserve, ``info["memory_first_favourites"]``
        whether it kept the favourite parents and ``info["memory_first_restarts"]`` (when
        there were restarts) how many.

    Raises:
        PlacementError: a unit fits on no device and no memory will be released, in any
            order (the message names the unit, the device and the missing bytes).
    """
    orders = [(f"release_first/{workers}", lambda w=workers: release_first_order(units, w))
              for workers in range(len(devices), 0, -1)]
    orders.append(("topological", lambda: units.topological_order.tolist()))
    preferences = [favourite_parent] + ([None] if favourite_parent is not None else [])
    error = None
    for name, make_order in orders:
        order = make_order()
        plain = None  # the failure of reserve 0 without favourites, where restarts begin
        for fav, reserve in itertools.product(preferences, RESERVES):
            try:
                schedule = _place_in_order(units, devices, memory_model, fav, method,
                                           order, name, reserve)
            except PlacementError as e:
                error = e
                if fav is None and reserve == 0.0 and isinstance(e, _Stuck):
                    plain = e
                continue
            schedule.info.update(memory_first_reserve=reserve,
                                 memory_first_favourites=fav is not None)
            return schedule
        if plain is not None:
            try:
                return _place_with_restarts(units, devices, memory_model, method, order, name,
                                            plain)
            except PlacementError:
                continue
    # The public error, without the private search state a ``_Stuck`` carries.
    raise PlacementError(str(error)) from None


def _place_with_restarts(units: UnitGraph, devices: DeviceSet, memory_model: str, method: str,
                         order: list[int], order_name: str, stuck: "_Stuck") -> Schedule:
    """``_place_in_order`` (reserve 0, no favourites), whose attempt without restarts failed
    with ``stuck``, restarted after each failure with the failure's culprit kept off its
    device, until it fits or has spent ``RESTARTS`` restarts or ``RESTART_WORK`` x the units
    in commits (module docstring)."""
    avoid: dict[int, set[int]] = {}
    work = 0
    for restart in itertools.count(1):
        work += stuck.position
        if stuck.culprit is None or restart > RESTARTS or \
                work > RESTART_WORK * units.num_units:
            raise stuck
        unit, device = stuck.culprit
        avoid.setdefault(unit, set()).add(device)
        try:
            schedule = _place_in_order(units, devices, memory_model, None, method, order,
                                       order_name, 0.0, avoid)
        except _Stuck as e:
            stuck = e
            continue
        schedule.info.update(memory_first_reserve=0.0, memory_first_favourites=False,
                             memory_first_restarts=restart)
        return schedule


class _Stuck(PlacementError):
    """A unit fits on no device and no memory will be released. ``position``: its place in
    the order; ``culprit``: (unit, device), a unit committed earlier whose outputs, held on
    the device where the stuck unit misses the fewest bytes, would have left it room
    (``_culprit``; None if there is none)."""

    def __init__(self, message: str, position: int, culprit: tuple[int, int] | None):
        super().__init__(message)
        self.position, self.culprit = position, culprit


def _place_in_order(units: UnitGraph, devices: DeviceSet, memory_model: str,
                    favourite_parent: np.ndarray | None, method: str, order: list[int],
                    order_name: str, reserve_fraction: float,
                    avoid: dict[int, set[int]] | None = None) -> Schedule:
    """``memory_first`` with the units committed in ``order``, each unit of ``avoid`` on
    another device than those listed for it where it can. Raises ``_Stuck``."""
    builder = ScheduleBuilder(units, devices, memory_model, transient_copies=True,
                              late_sends=True)
    limit = builder.limit
    reserve = [reserve_fraction * m for m in limit]
    group = units.group.tolist()
    _spread_variables(builder)
    fav = favourite_parent.tolist() if favourite_parent is not None else None
    all_devices = list(range(len(devices)))
    avoid = avoid or {}
    chosen = set()  # units that chose their device (their group was not placed yet)
    for position, u in enumerate(order):
        pinned = builder.group_device[group[u]]
        if pinned != -1:
            choices = [pinned]
        else:
            choices = [d for d in all_devices if d not in avoid.get(u, ())] or all_devices
            chosen.add(u)
        while True:
            fits = _fits(builder, u, choices)
            if fits:
                break
            next_free = builder.next_free_us()
            if next_free is not None:
                builder.advance(next_free)
                continue
            # nothing will be released: copies sent just in time may still meet bytes freed
            # since they began; sent from the clock on, they may fit
            builder.hold_sends(u)
            fits = _fits(builder, u, choices)
            if not fits:
                short, d = min((builder.start_shortfall_bytes(u, d), d) for d in choices)
                culprit = _culprit(units, builder, u, d, short, chosen, avoid)
                raise _Stuck(
                    f"{method}: unit {units.unit_name(u)!r} misses {short} bytes on "
                    f"{devices.names[d]} (limit {limit[d]} bytes, {builder.level[d]} in use; "
                    f"in use on every device: {builder.level}) even in {order_name} order. "
                    "Raise the device memory by at least "
                    f"{short} bytes or rematerialize.", position,
                    None if culprit is None else (culprit, d))
            break
        once = [(short, d) for short, d in fits if not builder.refetches(u, d)]
        fits = once or fits
        roomy = [d for short, d in fits if -short >= reserve[d]]
        if roomy:
            favourite = builder.device[fav[u]] if fav is not None and fav[u] != -1 else -1
            d = favourite if favourite in roomy else min(
                roomy, key=lambda d: (max(builder.device_free[d], builder.data_ready_us(u, d)),
                                      builder.level[d]))
        else:
            d = min(fits)[1]  # the most room left after it
        builder.commit(u, d)
    return builder.finish_schedule({"memory_first": True, "memory_first_order": order_name})


def _culprit(units: UnitGraph, builder: ScheduleBuilder, u: int, d: int, short: int,
             chosen: set[int], avoid: dict[int, set[int]]) -> int | None:
    """The unit to keep off device ``d``, where ``u`` misses ``short`` bytes: the last one
    that chose ``d`` (and may still avoid it) whose outputs, held there for readers still to
    come other than ``u``, are at least ``short`` bytes, else the last holding any."""
    mine = set(units.inputs(u).tolist())
    fallback = None
    for v in reversed(builder.units_on[d]):
        if v not in chosen or d in avoid.get(v, ()):
            continue
        held = sum(int(units.tensor_bytes[t]) for t in units.outputs(v).tolist()
                   if builder.remaining[t] > 0 and t not in mine)
        if held >= short:
            return v
        if held and fallback is None:
            fallback = v
    return fallback


def _fits(builder: ScheduleBuilder, u: int, choices: list[int]) -> list[tuple[int, int]]:
    """(shortfall, device) for the devices among ``choices`` where ``u`` fits when it would
    start (``ScheduleBuilder.start_shortfall_bytes``)."""
    fits = [(builder.start_shortfall_bytes(u, d), d) for d in choices]
    return [(short, d) for short, d in fits if short <= 0]


def release_first_order(units: UnitGraph, num_workers: int) -> list[int]:
    """A topological order of the units that runs memory-releasing units first (module
    docstring): list scheduling on ``num_workers`` identical workers, compute times only; a
    free worker takes the first ready unit (by ``topological_order``) whose outputs are no
    larger than the inputs it is the last reader of, else the first ready unit. Returns the
    units in order of their start."""
    adj = units.adjacency_lists()
    inputs, consumers = adj["inputs"], adj["consumers"]
    t_bytes = units.tensor_bytes.tolist()
    held = (units.tensor_persistent | units.tensor_fetched).tolist()
    out_bytes = units.output_bytes.tolist()
    compute = units.compute_us.tolist()
    position = [0] * units.num_units
    for k, u in enumerate(units.topological_order.tolist()):
        position[u] = k
    missing = np.bincount(units.edges[1], minlength=units.num_units).tolist()
    succ = [[] for _ in range(units.num_units)]
    for a, b in units.edges.T.tolist():
        succ[a].append(b)
    remaining = [len(c) for c in consumers]
    done = [False] * units.num_units

    def releases(u: int) -> bool:
        freed = sum(t_bytes[t] for t in inputs[u] if remaining[t] == 1 and not held[t])
        return out_bytes[u] <= freed

    release, other = [], []
    for u in range(units.num_units):
        if missing[u] == 0:
            heapq.heappush(release if releases(u) else other, (position[u], u))
    order = []
    running: list[tuple[float, int]] = []
    now = 0.0
    while len(order) < units.num_units:
        while len(running) < num_workers and (release or other):
            _, u = heapq.heappop(release or other)
            if done[u]:
                continue
            done[u] = True
            order.append(u)
            heapq.heappush(running, (now + compute[u], u))
            for t in inputs[u]:
                remaining[t] -= 1
                if remaining[t] == 1:
                    c = next(c for c in consumers[t] if not done[c])
                    if missing[c] == 0 and releases(c):
                        heapq.heappush(release, (position[c], c))
        now, u = heapq.heappop(running)
        finished = [u]
        while running and running[0][0] <= now:
            finished.append(heapq.heappop(running)[1])
        for u in finished:
            for v in succ[u]:
                missing[v] -= 1
                if missing[v] == 0:
                    heapq.heappush(release if releases(v) else other, (position[v], v))
    return order


def _spread_variables(builder: ScheduleBuilder) -> None:
    """Pin the colocation groups holding persistent bytes (variables) before any unit runs,
    largest first, each on the device holding the fewest persistent bytes so far.

    Variables are held all step; placed one by one in topological order, a late layer's
    weights meet devices whose activations already peaked (the fit test charges persistent
    bytes against the highest level so far), and a training step's last weights fit nowhere."""
    held = [0] * builder.num_devices
    persistent = builder.group_persistent
    for g in sorted((g for g, b in enumerate(persistent) if b), key=lambda g: -persistent[g]):
        d = min(range(builder.num_devices), key=lambda d: (held[d] - builder.limit[d], d))
        builder.pin_group(g, d)
        held[d] += persistent[g]
