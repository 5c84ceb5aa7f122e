"""Place an external op graph (a JSON file, ``baechi.external_graph``) on its devices.

Writes, into ``--out_dir``:

- ``placement.json``: op -> device, the schedule (start and finish per op), every transfer by
  tensor name, and the summary (makespan, its lower bound, peak bytes per device, options);
- ``trace.json``: the simulated step as a Chrome trace (open in Perfetto or chrome://tracing);
- ``gantt.png``: the schedule as a Gantt chart (compute and incoming transfers per device).

    python -m graphfit.tools.place --graph=tools/examples/two_towers.json --method=m_sct

Errors in the file, an instance that does not fit, or an ``--out_dir`` that cannot be written
end the program with one paragraph naming the problem (exit status 2, ``tools.cli``), and
nothing is written: the three files are written together (``profiler.profile.write_files``).
"""

from __future__ import annotations

import os

from absl import flags

from graphfit.baechi import gantt
from graphfit.baechi.devices import LINK_MODELS
from graphfit.baechi.external_graph import load_external_graph
from graphfit.baechi.grouping import GROUPERS
from graphfit.baechi.lp import LP_SOLVERS
from graphfit.baechi.memory import MEMORY_MODELS
from graphfit.baechi.place import METHODS, PLACER_TYPES, Placement, place
from graphfit.errors import check_writable_path
from graphfit.profiler.profile import atomic_write_json, write_files
from graphfit.profiler.sizes import format_bytes
from graphfit.tools import cli

__all__ = ["main", "placement_json", "plot_gantt"]

_GRAPH = flags.DEFINE_string("graph", None, "External graph JSON (baechi/external_graph.py).")
_OUT_DIR = flags.DEFINE_string("out_dir", "out/place", "Where placement.json, trace.json and "
                               "gantt.png are written.")
_METHOD = flags.DEFINE_enum("method", "m_etf", list(METHODS), "Placer.")
_PLACER_TYPE = flags.DEFINE_enum("placer_type", "default", list(PLACER_TYPES),
                                 "default: one unit per op; colocation: keep the grouper's "
                                 "groups together; fusion: fuse them first.")
_GROUPER = flags.DEFINE_enum("grouper", "tf", list(GROUPERS), "Groups: colocate_with labels "
                             "(tf) or also Baechi's co-placement (coplace).")
_MEMORY_MODEL = flags.DEFINE_enum("memory_model", "liveness", list(MEMORY_MODELS),
                                  "How device memory is counted.")
_LINK_MODEL = flags.DEFINE_enum("link_model", None, list(LINK_MODELS),
                                "Override the file's link model.")
_LP_SOLVER = flags.DEFINE_enum("lp_solver", "highs", list(LP_SOLVERS), "m-SCT's LP solver.")
flags.mark_flag_as_required("graph")


def placement_json(placement: Placement, source: str) -> dict:
    """The placement, its schedule and transfers, JSON-ready."""
    s, names = placement.schedule, placement.devices.names
    return {
        "format": "graphfit.placement/1", "graph": source,
        "placement": placement.op_devices(),
        "schedule": [{"op": placement.graph.names[u], "device": names[int(s.device[u])],
                      "start_us": float(s.start_us[u]), "finish_us": float(s.finish_us[u])}
                     for u in s.order.tolist()],
        "transfers": placement.transfers(), "summary": placement.summary()}


def plot_gantt(placement: Placement, path: str) -> None:
    """One row of compute per device and one of incoming transfers under it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, names = placement.schedule, placement.devices.names
    fig, ax = plt.subplots(figsize=(12, 1 + 0.8 * len(names)))
    for d in range(len(names)):
        on = s.device == d
        ax.broken_barh(list(zip(s.start_us[on] / 1e3, (s.finish_us - s.start_us)[on] / 1e3)),
                       (2 * d, 0.8), facecolors=gantt.COLOURS["compute"], edgecolor="white",
                       linewidth=0.3)
        into = s.transfer_dst == d
        ax.broken_barh(list(zip(s.transfer_start_us[into] / 1e3,
                                (s.transfer_end_us - s.transfer_start_us)[into] / 1e3)),
                       (2 * d + 0.9, 0.5), facecolors=gantt.COLOURS["incoming transfer"],
                       alpha=0.7)
    ax.set_yticks([2 * d + 0.4 for d in range(len(names))], names)
    ax.set_xlabel("simulated time in the step (ms)")
    gantt.add_legend(ax, ("compute", "incoming transfer"))
    ax.set_title(f"{placement.options['method']} ({placement.devices.link_model} links): "
                 f"makespan {placement.makespan_us / 1e3:.3f} ms", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    check_writable_path(os.path.join(_OUT_DIR.value, "placement.json"), "--out_dir")
    external = load_external_graph(_GRAPH.value)
    placement = place(external.graph, external.devices, method=_METHOD.value,
                      placer_type=_PLACER_TYPE.value, grouper=_GROUPER.value,
                      memory_model=_MEMORY_MODEL.value, lp_solver=_LP_SOLVER.value,
                      link_model=_LINK_MODEL.value)
    paths = write_files(_OUT_DIR.value, {
        "placement.json": lambda p: atomic_write_json(p, placement_json(placement,
                                                                         _GRAPH.value)),
        "trace.json": placement.schedule.write_chrome_trace,
        "gantt.png": lambda p: plot_gantt(placement, p)})
    summary = placement.summary()
    print(f"placed {summary['num_ops']} ops on {len(placement.devices)} devices with "
          f"{summary['method']} ({placement.devices.link_model} links) in "
          f"{summary['placement_s']:.3f} s: makespan {summary['makespan_us']:.1f} us "
          f"({summary['makespan_over_lower_bound']:.3f} x lower bound)")
    for name, ops, peak, limit in zip(placement.devices.names, summary["ops_per_device"],
                                      summary["peak_bytes"], summary["memory_bytes"]):
        print(f"  {name}: {ops} ops, peak {format_bytes(peak)} of {format_bytes(limit)}")
    print("wrote " + ", ".join(paths))


if __name__ == "__main__":
    cli.run(main, tensorflow=False)
