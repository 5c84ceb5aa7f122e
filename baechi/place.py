"""The placement pass: cost graph + devices -> Placement (every op's device and the simulated step).

Pipeline (Baechi, Jeon et al., SoCC 2020, §3): group (TF colocation, optionally co-placement) ->
build placement units (one op each, or fused groups) -> place with m-TOPO, m-ETF or m-SCT under
per-device memory limits -> simulate the step on the original ops with the chosen devices and
order -> check the postconditions (every op placed, each device's simulated peak within its
limit, every colocation group on one device).

``placer_type``:

- ``"default"``: one unit per op; TF's colocation groups are kept on one device (the
  ``grouper`` is not used).
- ``"colocation"``: one unit per op; the ``grouper``'s groups are kept on one device.
- ``"fusion"``: the ``grouper``'s groups are fused into units (``baechi.fusion``) first.
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.fusion import fuse
from graphfit.baechi.grouping import GROUPERS, coplacement_groups, tf_colocation_groups
from graphfit.baechi.lp import LP_SOLVERS
from graphfit.baechi.m_etf import m_etf
from graphfit.baechi.m_sct import m_sct
from graphfit.baechi.m_topo import m_topo
from graphfit.baechi.memory import check_memory_model
from graphfit.baechi.schedule import PlacementError, RuntimeCosts, Schedule, simulate
from graphfit.baechi.units import UnitGraph
from graphfit.errors import check_number
from graphfit.profiler.cost_graph import FEED_OP_TYPES, CostGraph

__all__ = ["METHODS", "PLACER_TYPES", "Placement", "PlacementError", "makespan_lower_bound_us",
           "place", "place_feeds_first"]

METHODS = ("m_topo", "m_etf", "m_sct")
PLACER_TYPES = ("default", "colocation", "fusion")
MAX_ATTEMPTS = 6


@dataclasses.dataclass
class Placement:
    """A placement of a cost graph and its simulated step.

    Attributes:
        graph: the original cost graph.
        devices: the device set.
        device_index: device index per original op.
        schedule: the simulated step over the original ops (makespan, peaks, Chrome trace).
        unit_schedule: the placer's own schedule over its units (LP statistics in ``info``).
        units: the placement units (``unit_of_op`` maps ops to units).
        options: method, placer_type, grouper, memory_model, sct_threshold, lp_solver.
        placement_s: wall time of grouping, fusion and placing (not the final simulation).
    """

    graph: CostGraph
    devices: DeviceSet
    device_index: np.ndarray
    schedule: Schedule
    unit_schedule: Schedule
    units: UnitGraph
    options: dict
    placement_s: float

    def op_devices(self) -> dict[str, str]:
        """Device name per original op name (what to write into ``NodeDef.device``)."""
        names = self.devices.names
        return {op: names[d] for op, d in zip(self.graph.names, self.device_index.tolist())}

    @property
    def makespan_us(self) -> float:
        return self.schedule.makespan_us

    def simulate(self, link_model: str) -> Schedule:
        """The placed step (same devices, same order) simulated under another link model."""
        return simulate(self.schedule.units, self.devices.with_link_model(link_model),
                        self.device_index, self.schedule.order, self.schedule.memory_model,
                        **self.schedule.replay_options())

    def predict(self, runtime: RuntimeCosts, link_model: str | None = None) -> Schedule:
        """The placed step (same devices, order and send gates) with a run target's measured
        costs (``baechi.calibrate``): what a real step should take. The repair step's waits
        for memory are left out: they are times of the plan without those costs."""
        devices = self.devices if link_model is None else self.devices.with_link_model(
            link_model)
        options = {**self.schedule.replay_options(), "not_before": None}
        return simulate(self.schedule.units, devices, self.device_index, self.schedule.order,
                        self.schedule.memory_model, runtime=runtime, **options)

    def transfers(self) -> list[dict]:
        """Every simulated transfer by name: the tensor (``producer:port``, or
        ``producer:control`` for a control edge), source and destination device, bytes, start
        and end in µs, in order of start; ``after``: the op on the source device the send
        waits for (the repair step's just-in-time sends, ``baechi.memory_first``), if any."""
        s, g, names = self.schedule, self.graph, self.devices.names
        op_tensor = s.units.tensor_op_tensor
        rows = []
        for k in np.argsort(s.transfer_start_us, kind="stable").tolist():
            t = int(s.transfer_tensor[k])
            tensor = (g.tensor_name(int(op_tensor[t])) if op_tensor[t] >= 0 else
                      f"{s.units.unit_name(int(s.units.tensor_producer[t]))}:control")
            rows.append({"tensor": tensor, "src": names[int(s.transfer_src[k])],
                         "dst": names[int(s.transfer_dst[k])],
                         "bytes": int(s.units.tensor_bytes[t]),
                         "start_us": float(s.transfer_start_us[k]),
                         "end_us": float(s.transfer_end_us[k])})
            if s.transfer_gate[k] >= 0:
                rows[-1]["after"] = s.units.unit_name(int(s.transfer_gate[k]))
        return rows

    def memory_order(self) -> list[tuple[str, str]]:
        """The ordering edges a run needs to allocate and free memory as planned: ``(before,
        after)`` op names, ``after`` to start once ``before`` has ended.

        The simulated peaks assume each device runs its ops one at a time in the planned
        order, and that bytes freed by an op on another device (the last reader of a tensor
        held here, or the reader of a copy sent from here) are gone when the plan starts the
        next op here; the repair step (``baechi.memory_first``) waits for exactly such
        releases. TF runs an op as soon as its inputs exist, two or more side by side. So:
        per device, each op after the one before it (no edge where a data edge orders them
        already); and for each tensor held here and read elsewhere, each remote reader (or the
        reader of each copy sent from here) before the first op here that the plan starts
        after that reader ends (TF frees the tensor once every reader is done, whichever the
        plan had last). Every edge points forward in the planned times, so the step stays
        acyclic. Ops without inputs (variables, constants, placeholders) get no edge: they
        hold their bytes all step or allocate nothing, and a variable's initialiser runs them
        too, outside the step. ``baechi.apply.apply_placement(ordering=...)`` writes the
        edges.
        """
        s = self.schedule
        units, device = s.units, s.device
        start, finish = s.start_us, s.finish_us
        position = np.empty(units.num_units, dtype=np.int64)
        position[s.order] = np.arange(units.num_units)
        # Only a data edge is sure to be in the built step: a control edge of the planned graph
        # may not be (the unrolled remat plan pins forward ops the rewrite leaves free), and
        # two convolutions it ordered ran side by side, 1-2 MiB over the plan (2026-12-07).
        pair_t, pair_u = units.consumer_pairs()
        data = units.tensor_op_tensor[pair_t] >= 0
        direct = set(zip(units.tensor_producer[pair_t[data]].tolist(), pair_u[data].tolist()))
        edges: set[tuple[int, int]] = set()
        on_device = []
        has_inputs = np.bincount(units.edges[1], minlength=units.num_units) > 0
        for d in range(len(self.devices)):
            ops = np.flatnonzero((device == d) & has_inputs)
            ops = ops[np.lexsort((position[ops], start[ops]))]
            on_device.append((start[ops], ops))
            edges.update((a, b) for a, b in zip(ops[:-1].tolist(), ops[1:].tolist())
                         if (a, b) not in direct)

        def first_after(d: int, time_us: float) -> int:
            starts, ops = on_device[d]
            k = int(np.searchsorted(starts, time_us, side="left"))
            return int(ops[k]) if k < len(ops) else -1

        shared = s.memory_model == "shared"
        consumers = units.adjacency_lists()["consumers"]
        releasers: dict[int, list[int]] = {}   # tensor -> remote ops whose end frees it here
        if shared:  # each remote reader: TF frees the buffer after all of them
            for t, readers in enumerate(consumers):
                home = device[units.tensor_producer[t]]
                remote = [r for r in readers if device[r] != home]
                if remote:
                    releasers[t] = remote
        else:
            for t, reader in zip(s.transfer_tensor.tolist(), s.transfer_reader.tolist()):
                releasers.setdefault(t, []).append(reader)
        held = units.tensor_persistent | units.tensor_fetched
        for t, readers in releasers.items():
            if held[t]:
                continue
            d = int(device[units.tensor_producer[t]])
            for r in readers:
                after = first_after(d, float(finish[r]))
                if after >= 0 and (r, after) not in direct:
                    edges.add((r, after))
        name = units.unit_name
        return sorted((name(a), name(b)) for a, b in edges)

    def gated_reads(self) -> list[dict]:
        """The gated sends (``transfers()`` with ``after``) with the ops each copy serves: per
        gated transfer, ``tensor``, ``src``, ``dst``, ``after`` and ``readers``, the ops on
        ``dst`` that start while it is the newest copy of the tensor there (a tensor may be
        sent to one device more than once, ``Schedule.transient_copies``). What
        ``baechi.apply.apply_placement`` turns into ordering edges."""
        s, g = self.schedule, self.graph
        units = s.units
        if not (s.transfer_gate >= 0).any():
            return []
        consumers = units.adjacency_lists()["consumers"]
        by_copy: dict[tuple[int, int], list[int]] = {}
        for k in np.argsort(s.transfer_start_us, kind="stable").tolist():
            by_copy.setdefault((int(s.transfer_tensor[k]), int(s.transfer_dst[k])), []).append(k)
        rows = []
        for (t, dst), ks in by_copy.items():
            starts = s.transfer_start_us[ks]
            readers = [r for r in consumers[t] if s.device[r] == dst]
            serving = [int(np.searchsorted(starts, s.start_us[r], side="right")) - 1
                       for r in readers]
            for j, k in enumerate(ks):
                if s.transfer_gate[k] < 0 or units.tensor_op_tensor[t] < 0:
                    continue
                rows.append({"tensor": g.tensor_name(int(units.tensor_op_tensor[t])),
                             "src": self.devices.names[int(s.transfer_src[k])],
                             "dst": self.devices.names[dst],
                             "after": units.unit_name(int(s.transfer_gate[k])),
                             "readers": sorted(units.unit_name(r) for r, c in
                                               zip(readers, serving) if max(c, 0) == j)})
        return [row for row in rows if row["readers"]]

    @property
    def peak_bytes(self) -> np.ndarray:
        """Simulated peak bytes per device (under the placement's memory model)."""
        return self.schedule.peak_bytes

    def summary(self) -> dict:
        """JSON-ready numbers: options, sizes, times, makespan, lower bound and peaks."""
        lower = makespan_lower_bound_us(self.graph, len(self.devices))
        return {**self.options, "num_ops": self.graph.num_ops,
                "num_units": self.units.num_units, "placement_s": self.placement_s,
                "makespan_us": self.makespan_us, "lower_bound_us": lower,
                "makespan_over_lower_bound": self.makespan_us / lower if lower else 1.0,
                "peak_bytes": self.peak_bytes.tolist(),
                "memory_bytes": self.devices.memory_bytes.tolist(),
                "ops_per_device": np.bincount(self.device_index,
                                              minlength=len(self.devices)).tolist(),
                "gated_sends": int((self.schedule.transfer_gate >= 0).sum()),
                **{k: v for k, v in self.unit_schedule.info.items()}}


def makespan_lower_bound_us(graph: CostGraph, num_devices: int) -> float:
    """max(critical path, total compute / devices), communication ignored."""
    if graph.num_ops == 0:
        return 0.0
    ops = UnitGraph.singletons(graph, np.zeros(graph.num_ops, dtype=np.int64))
    return float(max(ops.bottom_level_us().max(), graph.compute_us.sum() / num_devices))


def _check_option(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose one of {allowed}")


def _check_fits(units: UnitGraph, devices: DeviceSet) -> None:
    """Fail early, with the missing bytes, on instances no placer can solve."""
    limits = [int(m) for m in devices.memory_bytes.tolist()]  # Python ints: sums never wrap
    limit, total = max(limits), sum(limits)
    persistent = sum(units.persistent_bytes.tolist())
    if persistent > total:
        raise PlacementError(
            f"the variables alone need {persistent} bytes but the devices hold {total} in "
            f"total: {persistent - total} bytes do not fit")
    group_persistent = np.bincount(units.group, weights=units.persistent_bytes,
                                   minlength=units.num_groups)
    need = group_persistent[units.group] + units.output_bytes + units.temp_bytes
    worst = int(np.argmax(need)) if units.num_units else 0
    if units.num_units and need[worst] > limit:
        raise PlacementError(
            f"unit {units.unit_name(worst)!r} with its colocation group's variables needs "
            f"{int(need[worst])} bytes but the largest device holds {limit}: "
            f"{int(need[worst]) - limit} bytes do not fit")


def _check_postconditions(placement: Placement, tf_groups: np.ndarray,
                          groups: np.ndarray) -> None:
    device = placement.device_index
    if len(device) != placement.graph.num_ops or (device < 0).any():
        raise PlacementError("some op was not placed")
    over = placement.peak_bytes - placement.devices.memory_bytes
    if (over > 0).any():
        d = int(np.argmax(over))
        raise PlacementError(
            f"the simulated step peaks at {int(placement.peak_bytes[d])} bytes on "
            f"{placement.devices.names[d]}, {int(over[d])} over its limit (the placers' fit "
            "test approximates received copies and fused units, see baechi.schedule); raise "
            "the limit by "
            f"{int(over[d])} bytes or use memory_model='static'")
    for name, g in (("TF colocation", tf_groups), ("chosen", groups)):
        lo = np.full(int(g.max(initial=-1)) + 1, len(placement.devices))
        hi = np.full(len(lo), -1)
        np.minimum.at(lo, g, device)
        np.maximum.at(hi, g, device)
        if (lo != hi).any():
            op = placement.graph.names[int(np.flatnonzero((lo != hi)[g])[0])]
            raise PlacementError(f"{name} group of op {op!r} is split across devices")


def _op_order(graph: CostGraph, units: UnitGraph, unit_schedule: Schedule) -> np.ndarray:
    """The original ops in order of their start within the fused schedule (a unit's ops run
    back to back from the unit's start, in op order; ties by the units' commit order, then op
    index), taken as priorities of a topological sort: a start computed from op times can
    fall after a successor unit's start (the unit's scheduled duration is not the sum of its
    ops' times to the last bit), and an order that is not topological cannot be replayed. So
    the replay is a function of the costs alone, and valid for every costs."""
    unit = units.unit_of_op
    by_unit = np.lexsort((np.arange(graph.num_ops), unit))
    compute = graph.compute_us[by_unit]
    before = np.cumsum(compute) - compute
    first = np.searchsorted(unit[by_unit], np.arange(units.num_units))
    offset = np.empty(graph.num_ops)
    offset[by_unit] = before - before[first[unit[by_unit]]]
    position = np.empty(units.num_units, dtype=np.int64)
    position[unit_schedule.order] = np.arange(units.num_units)
    start = unit_schedule.start_us[unit] + offset
    priority = np.empty(graph.num_ops, dtype=np.int64)
    priority[np.lexsort((np.arange(graph.num_ops), position[unit], start))] = \
        np.arange(graph.num_ops)
    waiting = [len(graph.predecessors(j)) for j in range(graph.num_ops)]
    ready = [(int(priority[j]), j) for j in range(graph.num_ops) if waiting[j] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, j = heapq.heappop(ready)
        order.append(j)
        for k in graph.successors(j):
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, (int(priority[k]), k))
    return np.array(order, dtype=np.int64)


def _op_gates(units: UnitGraph, ops: UnitGraph, unit_schedule: Schedule) -> dict[int, int]:
    """The unit schedule's send gates (``ScheduleBuilder``'s ``late_sends``) over the original
    ops: a unit tensor becomes its op tensor, its reader unit the first op of the unit reading
    it, a gate unit its last op (a unit's ops run in op order). Gates of control edges (4
    bytes) are dropped."""
    graph = ops.graph
    op_tensor = np.full(graph.num_tensors, -1, dtype=np.int64)
    data = np.flatnonzero(ops.tensor_op_tensor >= 0)
    op_tensor[ops.tensor_op_tensor[data]] = data
    gates = {}
    for key, gate in unit_schedule.gates().items():
        t, reader = divmod(key, units.num_units)
        graph_tensor = int(units.tensor_op_tensor[t])
        if graph_tensor >= 0:
            op = next(int(j) for j in units.ops(reader) if graph_tensor in graph.op_inputs(j))
            gates[int(op_tensor[graph_tensor]) * ops.num_units + op] = int(units.ops(gate)[-1])
    return gates


def place(cost_graph: CostGraph, devices: DeviceSet, method: str = "m_etf",
          placer_type: str = "default", grouper: str = "tf", memory_model: str = "liveness",
          sct_threshold: float = 0.5, lp_solver: str = "highs",
          link_model: str | None = None) -> Placement:
    """Place every op of ``cost_graph`` on ``devices`` within their memory limits.

    Parameters:
        cost_graph: the profiled (or estimated) cost graph.
        devices: device names, memory limits and link costs.
        method: ``"m_topo"``, ``"m_etf"`` (default) or ``"m_sct"``.
        placer_type: ``"default"``, ``"colocation"`` or ``"fusion"`` (module docstring).
        grouper: ``"tf"`` (colocation groups) or ``"coplace"`` (plus Baechi's co-placement).
        memory_model: ``"liveness"`` (default) or ``"static"`` (``baechi.memory``).
        sct_threshold: m-SCT's LP rounding threshold.
        lp_solver: m-SCT's LP solver: ``"highs"`` (default), ``"cvxopt"``, ``"mosek"``.
        link_model: ``"contention"`` or ``"parallel"`` (``baechi.devices``); default:
            ``devices.link_model``. The placers plan with it and the step is simulated in it.

    Returns:
        The checked ``Placement``.

    Raises:
        PlacementError: the instance does not fit (the message says how many bytes are
            missing) or a postcondition failed.
        LPSolverError: the requested LP solver is unavailable.
        ValueError: an unknown option.

    Examples:
        >>> from graphfit.profiler.synthetic import training_like
        >>> from graphfit.baechi.devices import DeviceSet
        >>> devs = DeviceSet.uniform([f"/device:CPU:{i}" for i in range(4)], "4GiB",
        ...                          "0.0001754,134")
        >>> graph = training_like(200)
        >>> p = place(graph, devs, method="m_etf")
        >>> len(p.op_devices()) == graph.num_ops and bool((p.peak_bytes <= devs.memory_bytes).all())
        True
    """
    _check_option("method", method, METHODS)
    _check_option("placer_type", placer_type, PLACER_TYPES)
    _check_option("grouper", grouper, GROUPERS)
    _check_option("lp_solver", lp_solver, LP_SOLVERS)
    check_number(sct_threshold, "sct_threshold", minimum=0, maximum=1)
    check_memory_model(memory_model)
    if link_model is not None:
        devices = devices.with_link_model(link_model)
    began = time.perf_counter()
    tf_groups = tf_colocation_groups(cost_graph)
    groups = tf_groups if grouper == "tf" or placer_type == "default" else \
        coplacement_groups(cost_graph, tf_groups)
    if placer_type == "fusion":
        units = fuse(cost_graph, groups)
    else:
        units = UnitGraph.singletons(cost_graph, groups)
    _check_fits(units, devices)
    # The placers' fit test is approximate (received copies, fused units, the repair step's
    # transient copies): when the exact simulation overshoots a device, m-ETF and m-SCT place
    # again with their repair step (baechi.memory_first), then with that device's limit lowered
    # by the overshoot, a few times at most.
    limits = devices.memory_bytes.copy()
    placement_s = 0.0
    repair = False
    over = np.zeros(len(devices), dtype=np.int64)   # the last attempt's excess per device
    for attempt in range(1, MAX_ATTEMPTS + 1):
        began_attempt = time.perf_counter()
        placer_devices = devices.with_memory(limits.tolist())
        try:
            if method == "m_topo":
                unit_schedule = m_topo(units, placer_devices, memory_model)
            elif method == "m_etf":
                unit_schedule = m_etf(units, placer_devices, memory_model,
                                      memory_first_only=repair)
            else:
                unit_schedule = m_sct(units, placer_devices, memory_model, sct_threshold,
                                      lp_solver, memory_first_only=repair)
        except PlacementError as e:
            if attempt == 1:
                raise
            raise PlacementError(
                f"{e} (this was attempt {attempt}: the simulated step of the earlier ones went "
                f"over the limits by up to {int(over.max())} bytes)") from None
        placement_s += time.perf_counter() - (began if attempt == 1 else began_attempt)
        device_index = unit_schedule.device[units.unit_of_op]
        repaired = unit_schedule.info.get("memory_first", False)
        if units.num_units == cost_graph.num_ops and not repaired:
            schedule = dataclasses.replace(unit_schedule, devices=devices)
        else:  # fused units, or the repair step's transient copies: replay as TF runs it
            order = _op_order(cost_graph, units, unit_schedule)
            ops = UnitGraph.singletons(cost_graph, tf_groups)
            first_op = np.searchsorted(units.unit_of_op[np.argsort(units.unit_of_op,
                                                                   kind="stable")],
                                       np.arange(units.num_units))
            waits = np.zeros(cost_graph.num_ops)
            waits[np.argsort(units.unit_of_op, kind="stable")[first_op]] = unit_schedule.wait_us
            schedule = simulate(ops, devices, device_index, order, memory_model,
                                gates=_op_gates(units, ops, unit_schedule),
                                transient_copies=unit_schedule.transient_copies,
                                not_before=waits)
        over = schedule.peak_bytes - devices.memory_bytes
        if (over <= 0).all():
            break
        if method != "m_topo" and not repaired:
            repair = True  # the repair step at the same limits first
        else:
            limits = limits - np.maximum(over, 0)
    unit_schedule.info["placement_attempts"] = attempt
    placement = Placement(
        graph=cost_graph, devices=devices, device_index=device_index, schedule=schedule,
        unit_schedule=unit_schedule, units=units, placement_s=placement_s,
        options={"method": method, "placer_type": placer_type, "grouper": grouper,
                 "memory_model": memory_model, "sct_threshold": sct_threshold,
                 "lp_solver": lp_solver, "link_model": devices.link_model})
    _check_postconditions(placement, tf_groups, groups)
    return placement


def place_feeds_first(cost_graph: CostGraph, devices: DeviceSet, **place_options) -> Placement:
    """``place`` for devices that share one process's memory (``memory_model="shared"``, the
    virtual CPU devices): the session hands fed tensors to the client's device, the first,
    whatever device their placeholder is on (measured: a feed counts on ``CPU:0``). So the
    placeholders go there, the others are placed around them in the first device's remaining
    memory, and the whole step is simulated again as it will run.

    Raises:
        PlacementError: as ``place``, or the step with its feeds on the first device peaks over
            a limit (says by how much).
    """
    feeds = [i for i, op_type in enumerate(cost_graph.op_types) if op_type in FEED_OP_TYPES]
    specs = cost_graph.to_specs()
    for i in feeds:
        specs[i].persistent_bytes = 0
    limits = devices.memory_bytes.copy()
    limits[0] -= int(cost_graph.persistent_bytes[feeds].sum())
    placement = place(CostGraph.from_ops(specs), devices.with_memory(limits.tolist()),
                      **place_options)
    device_index = placement.device_index.copy()
    device_index[feeds] = 0
    schedule = simulate(UnitGraph.singletons(cost_graph, tf_colocation_groups(cost_graph)),
                        devices, device_index, placement.schedule.order,
                        placement.schedule.memory_model)
    over = schedule.peak_bytes - devices.memory_bytes
    if (over > 0).any():
        d = int(np.argmax(over))
        raise PlacementError(f"with the feeds on {devices.names[0]} the step peaks at "
                             f"{int(schedule.peak_bytes[d]) / 2**20:.2f} MiB on "
                             f"{devices.names[d]}, {int(over[d]) / 2**20:.2f} MiB over its limit")
    return dataclasses.replace(placement, graph=cost_graph, devices=devices,
                               device_index=device_index, schedule=schedule)
