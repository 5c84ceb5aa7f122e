"""Devices, their memory limits, and the cost of moving a tensor between two of them.

A transfer of ``n`` bytes from device ``i`` to device ``j`` costs ``a_ij * n + b_ij`` µs (a linear
fit of measured transfers, as in Baechi, Jeon et al., SoCC 2020, §4); a tensor that stays on its
device costs nothing. Unlike Baechi, which used one function for every pair, each ordered pair may
have its own coefficients.

Communication JSON (written by ``tools/communication_benchmark.py``, read by
``DeviceSet.from_json``)::

    {
      "default": {"a_us_per_byte": 0.0001754, "b_us": 134.0},
      "links": [
        {"src": "/job:worker/task:0/device:CPU:0", "dst": "/job:worker/task:1/device:CPU:0",
         "a_us_per_byte": 0.00045, "b_us": 310.0},
        ...
      ]
    }

``links`` are directional; a pair listed in one direction only uses the same coefficients for
the reverse direction. Pairs not listed use ``default``; without ``default`` the mean of the
listed links is used. Other keys (the benchmark's raw measurements) are ignored.

Link models (``DeviceSet.link_model``): how concurrent transfers share the hardware.

- ``"contention"`` (Baechi's model): each device has one channel, for its sends and its
  receives alike, so two transfers leaving or entering one device (a send and a receive
  included) run one after the other. A transfer is a send on its sender's channel, from when
  the tensor exists and that channel is free, and a receive on its receiver's channel, from
  the send's start or when that channel is free, whichever is later; the copy is there when
  the receive ends. The sender is free again when its send ends, not held while the receiver
  is busy: holding both channels for the whole transfer planned m-SCT 1-3% longer than
  Baechi's own m-SCT in Baechi's simulator on fork-join graphs and random graphs with a
  2,000-op window (``bench/RESULTS.md``, placement against Baechi). With a send queue and a
  receive queue per device instead, m-ETF's plans were 1.17-1.40 x longer in Baechi's own
  simulator (random and layered 2k-op graphs): receives were planned beside the device's
  sends.
  Real devices share copy engines, PCIe lanes and NICs; this is the default for GPUs, gRPC
  workers and any device not in this process's CPU.
- ``"parallel"``: every ordered device pair is its own link; transfers on different pairs run
  at the same time, transfers on one pair one after the other. The default when every device
  is a virtual CPU device of this process (``/device:CPU:i``), which pass tensors zero-copy.

The communication benchmark measures which model a transport follows and writes it as
``"link_model"`` in its JSON; ``DeviceSet.from_json`` takes it from there.

Device names follow TensorFlow (``/GPU:0``, ``/device:CPU:1``,
``/job:worker/task:2/device:CPU:0``, optionally with ``/replica:0``) unless
``require_tf_names=False`` (graphs from other frameworks, ``baechi.external_graph``).

Memory limits are non-negative integers of any size: a limit above ``MAX_MEMORY_BYTES``
(2^63 - 1, more than any graph can hold) is stored as ``MAX_MEMORY_BYTES``, so "unlimited"
limits such as 2^62 or 2^64 - 1 per device never overflow a sum.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from graphfit.errors import GraphfitError, read_json, short_repr
from graphfit.profiler.sizes import parse_bytes

__all__ = ["Device", "DeviceError", "DeviceSet", "LINK_MODELS", "LinkCost", "MAX_MEMORY_BYTES",
           "check_link_model", "checked_link_cost", "default_device_names", "parse_comm_coeffs",
           "read_comm_json"]

LINK_MODELS = ("contention", "parallel")
MAX_MEMORY_BYTES = (1 << 63) - 1
_LOCAL_CPU = re.compile(r"^(/device:|/)CPU:\d+$")


def check_link_model(name: str) -> None:
    """Raise ``DeviceError`` unless ``name`` is one of ``LINK_MODELS``."""
    if name not in LINK_MODELS:
        raise DeviceError(f"unknown link model {name!r}; choose one of {LINK_MODELS}")


def default_link_model(names: Sequence[str]) -> str:
    """``"parallel"`` when every device is a virtual CPU device of this process (zero-copy),
    else ``"contention"``."""
    return "parallel" if all(_LOCAL_CPU.match(n) for n in names) else "contention"

_DEVICE_NAME = re.compile(
    r"^(/job:[\w.-]+(/replica:\d+)?(/task:\d+)?)?(/device:|/)(CPU|GPU|TPU):\d+$")


class DeviceError(GraphfitError, ValueError):
    """A device name, memory size, or communication description cannot be used."""


@dataclasses.dataclass(frozen=True)
class Device:
    """A device a placer may use: its TF name and how many bytes it may hold."""

    name: str
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Linear transfer cost of one link direction: ``a_us_per_byte * bytes + b_us``."""

    a_us_per_byte: float
    b_us: float

    def transfer_us(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` over this link, in µs."""
        return self.a_us_per_byte * num_bytes + self.b_us

    def to_json(self) -> dict[str, float]:
        return {"a_us_per_byte": self.a_us_per_byte, "b_us": self.b_us}


def parse_comm_coeffs(text: str) -> LinkCost:
    """Parse ``--comm_cost_coeffs=a,b`` (µs per byte, µs; fractions allowed, e.g. ``1e-4,134``).

    Raises:
        DeviceError: if there are not exactly two non-negative numbers.

    Examples:
        >>> parse_comm_coeffs("0.0001754,134")
        LinkCost(a_us_per_byte=0.0001754, b_us=134.0)
    """
    parts = [p.strip() for p in str(text).split(",")]
    try:
        a, b = (float(p) for p in parts)
    except ValueError:
        raise DeviceError(
            f"--comm_cost_coeffs={text!r}: expected two numbers 'a,b' (transfer time = "
            "a µs/byte * bytes + b µs), e.g. 0.0001754,134") from None
    return checked_link_cost(a, b, f"--comm_cost_coeffs={text!r}")


# A link on which one TiB takes longer than a year is no measurement: the coefficients are
# refused, so no schedule's makespan becomes inf (1e308 us/byte * bytes overflows).
_TIB = 2**40
MAX_TIB_TRANSFER_US = 365 * 24 * 3600 * 1e6


def checked_link_cost(a_us_per_byte, b_us, where: str) -> LinkCost:
    """``LinkCost(a, b)`` if both are finite, non-negative numbers and a TiB moves within a
    year; otherwise ``DeviceError`` naming ``where`` (a flag, or a file and field)."""
    for value in (a_us_per_byte, b_us):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating,
                                                            np.integer)):
            raise DeviceError(f"{where}: {value!r} is not a number")
    a, b = float(a_us_per_byte), float(b_us)
    if not (np.isfinite(a) and np.isfinite(b)) or a < 0 or b < 0:
        raise DeviceError(f"{where}: link coefficients must be finite and non-negative, got "
                          f"a={a!r} µs/byte, b={b!r} µs")
    if a * _TIB + b > MAX_TIB_TRANSFER_US:
        raise DeviceError(f"{where}: a={a!r} µs/byte, b={b!r} µs would take "
                          f"{(a * _TIB + b) / 3.15e13:.3g} years for a TiB: not a link; "
                          "measure it with tools/communication_benchmark")
    return LinkCost(a, b)


def default_device_names(num_devices: int, gpu_names: Sequence[str] = ()) -> list[str]:
    """Names of ``num_devices`` local devices: ``/GPU:i`` when enough GPUs exist, else
    ``/device:CPU:i`` (virtual CPU devices).

    Parameters:
        num_devices: how many devices to place on.
        gpu_names: the physical GPUs, e.g. ``[d.name for d in
            tf.config.list_physical_devices("GPU")]`` (the caller asks TensorFlow, so this
            module stays TF-free).

    Examples:
        >>> default_device_names(2), default_device_names(2, ["/physical_device:GPU:0"] * 2)
        (['/device:CPU:0', '/device:CPU:1'], ['/GPU:0', '/GPU:1'])
    """
    if num_devices < 1:
        raise DeviceError(f"need at least one device, got {num_devices}")
    kind = "/GPU:" if len(gpu_names) >= num_devices else "/device:CPU:"
    return [f"{kind}{i}" for i in range(num_devices)]


def read_comm_json(source: str | Mapping
                   ) -> tuple[dict[tuple[str, str], LinkCost], LinkCost | None, str | None]:
    """The links, the default link and the link model (``None`` if not given) of a
    communication JSON (a path or the parsed dict; schema in the module docstring), every
    field checked.

    Raises:
        DeviceError: the file cannot be read or parsed, or a field is missing, of the wrong
            type, or not a finite non-negative cost; the message names the file and the field.
    """
    where = "communication JSON" if isinstance(source, Mapping) else f"--comm_cost_path={source}"
    if not isinstance(source, (str, os.PathLike, Mapping)):
        raise DeviceError(f"the communication JSON must be a file path or the parsed dict (as "
                          "tools/communication_benchmark writes it), got "
                          f"{type(source).__name__} {short_repr(source)}")
    if not isinstance(source, Mapping):
        source = read_json(source, where, "write it again with tools/communication_benchmark",
                           DeviceError)
    if not isinstance(source, Mapping):
        raise DeviceError(f"{where}: expected a JSON object with 'default' and/or 'links', "
                          f"got {type(source).__name__}")

    def link(entry, field: str) -> LinkCost:
        if not isinstance(entry, Mapping) or not {"a_us_per_byte", "b_us"} <= entry.keys():
            raise DeviceError(f"{where}: {field} must be an object with 'a_us_per_byte' and "
                              f"'b_us', got {entry!r}")
        return checked_link_cost(entry["a_us_per_byte"], entry["b_us"], f"{where}: {field}")

    entries = source.get("links", [])
    if not isinstance(entries, list):
        raise DeviceError(f"{where}: 'links' must be a list, got {type(entries).__name__}")
    links = {}
    for k, entry in enumerate(entries):
        field = f"links[{k}]"
        if not isinstance(entry, Mapping) or not all(
                isinstance(entry.get(key), str) for key in ("src", "dst")):
            raise DeviceError(f"{where}: {field} needs device names 'src' and 'dst'")
        links[entry["src"], entry["dst"]] = link(entry, field)
    default = source.get("default")
    if default is not None:
        default = link(default, "'default'")
    if default is None and not links:
        raise DeviceError(f"{where}: has neither 'default' nor 'links'")
    link_model = source.get("link_model")
    if link_model is not None and link_model not in LINK_MODELS:
        raise DeviceError(f"{where}: 'link_model' is {link_model!r}; choose one of {LINK_MODELS}")
    return links, default, link_model


class DeviceSet:
    """The devices of one placement and the link cost of every ordered pair.

    Parameters:
        devices: the devices, in index order (placers refer to devices by index).
        default: link cost for pairs without their own entry.
        links: per ordered pair ``(src name, dst name)`` link costs.
        link_model: ``"contention"`` or ``"parallel"`` (module docstring); default from the
            device names (``default_link_model``).
        require_tf_names: refuse names that are not TF device names.

    Attributes ``names``, ``memory_bytes`` (int64 array, limits saturated at
    ``MAX_MEMORY_BYTES``), ``link_model``, and ``a_us_per_byte`` / ``b_us`` (``D x D`` nested
    lists, zero on the diagonal, for the placers' hot loops).

    Raises:
        DeviceError: on an empty set, a duplicate or malformed name, negative memory, or an
            unknown link model.
    """

    def __init__(self, devices: Sequence[Device], default: LinkCost,
                 links: Mapping[tuple[str, str], LinkCost] | None = None,
                 link_model: str | None = None, require_tf_names: bool = True):
        if not devices:
            raise DeviceError("a device set needs at least one device")
        self.devices = list(devices)
        self.names = [d.name for d in self.devices]
        if len(set(self.names)) != len(self.names):
            raise DeviceError(f"duplicate device names in {self.names}")
        for name in self.names if require_tf_names else ():
            if not _DEVICE_NAME.match(name):
                raise DeviceError(
                    f"device name {name!r} is not a TF device name such as /GPU:0, "
                    "/device:CPU:1 or /job:worker/task:2/device:CPU:0")
        if any(d.memory_bytes < 0 for d in self.devices):
            raise DeviceError(f"negative memory limit in {[d.memory_bytes for d in devices]}")
        self.devices = [Device(d.name, min(int(d.memory_bytes), MAX_MEMORY_BYTES))
                        for d in self.devices]
        self.memory_bytes = np.array([d.memory_bytes for d in self.devices], dtype=np.int64)
        self.require_tf_names = require_tf_names
        self.link_model = link_model or default_link_model(self.names)
        check_link_model(self.link_model)
        self.default = checked_link_cost(default.a_us_per_byte, default.b_us, "default link")
        links = {pair: checked_link_cost(c.a_us_per_byte, c.b_us, f"link {pair[0]} -> {pair[1]}")
                 for pair, c in (links or {}).items()}
        self.links = {}
        for i, src in enumerate(self.names):
            for j, dst in enumerate(self.names):
                if i != j:
                    self.links[i, j] = links.get((src, dst), links.get((dst, src), default))
        d = len(self.names)
        self.a_us_per_byte = [[self.links[i, j].a_us_per_byte if i != j else 0.0
                               for j in range(d)] for i in range(d)]
        self.b_us = [[self.links[i, j].b_us if i != j else 0.0 for j in range(d)]
                     for i in range(d)]

    @classmethod
    def uniform(cls, names: Sequence[str], memory_bytes: int | str | Sequence[int | str],
                link: LinkCost | str, link_model: str | None = None) -> "DeviceSet":
        """Devices with the given memory (one size for all, or one per device) and one link
        cost for every pair (a ``LinkCost`` or an ``a,b`` string as in ``--comm_cost_coeffs``)."""
        if isinstance(memory_bytes, (str, int, np.integer)):
            memory_bytes = [memory_bytes] * len(names)
        if len(memory_bytes) != len(names):
            raise DeviceError(f"{len(memory_bytes)} memory sizes for {len(names)} devices")
        if isinstance(link, str):
            link = parse_comm_coeffs(link)
        return cls([Device(n, parse_bytes(m)) for n, m in zip(names, memory_bytes)], link,
                   link_model=link_model)

    @classmethod
    def from_json(cls, names: Sequence[str], memory_bytes: int | str | Sequence[int | str],
                  source: str | Mapping) -> "DeviceSet":
        """Devices whose link costs come from the communication benchmark's JSON (a path or the
        parsed dict; schema in the module docstring). Listed links whose devices are not in
        ``names`` are ignored.

        Raises:
            DeviceError: if the JSON has neither ``default`` nor ``links``, or a malformed entry.
        """
        links, default, link_model = read_comm_json(source)
        if default is None:
            default = LinkCost(float(np.mean([l.a_us_per_byte for l in links.values()])),
                               float(np.mean([l.b_us for l in links.values()])))
        uniform = cls.uniform(names, memory_bytes, default)
        return cls(uniform.devices, default, links, link_model=link_model)

    def to_json(self) -> dict:
        """The link costs in the communication-JSON schema (plus device names and memory)."""
        return {"default": self.default.to_json(), "link_model": self.link_model,
                "links": [{"src": self.names[i], "dst": self.names[j], **c.to_json()}
                          for (i, j), c in sorted(self.links.items())],
                "devices": [{"name": d.name, "memory_bytes": d.memory_bytes}
                            for d in self.devices]}

    def with_memory(self, memory_bytes: int | Sequence[int]) -> "DeviceSet":
        """The same devices and links with other memory limits."""
        if isinstance(memory_bytes, (int, np.integer)):
            memory_bytes = [int(memory_bytes)] * len(self)
        copy = DeviceSet.__new__(DeviceSet)
        copy.__dict__.update(self.__dict__)
        copy.devices = [Device(d.name, min(int(m), MAX_MEMORY_BYTES))
                        for d, m in zip(self.devices, memory_bytes)]
        copy.memory_bytes = np.array([d.memory_bytes for d in copy.devices], dtype=np.int64)
        return copy

    def with_link_model(self, link_model: str) -> "DeviceSet":
        """The same devices, limits and link costs under another link model."""
        check_link_model(link_model)
        copy = DeviceSet.__new__(DeviceSet)
        copy.__dict__.update(self.__dict__)
        copy.link_model = link_model
        return copy

    def transfer_us(self, src: int, dst: int, num_bytes: float) -> float:
        """Time to move ``num_bytes`` from device index ``src`` to ``dst`` (0 when equal)."""
        return self.a_us_per_byte[src][dst] * num_bytes + self.b_us[src][dst]

    def mean_link(self) -> LinkCost:
        """The mean link cost over distinct pairs (what m-SCT's LP charges for an edge)."""
        if len(self) == 1:
            return LinkCost(0.0, 0.0)
        costs = list(self.links.values())
        return LinkCost(float(np.mean([c.a_us_per_byte for c in costs])),
                        float(np.mean([c.b_us for c in costs])))

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return (f"DeviceSet({self.names}, memory_bytes={self.memory_bytes.tolist()}, "
                f"link_model={self.link_model!r})")
