"""m-TOPO: fill devices in topological order, each up to its share of the memory.

Baechi's baseline placer (Jeon et al., SoCC 2020, §3.4): walk the ops in topological order and
put them on device 0 until it holds its share of the total memory, then device 1, and so on.
It is very fast and ignores communication; its schedule is whatever list scheduling in that
order gives. Unlike Baechi's m-TOPO, which ignored the limits on these graphs, a unit that does
not fit on the current device goes to the next one with room (then any device with room), a
colocation group stays on the device of its first unit, and an instance where nothing fits is
reported with the shortfall.
"""

from __future__ import annotations

import numpy as np

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.schedule import PlacementError, Schedule, ScheduleBuilder
from graphfit.baechi.units import UnitGraph

__all__ = ["m_topo"]


def m_topo(units: UnitGraph, devices: DeviceSet, memory_model: str = "liveness") -> Schedule:
    """Place units in topological order, filling one device after another.

    Parameters:
        units: the unit graph.
        devices: devices, memory limits and link costs.
        memory_model: ``"liveness"`` (default) or ``"static"`` for the fit test.

    Returns:
        The ``Schedule`` of list scheduling in topological order on the chosen devices.

    Raises:
        PlacementError: a unit fits on no device even after everything committed before it
            ran (the message names the unit, the device with most room and the missing bytes).

    Notes:
        The share of device ``d`` is ``min(limit_d, total / D)`` with ``total`` the static sum
        of all units' bytes (outputs, temporary, persistent), so the devices are balanced by
        size whatever memory model decides fitting.
    """
    builder = ScheduleBuilder(units, devices, memory_model)
    num_devices = len(devices)
    charge = (units.output_bytes + units.temp_bytes + units.persistent_bytes).tolist()
    share = np.minimum(devices.memory_bytes, sum(charge) / num_devices).tolist()
    filled = [0] * num_devices
    group = units.group.tolist()
    current = 0
    for u in units.topological_order.tolist():
        pinned = builder.group_device[group[u]]
        if pinned != -1:
            choices = [pinned]
        else:
            if filled[current] + charge[u] > share[current] and current < num_devices - 1:
                current += 1
            choices = list(range(current, num_devices)) + list(range(current))
        d = next((d for d in choices if builder.shortfall_bytes(u, d) <= 0), -1)
        while d == -1 and builder.next_free_us() is not None:
            builder.advance(builder.next_free_us())  # wait for memory to be released
            d = next((d for d in choices if builder.shortfall_bytes(u, d) <= 0), -1)
        if d == -1:
            short, d = min((builder.shortfall_bytes(u, d), d) for d in choices)
            raise PlacementError(
                f"m_topo: unit {units.unit_name(u)!r} misses {short} bytes on "
                f"{devices.names[d]} (limit {builder.limit[d]} bytes, {builder.level[d]} in "
                f"use). Raise the device memory by at least {short} bytes or rematerialize.")
        filled[d] += charge[u]
        builder.commit(u, d)
    return builder.finish_schedule()
