"""Build a model's training step, optionally profile it, run it and report.

The Baechi-style entry point (``bazel-bin/train`` or ``python -m graphfit.tools.train``):

    python -m graphfit.tools.train --model_name=resnet --batch_size=32 --steps=20
    python -m graphfit.tools.train --model_name=mlp --costgen --cost_path=out/mlp_costs.json

It prints the median step time and the peak memory of the step, and writes a JSON report
(``--report_path``). The passes are ``pipeline.optimize``'s: with ``--memory_budget`` or
``--memory_ratio`` the step is first rematerialized and the report compares planned and
measured peak and overhead. With ``--num_devices`` > 1 the step is placed (Baechi: ``--placement_method``,
``--placer_type``, ``--grouper``, memory and communication flags), applied, checked against the
single-device step and run on the devices (``--cluster``: this process or local gRPC workers); the
report compares the planned makespan and per-device peaks with the measured ones.

On several machines, start ``tools/worker.py`` on each and give their addresses: the step is
placed over every device of every worker and runs there (``baechi.cluster``: every call is
bounded by ``--cluster_timeout_s``; a missing, killed or stopped worker ends the run with a
``ClusterError`` naming it):

    python -m graphfit.tools.train --model_name=mlp --cluster_spec=worker=h1:2222,h2:2222
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

from absl import flags

from graphfit.errors import ArgumentError, GraphfitError, check_number, check_writable_path
from graphfit.tools import cli

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
flags.DEFINE_string("remat_heuristic", "offline", "Rematerialization planner: offline (the "
                    "default: plans knowing the whole step, best or tied on every model "
                    "measured), a DTR heuristic (dtr, dtr_eq, dtr_local, lru, size, msps, "
                    "random, belady) or a baseline (checkpoint_all, chen_sqrt_n, chen_greedy, "
                    "checkmate).")
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
flags.DEFINE_list("skip_passes", [], "Passes not to run, comma-separated, of "
                  "pipeline.passes.PASSES: patch_convs, conv_grad_kernels, flat_matmuls, "
                  "grad_accumulation, early_updates, remat, place.")
flags.DEFINE_boolean("verify_structure", False, "Debugging: after each pass, verify the "
                     "step's structure (acyclic, every read version exists, no stateful clone, "
                     "colocation and limits kept; pipeline/verify.py).")
flags.DEFINE_enum("cluster", "local", ["local", "grpc"], "Where --num_devices > 1 runs: "
                  "this process (GPUs or virtual CPUs) or local TF gRPC worker processes.")
flags.DEFINE_boolean("joint", False, "With --num_devices > 1: decide the remat budget and the "
                     "placement together (pipeline.joint): the fastest simulated step that fits "
                     "every device of --device_memory; compares with remat only and place only.")
flags.DEFINE_list("joint_ratios", None, "With --joint: remat budgets to search, as fractions of "
                  "the measured peak (default: pipeline.joint.DEFAULT_RATIOS).")
flags.DEFINE_list("joint_methods", None, "With --joint: placers to search (default: "
                  "pipeline.joint.DEFAULT_METHODS).")
flags.DEFINE_string("report_dir", None, "Also write a report a person reads into this "
                    "directory: the JSON, memory per device planned vs measured, the placement "
                    "as a Gantt chart, the remat plan, the schedule as a Chrome trace, "
                    "summary.md.")
flags.DEFINE_string("cluster_spec", None, "Run on running tools/worker.py workers: "
                    "job=host:port,host:port (e.g. worker=h1:2222,h2:2222) or a JSON file "
                    "{\"worker\": [...]}; the step is placed over every device of every worker "
                    "(--num_devices and --cluster are not used).")
flags.DEFINE_float("cluster_timeout_s", 20.0, "On a gRPC cluster: bound on every session call "
                   "(a step, a traced step, a close); a worker that is killed, stopped or "
                   "missing ends the run with an error within about twice this.",
                   lower_bound=1.0)
flags.DEFINE_boolean("isolated_network", None, "With --cluster=grpc: run the client and its "
                     "workers in a private network namespace that has only loopback (unshare "
                     "--user --net), so no other host can reach the workers' ports. Default: "
                     "isolated wherever the platform allows, else a warning; --isolated_network "
                     "requires it (an error where impossible), --noisolated_network opts out.")


def _model_kwargs() -> dict:
    """--model_arg key=value pairs, values parsed as int, float or string."""
    kwargs = {}
    for pair in FLAGS.model_arg:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ArgumentError(f"--model_arg={pair!r} is not key=value")
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


def check_flags() -> None:
    """Check every flag before any work, so a typo costs no profiling run.

    Raises:
        errors.ArgumentError (or a layer's error, e.g. ``DeviceError``): naming the flag,
        its value and what is allowed.
    """
    from graphfit import models
    from graphfit.baechi.devices import parse_comm_coeffs, read_comm_json
    from graphfit.profiler.profile import Profile
    from graphfit.profiler.sizes import parse_bytes
    from graphfit.pipeline.passes import check_skip
    from graphfit.remat.pipeline import PLANNERS

    check_skip(FLAGS.skip_passes)

    for name, minimum in (("steps", 1), ("warmup_steps", 0), ("trace_every", 1),
                          ("num_devices", 1)):
        check_number(FLAGS[name].value, f"--{name}", minimum=minimum, integer=True)
    if FLAGS.memory_budget is not None and FLAGS.memory_ratio is not None:
        raise ArgumentError("give one of --memory_budget and --memory_ratio, not both")
    if FLAGS.memory_ratio is not None:
        check_number(FLAGS.memory_ratio, "--memory_ratio", above=0)
    for name in ("memory_budget", "device_memory"):
        if FLAGS[name].value is not None:
            parse_bytes(FLAGS[name].value, f"--{name}")
    if FLAGS.remat_heuristic not in PLANNERS:
        raise ArgumentError(f"--remat_heuristic={FLAGS.remat_heuristic!r} is not one of "
                            f"{', '.join(PLANNERS)}")
    check_number(FLAGS.remat_overhead_limit, "--remat_overhead_limit", minimum=1,
                 allow_inf=True)
    if FLAGS.sct_threshold is not None:
        check_number(FLAGS.sct_threshold, "--sct_threshold", minimum=0, maximum=1)
    if FLAGS.comm_cost_coeffs is not None:
        parse_comm_coeffs(FLAGS.comm_cost_coeffs)
    if FLAGS.comm_cost_path is not None:
        read_comm_json(FLAGS.comm_cost_path)
    models.check_knobs(FLAGS.model_name, {**_model_kwargs(), "optimizer": FLAGS.optimizer,
                                          "seed": FLAGS.seed})
    models.preset_config(FLAGS.model_name, FLAGS.preset)
    check_writable_path(FLAGS.report_path, "--report_path")
    if FLAGS.report_dir is not None:
        if not FLAGS.report_dir.strip():
            raise ArgumentError("--report_dir is empty: give the directory to write the report "
                                "into, e.g. out/report (or leave the flag out)")
        check_writable_path(os.path.join(FLAGS.report_dir, "summary.md"), "--report_dir")
    if FLAGS.joint and (FLAGS.memory_budget is not None or FLAGS.memory_ratio is not None):
        raise ArgumentError("--joint searches the remat budget itself: give --num_devices and "
                            "--device_memory, not --memory_budget or --memory_ratio")
    if FLAGS.costgen:
        check_writable_path(FLAGS.cost_path, "--cost_path")
    elif FLAGS["cost_path"].present and (FLAGS.num_devices > 1 or FLAGS.cluster_spec):
        Profile.load(FLAGS.cost_path)  # its graph is checked once the model is built


def run_steps(item, steps: int, warmup: int, session_factory=None, between_steps=None) -> dict:
    """Run the step ``warmup + steps`` times; median step time, final loss and the peak bytes:
    the allocator's high-water mark over the measured steps (CPU:0's allocator is shared by all
    virtual CPU devices; on a gRPC cluster it is this client's, not the workers'), or, if
    the allocator keeps no statistics (``profiler.trace.AllocatorPeak``), the peak replayed
    from the allocation records of one more, traced step.
    ``session_factory``: graph -> session (a ``RunTarget.session``); default one device.
    ``between_steps``: called before each step (``Cluster.check_faults``: a local run beside a
    cluster stops when a worker fails)."""
    from graphfit.profiler.session import make_session
    from graphfit.profiler.trace import AllocatorPeak, step_fetches, traced_peak_bytes

    times_ms, losses = [], []
    with (session_factory or make_session)(item.graph) as session:
        item.initialize(session)
        feeds = item.feed_dict()
        fetches = step_fetches(item)[:2]
        for _ in range(warmup):
            if between_steps:
                between_steps()
            session.run(fetches, feeds)
        with AllocatorPeak() as allocator:
            for _ in range(steps):
                if between_steps:
                    between_steps()
                begin = time.perf_counter()
                _, loss = session.run(fetches, feeds)
                times_ms.append((time.perf_counter() - begin) * 1000)
                losses.append(float(loss))
        peak, source = allocator.bytes, "allocator"
        if not peak:  # no statistics kept, or none for a step this small: not a measurement
            peak, source = traced_peak_bytes(session, item.graph, fetches, feeds), "records"
    return {"step_time_ms_median": statistics.median(times_ms), "step_times_ms": times_ms,
            "losses": losses, "peak_bytes": int(peak), "peak_source": source}


def _device_set(names):
    """The placer's devices: --device_memory x --memory_fraction each, links from
    --comm_cost_path, else --comm_cost_coeffs, else Baechi's GPU fit."""
    import os

    from graphfit.baechi.devices import DeviceSet
    from graphfit.profiler.sizes import parse_bytes

    memory = (parse_bytes(FLAGS.device_memory) if FLAGS.device_memory is not None else
              os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(names))
    memory = int(memory * FLAGS.memory_fraction)
    if FLAGS.comm_cost_path is not None:
        return DeviceSet.from_json(names, memory, FLAGS.comm_cost_path)
    return DeviceSet.uniform(names, memory, FLAGS.comm_cost_coeffs or "0.0001754,134")


def _budget() -> dict:
    """--memory_budget / --memory_ratio as ``optimize`` keywords (``check_flags`` checked
    them)."""
    from graphfit.profiler.sizes import parse_bytes

    budget = None if FLAGS.memory_budget is None else parse_bytes(FLAGS.memory_budget)
    return {"memory_budget": budget, "memory_ratio": FLAGS.memory_ratio}


def _place_options() -> dict:
    return {key: FLAGS[flag].value for key, flag in (
        ("method", "placement_method"), ("placer_type", "placer_type"), ("grouper", "grouper"),
        ("sct_threshold", "sct_threshold"), ("lp_solver", "lp_solver"))
        if FLAGS[flag].value is not None}


def _print_report(result) -> None:
    """One line per pass that changed the step: planned against measured, in the numbers the
    report files hold (``pipeline.report``)."""
    from graphfit.pipeline.report import placement_lines, remat_line
    from graphfit.profiler.trace import print_progress

    line = remat_line(result)
    if line:
        print_progress(line)
    for line in placement_lines(result):
        print_progress(line)


def _print_joint(result) -> None:
    """The search's verdict, the two one-pass alternatives, and per device the planned and
    measured peaks side by side."""
    from graphfit.pipeline.report import placement_lines
    from graphfit.profiler.sizes import format_bytes
    from graphfit.profiler.trace import print_progress

    report = result.report()["joint"]
    search = report["search"]

    def line(name, option):
        if not option["fits"]:
            return f"  {name:<11} does not fit: {option['reason']}"
        return (f"  {name:<11} fits: simulated step {option['makespan_us'] / 1000:.1f} ms, "
                f"{option['num_recomputes']} recomputations (compute x{option['overhead']:.2f})"
                + (f", remat budget {option['ratio']:.3g} of the peak" if option["ratio"] else "")
                + (f", {option['method']}" if option["method"] else ", one device"))

    print_progress(f"single device: peak {format_bytes(search['baseline_peak_bytes'])}; "
                   f"devices hold {format_bytes(min(search['limit_bytes']))} each")
    for name, option in (("place only", search["place_only"]),
                         ("remat only", search["remat_only"]),
                         ("joint", report.get("built", search["winner"]))):
        print_progress(line(name, option))
    for line_ in placement_lines(result):
        print_progress(line_)


def _joint_space():
    """--joint_ratios / --joint_methods as a ``pipeline.joint.JointSpace``."""
    from graphfit.pipeline import joint

    try:
        ratios = [float(r) for r in FLAGS.joint_ratios or joint.DEFAULT_RATIOS]
    except ValueError as error:
        raise ArgumentError(f"--joint_ratios: {error}") from error
    return joint.JointSpace(ratios, FLAGS.joint_methods or joint.DEFAULT_METHODS)


def _profile(item, report: dict):
    """The step's measured costs: --costgen profiles and saves them; --cost_path alone loads
    them for the placer. ``None`` otherwise (the passes profile what they need)."""
    from graphfit.profiler.profile import Profile
    from graphfit.profiler.sizes import format_bytes
    from graphfit.profiler.trace import print_progress, profile_graph

    if FLAGS.costgen:
        profile = profile_graph(item, steps=max(2, FLAGS.steps), warmup=FLAGS.warmup_steps,
                                trace_every=FLAGS.trace_every,
                                num_cpu_devices=FLAGS.num_devices)
        profile.save(FLAGS.cost_path)
        print_progress(f"profile: {profile.coverage:.1%} of {profile.num_graph_ops} step ops "
                       f"measured, peak {format_bytes(profile.peak_bytes)} -> {FLAGS.cost_path}")
        report["profile"] = {"path": FLAGS.cost_path, "coverage": profile.coverage,
                             "profiled_peak_bytes": profile.peak_bytes}
        return profile
    if FLAGS["cost_path"].present and (FLAGS.num_devices > 1 or FLAGS.cluster_spec):
        return Profile.load(FLAGS.cost_path, item.graph_def())
    return None


def _cluster():
    """The gRPC cluster the flags ask for (``None``: run in this process)."""
    from graphfit.baechi.cluster import Cluster, LocalCluster

    if FLAGS.cluster_spec is not None:
        if FLAGS["num_devices"].present or FLAGS["cluster"].present:
            raise ArgumentError("--cluster_spec places over every device of its workers: "
                                 "leave out --num_devices and --cluster")
        try:
            return Cluster(FLAGS.cluster_spec, operation_timeout_s=FLAGS.cluster_timeout_s)
        except ValueError as error:
            raise ArgumentError(f"--cluster_spec: {error}") from error
    if FLAGS.num_devices > 1 and FLAGS.cluster == "grpc":
        return LocalCluster(FLAGS.num_devices, operation_timeout_s=FLAGS.cluster_timeout_s)
    return None


def _exit_if_stuck(cluster, error) -> None:
    """The watchdog's last resort: a worker failed its probe; the run stops by itself within
    2 x --cluster_timeout_s + a probe, so if this process still runs well after that, something
    in TF did not honour the timeout: print the diagnosis, end the workers it started, exit."""
    import os
    import threading

    def stuck() -> None:
        if not cluster.failing():
            return  # the worker answers again: a slow probe, not a fault
        print(f"cluster error: {error} (the run did not stop by itself within "
              f"{grace_s:.0f} s; exiting)", file=sys.stderr, flush=True)
        cluster.close()
        os._exit(1)

    grace_s = 2 * cluster.operation_timeout_s + 2 * cluster.probe_timeout_s + 30
    timer = threading.Timer(grace_s, stuck)
    timer.daemon = True
    timer.start()


def _optimize_and_run(item, profile, report: dict) -> dict:
    """``pipeline.optimize`` with the flags' passes, then the measured run of its result."""
    from contextlib import nullcontext

    from graphfit.pipeline import optimize
    from graphfit.baechi.run import local_target
    from graphfit.profiler.session import make_session, user_config

    budget = _budget()
    cluster = _cluster()
    with cluster if cluster is not None else nullcontext():
        if cluster is not None:
            cluster.watch(lambda error: _exit_if_stuck(cluster, error))
        target = cluster.run_target if cluster is not None else local_target(FLAGS.num_devices)
        placing = len(target.devices) > 1
        if FLAGS.joint and not placing:
            raise ArgumentError("--joint places over several devices: give --num_devices > 1 "
                                 "or a --cluster_spec with more than one device")
        report["num_devices"] = len(target.devices)
        if cluster is not None:
            report["cluster"] = {"spec": cluster.spec, "devices": list(target.devices),
                                 "operation_timeout_s": cluster.operation_timeout_s,
                                 "workers": cluster.worker_info}
        devices = _device_set(list(target.devices)) if placing else None
        result = optimize(item, **budget, joint=_joint_space() if FLAGS.joint else None,
                          remat_heuristic=FLAGS.remat_heuristic,
                          remat_overhead_limit=FLAGS.remat_overhead_limit, target=target,
                          devices=devices, profile=None if FLAGS.joint else profile,
                          place_options=_place_options(), skip=FLAGS.skip_passes,
                          verify_structure=FLAGS.verify_structure)
        report.update(result.report())
        (_print_joint if FLAGS.joint else _print_report)(result)
        check = cluster.check_faults if cluster is not None else None
        if placing:
            single = run_steps(item, FLAGS.steps, FLAGS.warmup_steps,
                               between_steps=check)["step_time_ms_median"]
            report["place"]["single_device_step_time_ms_median"] = single
        run = run_steps(result.item, FLAGS.steps, FLAGS.warmup_steps, target.session, check)
        run["unchanged"] = result.item is item
        if not run["unchanged"]:  # else the same graph timed twice: noise, not a result
            # The input as the user runs it: TF's default configuration, one device.
            run["user_step_time_ms_median"] = run_steps(
                item, FLAGS.steps, FLAGS.warmup_steps,
                lambda graph: make_session(graph, config=user_config()),
                between_steps=check)["step_time_ms_median"]
            run["overhead_vs_user"] = (run["step_time_ms_median"]
                                       / run["user_step_time_ms_median"])
    _one_measured_peak(run, result)
    return run, result


def _one_measured_peak(run: dict, result) -> None:
    """The run's peak is the one the passes measured and the report files show (the worst
    device's when placed: the shared allocator cannot tell devices apart), so one run reports
    one measured peak; the step's own allocator figure only when no pass measured one."""
    placement, remat = result.placement, result.report().get("remat", {})
    if placement and placement.get("measured_peak_bytes"):
        run["peak_bytes"] = max(placement["measured_peak_bytes"].values())
        run["peak_source"] = "placement check (worst device)"
    elif remat.get("changed") and remat.get("measured_peak_bytes") is not None:
        run["peak_bytes"] = int(remat["measured_peak_bytes"])
        run["peak_source"] = "remat pass (verified run)"


def _with_budget_hint(error) -> str:
    """A budget without a plan, with the smallest budget that has one (searched by the remat
    pass on this run's step) as the flags to pass, with ``HINT_ROOM`` for the next run's
    traced orders, as ``pipeline.keras_fit`` suggests it."""
    from graphfit.profiler.sizes import format_bytes
    from graphfit.remat.pipeline import HINT_ROOM

    if error.smallest_bytes is None or not error.baseline_bytes:
        return str(error)
    room = int(error.smallest_bytes * (1 + HINT_ROOM))
    return (f"{str(error).rstrip('.')}. The smallest budget with a plan is "
            f"{format_bytes(error.smallest_bytes)} ({error.ratio_of(error.smallest_bytes):.3f} "
            f"of what the step adds above its {format_bytes(error.resident_bytes)} resident, "
            f"measured in this run): pass --memory_budget={room} ({HINT_ROOM:.0%} above it, "
            f"for the next run's traced orders) or "
            f"--memory_ratio={math.ceil(error.ratio_of(room) * 100) / 100:.2f}.")


def _isolate_network() -> None:
    """Keep the gRPC workers this binary starts off the network: TF's server listens on every
    interface without authentication, so with --cluster=grpc the binary re-executes itself in
    a loopback-only network namespace wherever the platform allows (``baechi.netns``). Where
    it does not, the run goes on with a warning in this binary's own output (the workers'
    warnings go to their logs, which nobody reads), unless --isolated_network demanded it."""
    from graphfit.baechi.netns import NamespaceError, enter_isolated_network, unavailable_reason

    spawns_workers = (FLAGS.cluster_spec is None and FLAGS.cluster == "grpc"
                      and FLAGS.num_devices > 1)       # as _cluster starts them
    if FLAGS.isolated_network and not spawns_workers:
        raise ArgumentError("--isolated_network is for workers this binary starts itself "
                             "(--cluster=grpc --num_devices > 1); workers of a --cluster_spec run "
                             "elsewhere")
    if not spawns_workers or FLAGS.isolated_network is False:
        if spawns_workers:
            _exposure_warning("--noisolated_network was given")
        return
    reason = None if FLAGS.isolated_network else unavailable_reason()
    if reason is not None:
        _exposure_warning(reason)
        return
    try:
        enter_isolated_network([sys.executable, "-m", "graphfit.tools.train", *sys.argv[1:]])
    except NamespaceError as error:
        raise SystemExit(f"--isolated_network: {error}") from error


def _exposure_warning(reason: str) -> None:
    print(f"train: warning: the {FLAGS.num_devices} gRPC workers of this run are not isolated "
          f"({reason}): TensorFlow's server listens on every network interface with no "
          "authentication, so any host that reaches their ports can run code as you until the "
          "run ends. Run on a trusted network or behind a firewall, or use --cluster=local.",
          file=sys.stderr, flush=True)


def main(argv):
    del argv
    check_flags()
    _isolate_network()
    from graphfit import models
    from graphfit.baechi.cluster import ClusterError
    from graphfit.profiler.profile import atomic_write_json
    from graphfit.remat.pipeline import BudgetError
    from graphfit.profiler.sizes import format_bytes
    from graphfit.profiler.trace import print_progress

    item = models.build(FLAGS.model_name, preset=FLAGS.preset, optimizer=FLAGS.optimizer,
                        seed=FLAGS.seed, **_model_kwargs())
    num_ops = len(item.graph.get_operations())
    print_progress(f"built {item.name}: {num_ops} ops, config {item.config}")
    report = {"model": item.name, "config": item.config, "optimizer": FLAGS.optimizer,
              "graph_ops": num_ops, "num_devices": FLAGS.num_devices}
    profile = _profile(item, report)
    try:
        result, optimized = _optimize_and_run(item, profile, report)
    except ClusterError as error:
        raise SystemExit(f"cluster error: {error}") from error
    except BudgetError as error:
        raise GraphfitError(_with_budget_hint(error)) from None
    report["run"] = result
    versus = ("unchanged: no pass rewrote the step" if result["unchanged"] else
              f"{result['overhead_vs_user']:.2f}x your step under TF's defaults, "
              f"{result['user_step_time_ms_median']:.1f} ms")
    print(f"{item.name}: step time {result['step_time_ms_median']:.1f} ms (median of "
          f"{FLAGS.steps}; {versus}), peak memory {format_bytes(result['peak_bytes'])}, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; "
          f"report {FLAGS.report_path}")
    try:  # after the summary, so a full disk loses no result
        atomic_write_json(FLAGS.report_path, report)
        if FLAGS.report_dir:
            optimized.save(FLAGS.report_dir, extra={"run": result, "model": item.name,
                                                    "config": item.config})
            print_progress(f"report: {FLAGS.report_dir}/summary.md")
    except OSError as error:
        raise GraphfitError(f"cannot write the report ({error}); the line above holds the "
                            "results") from None


def run():
    """Console-script entry point."""
    cli.run(main)


if __name__ == "__main__":
    sys.exit(run())
