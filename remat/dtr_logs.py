"""Read DTR's PyTorch operator logs into cost graphs, so every heuristic can replay them.

The Dynamic Tensor Rematerialization artifact (Kirisame et al., ICLR 2021; uwsampl/dtr-prototype,
``simrd/logs.zip``) ships eight logged training steps of real GPU models. Each line is one JSON
instruction (format: ``shared/dtr-logs/README.md``). This module turns one log into a
``CostGraph`` plus the list of tensors that must be resident when the step ends.

Modelling (the choices a replay has to make):

- ``CONSTANT`` + ``MEMORY``: a parameter or input. It becomes an op of type ``Constant`` with
  ``persistent_bytes`` = its size and ``is_variable`` set, and one output of 0 bytes (a handle):
  the bytes count against the budget for the whole step and are never evicted.
- ``CALL``: an op (type = the operator's name, ``compute_us`` = ``TIME`` / 1000). Each result has
  its ``MEMORY`` bytes, unless its ``ALIAS`` names an argument: a view of that argument's storage,
  which gets 0 bytes of its own. An op reading a view also reads the view's root storage, so the
  storage stays alive (and is rematerialized) as long as any view of it is used.
- ``MUTATE``: an in-place op, modelled out of place: it reads all its arguments and makes one
  new tensor per mutated argument, the size of that argument's storage; every name bound to the
  old tensor is rebound to the new version (the old one dies after its last use).
- ``COPY``: one more name for the same tensor. ``COPY_FROM``: every name of the destination's
  tensor is rebound to the source's tensor. ``RELEASE``: the name is dropped (releases of
  unknown names are ignored, as DTR's own parser does).
- Tensors still named when the log ends are the step's outputs (with their root storage).
- ``ANNOTATE``: the step starts after ``START``; ``BACKWARD`` marks the first backward op.

Liveness comes from the graph (a tensor dies after its last reader), not from ``RELEASE``: the
simulator frees eagerly, which is at least as early as Python dropping its last reference. The
release events are kept too (``DtrTrace.released_after``): DTR's papers take budget ratios of
the peak of a replay that frees a storage only when the program drops its last reference
(``release_peak_bytes``), which is higher than the eager checkpoint-all peak.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from graphfit.errors import GraphfitError
from graphfit.profiler.cost_graph import CostGraph, OpSpec

__all__ = ["DtrLogError", "DtrTrace", "default_logs_path", "read_log", "load_trace",
           "load_traces", "trace_names", "release_peak_bytes"]

_REPO_ROOT = Path(__file__).resolve().parents[1]


class DtrLogError(GraphfitError, ValueError):
    """A log line is malformed or names a tensor the log never defined."""


@dataclasses.dataclass
class DtrTrace:
    """One logged training step as a cost graph.

    Attributes:
        name: the model (manifest name, e.g. ``"ResNet-32 (56)"``) or the file name.
        graph: ops in log order (a topological order), sizes in bytes, times in microseconds.
        outputs: tensor ids that must be resident when the step ends.
        backward_start: id of the first op after the ``BACKWARD`` annotation (``num_ops`` if
            the log has none).
        released_after: per tensor, the id of the last op logged before the program dropped
            its last reference to the tensor's storage (itself or a view of it);
            ``num_ops`` for the step's outputs. Views (0 bytes) carry their root's value.
    """

    name: str
    graph: CostGraph
    outputs: list[int]
    backward_start: int
    released_after: list[int] = dataclasses.field(default_factory=list)


def default_logs_path() -> Path:
    """``logs.zip`` in the shared folder next to the repository (``../shared/dtr-logs``),
    or ``$DTR_LOGS`` when set."""
    return Path(os.environ.get("DTR_LOGS", _REPO_ROOT.parent / "shared" / "dtr-logs" / "logs.zip"))


class _Builder:
    """Accumulates op specs while replaying the log's naming (names -> tensors)."""

    def __init__(self):
        self.specs: list[OpSpec] = []
        self.names: dict[str, tuple[str, int]] = {}       # log name -> tensor (op, port)
        self.holders: dict[tuple[str, int], set[str]] = {}  # tensor -> log names bound to it
        self.root: dict[tuple[str, int], tuple[str, int]] = {}  # view -> storage tensor
        self.storage_bytes: dict[tuple[str, int], int] = {}
        self.backward_start: int | None = None
        self.released_after: dict[tuple[str, int], int] = {}  # tensor -> last op before release

    def bind(self, name: str, tensor: tuple[str, int]) -> None:
        self.release(name)
        self.names[name] = tensor
        self.holders.setdefault(tensor, set()).add(name)

    def release(self, name: str) -> None:
        tensor = self.names.pop(name, None)
        if tensor is not None:
            self.holders[tensor].discard(name)
            if not self.holders[tensor]:
                self.released_after[tensor] = len(self.specs) - 1

    def rebind_all(self, old: tuple[str, int], new: tuple[str, int]) -> None:
        for name in list(self.holders.get(old, ())):
            self.bind(name, new)

    def tensor(self, name: str, line_no: int) -> tuple[str, int]:
        try:
            return self.names[name]
        except KeyError:
            raise DtrLogError(f"line {line_no}: {name!r} is used but was never defined "
                              "(or was released before)") from None

    def inputs(self, args: list[str], line_no: int) -> list[tuple[str, int]]:
        """The argument tensors and the root storages of views, without repeats."""
        tensors = [self.tensor(a, line_no) for a in args]
        return list(dict.fromkeys(tensors + [self.root[t] for t in tensors if t in self.root]))

    def add_op(self, op_type: str, inputs, output_bytes, time_ns=0.0, **flags) -> str:
        name = f"{op_type}_{len(self.specs)}"
        self.specs.append(OpSpec(name, op_type, inputs=inputs, output_bytes=output_bytes,
                                 compute_us=float(time_ns) / 1000.0, **flags))
        return name


def read_log(lines: Iterable[str | bytes], name: str = "") -> DtrTrace:
    """Replay one DTR log (an iterable of JSON lines) into a ``DtrTrace``.

    Parameters:
        lines: the log's lines (str or bytes), e.g. an open file.
        name: what to call the trace.

    Returns:
        The trace; its graph's ops are in log order.

    Raises:
        DtrLogError: on a line that is not JSON, an unknown instruction, a CALL whose results
            lack MEMORY/ALIAS lines, or an argument that names no live tensor.
    """
    records = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((line_no, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DtrLogError(f"line {line_no} is not JSON: {e}") from None
    if any(r.get("ANNOTATION") == "START" for _, r in records):
        start = next(k for k, (_, r) in enumerate(records) if r.get("ANNOTATION") == "START")
        records = records[start + 1:]
    b = _Builder()
    k = 0
    while k < len(records):
        line_no, r = records[k]
        k += 1
        kind = r.get("INSTRUCTION")
        if kind == "CONSTANT":
            mem = _expect(records, k, "MEMORY", r["NAME"])
            k += 1
            op = b.add_op("Constant", (), [0], persistent_bytes=int(mem["MEMORY"]),
                          is_variable=True)
            b.storage_bytes[(op, 0)] = int(mem["MEMORY"])
            b.bind(r["NAME"], (op, 0))
        elif kind == "CALL":
            results = r["RESULT"]
            mems, aliases = [], []
            for res in results:
                mems.append(int(_expect(records, k, "MEMORY", res)["MEMORY"]))
                aliases.append(int(_expect(records, k + 1, "ALIAS", res)["ALIAS"]))
                k += 2
            args = [b.tensor(a, line_no) for a in r["ARGS"]]
            sizes = [0 if a >= 0 else m for m, a in zip(mems, aliases)]
            op = b.add_op(r["NAME"], b.inputs(r["ARGS"], line_no), sizes, r["TIME"])
            for port, (res, alias) in enumerate(zip(results, aliases)):
                t = (op, port)
                if alias >= 0:
                    base = args[alias]
                    b.root[t] = b.root.get(base, base)
                    b.storage_bytes[t] = b.storage_bytes[b.root[t]]
                else:
                    b.storage_bytes[t] = sizes[port]
                b.bind(res, t)
        elif kind == "MUTATE":
            args = [b.tensor(a, line_no) for a in r["ARGS"]]
            mutated = [args[int(m)] for m in r["MUTATE"]]
            sizes = [b.storage_bytes[t] for t in mutated]
            op = b.add_op(r["NAME"], b.inputs(r["ARGS"], line_no), sizes, r["TIME"])
            for port, old in enumerate(mutated):
                b.storage_bytes[(op, port)] = sizes[port]
                b.rebind_all(old, (op, port))
        elif kind == "COPY":
            b.bind(r["DST"], b.tensor(r["SRC"], line_no))
        elif kind == "COPY_FROM":
            b.rebind_all(b.tensor(r["DST"], line_no), b.tensor(r["SRC"], line_no))
        elif kind == "RELEASE":
            b.release(r["NAME"])
        elif kind == "ANNOTATE":
            if r.get("ANNOTATION") == "BACKWARD" and b.backward_start is None:
                b.backward_start = len(b.specs)
        else:
            raise DtrLogError(f"line {line_no}: unexpected instruction {kind!r} "
                              "(MEMORY and ALIAS must follow a CONSTANT or CALL)")
    graph = CostGraph.from_ops(b.specs)
    live = {t for t in b.names.values()}
    live |= {b.root[t] for t in live if t in b.root}
    outputs = sorted(int(graph.output_offset[graph.index[op]]) + port for op, port in live)
    backward = graph.num_ops if b.backward_start is None else b.backward_start
    released = [-1] * graph.num_tensors
    for (op, port), last in b.released_after.items():
        storage = b.root.get((op, port), (op, port))
        t = int(graph.output_offset[graph.index[storage[0]]]) + storage[1]
        released[t] = max(released[t], last)
    for t in outputs:
        released[t] = graph.num_ops
    for (op, port), storage in b.root.items():
        view = int(graph.output_offset[graph.index[op]]) + port
        released[view] = released[int(graph.output_offset[graph.index[storage[0]]]) + storage[1]]
    return DtrTrace(name=name, graph=graph, outputs=outputs, backward_start=backward,
                    released_after=released)


def release_peak_bytes(trace: DtrTrace) -> int:
    """Peak resident bytes of the step without a budget when each storage is freed after its
    last reader or at its release event, whichever comes later — the baseline DTR's simulator
    (and paper) takes budget ratios of. As there, a constant counts from the op that declares it;
    the step's outputs are never freed.
    """
    g = trace.graph
    n = g.num_ops
    death = np.maximum(np.array(trace.released_after, dtype=np.int64), g.tensor_producer)
    for t in range(g.num_tensors):
        consumers = g.tensor_consumers(t)
        if len(consumers):
            death[t] = max(death[t], int(consumers.max()))
    delta = np.zeros(n + 2, dtype=np.int64)
    np.add.at(delta, g.tensor_producer, g.tensor_bytes)
    np.add.at(delta, np.minimum(death, n) + 1, -g.tensor_bytes)
    delta[:n] += g.persistent_bytes
    live = np.cumsum(delta)[:n] + g.temp_bytes
    return int(live.max() if n else 0)


def _expect(records, k: int, kind: str, name: str) -> dict:
    """The record at ``k``, which must be a ``kind`` line about ``name``."""
    if k >= len(records) or records[k][1].get("INSTRUCTION") != kind \
            or records[k][1].get("NAME") != name:
        where = records[k][0] if k < len(records) else "end of log"
        raise DtrLogError(f"line {where}: expected {kind} for {name!r}")
    return records[k][1]


def trace_names(zip_path: str | os.PathLike | None = None) -> dict[str, str]:
    """Manifest name -> member path of each log in DTR's ``logs.zip``."""
    with zipfile.ZipFile(zip_path or default_logs_path()) as z:
        manifest = json.loads(z.read("logs/manifest.json"))
    return {m["name"]: m["log"] for m in manifest["models"]}


def load_trace(path: str | os.PathLike, member: str | None = None,
               name: str | None = None) -> DtrTrace:
    """Read one log from a file, or from ``member`` of a zip archive at ``path``.

    Parameters:
        path: a ``.log``/``.jsonl`` file, or ``logs.zip`` together with ``member``.
        member: the log's path inside the zip (see ``trace_names``).
        name: the trace's name (default: the file or member name).

    Raises:
        FileNotFoundError: when the file does not exist.
        DtrLogError: on a malformed log.
    """
    if member is None:
        with open(path, "rb") as f:
            return read_log(f, name or Path(path).name)
    with zipfile.ZipFile(path) as z, z.open(member) as f:
        return read_log(io.TextIOWrapper(f, encoding="utf-8"), name or Path(member).name)


def load_traces(zip_path: str | os.PathLike | None = None,
                names: Iterable[str] | None = None) -> dict[str, DtrTrace]:
    """All eight traces (or the named ones) of DTR's ``logs.zip``, keyed by manifest name.

    Raises:
        FileNotFoundError: when the zip is missing (see ``default_logs_path``).
        KeyError: for a name not in the manifest.
    """
    zip_path = zip_path or default_logs_path()
    members = trace_names(zip_path)
    wanted = list(members) if names is None else list(names)
    return {n: load_trace(zip_path, members[n], n) for n in wanted}
