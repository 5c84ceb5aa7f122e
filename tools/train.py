"""Build a model's training step, optionally profile it, run it and report.

The Baechi-style entry point (``bazel-bin/train`` or ``python -m tools.train``):

    python -m tools.train --model_name=resnet --batch_size=32 --steps=20
    python -m tools.train --model_name=mlp --costgen --cost_path=out/mlp_costs.json

It prints the median step time and the peak memory of the step, and writes a JSON report
(``--report_path``). Rematerialization and placement flags arrive with their passes.
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


def run_steps(item, steps: int, warmup: int, num_cpu_devices: int = 1) -> dict:
    """Run the step ``warmup + steps`` times; median step time, final loss and the
    allocator's peak bytes over the measured steps (CPU:0's allocator is shared by all
    virtual CPU devices)."""
    import tensorflow as tf

    from profiler.session import make_session
    from profiler.trace import step_fetches

    times_ms, losses = [], []
    with make_session(item.graph, num_cpu_devices) as session:
        session.run(item.init_op)
        feeds = item.feed_dict()
        fetches = step_fetches(item)[:2]
        for _ in range(warmup):
            session.run(fetches, feeds)
        tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(steps):
            begin = time.perf_counter()
            _, loss = session.run(fetches, feeds)
            times_ms.append((time.perf_counter() - begin) * 1000)
            losses.append(float(loss))
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"step_time_ms_median": statistics.median(times_ms), "step_times_ms": times_ms,
            "losses": losses, "peak_bytes": int(peak)}


def main(argv):
    del argv
    import models
    from profiler.profile import atomic_write_json
    from profiler.trace import print_progress, profile_graph

    try:
        item = models.build(FLAGS.model_name, preset=FLAGS.preset, optimizer=FLAGS.optimizer,
                            seed=FLAGS.seed, **_model_kwargs())
    except (ValueError, TypeError) as error:
        raise app.UsageError(str(error)) from error
    num_ops = len(item.graph.get_operations())
    print_progress(f"built {item.name}: {num_ops} ops, config {item.config}")
    report = {"model": item.name, "config": item.config, "optimizer": FLAGS.optimizer,
              "graph_ops": num_ops, "num_devices": FLAGS.num_devices}
    if FLAGS.costgen:
        profile = profile_graph(item, steps=max(2, FLAGS.steps), warmup=FLAGS.warmup_steps,
                                trace_every=FLAGS.trace_every,
                                num_cpu_devices=FLAGS.num_devices)
        profile.save(FLAGS.cost_path)
        print_progress(f"profile: {profile.coverage:.1%} of {profile.num_graph_ops} step ops "
                       f"measured, peak {profile.peak_bytes / 2**20:.1f} MiB -> {FLAGS.cost_path}")
        report["profile"] = {"path": FLAGS.cost_path, "coverage": profile.coverage,
                             "profiled_peak_bytes": profile.peak_bytes}
    result = run_steps(item, FLAGS.steps, FLAGS.warmup_steps, FLAGS.num_devices)
    report["run"] = result
    atomic_write_json(FLAGS.report_path, report)
    print(f"{item.name}: step time {result['step_time_ms_median']:.1f} ms (median of "
          f"{FLAGS.steps}), peak memory {result['peak_bytes'] / 2**20:.1f} MiB, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; "
          f"report {FLAGS.report_path}")


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    sys.exit(run())
