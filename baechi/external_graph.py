"""Graphs that are not TensorFlow's: a JSON format for op graphs and devices, and its loader.

Any framework (or a hand-written file) can hand the placers an op graph this way. One JSON
object, format ``"graphfit.external_graph/1"``::

    {
      "format": "graphfit.external_graph/1",
      "ops": [
        {"name": "w1", "persistent_outputs": [0], "variable": true},
        {"name": "x"},
        {"name": "mm1", "compute_us": 120.0, "temp_bytes": 4096, "colocate_with": "w1"},
        {"name": "loss", "compute_us": 5.0, "fetched_outputs": [0]}
      ],
      "edges": [
        {"src": "w1", "dst": "mm1", "bytes": 4194304},
        {"src": "x", "dst": "mm1", "bytes": 1048576},
        {"src": "mm1", "dst": "loss", "bytes": 1048576},
        {"src": "x", "dst": "loss", "control": true}
      ],
      "devices": [{"name": "gpu0", "memory": "8GiB"}, {"name": "gpu1", "memory": 8589934592}],
      "links": {"default": {"a_us_per_byte": 0.0001754, "b_us": 134},
                "links": [{"src": "gpu0", "dst": "gpu1", "a_us_per_byte": 0.0002, "b_us": 100}],
                "link_model": "contention"}
    }

Ops: ``name`` (unique), and optionally ``type``, ``compute_us``, ``temp_bytes`` (working memory
while the op runs), ``persistent_bytes`` (state held all step besides its outputs),
``output_bytes`` (bytes per output port; otherwise taken from the edges), ``persistent_outputs``
(ports whose output *is* a persistent buffer, e.g. a weight: held all step on the op's device,
counted once), ``fetched_outputs`` (ports the caller fetches: held until the step ends),
``colocate_with`` (a label or another op's name; ops with one label, and the op of that name,
share a device), ``variable`` (state that must
not be recomputed; it does not pin its readers), ``device`` (informational).

Edges: ``src``, ``dst``, ``output`` (the source's port, default 0), ``bytes`` (the tensor's
size; every edge of one port must agree, and agree with ``output_bytes``), ``control`` (an
ordering edge without data). Several edges of one port are one tensor read by several ops.

Devices: ``name`` (any string), ``memory`` (bytes, or a size such as ``"16GiB"``; any 64-bit
value). ``links`` is the communication JSON of ``baechi.devices`` (``default``, directional
``links``, ``link_model``); without it, Baechi's GPU fit 0.0001754 µs/B + 134 µs is used.
Unknown keys are errors, so a misspelt field is never silently ignored.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

from graphfit.errors import ArgumentError, GraphfitError, check_number, read_json, short_repr
from graphfit.baechi.devices import Device, DeviceError, DeviceSet, LinkCost, check_link_model
from graphfit.profiler.cost_graph import CostGraph, CostGraphError, OpSpec
from graphfit.profiler.sizes import SizeError, parse_bytes

__all__ = ["FORMAT", "DEFAULT_LINK", "ExternalGraph", "ExternalGraphError", "load_external_graph",
           "parse_external_graph"]

FORMAT = "graphfit.external_graph/1"
DEFAULT_LINK = LinkCost(0.0001754, 134.0)
_OP_KEYS = {"name", "type", "compute_us", "temp_bytes", "persistent_bytes", "output_bytes",
            "persistent_outputs", "fetched_outputs", "colocate_with", "variable", "device"}
_EDGE_KEYS = {"src", "dst", "output", "bytes", "control"}
_DEVICE_KEYS = {"name", "memory"}


class ExternalGraphError(GraphfitError, ValueError):
    """The external graph file cannot be read: the message names the entry and the problem."""


@dataclasses.dataclass
class ExternalGraph:
    """A loaded external graph: the cost graph and the devices to place it on."""

    graph: CostGraph
    devices: DeviceSet


def _check_keys(entry, allowed: set[str], where: str) -> None:
    if not isinstance(entry, Mapping):
        raise ExternalGraphError(f"{where} must be a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ExternalGraphError(f"{where} has unknown key(s) {unknown}; allowed: "
                                 f"{sorted(allowed)}")


def _number(entry: Mapping, key: str, where: str, default=0, integer: bool = False):
    """``entry[key]`` if it is a non-negative number (an integer below 2^63, what the cost
    graph holds, if ``integer``): the error names the entry and the key."""
    try:
        return check_number(entry.get(key, default), repr(key), minimum=0, integer=integer,
                            maximum=2 ** 63 - 1 if integer else None)
    except ArgumentError as error:
        raise ExternalGraphError(f"{where}: {error}") from None


def _ports(entry: Mapping, key: str, where: str) -> list[int]:
    ports = entry.get(key, [])
    if not isinstance(ports, list) or not all(isinstance(p, int) and not isinstance(p, bool)
                                              and p >= 0 for p in ports):
        raise ExternalGraphError(f"{where}: {key!r} must be a list of output ports (integers "
                                 f">= 0), got {short_repr(ports)}")
    return ports


def _dense_sizes(name: str, ports: dict[int, int | None], uses: dict[int, str]) -> list[int]:
    """The sizes of ports ``0..max(ports)`` of op ``name``; every one must be given, so the
    list is never longer than the file's own entries (a port of 10^9 is refused, not
    allocated). ``uses``: the entry that first names each port."""
    given = {port: size for port, size in ports.items() if size is not None}
    count = max(ports) + 1
    if len(given) < count:
        missing = list(itertools.islice((p for p in range(count) if p not in given), 5))
        more = count - len(given) - len(missing)
        raise ExternalGraphError(
            f"op {name!r}: the size of output(s) {missing}{f' and {more} more' if more else ''} "
            f"is not given (ports are numbered from 0, and {uses[count - 1]} uses port "
            f"{count - 1}): add 'bytes' to an edge of that output or 'output_bytes' to the op, "
            "or check the port numbers")
    return [given[p] for p in range(count)]


def _output_sizes(ops: list[Mapping], edges: list[Mapping], names: set[str]
                  ) -> dict[str, list[int]]:
    """Bytes per output port of every op, from ``output_bytes`` and the edges (which agree)."""
    sizes: dict[str, dict[int, int | None]] = {}
    uses: dict[str, dict[int, str]] = {}  # the entry that first names a port
    declared: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        where = f"ops[{k}] ({op['name']!r})"
        if "output_bytes" in op:
            out = op["output_bytes"]
            if not isinstance(out, list) or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in out):
                raise ExternalGraphError(f"{where}: 'output_bytes' must be a list of byte "
                                         f"counts, got {short_repr(out)}")
            declared[op["name"]] = out
            sizes[op["name"]] = dict(enumerate(out))
        for key in ("persistent_outputs", "fetched_outputs"):
            for port in _ports(op, key, where):
                sizes.setdefault(op["name"], {}).setdefault(port, None)
                uses.setdefault(op["name"], {}).setdefault(port, f"{where} {key!r}")
    for k, edge in enumerate(edges):
        where = f"edges[{k}] ({edge['src']!r} -> {edge['dst']!r})"
        if edge.get("control"):
            continue
        port = _number(edge, "output", where, integer=True)
        have = sizes.setdefault(edge["src"], {})
        uses.setdefault(edge["src"], {}).setdefault(port, where)
        if edge["src"] in declared and port >= len(declared[edge["src"]]):
            raise ExternalGraphError(f"{where} reads output {port}, but {edge['src']!r} "
                                     f"declares {len(declared[edge['src']])} outputs")
        if "bytes" in edge:
            nbytes = _number(edge, "bytes", where, integer=True)
            if have.get(port) not in (None, nbytes):
                raise ExternalGraphError(
                    f"{where} says output {port} has {nbytes} bytes, but it was given "
                    f"{have[port]} bytes before: every edge of one output carries one tensor")
            have[port] = nbytes
        else:
            have.setdefault(port, None)
    return {name: _dense_sizes(name, ports, uses.get(name, {})) for name, ports in sizes.items()}


def _devices(data: Mapping) -> DeviceSet:
    entries = data.get("devices")
    if not isinstance(entries, list) or not entries:
        raise ExternalGraphError("'devices' must be a non-empty list of {\"name\", \"memory\"}")
    devices = []
    for k, entry in enumerate(entries):
        _check_keys(entry, _DEVICE_KEYS, f"devices[{k}]")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ExternalGraphError(f"devices[{k}] needs a non-empty string 'name'")
        if "memory" not in entry:
            raise ExternalGraphError(f"devices[{k}] ({entry['name']!r}) needs 'memory' (bytes "
                                     "or a size such as \"16GiB\")")
        try:
            devices.append(Device(entry["name"], parse_bytes(entry["memory"])))
        except SizeError as e:
            raise ExternalGraphError(f"devices[{k}] ({entry['name']!r}): {e}") from None
    links = data.get("links", {})
    try:
        if not isinstance(links, Mapping):
            raise DeviceError("'links' must be an object (the communication JSON)")
        link_model = links.get("link_model", "contention")
        check_link_model(link_model)
        names = [d.name for d in devices]
        default = links.get("default")
        default = LinkCost(float(default["a_us_per_byte"]), float(default["b_us"])) \
            if default is not None else DEFAULT_LINK
        per_pair = {}
        for k, e in enumerate(links.get("links", [])):
            if e.get("src") not in names or e.get("dst") not in names:
                raise DeviceError(f"links.links[{k}] names a device that is not in 'devices' "
                                  f"({e.get('src')!r} -> {e.get('dst')!r})")
            per_pair[e["src"], e["dst"]] = LinkCost(float(e["a_us_per_byte"]), float(e["b_us"]))
        if min([default.a_us_per_byte, default.b_us] + [
                v for c in per_pair.values() for v in (c.a_us_per_byte, c.b_us)]) < 0:
            raise DeviceError("link coefficients must be non-negative")
        return DeviceSet(devices, default, per_pair, link_model=link_model,
                         require_tf_names=False)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ExternalGraphError):
            raise
        raise ExternalGraphError(f"'links' cannot be used: {e}") from None


def parse_external_graph(data: Mapping) -> ExternalGraph:
    """Build the cost graph and device set of an external graph (the parsed JSON).

    Raises:
        ExternalGraphError: on a malformed file; the message names the entry and the fix.

    Examples:
        >>> g = parse_external_graph({
        ...     "format": FORMAT,
        ...     "ops": [{"name": "a", "compute_us": 10},
        ...             {"name": "b", "compute_us": 5, "output_bytes": [4],
        ...              "fetched_outputs": [0]}],
        ...     "edges": [{"src": "a", "dst": "b", "bytes": 1000}],
        ...     "devices": [{"name": "left", "memory": "1MiB"}, {"name": "right",
        ...                                                      "memory": 2 ** 64 - 1}]})
        >>> g.graph.num_ops, g.devices.names, g.devices.link_model
        (2, ['left', 'right'], 'contention')
    """
    if not isinstance(data, Mapping):
        raise ExternalGraphError("an external graph is a JSON object with 'ops', 'edges' and "
                                 "'devices'")
    _check_keys(data, {"format", "ops", "edges", "devices", "links"}, "the file")
    if data.get("format") != FORMAT:
        raise ExternalGraphError(f"'format' must be {FORMAT!r}, got {data.get('format')!r}")
    ops, edges = data.get("ops"), data.get("edges", [])
    if not isinstance(ops, list) or not ops:
        raise ExternalGraphError("'ops' must be a non-empty list of op objects")
    if not isinstance(edges, list):
        raise ExternalGraphError("'edges' must be a list of edge objects")
    names = set()
    for k, op in enumerate(ops):
        _check_keys(op, _OP_KEYS, f"ops[{k}]")
        if not isinstance(op.get("name"), str) or not op["name"]:
            raise ExternalGraphError(f"ops[{k}] needs a non-empty string 'name'")
        if op["name"] in names:
            raise ExternalGraphError(f"two ops are named {op['name']!r}")
        names.add(op["name"])
    for k, edge in enumerate(edges):
        _check_keys(edge, _EDGE_KEYS, f"edges[{k}]")
        for end in ("src", "dst"):
            if edge.get(end) not in names:
                raise ExternalGraphError(f"edges[{k}]: {end} {edge.get(end)!r} is not an op")
    sizes = _output_sizes(ops, edges, names)
    inputs: dict[str, list[tuple[str, int]]] = {n: [] for n in names}
    controls: dict[str, list[str]] = {n: [] for n in names}
    for edge in edges:
        if edge.get("control"):
            controls[edge["dst"]].append(edge["src"])
        else:
            inputs[edge["dst"]].append((edge["src"], edge.get("output", 0)))
    specs = []
    for k, op in enumerate(ops):
        where = f"ops[{k}] ({op['name']!r})"
        colocate = op.get("colocate_with")
        if colocate is not None and not isinstance(colocate, str):
            raise ExternalGraphError(f"{where}: 'colocate_with' must be a string label")
        specs.append(OpSpec(
            name=op["name"], op_type=str(op.get("type", "Op")), inputs=inputs[op["name"]],
            control_inputs=controls[op["name"]], output_bytes=sizes.get(op["name"], []),
            compute_us=_number(op, "compute_us", where),
            temp_bytes=_number(op, "temp_bytes", where, integer=True),
            persistent_bytes=_number(op, "persistent_bytes", where, integer=True),
            device=str(op.get("device", "")),
            colocation_group=colocate,
            is_variable=bool(op.get("variable", False)),
            is_stateful=bool(op.get("variable", False)),
            persistent_outputs=_ports(op, "persistent_outputs", where),
            fetched_outputs=_ports(op, "fetched_outputs", where)))
    try:
        graph = CostGraph.from_ops(specs)
    except CostGraphError as e:
        raise ExternalGraphError(str(e)) from None
    return ExternalGraph(graph, _devices(data))


def load_external_graph(path: str) -> ExternalGraph:
    """Read an external graph file (format in the module docstring).

    Raises:
        ExternalGraphError: the file is missing, not JSON, or malformed.
    """
    data = read_json(path, f"external graph {path!r}", "write it as one JSON object (format "
                     "in baechi/external_graph.py)", ExternalGraphError)
    return parse_external_graph(data)
