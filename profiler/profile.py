"""Measured costs of a graph, and their versioned JSON form.

A ``Profile`` is what ``profiler.trace.profile_graph`` measured: per op the median compute time
and the largest output, temporary and persistent bytes seen over the traced steps; per device the
memory timeline replayed from the allocator's records, and its peak. It carries a fingerprint of
the graph it was measured on, so it is never applied to another graph by mistake.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any

__all__ = ["DeviceMemory", "OpCost", "Profile", "ProfileMismatchError", "graph_fingerprint",
           "atomic_write_json"]

FORMAT_VERSION = 1


class ProfileMismatchError(ValueError):
    """A profile is applied to a graph other than the one it was measured on."""


@dataclasses.dataclass
class OpCost:
    """What one op cost in a traced step (compute: median; bytes: the largest seen)."""

    compute_us: float
    output_bytes: list[int]
    temp_bytes: int = 0
    persistent_bytes: int = 0


@dataclasses.dataclass
class DeviceMemory:
    """A device's memory over one traced step.

    ``timeline`` holds ``(microseconds since the step started, bytes in use)`` after each
    allocation or free, replayed from the allocation records; ``resident_bytes`` were in use
    before the step began (variables, cached constants, fed tensors) and are included in
    ``timeline`` and ``peak_bytes``. ``allocator_timeline`` / ``allocator_peak_bytes`` are the
    allocator's bytes in use sampled as each op finished (shared by virtual CPU devices).
    """

    peak_bytes: int
    resident_bytes: int
    timeline: list[tuple[float, int]]
    allocator_peak_bytes: int = 0
    allocator_timeline: list[tuple[float, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Profile:
    """Measured per-op costs and per-device memory for one graph."""

    graph_fingerprint: str
    ops: dict[str, OpCost]
    devices: dict[str, DeviceMemory]
    step_time_us: list[float]
    num_graph_ops: int
    unmeasured_ops: list[str] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def coverage(self) -> float:
        """Fraction of the graph's ops with a measured cost."""
        return len(self.ops) / max(1, self.num_graph_ops)

    @property
    def peak_bytes(self) -> int:
        """The largest per-device peak."""
        return max((d.peak_bytes for d in self.devices.values()), default=0)

    @property
    def allocator_peak_bytes(self) -> int:
        """The largest allocator bytes-in-use sample over all devices."""
        return max((d.allocator_peak_bytes for d in self.devices.values()), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Profile":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"profile format version {version!r} is not {FORMAT_VERSION}: "
                             "profile the graph again with this version (--costgen)")
        fields = {k: v for k, v in data.items() if k != "format_version"}
        fields["ops"] = {k: OpCost(**v) for k, v in fields["ops"].items()}
        fields["devices"] = {
            k: DeviceMemory(**{**v, "timeline": [tuple(p) for p in v["timeline"]],
                               "allocator_timeline": [tuple(p) for p in v["allocator_timeline"]]})
            for k, v in fields["devices"].items()}
        return cls(**fields)

    def save(self, path: str) -> None:
        """Write as JSON; the file appears whole or not at all."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str, graph_def=None) -> "Profile":
        """Read a saved profile; with ``graph_def``, check it was measured on that graph.

        Raises:
            ProfileMismatchError: the profile belongs to another graph.
        """
        with open(path) as f:
            profile = cls.from_json(json.load(f))
        if graph_def is not None:
            profile.check_matches(graph_def)
        return profile

    def check_matches(self, graph_def) -> None:
        """Raise ``ProfileMismatchError`` unless this profile was measured on ``graph_def``."""
        fingerprint = graph_fingerprint(graph_def)
        if fingerprint != self.graph_fingerprint:
            raise ProfileMismatchError(
                f"the profile was measured on graph {self.graph_fingerprint[:12]} "
                f"({self.num_graph_ops} ops) but this graph is {fingerprint[:12]} "
                f"({len(graph_def.node)} ops): profile this graph again (--costgen)")


def graph_fingerprint(graph_def) -> str:
    """A hash of every node's name, op, inputs, device and attributes.

    Independent of node order and of the GraphDef's version stamps, so rebuilding the same
    model gives the same fingerprint.
    """
    digest = hashlib.sha256()
    for node in sorted(graph_def.node, key=lambda n: n.name):
        digest.update(node.name.encode())
        digest.update(node.op.encode())
        digest.update("\0".join(node.input).encode())
        digest.update(node.device.encode())
        for key in sorted(node.attr):
            digest.update(key.encode())
            digest.update(node.attr[key].SerializeToString(deterministic=True))
    return digest.hexdigest()


def atomic_write_json(path: str, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
