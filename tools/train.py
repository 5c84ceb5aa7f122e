"""Build a model's training step, optionally profile it, run it and report.

The Baechi-style entry point (``bazel-bin/train`` or ``python -m graphfit.tools.train``):

    python -m graphfit.tools.train --model_name=resnet --batch_size=32 --steps=20
    python -m graphfit.tools.train --model_name=mlp --costgen --cost_path=out/mlp_costs.json

It prints the median step time and the peak memory of the step, and writes a JSON report
(``--report_path``). The passes are ``baechi.optimize``'s: with ``--memory_budget`` or
``--memory_ratio`` the step is first rematerialized and the report compares planned and
measured peak and overhead. With ``--num_devices`` > 1 the step is placed (Baechi: ``--placement_method``,
``--placer_type``, ``--grouper``, memory and communication flags), applied, checked against the
single-device step and run on the devices (``--cluster``: this process or local gRPC workers); the
report compares the planned makespan and per-device peaks with the measured ones.
"""

from __future__ import annotations

import statistics
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS

flags.DEFINE_string("model_name", "resnet", "Model to train (see models.MODEL_NAMES).")
flags.DEFINE_string("preset", "default", "Size preset of the model: tiny, default, activations.")
flags.DEFINE_integer("batch_size", None, "Batch size; default: the preset's.")
flags.DEFINE_multi_string("model_arg", [], "Model size knob as key=value (repeatable), "
                          "e.g. --model_arg=depth=32 --model_arg=width=64.")
flags.DEFINE_string("optimizer", "sgd", "Optimizer: sgd, momentum, adam, adagrad, rmsprop.")
flags.DEFINE_integer("steps", 10, "Measured training steps (after --warmup_steps).")
flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first.")
flags.DEFINE_boolean("costgen", False, "Profile the step (traced runs) and save the costs.")
flags.DEFINE_string("cost_path", "out/costs.json", "Where --costgen writes the profile.")
flags.DEFINE_integer("trace_every", 2, "With --costgen: trace every k-th profiled step.")
flags.DEFINE_integer("num_devices", 1, "Devices to run on (virtual CPU devices without GPUs).")
flags.DEFINE_string("report_path", "out/train_report.json", "JSON report of the run.")
flags.DEFINE_integer("seed", 0, "Seed of weights and generated data.")
flags.DEFINE_string("memory_budget", None, "Rematerialize to fit this peak memory: bytes or "
                    "a size such as 300MiB or 1.5GiB (resident variables and feeds included).")
flags.DEFINE_float("memory_ratio", None, "Rematerialize to fit this fraction of the measured "
                   "baseline peak (alternative to --memory_budget).")
flags.DEFINE_string("remat_heuristic", "dtr", "Rematerialization planner: a DTR heuristic (dtr, "
                    "dtr_eq, dtr_local, lru, size, msps, random, belady, offline) or a baseline "
                    "(checkpoint_all, chen_sqrt_n, chen_greedy, checkmate).")
flags.DEFINE_float("remat_overhead_limit", 2.0, "Give up (thrash) when recomputation would "
                   "exceed this multiple of the step's compute.")
flags.DEFINE_enum("placement_method", None, ["m_topo", "m_etf", "m_sct"],
                  "With --num_devices > 1: the Baechi placer (default: baechi.place's).")
flags.DEFINE_enum("placer_type", None, ["default", "colocation", "fusion"],
                  "Placement units: single ops, colocation groups, or fused groups.")
flags.DEFINE_enum("grouper", None, ["tf", "coplace"], "Groups: TF colocation only, or "
                  "Baechi's co-placement on top.")
flags.DEFINE_string("comm_cost_coeffs", None, "Transfer cost 'a,b': a us/byte * bytes + b us "
                    "for every device pair (default: Baechi's GPU fit 0.0001754,134).")
flags.DEFINE_string("comm_cost_path", None, "Per-link transfer costs: the JSON written by "
                    "tools/communication_benchmark (overrides --comm_cost_coeffs).")
flags.DEFINE_string("device_memory", None, "Memory of each device, e.g. 2GiB (default: this "
                    "machine's RAM / --num_devices).")
flags.DEFINE_float("memory_fraction", 1.0, "Fraction of --device_memory the placer may fill.",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("sct_threshold", None, "m-SCT: LP values below it make a favourite child.")
flags.DEFINE_enum("lp_solver", None, ["highs", "cvxopt", "mosek"], "m-SCT's LP solver.")
flags.DEFINE_enum("cluster", "local", ["local", "grpc"], "Where --num_devices > 1 runs: "
                  "this process (GPUs or virtual CPUs) or local TF gRPC worker processes.")


def _model_kwargs() -> dict:
    """--model_arg key=value pairs, values parsed as int, float or string."""
    kwargs = {}
    for pair in FLAGS.model_arg:
        key, sep, value = pair.partition("=")
        if not sep:
            raise app.UsageError(f"--model_arg={pair!r} is not key=value")
        for parse in (int, float):
            try:
                kwargs[key] = parse(value)
                break
            except ValueError:
                continue
        else:
            kwargs[key] = {"true": True, "false": False}.get(value.lower(), value)
    if FLAGS.batch_size is not None:
        kwargs["batch_size"] = FLAGS.batch_size
    return kwargs


def run_steps(item, steps: int, warmup: int, num_cpu_devices: int = 1, target: str = "",
              config=None) -> dict:
    """Run the step ``warmup + steps`` times in a session with ``config`` (default: the
    project's ``profiler.session.session_config``); median step time, final loss and the peak
    bytes:
    the allocator's high-water mark over the measured steps (CPU:0's allocator is shared by all
    virtual CPU devices; with a gRPC ``target`` it is this client's, not the workers'), or, if
    the allocator keeps no statistics (``profiler.trace.AllocatorPeak``), the peak replayed
    from the allocation records of one more, traced step."""
    from graphfit.profiler.session import make_session
    from graphfit.profiler.trace import AllocatorPeak, step_fetches, traced_peak_bytes

    times_ms, losses = [], []
    with make_session(item.graph, num_cpu_devices, target, config) as session:
        session.run(item.init_op)
        feeds = item.feed_dict()
        fetches = step_fetches(item)[:2]
        for _ in range(warmup):
            session.run(fetches, feeds)
        with AllocatorPeak() as allocator:
            for _ in range(steps):
                begin = time.perf_counter()
                _, loss = session.run(fetches, feeds)
                times_ms.append((time.perf_counter() - begin) * 1000)
                losses.append(float(loss))
        peak, source = allocator.bytes, "allocator"
        if peak is None:
            peak, source = traced_peak_bytes(session, item.graph, fetches, feeds), "records"
    return {"step_time_ms_median": statistics.median(times_ms), "step_times_ms": times_ms,
            "losses": losses, "peak_bytes": int(peak), "peak_source": source}


def _device_set(names):
    """The placer's devices: --device_memory x --memory_fraction each, links from
    --comm_cost_path, else --comm_cost_coeffs, else Baechi's GPU fit."""
    import os

    from graphfit.baechi.devices import DeviceSet
    from graphfit.profiler.sizes import parse_bytes

    try:
        memory = (parse_bytes(FLAGS.device_memory) if FLAGS.device_memory is not None else
                  os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(names))
        memory = int(memory * FLAGS.memory_fraction)
        if FLAGS.comm_cost_path is not None:
            return DeviceSet.from_json(names, memory, FLAGS.comm_cost_path)
        return DeviceSet.uniform(names, memory, FLAGS.comm_cost_coeffs or "0.0001754,134")
    except (ValueError, OSError) as error:  # DeviceError, SizeError
        raise app.UsageError(str(error)) from error


def _budget() -> dict:
    """--memory_budget / --memory_ratio as ``optimize`` keywords (checked here, so a typo is a
    usage error before any work)."""
    from graphfit.profiler.sizes import parse_bytes
    from graphfit.remat.pipeline import PLANNERS

    if FLAGS.memory_budget is not None and FLAGS.memory_ratio is not None:
        raise app.UsageError("give one of --memory_budget and --memory_ratio, not both")
    if FLAGS.remat_heuristic not in PLANNERS:
        raise app.UsageError(f"--remat_heuristic={FLAGS.remat_heuristic!r} is not one of "
                             f"{', '.join(PLANNERS)}")
    try:
        budget = None if FLAGS.memory_budget is None else parse_bytes(FLAGS.memory_budget)
    except ValueError as error:
        raise app.UsageError(f"--memory_budget: {error}") from error
    return {"memory_budget": budget, "memory_ratio": FLAGS.memory_ratio,
            "remat_heuristic": FLAGS.remat_heuristic,
            "remat_overhead_limit": FLAGS.remat_overhead_limit}


def _place_options() -> dict:
    return {key: FLAGS[flag].value for key, flag in (
        ("method", "placement_method"), ("placer_type", "placer_type"), ("grouper", "grouper"),
        ("sct_threshold", "sct_threshold"), ("lp_solver", "lp_solver"))
        if FLAGS[flag].value is not None}


def _print_report(result) -> None:
    """One line per pass: planned against measured."""
    from graphfit.profiler.trace import print_progress

    report = result.report()
    remat = report["remat"]
    if remat["changed"]:
        print_progress(
            f"remat {remat['method']}: budget {remat['budget_bytes'] / 2**20:.1f} MiB, peak "
            f"planned {remat['planned_peak_bytes'] / 2**20:.1f} MiB, measured "
            f"{remat['measured_peak_bytes'] / 2**20:.1f} MiB (baseline "
            f"{remat['baseline_peak_bytes'] / 2**20:.1f} MiB); overhead planned "
            f"{remat['planned_overhead']:.2f}x, measured {remat['measured_overhead']:.2f}x "
            f"({remat['overhead_vs_user']:.2f}x the step under TF's defaults); "
            f"{remat['num_recomputes']} recomputations; loss/gradients match: "
            f"{remat['loss_match'] and remat['gradients_match']}")
    placement = result.placement
    if placement is not None:
        for name in placement["devices"]:
            print_progress(
                f"  {name}: {placement['ops_per_device'][name]} ops, peak planned "
                f"{placement['planned_peak_bytes'][name] / 2**20:.1f} MiB, measured "
                f"{placement['measured_peak_bytes'].get(name, 0) / 2**20:.1f} MiB, limit "
                f"{placement['limit_bytes'][name] / 2**20:.1f} MiB")
        print_progress(
            f"placed on {len(placement['devices'])} devices ({placement['target']}) in "
            f"{placement['plan']['placement_s']:.2f} s; makespan planned "
            f"{placement['plan']['makespan_us'] / 1000:.2f} ms; loss/gradients equal to 1 "
            f"device: {placement['equal_to_single_device']}")


def _profile(item, report: dict):
    """The step's measured costs: --costgen profiles and saves them; --cost_path alone loads
    them for the placer. ``None`` otherwise (the passes profile what they need)."""
    from graphfit.profiler.profile import Profile
    from graphfit.profiler.trace import print_progress, profile_graph

    if FLAGS.costgen:
        profile = profile_graph(item, steps=max(2, FLAGS.steps), warmup=FLAGS.warmup_steps,
                                trace_every=FLAGS.trace_every,
                                num_cpu_devices=FLAGS.num_devices)
        profile.save(FLAGS.cost_path)
        print_progress(f"profile: {profile.coverage:.1%} of {profile.num_graph_ops} step ops "
                       f"measured, peak {profile.peak_bytes / 2**20:.1f} MiB -> {FLAGS.cost_path}")
        report["profile"] = {"path": FLAGS.cost_path, "coverage": profile.coverage,
                             "profiled_peak_bytes": profile.peak_bytes}
        return profile
    if FLAGS["cost_path"].present and FLAGS.num_devices > 1:
        try:
            return Profile.load(FLAGS.cost_path, item.graph_def())
        except (OSError, ValueError) as error:
            raise app.UsageError(f"--cost_path={FLAGS.cost_path}: {error}") from error
    return None


def _optimize_and_run(item, profile, report: dict) -> dict:
    """``baechi.optimize`` with the flags' passes, then the measured run of its result."""
    from contextlib import nullcontext

    from graphfit.baechi import optimize
    from graphfit.baechi.lp import LPSolverError
    from graphfit.baechi.run import LocalCluster, local_target
    from graphfit.baechi.schedule import PlacementError
    from graphfit.profiler.session import user_config
    from graphfit.remat.pipeline import BudgetError

    budget = _budget()
    placing = FLAGS.num_devices > 1
    grpc = placing and FLAGS.cluster == "grpc"
    with LocalCluster(FLAGS.num_devices) if grpc else nullcontext() as cluster:
        target = cluster.run_target if grpc else local_target(FLAGS.num_devices)
        try:
            result = optimize(item, **budget, target=target,
                              devices=_device_set(list(target.devices)) if placing else None,
                              profile=profile, place_options=_place_options())
        except BudgetError as error:
            raise app.UsageError(str(error)) from error
        except (PlacementError, LPSolverError) as error:
            raise SystemExit(f"placement failed: {error}") from error
        report.update(result.report())
        _print_report(result)
        if placing:
            report["place"]["single_device_step_time_ms_median"] = run_steps(
                item, FLAGS.steps, FLAGS.warmup_steps)["step_time_ms_median"]
        run = run_steps(result.item, FLAGS.steps, FLAGS.warmup_steps, target.num_cpu_devices,
                        target.target)
        # The input as the user runs it: TF's default configuration, one device.
        run["user_step_time_ms_median"] = run_steps(
            item, FLAGS.steps, FLAGS.warmup_steps, config=user_config())["step_time_ms_median"]
        run["overhead_vs_user"] = run["step_time_ms_median"] / run["user_step_time_ms_median"]
    if placing:  # the shared allocator cannot tell devices apart: report the worst device
        run["peak_bytes"] = max(result.placement["measured_peak_bytes"].values())
    return run


def main(argv):
    del argv
    from graphfit import models
    from graphfit.profiler.profile import atomic_write_json
    from graphfit.profiler.trace import print_progress

    try:
        item = models.build(FLAGS.model_name, preset=FLAGS.preset, optimizer=FLAGS.optimizer,
                            seed=FLAGS.seed, **_model_kwargs())
    except (ValueError, TypeError) as error:
        raise app.UsageError(str(error)) from error
    num_ops = len(item.graph.get_operations())
    print_progress(f"built {item.name}: {num_ops} ops, config {item.config}")
    report = {"model": item.name, "config": item.config, "optimizer": FLAGS.optimizer,
              "graph_ops": num_ops, "num_devices": FLAGS.num_devices}
    profile = _profile(item, report)
    result = report["run"] = _optimize_and_run(item, profile, report)
    atomic_write_json(FLAGS.report_path, report)
    print(f"{item.name}: step time {result['step_time_ms_median']:.1f} ms (median of "
          f"{FLAGS.steps}; {result['overhead_vs_user']:.2f}x the input under TF's defaults, "
          f"{result['user_step_time_ms_median']:.1f} ms), peak memory {result['peak_bytes'] / 2**20:.1f} MiB, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; "
          f"report {FLAGS.report_path}")


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    sys.exit(run())
