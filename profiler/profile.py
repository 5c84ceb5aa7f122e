"""Measured costs of a graph, and their versioned JSON form.

A ``Profile`` is what ``profiler.trace.profile_graph`` measured: per op the median compute time
and the largest output, temporary and persistent bytes seen over the traced steps; per device the
memory timeline replayed from the allocator's records, and its peak. It carries a fingerprint of
the graph it was measured on, so it is never applied to another graph by mistake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from graphfit.errors import GraphfitError, OutputError, read_json, short_repr

__all__ = ["DeviceMemory", "OpCost", "Profile", "ProfileError", "ProfileMismatchError",
           "graph_fingerprint", "atomic_write_json", "write_files"]

FORMAT_VERSION = 1


class ProfileError(GraphfitError, ValueError):
    """A profile cannot be read or used: unreadable, malformed, or with impossible costs."""


class ProfileMismatchError(ProfileError):
    """A profile is applied to a graph other than the one it was measured on."""


def _count(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ProfileError(f"{field} = {short_repr(value)}: must be a non-negative integer "
                           "below 2^63 (bytes, count)")
    return value


def _duration(value, field: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            or value > sys.float_info.max or not math.isfinite(value)):  # an int may exceed
        raise ProfileError(f"{field} = {short_repr(value)}: must be a finite non-negative "
                           "number (µs)")
    return float(value)


def _fields(data, field: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(data, dict):
        raise ProfileError(f"{field} must be a JSON object, got {type(data).__name__}")
    missing, extra = required - data.keys(), data.keys() - required - optional
    if missing or extra:
        raise ProfileError(f"{field}: missing {sorted(missing)}, unexpected {sorted(extra)}"
                           if missing else f"{field}: unexpected {sorted(extra)}")
    return data


def _op_cost(data, field: str) -> "OpCost":
    _fields(data, field, {"compute_us", "output_bytes"}, {"temp_bytes", "persistent_bytes"})
    outputs = data["output_bytes"]
    if not isinstance(outputs, list):
        raise ProfileError(f"{field}.output_bytes must be a list of byte counts")
    return OpCost(compute_us=_duration(data["compute_us"], f"{field}.compute_us"),
                  output_bytes=[_count(b, f"{field}.output_bytes[{k}]")
                                for k, b in enumerate(outputs)],
                  temp_bytes=_count(data.get("temp_bytes", 0), f"{field}.temp_bytes"),
                  persistent_bytes=_count(data.get("persistent_bytes", 0),
                                          f"{field}.persistent_bytes"))


def _timeline(points, field: str) -> list[tuple[float, int]]:
    if not isinstance(points, list):
        raise ProfileError(f"{field} must be a list of [µs, bytes] pairs")
    timeline = []
    for k, point in enumerate(points):
        if not isinstance(point, list) or len(point) != 2:
            raise ProfileError(f"{field}[{k}] = {point!r}: must be a [µs, bytes] pair")
        timeline.append((_duration(point[0], f"{field}[{k}][0]"),
                         _count(point[1], f"{field}[{k}][1]")))
    return timeline


def _device_memory(data, field: str) -> "DeviceMemory":
    _fields(data, field, {"peak_bytes", "resident_bytes", "timeline"},
            {"allocator_peak_bytes", "allocator_timeline"})
    return DeviceMemory(
        peak_bytes=_count(data["peak_bytes"], f"{field}.peak_bytes"),
        resident_bytes=_count(data["resident_bytes"], f"{field}.resident_bytes"),
        timeline=_timeline(data["timeline"], f"{field}.timeline"),
        allocator_peak_bytes=_count(data.get("allocator_peak_bytes", 0),
                                    f"{field}.allocator_peak_bytes"),
        allocator_timeline=_timeline(data.get("allocator_timeline", []),
                                     f"{field}.allocator_timeline"))


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
        """Parse and check a profile's JSON form: every field present and of its type, every
        time and byte count finite and non-negative.

        Raises:
            ProfileError: naming the first bad field (``ops['x'].compute_us = -3``).
        """
        version = data.get("format_version") if isinstance(data, dict) else None
        if version != FORMAT_VERSION:
            raise ProfileError(f"profile format version {version!r} is not {FORMAT_VERSION}: "
                               "profile the graph again with this version (--costgen)")
        _fields(data, "profile", {"format_version", "graph_fingerprint", "ops", "devices",
                                  "step_time_us", "num_graph_ops"},
                {"unmeasured_ops", "metadata"})
        for key in ("ops", "devices"):
            if not isinstance(data[key], dict):
                raise ProfileError(f"{key} must be a JSON object keyed by name")
        steps = data["step_time_us"]
        if not isinstance(steps, list):
            raise ProfileError("step_time_us must be a list of step times (µs)")
        if not isinstance(data["graph_fingerprint"], str):
            raise ProfileError("graph_fingerprint must be a string")
        unmeasured = data.get("unmeasured_ops", [])
        if not isinstance(unmeasured, list) or not all(isinstance(n, str) for n in unmeasured):
            raise ProfileError("unmeasured_ops must be a list of op names")
        return cls(
            graph_fingerprint=data["graph_fingerprint"],
            ops={name: _op_cost(v, f"ops[{name!r}]") for name, v in data["ops"].items()},
            devices={name: _device_memory(v, f"devices[{name!r}]")
                     for name, v in data["devices"].items()},
            step_time_us=[_duration(t, f"step_time_us[{k}]") for k, t in enumerate(steps)],
            num_graph_ops=_count(data["num_graph_ops"], "num_graph_ops"),
            unmeasured_ops=list(unmeasured), metadata=dict(data.get("metadata") or {}))

    def save(self, path: str) -> None:
        """Write as JSON; the file appears whole or not at all."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str, graph_def=None) -> "Profile":
        """Read a saved profile; with ``graph_def``, check it was measured on that graph.

        Raises:
            ProfileError: the file cannot be read, is not JSON, or has a bad field (named,
                with the file).
            ProfileMismatchError: the profile belongs to another graph.
        """
        data = read_json(path, f"profile {path}", "profile the graph again (--costgen)",
                         ProfileError)
        try:
            profile = cls.from_json(data)
        except ProfileError as error:
            raise ProfileError(f"profile {path}: {error}") from None
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


def write_files(directory: str, writers: dict[str, Callable[[str], None]],
                owned: Iterable[str] = ()) -> list[str]:
    """Write one run's files into ``directory`` together: ``writers[name](path)`` writes each
    into a hidden staging directory inside it, and only when all succeeded are they renamed
    into place and the files of ``owned`` (every name the caller ever writes there) that this
    run did not write are removed. So the directory holds one run's files, never half of a run
    nor another run's leftovers; other files in it are left alone.

    Returns:
        The paths written, in the order of ``writers``.

    Raises:
        OutputError: a file could not be written (e.g. a full disk); ``directory`` is as it was.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        staging = tempfile.mkdtemp(dir=directory, prefix=".staging-")
    except OSError as error:
        raise OutputError(f"cannot write into {directory} ({error.strerror or error}); "
                          "nothing was written: choose another directory") from None
    try:
        for name, write in writers.items():
            try:
                write(os.path.join(staging, name))
            except OSError as error:
                raise OutputError(f"cannot write {name} into {directory} "
                                  f"({error.strerror or error}); nothing was written: free "
                                  "some space or choose another directory") from None
        for name in set(owned) - set(writers):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        for name in writers:
            os.replace(os.path.join(staging, name), os.path.join(directory, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(directory, name) for name in writers]
