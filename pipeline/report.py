"""A report a person reads: what the passes did to a step, as files in one directory.

``write_report(result, directory)`` (also ``OptimizeResult.save``) writes:

- ``report.json``: every number of ``result.report()`` (and the caller's extras);
- ``memory.png``: per device, memory over the step as planned (the placement's simulated
  schedule) and as measured (allocation records of a traced run), with the device's limit;
  without a placement, planned against measured peak of the rematerialized step;
- ``placement_gantt.png``: the planned schedule as a Gantt chart, one row per device,
  recomputations in another colour;
- ``remat_plan.md``: which ops the plan recomputes, how often, what each costs;
- ``schedule_trace.json``: the planned schedule as a Chrome trace (open it in Perfetto or
  ``chrome://tracing``; TensorBoard's trace viewer reads the same format);
- ``summary.md``: the headline numbers and links to the rest.

Files that need a placement are written only when the result has one; ``summary.md`` says so.
The files are written together (``profiler.profile.write_files``): a directory holds one run's
report, never half of one nor a previous run's leftovers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphfit.baechi.gantt import COLOURS, add_legend
from graphfit.profiler.profile import atomic_write_json, write_files
from graphfit.profiler.sizes import format_bytes

if TYPE_CHECKING:
    from graphfit.pipeline.meta_optimizer import OptimizeResult

__all__ = ["REPORT_FILES", "placement_lines", "remat_line", "write_report"]

REPORT_FILES = ("report.json", "memory.png", "placement_gantt.png", "remat_plan.md",
                "schedule_trace.json", "summary.md")
MIB = 2 ** 20


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save_figure(figure, path: str) -> None:
    try:
        figure.savefig(path, dpi=110, bbox_inches="tight", format="png")
    finally:
        _pyplot().close(figure)


def _memory_plot(result: "OptimizeResult", path: str) -> None:
    """Per device planned and measured bytes in use over the step (or peaks without a
    placement)."""
    from graphfit.baechi.memory import device_timelines

    plt = _pyplot()
    placement = result.placement or {}
    if result.schedule is None:
        remat = result.report().get("remat", {})
        figure, axis = plt.subplots(figsize=(5, 3.5))
        bars = {"baseline (measured)": remat.get("baseline_peak_bytes"),
                "planned": remat.get("planned_peak_bytes"),
                "measured": remat.get("measured_peak_bytes")}
        bars = {k: v / MIB for k, v in bars.items() if v is not None}
        axis.bar(list(bars), list(bars.values()), color=["grey", "tab:blue", "tab:orange"][
            :len(bars)])
        if remat.get("budget_bytes"):
            axis.axhline(remat["budget_bytes"] / MIB, color="red", linestyle="--",
                         label="budget")
            axis.legend()
        axis.set_ylabel("peak memory (MiB)")
        axis.set_title("one device: peak memory of the step")
        _save_figure(figure, path)
        return
    names = list(result.schedule.devices.names)
    measured = placement.get("measured_timeline_bytes", {})
    figure, axes = plt.subplots(len(names), 1, figsize=(8, 2.2 * len(names)), sharex=True,
                                squeeze=False)
    for axis, name, (times, level) in zip(axes[:, 0], names,
                                          device_timelines(result.schedule)):
        axis.step(times / 1000, level / MIB, where="post", label="planned")
        highest = float(level.max()) if len(level) else 0.0
        if measured.get(name):
            t, b = zip(*measured[name])
            axis.step([x / 1000 for x in t], [x / MIB for x in b], where="post",
                      label="measured")
            highest = max(highest, float(max(b)))
        limit = placement.get("limit_bytes", {}).get(name)
        title = name
        if limit and limit <= 2 * highest:
            axis.axhline(limit / MIB, color="red", linestyle="--", label="limit")
        elif limit:  # a limit far above the step (the machine's RAM) would flatten the lines
            title += f" (limit {format_bytes(limit)}, off the scale)"
        axis.set_ylim(bottom=0)
        axis.set_ylabel("in use (MiB)")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7, loc="upper right")
    figure.suptitle("memory per device over the step: planned against measured", fontsize=10)
    axes[-1, 0].set_xlabel("time in the step (ms; planned: simulated, measured: traced run)")
    _save_figure(figure, path)


def _gantt(result: "OptimizeResult", path: str) -> None:
    """One row per device: each unit as a bar from its planned start to its finish."""
    plt = _pyplot()
    s = result.schedule
    names = list(s.devices.names)
    figure, axis = plt.subplots(figsize=(10, 0.6 * len(names) + 1.5))
    is_clone = ["/remat_" in s.units.unit_name(u) for u in range(s.units.num_units)]
    colours = {False: COLOURS["compute"], True: COLOURS["recompute"]}
    for d in range(len(names)):
        for clone, colour in colours.items():
            axis.broken_barh([(s.start_us[u] / 1000, max(s.finish_us[u] - s.start_us[u], 1.0)
                               / 1000) for u in range(s.units.num_units)
                              if s.device[u] == d and is_clone[u] == clone],
                             (d - 0.4, 0.8), facecolors=colour)
    for k in range(len(s.transfer_tensor)):
        axis.broken_barh([(s.transfer_start_us[k] / 1000,
                           max(s.transfer_end_us[k] - s.transfer_start_us[k], 1.0) / 1000)],
                         (int(s.transfer_dst[k]) + 0.25, 0.15),
                         facecolors=COLOURS["incoming transfer"])
    axis.set_yticks(range(len(names)), names, fontsize=8)
    axis.set_xlabel("simulated time in the step (ms)")
    axis.set_title(f"placement: makespan {s.makespan_us / 1000:.2f} ms")
    add_legend(axis)
    axis.invert_yaxis()
    _save_figure(figure, path)


def remat_line(result: "OptimizeResult") -> str | None:
    """The remat pass in one line, planned against measured (``None``: it changed nothing).
    The console and ``summary.md`` both print this line, so they show the same numbers."""
    remat = result.report().get("remat", {})
    if not remat.get("changed"):
        return None
    measured = remat.get("measured_peak_bytes")
    text = (f"remat{' ' + remat['method'] if remat.get('method') else ''}: "
            f"{remat['num_recomputes']} recomputations; peak "
            f"{format_bytes(remat['baseline_peak_bytes'])} -> planned "
            f"{format_bytes(remat['planned_peak_bytes'])}"
            + (f", measured {format_bytes(measured)}" if measured is not None else "")
            + f" (budget {format_bytes(remat['budget_bytes'])}); compute "
            f"x{remat['planned_overhead']:.2f} planned")
    if remat.get("measured_overhead") is not None:
        text += f", x{remat['measured_overhead']:.2f} measured"
    measured_step, planned_step = remat.get("overhead_vs_user"), remat.get("planned_step_vs_user")
    if planned_step is not None:
        text += (f"; step time x{planned_step:.2f} of your step planned, "
                 f"x{measured_step:.2f} measured")
    elif measured_step is not None:
        text += f"; step time x{measured_step:.2f} of your step measured"
    if "loss_match" in remat:
        equal = remat["loss_match"] and remat["gradients_match"]
        text += f"; loss and gradients equal: {'yes' if equal else 'NO'}"
    return text


def placement_lines(result: "OptimizeResult") -> list[str]:
    """Per device its ops and planned, measured and allowed peak, then the placer, the planned
    makespan and whether the placed step computes the single device's loss and gradients."""
    placement = result.placement
    if not placement or "measured_peak_bytes" not in placement:
        return []
    plan = placement["plan"]
    lines = [f"  {name}: {placement['ops_per_device'][name]} ops, peak planned "
             f"{format_bytes(placement['planned_peak_bytes'][name])}, measured "
             f"{format_bytes(placement['measured_peak_bytes'].get(name, 0))}, limit "
             f"{format_bytes(placement['limit_bytes'][name])}"
             for name in placement["devices"]]
    lines.append(f"placed by {plan.get('method', 'the placer')} on "
                 f"{len(placement['devices'])} devices ({placement['target']}) in "
                 f"{plan['placement_s']:.2f} s; makespan planned {plan['makespan_us'] / 1000:.2f} "
                 f"ms; loss and gradients equal to one device: "
                 f"{'yes' if placement['equal_to_single_device'] else 'NO'}")
    return lines


def _remat_markdown(result: "OptimizeResult") -> str:
    plan = result.plan
    if plan is None or plan.num_recomputes == 0:
        return "# Rematerialization plan\n\nNothing is recomputed: the step fits as it is.\n"
    rows = plan.stats.get("recomputed_ops", [])
    total_us = sum(r["times"] * r["compute_us"] for r in rows)
    baseline = result.report().get("remat", {}).get(      # the baseline summary.md shows
        "baseline_peak_bytes", plan.stats.get("baseline_peak_bytes", 0))
    lines = ["# Rematerialization plan", "",
             f"Planner `{plan.method}`, budget {format_bytes(plan.budget_bytes)}, planned peak "
             f"{format_bytes(plan.peak_bytes)} on one device "
             f"(baseline {format_bytes(baseline)}). "
             f"{plan.num_recomputes} recomputations of {len(rows)} ops cost "
             f"{total_us / 1000:.2f} ms of compute: x{plan.overhead:.3f} the step's compute.",
             "", "| op | type | recomputed | compute per run (us) | output (MiB) |",
             "|---|---|---|---|---|"]
    lines += [f"| `{r['op']}` | {r['op_type']} | {r['times']}x | {r['compute_us']:.1f} | "
              f"{r['output_bytes'] / MIB:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def _run_markdown(result: "OptimizeResult", run: dict[str, Any] | None) -> list[str]:
    """What ran: the passes that changed the step, the placer, and the measured step time
    against the user's (or "unchanged": no ratio of two timings of one graph)."""
    changed = [p.name for p in result.passes if p.changed]
    if not changed:
        return ["**Unchanged**: no pass rewrote the step (no budget, or nothing to do); it "
                "runs as you run it.", ""]
    text = f"Passes that changed the step: {', '.join(changed)}."
    if result.placement:
        text += f" Placer: {result.placement['plan'].get('method', 'unknown')}."
    if run and run.get("overhead_vs_user") is not None:
        text += (f" Measured step time {run['step_time_ms_median']:.1f} ms, "
                 f"x{run['overhead_vs_user']:.2f} your step under TF's defaults "
                 f"({run['user_step_time_ms_median']:.1f} ms).")
    if run and run.get("peak_bytes") is not None:
        text += f" Measured peak {format_bytes(run['peak_bytes'])}."
    return [text, ""]


def _summary_markdown(result: "OptimizeResult", written: list[str],
                      extra: dict[str, Any] | None = None) -> str:
    report = result.report()
    lines = ["# graphfit report", ""] + _run_markdown(result, (extra or {}).get("run"))
    joint = report.get("joint", {}).get("search")
    if joint:
        lines += ["## Joint remat + placement", "", joint["explanation"], "",
                  "| option | fits | simulated step (ms) | recomputations | compute x | why not |",
                  "|---|---|---|---|---|---|"]
        for name, option in (("place only", joint["place_only"]),
                             ("remat only (smallest device)", joint["remat_only"]),
                             ("joint (winner)", joint["winner"])):
            if option is None:
                continue
            step = f"{option['makespan_us'] / 1000:.1f}" if option["fits"] else "-"
            lines.append(f"| {name} | {'yes' if option['fits'] else 'no'} | {step} | "
                         f"{option['num_recomputes']} | {option['overhead']:.2f} | "
                         f"{option['reason'][:120]} |")
        lines += ["", f"{len(joint['options'])} options simulated; all are in `report.json` "
                  "(`joint.search.options`).", ""]
    remat = remat_line(result)
    if remat:
        lines += ["## Rematerialization", "", remat[0].upper() + remat[1:] + ".", ""]
    placement = result.placement
    if placement and "measured_peak_bytes" in placement:
        lines += ["## Per device: planned vs measured peak", "",
                  "| device | ops | planned (MiB) | measured (MiB) | limit (MiB) |",
                  "|---|---|---|---|---|"]
        for name in placement["devices"]:
            lines.append(f"| {name} | {placement['ops_per_device'][name]} | "
                         f"{placement['planned_peak_bytes'][name] / MIB:.2f} | "
                         f"{placement['measured_peak_bytes'].get(name, 0) / MIB:.2f} | "
                         f"{placement['limit_bytes'][name] / MIB:.2f} |")
        verdict = placement_lines(result)[-1]
        lines += ["", verdict[0].upper() + verdict[1:] + ".", ""]
    described = {"report.json": "every number", "memory.png": "memory per device over the step, "
                 "planned vs measured", "placement_gantt.png": "the placement as a Gantt chart",
                 "remat_plan.md": "what is recomputed and what it costs",
                 "schedule_trace.json": "the schedule as a Chrome trace (Perfetto, "
                 "chrome://tracing)"}
    lines += ["## Files", ""] + [f"- [{name}]({name}): {text}" for name, text in
                                 described.items() if name in written]
    missing = [name for name in described if name not in written]
    if missing:
        lines.append(f"- not written (the step was not placed): {', '.join(missing)}")
    return "\n".join(lines) + "\n"


def write_report(result: "OptimizeResult", directory: str,
                 extra: dict[str, Any] | None = None) -> list[str]:
    """Write the report files of ``result`` into ``directory`` (module docstring).

    Parameters:
        result: what ``pipeline.optimize`` returned.
        directory: created if missing; the report files of a previous run are replaced or
            removed, other files are left alone.
        extra: JSON-ready entries added to ``report.json`` (e.g. the training run).

    Returns:
        The paths written, ``summary.md`` last.

    Raises:
        OutputError: a file cannot be written; the directory is left as it was.
    """
    writers = {"report.json": lambda p: atomic_write_json(p, {**result.report(),
                                                              **(extra or {})}),
               "memory.png": lambda p: _memory_plot(result, p)}
    if result.schedule is not None:
        writers["placement_gantt.png"] = lambda p: _gantt(result, p)
        writers["schedule_trace.json"] = result.schedule.write_chrome_trace
    writers["remat_plan.md"] = lambda p: _write_text(p, _remat_markdown(result))
    summary = _summary_markdown(result, [*writers, "summary.md"], extra)
    writers["summary.md"] = lambda p: _write_text(p, summary)
    return write_files(directory, writers, owned=REPORT_FILES)
