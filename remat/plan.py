"""A rematerialization plan: the order in which a step computes, recomputes and frees.

The plan is the contract between the planners (the DTR simulator, the baselines, the MILP) and
their consumers (the TF rewrite, the placer's liveness memory model, reports). It names ops and
tensors by their ids in the ``CostGraph`` it was made for:

- ``Event("compute", op)``: the first computation of ``op`` (all its outputs appear);
- ``Event("recompute", op)``: ``op`` runs again because an output it made was evicted; later
  reads of its outputs use this newest version;
- ``Event("free", tensor)``: the tensor's memory is released (last use passed, or evicted).

Every op of the graph is computed exactly once, in an order consistent with its dependencies;
an op is only (re)computed when every tensor it reads is resident.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from graphfit.profiler.cost_graph import CostGraph

__all__ = ["Event", "RematPlan", "COMPUTE", "RECOMPUTE", "FREE"]

COMPUTE, RECOMPUTE, FREE = "compute", "recompute", "free"


class Event(NamedTuple):
    """One step of a plan: ``kind`` is compute / recompute (``index`` = op id) or free
    (``index`` = tensor id)."""

    kind: str
    index: int


@dataclasses.dataclass
class RematPlan:
    """What a planner decided and what it predicts.

    Attributes:
        events: the ordered compute / recompute / free events.
        budget_bytes: the memory budget the plan was made for.
        peak_bytes: the predicted peak of resident bytes (constants and parameters included).
        baseline_compute_us: compute time of the step without recomputation.
        compute_us: predicted compute time with recomputation.
        method: the planner (heuristic or baseline) that made it.
        stats: planner-specific numbers (evictions, solve time, ...).
    """

    events: list[Event]
    budget_bytes: int
    peak_bytes: int
    baseline_compute_us: float
    compute_us: float
    method: str
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Compute with recomputation / compute without (1.0 = free)."""
        return self.compute_us / self.baseline_compute_us if self.baseline_compute_us else 1.0

    @property
    def num_recomputes(self) -> int:
        return sum(1 for e in self.events if e.kind == RECOMPUTE)

    def recomputed_ops(self, graph: "CostGraph") -> list[dict[str, Any]]:
        """Per op this plan recomputes (over ``graph``, the graph it was made for): name, type,
        how often, and the compute time and output bytes of one recomputation: what the plan
        pays to free those bytes early. Dearest first."""
        counts = collections.Counter(e.index for e in self.events if e.kind == RECOMPUTE)
        rows = [{"op": graph.names[i], "op_type": graph.op_types[i], "times": n,
                 "compute_us": float(graph.compute_us[i]),
                 "output_bytes": int(graph.output_bytes(i).sum())} for i, n in counts.items()]
        return sorted(rows, key=lambda row: (-row["times"] * row["compute_us"], row["op"]))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["events"] = [[e.kind, e.index] for e in self.events]
        data["overhead"] = self.overhead
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RematPlan":
        fields = {k: v for k, v in data.items() if k != "overhead"}
        fields["events"] = [Event(kind, int(index)) for kind, index in data["events"]]
        return cls(**fields)
