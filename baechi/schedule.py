"""Event machinery shared by the placers and the step simulator.

``ScheduleBuilder`` commits units to devices one at a time, in a nondecreasing "clock" of start
times (list scheduling): a unit starts when its device is free and its inputs have arrived;
a tensor crossing devices is sent once per destination device (later readers there reuse the
copy), each transfer starting when the tensor exists and its channel is free. Under the
devices' ``link_model`` (``baechi.devices``) that channel is each device's one channel
(``"contention"``, Baechi's model: the send holds the sender's channel from when the tensor
and that channel are free, the receive holds the receiver's from then or when it is free, and
the copy is there when the receive ends) or the ordered device pair (``"parallel"``). m-TOPO, m-ETF and m-SCT differ only in which unit
they commit next and where; ``simulate`` replays a given placement and order with the same
machinery, so a placer's schedule and the simulated step are the same computation.

Memory during list scheduling (the placers' fit test) follows ``baechi.memory``: under the
liveness model a tensor is charged to a device from its producer's commit (or the copy's
transfer) until every consumer has been committed and the local ones have finished; under the
static model nothing is ever released. The test is made at commit time against the bytes
resident at the current clock, which is an approximation for received copies (their transfer
may start before the clock, so a peak before the clock can grow by the copy; on training-like
graphs at the tightest limits this reached tens of MB; the repair step's builder tests at each
unit's start instead, copies begun before the clock included, never below the exact peak:
``start_shortfall_bytes``). The exact per-device peak of the final
schedule is computed by ``baechi.memory.device_peak_bytes``; ``baechi.place`` checks it and, on
an overshoot, places again with that device's limit lowered by the overshoot. Persistent bytes (variables) are reserved for a whole colocation group when its
first unit is placed, against the highest level the device has had, so they never break an
earlier check.

References:
    Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020, §4
    (m-ETF's event-driven list scheduling with serialised transfers).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from graphfit.baechi.devices import DeviceSet
from graphfit.baechi.memory import check_memory_model, device_peak_bytes
from graphfit.baechi.units import CONTROL_EDGE_BYTES, UnitGraph
from graphfit.errors import GraphfitError
from graphfit.profiler.profile import atomic_write_json

__all__ = ["RuntimeCosts", "Schedule", "ScheduleBuilder", "PlacementError", "simulate"]


MIN_DURATION_US = 1e-3


class PlacementError(GraphfitError, ValueError):
    """No device can hold a unit (the message says how many bytes do not fit), or a
    placement breaks a constraint."""


@dataclasses.dataclass(frozen=True)
class RuntimeCosts:
    """What a real step costs beyond its ops' traced times and its transfers, measured on a run
    target by ``baechi.calibrate.calibrate_runtime``.

    Attributes:
        step_us: fixed cost of one step (``Session.run`` on all the target's devices, nothing
            to compute), added to the makespan.
        op_us: per-op dispatch cost beyond the op's traced time, added to every op.
        cores: how many ops run at once across all the devices (one machine's cores; virtual
            CPU devices and local gRPC workers share them).
        transfer_us: the least a transfer between two devices costs (a scalar's hop); a link
            whose fitted constant term is smaller takes this one instead.
    """

    step_us: float
    op_us: float
    cores: int
    transfer_us: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Schedule:
    """A simulated step: where and when each unit ran, and every transfer.

    Attributes:
        device, start_us, finish_us: per unit.
        order: units in commit order (per device, also execution order).
        transfer_tensor, transfer_src, transfer_dst, transfer_start_us, transfer_end_us:
            one entry per (unit tensor, destination device) copy.
        transfer_gate: per transfer, the unit on the sending device whose end the send waits
            for (-1: it starts as soon as the tensor and the channel allow); see ``late_sends``.
        transfer_reader: per transfer, the unit whose commit made it.
        transient_copies: copies were freed after their readers so far and fetched again
            (``ScheduleBuilder``); a tensor may then reach one device more than once.
        wait_us: per unit, the clock when the placer committed it, if the placer moved the
            clock or released memory since the previous commit, e.g. to wait for memory (0:
            it did not, or its copies had to wait, ``ScheduleBuilder.hold_sends``); a replay
            starts it, and with ``transient_copies`` its copies, no earlier and releases what
            was released by then.
    """

    units: UnitGraph
    devices: DeviceSet
    memory_model: str
    device: np.ndarray
    start_us: np.ndarray
    finish_us: np.ndarray
    order: np.ndarray
    transfer_tensor: np.ndarray
    transfer_src: np.ndarray
    transfer_dst: np.ndarray
    transfer_start_us: np.ndarray
    transfer_end_us: np.ndarray
    makespan_us: float
    peak_bytes: np.ndarray
    transfer_gate: np.ndarray
    transfer_reader: np.ndarray
    wait_us: np.ndarray
    transient_copies: bool = False
    info: dict = dataclasses.field(default_factory=dict)

    def gates(self) -> dict[int, int]:
        """The transfers' gates as ``simulate`` takes them: ``tensor * units + reader`` -> gate
        unit."""
        gated = np.flatnonzero(self.transfer_gate >= 0)
        keys = self.transfer_tensor[gated] * self.units.num_units + self.transfer_reader[gated]
        return dict(zip(keys.tolist(), self.transfer_gate[gated].tolist()))

    def replay_options(self) -> dict:
        """What ``simulate`` needs besides devices and order to replay this schedule: its send
        gates, transient copies and waits for memory (all empty unless the repair step made
        it)."""
        return {"gates": self.gates(), "transient_copies": self.transient_copies,
                "not_before": self.wait_us}

    def to_chrome_trace(self) -> dict:
        """The schedule as Chrome trace JSON (open in Perfetto or chrome://tracing): one process
        per device, thread 0 for compute, one thread per incoming link for transfers."""
        names = self.devices.names
        events = [{"ph": "M", "name": "process_name", "pid": d, "args": {"name": n}}
                  for d, n in enumerate(names)]
        for u in self.order.tolist():
            events.append({"ph": "X", "pid": int(self.device[u]), "tid": 0, "cat": "compute",
                           "name": self.units.unit_name(u), "ts": float(self.start_us[u]),
                           "dur": float(self.finish_us[u] - self.start_us[u])})
        for k in range(len(self.transfer_tensor)):
            t, src = int(self.transfer_tensor[k]), int(self.transfer_src[k])
            producer = self.units.unit_name(int(self.units.tensor_producer[t]))
            events.append({"ph": "X", "pid": int(self.transfer_dst[k]), "tid": 1 + src,
                           "cat": "transfer", "name": f"recv {producer} from {names[src]}",
                           "ts": float(self.transfer_start_us[k]),
                           "dur": float(self.transfer_end_us[k] - self.transfer_start_us[k]),
                           "args": {"bytes": int(self.units.tensor_bytes[t])}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str) -> None:
        """Write ``to_chrome_trace()`` to ``path`` atomically."""
        atomic_write_json(path, self.to_chrome_trace())


class _PendingReleases:
    """One device's pending releases that no later commit can postpone (the repair step's
    ``ScheduleBuilder._level_at``), in growable arrays: the bytes due by a time are one
    vectorised sum. ``_level_at`` asks for it twice per device on every fit test, and with
    thousands of releases pending (the backward pass of a 20,000-op training step) a walk
    over a heap of them took most of a placement's time."""

    def __init__(self):
        self.times = np.empty(64)
        self.nbytes = np.empty(64, dtype=np.int64)
        self.size = 0
        self.first = np.inf  # the earliest pending time

    def add(self, time_us: float, nbytes: int) -> None:
        if self.size == len(self.times):
            self.times = np.resize(self.times, 2 * self.size)
            self.nbytes = np.resize(self.nbytes, 2 * self.size)
        self.times[self.size], self.nbytes[self.size] = time_us, nbytes
        self.size += 1
        self.first = min(self.first, time_us)

    def drop_until(self, time_us: float) -> None:
        """Forget the releases due by ``time_us`` (done)."""
        if self.first > time_us:
            return
        times, nbytes = self.times[:self.size], self.nbytes[:self.size]
        keep = times > time_us
        self.size = int(keep.sum())
        self.times[:self.size], self.nbytes[:self.size] = times[keep], nbytes[keep]
        self.first = float(self.times[:self.size].min(initial=np.inf))

    def due_by(self, time_us: float) -> int:
        """Bytes released by ``time_us``."""
        if self.first > time_us:
            return 0
        times = self.times[:self.size]
        return int(self.nbytes[:self.size][times <= time_us].sum())


class ScheduleBuilder:
    """Mutable list-scheduling state over a unit graph and a device set.

    Parameters:
        units: the unit graph.
        devices: devices (memory limits, link costs).
        memory_model: ``"liveness"`` or ``"static"`` (see ``baechi.memory``).
        monotone: commit start times never go below the clock (the placers need this for
            their memory accounting); without it a unit starts as soon as its device and
            inputs allow, whatever was committed before it on other devices.
        transient_copies: a received copy is freed as soon as its readers committed so far
            have finished (instead of when every reader of the tensor anywhere has been
            committed); a reader committed while the copy is still there extends it, and a
            reader after it is gone receives the tensor again (``refetches``; TF receives a
            tensor once per device, so the caller replays the placement with ``simulate``).
        late_sends: a transfer starts just in time for its reader instead of as soon as the
            tensor exists: it waits for the end of a "gate", the last unit committed on the
            sending device that ends before the transfer must begin for the copy to arrive when
            the reader could start. The received copy then lives from about the reader's turn,
            not from its producer's end (which, with idle links, puts a copy of every tensor
            read elsewhere on the reader's device long before it is needed). A run realises a
            gate with one ordering edge on the sending device (``Schedule.transfer_gate``).
            ``baechi.memory_first`` uses it.
        gates: replay given gates (``Schedule.gates()``): ``tensor * units + reader`` -> gate
            unit, which must be committed before the reader.
        not_before: replay given waits for memory (``Schedule.wait_us``): per unit, a time
            before which it does not start.
        runtime: ``RuntimeCosts`` of the target: every op costs ``op_us`` more, at most
            ``cores`` units run at once across the devices, a transfer costs at least
            ``transfer_us``, and the makespan includes ``step_us`` (None: none of these, the
            placers' model).

    A placer repeatedly picks a ready unit and a device, asks ``shortfall_bytes`` (<= 0: fits)
    and ``data_ready_us`` (when its inputs would be there), and calls ``commit``, which returns
    the units that became ready. ``advance`` moves the clock and releases memory freed by then.
    """

    def __init__(self, units: UnitGraph, devices: DeviceSet, memory_model: str = "liveness",
                 monotone: bool = True, transient_copies: bool = False,
                 late_sends: bool = False, gates: dict[int, int] | None = None,
                 not_before: Sequence[float] | None = None,
                 runtime: RuntimeCosts | None = None):
        check_memory_model(memory_model)
        self.monotone = monotone
        self.late_sends = late_sends
        self.gates = gates
        self.transient_copies = transient_copies and memory_model == "liveness"
        self.copy_free_at: dict[int, float] = {}   # t * D + device -> scheduled release
        self.gone: set[int] = set()                # t * D + device: copy freed, not again
        self.units, self.devices = units, devices
        # The fit test of "shared" is liveness's (a received copy is charged: conservative on
        # the reader, optimistic on the producer; place() re-checks the exact peaks).
        self.liveness = memory_model in ("liveness", "shared")
        self.memory_model = memory_model
        n, d = units.num_units, len(devices)
        self.num_devices = d
        adj = units.adjacency_lists()
        self._inputs, self._outputs = adj["inputs"], adj["outputs"]
        self._consumers = adj["consumers"]
        # A unit takes at least 1 ns, so its inputs and outputs coexist in the memory sweep.
        compute = units.compute_us
        self.runtime = runtime
        self.cores_free: list[float] = []  # when each core is free, a heap (with ``runtime``)
        if runtime is not None:
            compute = compute + runtime.op_us * np.bincount(units.unit_of_op,
                                                            minlength=units.num_units)
            if runtime.cores < len(devices):
                self.cores_free = [0.0] * runtime.cores
        self._compute = np.maximum(compute, MIN_DURATION_US).tolist()
        self._temp = units.temp_bytes.tolist()
        self._out_bytes = units.output_bytes.tolist()
        self._group = units.group.tolist()
        self._t_bytes = units.tensor_bytes.tolist()
        self._t_comm = np.maximum(units.tensor_bytes, CONTROL_EDGE_BYTES).tolist()
        self._t_producer = units.tensor_producer.tolist()
        # Persistent outputs (charged with the unit's persistent bytes) and fetched outputs
        # (held to the end) are never released on their producer's device.
        self._t_held = (units.tensor_persistent | units.tensor_fetched).tolist()
        self._a, self._b = devices.a_us_per_byte, devices.b_us
        if runtime is not None and runtime.transfer_us:
            self._b = [[max(b, runtime.transfer_us) if i != j else 0.0
                        for j, b in enumerate(row)] for i, row in enumerate(self._b)]
        self.limit = devices.memory_bytes.tolist()
        group_persistent = np.bincount(units.group, weights=units.persistent_bytes,
                                       minlength=units.num_groups)
        self.group_persistent = group_persistent.astype(np.int64).tolist()
        self.group_device = [-1] * units.num_groups
        self.device = [-1] * n
        self.start = [0.0] * n
        self.finish = [0.0] * n
        self.wait_us = [0.0] * n if not_before is None else list(not_before)
        self.advanced = False                        # advance() called since the last commit
        self.order: list[int] = []
        self.device_free = [0.0] * d
        self.ends_on: list[list[float]] = [[] for _ in range(d)]   # per device, in order
        self.units_on: list[list[int]] = [[] for _ in range(d)]
        self.contention = devices.link_model == "contention"
        self.link_free = [[0.0] * d for _ in range(d)]   # parallel: per ordered pair
        self.channel_free = [0.0] * d                    # contention: per device
        self.arrival: dict[int, float] = {}          # t * D + device -> time the copy is there
        # data_ready_us asks _incoming with gated, late or transient sends; otherwise it keeps
        # u * D + device -> a ready unit's inputs (local ready time, sends)
        self._ready_from_incoming = late_sends or gates is not None or self.transient_copies
        self._ready_inputs: dict[int, tuple[float, list[tuple[float, int, float]], float]] = {}
        self.last_use: dict[int, float] = {}         # t * D + device -> when it may be freed
        self.holders: list[list[int]] = [[] for _ in range(units.num_tensors)]
        self.remaining = [len(c) for c in self._consumers]
        self.level = [0] * d                         # bytes resident at the clock
        self.high_water = [0] * d                    # highest level seen so far
        self.pending_frees: list[tuple[float, int, int, int]] = []  # (time, d, bytes, copy)
        # per device, the releases so far: times and the bytes released up to each (a copy
        # sent before the clock meets the bytes released since its transfer began); the
        # pending releases no commit can postpone, per device (start_shortfall_bytes)
        self.release_times: list[list[float]] = [[] for _ in range(d)]
        self.released_bytes: list[list[int]] = [[0] for _ in range(d)]
        self.final_frees = [_PendingReleases() for _ in range(d)]
        self.clock = 0.0
        self.transfers: list[tuple[int, int, int, float, float, int, int]] = []
        self.received = [0] * d                      # transfers into each device so far
        indegree = np.zeros(n, dtype=np.int64)
        np.add.at(indegree, units.edges[1], 1)
        self.missing_inputs = indegree.tolist()
        succ = [[] for _ in range(n)]
        for a, b in units.edges.T.tolist():
            succ[a].append(b)
        self._successors = succ

    # -- queries ------------------------------------------------------------------------------
    def initially_ready(self) -> list[int]:
        """Units with no predecessor, ascending."""
        return [u for u, k in enumerate(self.missing_inputs) if k == 0]

    def _incoming(self, u: int, d: int) -> tuple[float, list[tuple[int, int, float, float, int]]]:
        """When all of ``u``'s inputs are on device ``d``, and the transfers that needs
        (tensor, source device, start, end, gate), sent in order of availability."""
        ready = 0.0
        needed = []
        dd = self.num_devices
        for t in self._inputs[u]:
            p = self._t_producer[t]
            src = self.device[p]
            if src == d:
                when = self.finish[p]
            else:
                when = self.arrival.get(t * dd + d)
                if when is None:
                    needed.append((self.finish[p], t, src))
                    continue
            if when > ready:
                ready = when
        sends = []
        if needed:
            needed.sort()
            # source -> when its channel (contention) or its link to d is free again
            sent: dict[int, float] = {}
            received = self.channel_free[d]
            wanted = max(self.clock, self.device_free[d])  # when u could start on d
            for available, t, src in needed:
                cost = self._a[src][d] * self._t_comm[t] + self._b[src][d]
                gate = -1
                if self.late_sends:
                    gate = self._gate(src, available, wanted - cost)
                elif self.gates is not None:
                    gate = self.gates.get(t * self.units.num_units + u, -1)
                    if gate != -1 and self.device[gate] == -1:
                        name = self.units.unit_name
                        raise PlacementError(
                            f"the send of a tensor of {name(self._t_producer[t])!r} waits for "
                            f"{name(gate)!r}, which comes after its reader {name(u)!r} in the "
                            "order")
                if gate != -1 and self.finish[gate] > available:
                    available = self.finish[gate]
                if self.transient_copies and self.monotone and available < self.wait_us[u]:
                    available = self.wait_us[u]  # a unit that waited for memory (hold_sends)
                if self.contention:  # see the class docstring: send, then receive
                    send_begin = max(available, sent.get(src, self.channel_free[src]))
                    begin = max(send_begin, received)
                    sent[src] = send_begin + cost
                else:
                    begin = max(available, sent.get(src, self.link_free[src][d]))
                    sent[src] = begin + cost
                end = received = begin + cost
                sends.append((t, src, begin, end, gate))
                if end > ready:
                    ready = end
            self._senders_free = sent
        return ready, sends

    def _gate(self, src: int, available: float, latest: float) -> int:
        """The last unit committed on ``src`` that ends after ``available`` and by ``latest``
        (-1: none, the tensor itself is that recent)."""
        ends = self.ends_on[src]
        k = bisect.bisect_right(ends, latest) - 1
        return self.units_on[src][k] if k >= 0 and ends[k] > available else -1

    def data_ready_us(self, u: int, d: int) -> float:
        """When ``u``'s inputs would all be on device ``d`` (ignoring the device's queue):
        ``_incoming``'s time without its list of sends (the placers' hot query).

        m-ETF asks again for the same (unit, device) each time a link may have got busier
        (hundreds of thousands of times on a 100k-op graph), and only the channel times change
        between those asks: what the inputs need (the local ready time and the sends, sorted,
        with their costs) is kept until the unit is committed or one of its inputs reaches
        ``d`` (``_forget_ready``), so such an ask is one pass over the sends, and
        ``receive_bound`` reads it."""
        if self._ready_from_incoming:
            return self._incoming(u, d)[0]
        key = u * self.num_devices + d
        known = self._ready_inputs.get(key)
        if known is None:
            known = self._ready_inputs[key] = self._ready_inputs_of(u, d)
        ready, needed, _ = known
        if not needed:
            return ready
        if self.contention:  # each sender's channel, then d's, one transfer at a time
            sender = self.channel_free.copy()
            received = sender[d]
            for available, src, cost in needed:
                begin = sender[src]
                if available > begin:
                    begin = available
                sender[src] = begin + cost
                if received > begin:
                    begin = received
                received = begin + cost
            return received if received > ready else ready
        sent: dict[int, float] = {}
        link = self.link_free
        for available, src, cost in needed:
            begin = max(available, sent.get(src, link[src][d]))
            sent[src] = begin + cost
        return max(ready, *sent.values())

    def readers(self, t: int) -> list[int]:
        """The units that read tensor ``t``."""
        return self._consumers[t]

    def receive_bound(self, u: int, d: int) -> tuple[float, float] | None:
        """``(floor_us, cost_us)`` with ``data_ready_us(u, d) >= max(floor_us,
        receive_free_us(d) + cost_us)``, at the cost of one look-up, for a (unit, device)
        whose inputs ``data_ready_us`` keeps (asked before, no copy of an input reached ``d``
        since; else None). Under contention every send into ``d`` queues on ``d``'s one
        channel: the inputs are there no earlier than that channel is free, or the first
        tensor, plus all the sends' costs. m-ETF tests it before asking again: when links
        contend, nine in ten estimates that go stale do so because ``d``'s channel got busier,
        and ``cost_us`` stays the same while that channel moves."""
        known = self._ready_inputs.get(u * self.num_devices + d)
        if known is None:
            return None
        ready, needed, cost = known
        if not needed or not self.contention:
            return ready, 0.0
        return max(ready, needed[0][0] + cost), cost

    def receive_free_us(self, d: int) -> float:
        """When device ``d``'s receiving channel is free (contention; 0 with parallel links,
        which have no shared channel)."""
        return self.channel_free[d] if self.contention else 0.0

    def ready_epoch(self, d: int) -> int:
        """A count that changes whenever ``data_ready_us(·, d)`` may have changed: only
        transfers change it (channel times, copies that arrived), and with parallel links only
        those into ``d``. m-ETF asks a stale-looking estimate again only when this moved (on
        a training step most commits send nothing; with parallel links most send elsewhere)."""
        return len(self.transfers) if self.contention else self.received[d]

    def _ready_inputs_of(self, u: int, d: int
                         ) -> tuple[float, list[tuple[float, int, float]], float]:
        """What ``data_ready_us`` needs of ``u`` on ``d`` besides the channel times: when its
        inputs already there are ready, the sends of the others in ``_incoming``'s order
        (available, source, cost), and the sends' total cost."""
        ready = 0.0
        needed = []
        dd, device, finish, arrival = self.num_devices, self.device, self.finish, self.arrival
        producer = self._t_producer
        for t in self._inputs[u]:
            p = producer[t]
            src = device[p]
            if src == d:
                when = finish[p]
            else:
                when = arrival.get(t * dd + d)
                if when is None:
                    needed.append((finish[p], t, src))
                    continue
            if when > ready:
                ready = when
        if not needed:
            return ready, needed, 0
        needed.sort()
        a, b, t_comm = self._a, self._b, self._t_comm
        sends = []
        total = 0
        for available, t, src in needed:
            cost = a[src][d] * t_comm[t] + b[src][d]
            sends.append((available, src, cost))
            total += cost
        return ready, sends, total

    def _forget_ready(self, u: int, d: int, sends: list[tuple]) -> None:
        """Drop ``data_ready_us``'s kept inputs of ``u`` (committed) and, on ``d``, of the
        readers of each tensor in ``sends`` (``_incoming``'s, whose copies reach ``d``)."""
        if not self._ready_inputs:
            return
        dd, kept, consumers = self.num_devices, self._ready_inputs, self._consumers
        for e in range(dd):
            kept.pop(u * dd + e, None)
        for t, *_ in sends:
            for v in consumers[t]:
                kept.pop(v * dd + d, None)

    def shortfall_bytes(self, u: int, d: int) -> int:
        """Bytes by which unit ``u`` does not fit on device ``d`` now (<= 0: it fits).

        Counts its outputs, temporary bytes, copies of inputs not yet on ``d``, and, for the
        first unit of a colocation group, the whole group's persistent bytes (checked against
        the device's highest level so far, since they are held all step), against the level at
        the clock (``start_shortfall_bytes`` tests at the unit's start).
        """
        g = self._group[u]
        gd = self.group_device[g]
        if gd != -1 and gd != d:
            return 1 << 62
        need = self._out_bytes[u] + self._temp[u]
        dd = self.num_devices
        for t in self._inputs[u]:
            if self.device[self._t_producer[t]] != d and (t * dd + d) not in self.arrival:
                need += self._t_bytes[t]
        if gd == -1 and self.group_persistent[g]:
            return max(self.level[d] + need, self.high_water[d]) + self.group_persistent[g] \
                - self.limit[d]
        return self.level[d] + need - self.limit[d]

    def start_shortfall_bytes(self, u: int, d: int) -> int:
        """Bytes by which unit ``u`` does not fit on device ``d`` when it would start there
        (<= 0: it fits); with ``transient_copies`` and ``monotone`` only (the repair step's
        builder; else ``shortfall_bytes``).

        ``shortfall_bytes`` tests against the level at the clock, but a unit starts when its
        device and inputs are ready, often later, when bytes ``d`` holds now are gone: this
        test takes the level at the unit's start (less the releases due on ``d`` by then that
        no later commit can postpone) for its outputs, temporary bytes and copies, and the
        level when its first copy begins (a just-in-time send may begin before the clock:
        then the level now plus what ``d`` released since) for the copies. Never below what
        the device holds then, so a replay of the schedule peaks within the limits.
        """
        g = self._group[u]
        gd = self.group_device[g]
        if gd != d and (gd != -1 or self.group_persistent[g]) or not (
                self.transient_copies and self.monotone):
            return self.shortfall_bytes(u, d)
        ready, sends = self._incoming(u, d)
        begin = max(ready, self.device_free[d], self.clock, self.wait_us[u])
        copies = sum(self._t_bytes[t] for t, *_ in sends)
        first = min((t_begin for _, _, t_begin, _, _ in sends), default=begin)
        return max(self._level_at(d, begin) + self._out_bytes[u] + self._temp[u] + copies,
                   self._level_at(d, first) + copies) - self.limit[d]

    def _level_at(self, d: int, time_us: float) -> int:
        """An upper bound of device ``d``'s bytes at ``time_us`` given what is committed:
        before the clock, the level now plus what ``d`` released since; after it, the level
        less the final releases due by then (a copy's release is not final: a later reader
        can extend it)."""
        if time_us < self.clock:
            k = bisect.bisect_right(self.release_times[d], time_us)
            return self.level[d] + self.released_bytes[d][-1] - self.released_bytes[d][k]
        return self.level[d] - self.final_frees[d].due_by(time_us)

    def refetches(self, u: int, d: int) -> bool:
        """Whether ``u`` on ``d`` would receive again an input whose copy ``d`` already freed
        (``transient_copies``)."""
        dd = self.num_devices
        return any(t * dd + d in self.gone for t in self._inputs[u])

    def growth_bytes(self, u: int, d: int) -> int:
        """Net bytes committing ``u`` on ``d`` would add to ``d`` once it ends: what it
        allocates minus the local inputs it is the last reader of (a rough, liveness-only
        measure the placers use to prefer units that release memory)."""
        grow = self._out_bytes[u]
        dd = self.num_devices
        for t in self._inputs[u]:
            local = self.device[self._t_producer[t]] == d
            if not local and (t * dd + d) not in self.arrival:
                grow += self._t_bytes[t]
            elif self.remaining[t] == 1 and self.liveness and not (local and self._t_held[t]):
                grow -= self._t_bytes[t]
        return grow

    def next_free_us(self) -> float | None:
        """Time of the next pending memory release, if any."""
        return self.pending_frees[0][0] if self.pending_frees else None

    # -- updates ------------------------------------------------------------------------------
    def pin_group(self, g: int, d: int) -> None:
        """Put colocation group ``g`` on device ``d`` now, holding its persistent bytes there
        from now on (at the latest when its first unit is committed)."""
        self.group_device[g] = d
        self.level[d] += self.group_persistent[g]
        self.high_water[d] += self.group_persistent[g]

    def hold_sends(self, u: int) -> None:
        """Make unit ``u`` (not committed yet) wait for the clock, and with
        ``transient_copies`` its copies too: they begin no earlier than ``wait_us[u]``, so
        the fit test at the clock is exact for them."""
        self.wait_us[u] = max(self.wait_us[u], self.clock)

    def advance(self, time_us: float) -> bool:
        """Move the clock to ``time_us`` (never back) and release memory freed by then.
        Returns whether anything was released."""
        self.advanced = True
        if time_us > self.clock:
            self.clock = time_us
        released = False
        frees = self.pending_frees
        while frees and frees[0][0] <= self.clock:
            when, d, nbytes, copy = heapq.heappop(frees)
            if copy >= 0:
                if self.copy_free_at.get(copy) != when:
                    continue  # extended by a later reader
                del self.copy_free_at[copy], self.arrival[copy]
                self.gone.add(copy)
            self.level[d] -= nbytes
            self.release_times[d].append(when)
            self.released_bytes[d].append(self.released_bytes[d][-1] + nbytes)
            released = True
        if self.transient_copies:
            for releases in self.final_frees:  # the same releases, done
                releases.drop_until(self.clock)
        return released

    def _charge(self, d: int, nbytes: int) -> None:
        self.level[d] += nbytes
        if self.level[d] > self.high_water[d]:
            self.high_water[d] = self.level[d]

    def _release_later(self, time_us: float, d: int, nbytes: int, copy: int = -1) -> None:
        if self.liveness and nbytes:
            heapq.heappush(self.pending_frees, (time_us, d, nbytes, copy))
            if copy < 0 and self.transient_copies:
                self.final_frees[d].add(time_us, nbytes)

    def commit(self, u: int, d: int) -> list[int]:
        """Run unit ``u`` on device ``d`` as early as possible at or after the clock; returns
        the units that became ready."""
        dd = self.num_devices
        if self.advanced and self.monotone:
            # the placer moved the clock or released memory since the last commit (e.g. it
            # waited for memory): a replay must do the same before this unit
            self.wait_us[u] = max(self.wait_us[u], self.clock)
        self.advanced = False
        ready, sends = self._incoming(u, d)
        begin = max(ready, self.device_free[d], self.clock if self.monotone else 0.0,
                    self.wait_us[u])
        if self.cores_free:
            begin = max(begin, self.cores_free[0])
        end = begin + self._compute[u]
        if self.cores_free:
            heapq.heapreplace(self.cores_free, end)
        if begin > self.clock:
            self.clock = begin
        if self.group_device[self._group[u]] == -1:
            self.pin_group(self._group[u], d)
        # the loops below run for every input and output of every commit: locals, not
        # attribute look-ups
        last_use, holders, t_bytes = self.last_use, self.holders, self._t_bytes
        release_later = self._release_later
        for t, src, t_begin, t_end, gate in sends:
            self.link_free[src][d] = self.channel_free[d] = t_end
            self.arrival[t * dd + d] = t_end
            self.transfers.append((t, src, d, t_begin, t_end, gate, u))
            self.received[d] += 1
            if not self.transient_copies:
                holders[t].append(d)
            key = t * dd + src
            if last_use.get(key, 0.0) < t_end:
                last_use[key] = t_end
            self._charge(d, t_bytes[t])
        if sends and self.contention:
            for src, free in self._senders_free.items():
                self.channel_free[src] = free
        self._forget_ready(u, d, sends)
        self._charge(d, self._out_bytes[u] + self._temp[u])
        release_later(end, d, self._temp[u])
        remaining = self.remaining
        transient, copy_free_at = self.transient_copies, self.copy_free_at
        device, producer = self.device, self._t_producer
        for t in self._inputs[u]:
            key = t * dd + d
            if last_use.get(key, 0.0) < end:
                last_use[key] = end
            if transient and device[producer[t]] != d and copy_free_at.get(key, -1.0) < end:
                copy_free_at[key] = end
                release_later(end, d, t_bytes[t], key)
            remaining[t] -= 1
            if remaining[t] == 0:
                for h in holders[t]:
                    release_later(last_use[t * dd + h], h, t_bytes[t])
        held = self._t_held
        for t in self._outputs[u]:
            if held[t]:
                continue
            holders[t].append(d)
            if remaining[t] == 0:  # an output nobody reads: freed when its producer ends
                release_later(end, d, t_bytes[t])
        self.device[u], self.start[u], self.finish[u] = d, begin, end
        self.device_free[d] = end
        self.ends_on[d].append(end)
        self.units_on[d].append(u)
        self.order.append(u)
        ready_units = []
        missing = self.missing_inputs
        for v in self._successors[u]:
            missing[v] -= 1
            if missing[v] == 0:
                ready_units.append(v)
        return ready_units

    def finish_schedule(self, info: dict | None = None) -> Schedule:
        """The committed schedule, with exact per-device peaks.

        Raises:
            PlacementError: if some unit was never committed.
        """
        if len(self.order) != self.units.num_units:
            missing = next(u for u in range(self.units.num_units) if self.device[u] == -1)
            raise PlacementError(f"unit {self.units.unit_name(missing)!r} was never scheduled")
        tr = np.array(self.transfers, dtype=np.float64).reshape(-1, 7)
        sched = Schedule(
            units=self.units, devices=self.devices, memory_model=self.memory_model,
            device=np.array(self.device, dtype=np.int64),
            start_us=np.array(self.start), finish_us=np.array(self.finish),
            order=np.array(self.order, dtype=np.int64),
            transfer_tensor=tr[:, 0].astype(np.int64), transfer_src=tr[:, 1].astype(np.int64),
            transfer_dst=tr[:, 2].astype(np.int64), transfer_start_us=tr[:, 3],
            transfer_end_us=tr[:, 4],
            makespan_us=max(self.finish, default=0.0) + (self.runtime.step_us
                                                          if self.runtime else 0.0),
            peak_bytes=np.zeros(self.num_devices, dtype=np.int64),
            transfer_gate=tr[:, 5].astype(np.int64), transfer_reader=tr[:, 6].astype(np.int64),
            wait_us=np.array(self.wait_us), transient_copies=self.transient_copies,
            info=dict(info or {}))
        sched.peak_bytes = device_peak_bytes(sched)
        return sched


def simulate(units: UnitGraph, devices: DeviceSet, device_of_unit: Sequence[int],
             order: Sequence[int] | None = None, memory_model: str = "liveness",
             in_order: bool = True, gates: dict[int, int] | None = None,
             transient_copies: bool = False,
             not_before: Sequence[float] | None = None,
             runtime: RuntimeCosts | None = None) -> Schedule:
    """Simulate one step of a placed unit graph.

    Units start in ``order`` (default: topological), each as soon as its device is free and its
    inputs have arrived; transfers share channels as ``devices.link_model`` says. With ``in_order`` (the
    default, what the placers do) no unit starts before an earlier unit of ``order``, so a
    placer's commit order replays its schedule exactly; without it each device runs its units
    as early as possible (memory peaks can then differ from the placer's).

    Parameters:
        units: the unit graph (``UnitGraph.singletons`` for plain op graphs).
        devices: device set (link costs and link model; memory limits are not enforced here).
        device_of_unit: device index per unit.
        order: a topological order of all units (e.g. a placer's commit order).
        memory_model: how ``peak_bytes`` is computed (``"liveness"`` or ``"static"``).
        in_order: keep start times in ``order`` (see above).
        gates: sends that wait for a unit's end (``Schedule.gates()`` of a placement made
            with ``late_sends``, see ``ScheduleBuilder``).
        transient_copies: free received copies after their readers so far and fetch again
            (``ScheduleBuilder``), as the repair step planned (``Schedule.transient_copies``).
        not_before: per unit, a time before which it may not start (``Schedule.wait_us``: the
            repair step's waits for memory).
        runtime: the target's measured ``RuntimeCosts`` (step and per-op costs, cores), to
            predict a real step's time; default: none (the placers' model).

    Returns:
        The ``Schedule``: makespan, per-device peak bytes, per-unit times, transfers.

    Raises:
        PlacementError: if ``order`` is not a topological order of every unit, or a device
            index is out of range.

    Examples:
        >>> from graphfit.profiler.cost_graph import CostGraph, OpSpec
        >>> from graphfit.baechi.devices import DeviceSet
        >>> g = CostGraph.from_ops([OpSpec("a", "X", output_bytes=[1000], compute_us=10),
        ...                         OpSpec("b", "Y", inputs=[("a", 0)], compute_us=5)])
        >>> devs = DeviceSet.uniform(["/GPU:0", "/GPU:1"], "1MiB", "0.01,2")
        >>> simulate(UnitGraph.singletons(g, [0, 1]), devs, [0, 1]).makespan_us  # 10 + 12 + 5
        27.0
    """
    device_of_unit = np.asarray(device_of_unit, dtype=np.int64)
    if len(device_of_unit) != units.num_units or (device_of_unit < 0).any() or (
            device_of_unit >= len(devices)).any():
        raise PlacementError(f"need a device index in [0, {len(devices)}) for each of the "
                             f"{units.num_units} units")
    builder = ScheduleBuilder(units, devices, memory_model, monotone=in_order,
                              gates=gates, transient_copies=transient_copies,
                              not_before=not_before, runtime=runtime)
    seq = units.topological_order if order is None else np.asarray(order)
    for u in seq.tolist():
        if builder.missing_inputs[u] != 0 or builder.device[u] != -1:
            raise PlacementError(f"order is not topological at unit {units.unit_name(u)!r}")
        if builder.wait_us[u] > 0:  # the plan waited here for memory: release what it did
            builder.advance(builder.wait_us[u])
        builder.commit(u, int(device_of_unit[u]))
    return builder.finish_schedule()

