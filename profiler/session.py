"""The session configurations of the project: the one every optimized step runs and is measured
with, and the user's own (TF's defaults), which reports compare against.

``session_config`` keeps Grappler at TF's defaults, with three exceptions:

- **On** (TF's defaults): the arithmetic optimizer (without its common-subgraph elimination),
  constant folding, the remapper (it fuses e.g. ``MatMul`` + ``BiasAdd`` + ``Relu`` into one
  ``_FusedMatMul`` named after the last op, clones too), the layout, loop, shape, function,
  memory (default level), pin-to-host and implementation-selector optimizers. None of them
  undoes a plan. Measured on the mlp ``activations`` preset at ratio 0.5 (59 clones, plan
  143.02 MB): the rewritten step's replayed peak was 143.05 MB under TF's defaults, and the
  same with, one at a time, the arithmetic optimizer, CSE, the dependency optimizer, constant
  folding or the remapper off, against 143.02 MB with Grappler off.
- **Off: common-subgraph elimination, Grappler's and the classic optimizer's** (the classic
  one forces its CSE on at L1, so it runs at L0). A clone whose inputs are its original's
  (a plan does this when the clone's previous event is its own input, so no ordering edge is
  added) is merged with the original; after the remapper fused both, even an attribute that
  tells them apart is gone. Measured on the tiny mlp with such a clone: under TF's defaults
  the original ``layer_0/Relu`` no longer runs (the clone's fused node serves both, holding
  the activation through the backward pass); with both CSEs off both run.
- **Off: the dependency optimizer.** It removes control edges that other paths imply
  (transitive reduction) and control inputs that repeat a data input. The rewrite adds
  exactly such edges to keep oneDNN's run-time merge (``MklLayoutRewritePass``, which runs
  after Grappler) away from a fusable pair the plan split (``remat.rewrite``); without them
  the merge makes a cycle or aborts the process. Its own gain is small: it prunes ``NoOp``
  and ``Identity`` nodes.

Everything else about the session is TF's default too: inter- and intra-op thread pools,
allocator. ``user_config`` is TF's default ``ConfigProto`` (a ``tf.function`` runs with the
same Grappler defaults): the step as the user runs it today, the reference of the reports'
``overhead_vs_user``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from graphfit.errors import GraphfitError

__all__ = ["session_config", "user_config", "serial_config", "make_session", "step_config",
           "onednn_enabled", "EXACT_GRAPH", "OpenSessions", "StepFailedError", "failing_step",
           "run_once"]

# The ``GraphItem.config`` key a graph rewrite sets when it adds clones or ordering edges that
# CSE or the dependency optimizer would undo (``remat.rewrite``, ``remat.grad_accumulation``,
# ``remat.early_updates``): such a step runs under ``session_config``.
EXACT_GRAPH = "exact_graph"


def user_config(num_cpu_devices: int = 1) -> tf.compat.v1.ConfigProto:
    """TF's default configuration with ``num_cpu_devices`` CPU devices: the user's step."""
    return tf.compat.v1.ConfigProto(device_count={"CPU": num_cpu_devices})


def session_config(num_cpu_devices: int = 1) -> tf.compat.v1.ConfigProto:
    """The project's configuration: TF's defaults without CSE and the dependency optimizer
    (module docstring). Soft placement stays off so an op pinned to a device runs there or fails
    loudly."""
    config = user_config(num_cpu_devices)
    rewrite_options = config.graph_options.rewrite_options
    rewrite_options.dependency_optimization = rewriter_config_pb2.RewriterConfig.OFF
    rewrite_options.common_subgraph_elimination = rewriter_config_pb2.RewriterConfig.OFF
    # The classic optimizer forces its CSE on at L1 (TF's default): L0, without CSE.
    options = config.graph_options.optimizer_options
    options.opt_level = tf.compat.v1.OptimizerOptions.L0
    options.do_common_subexpression_elimination = False
    return config


def serial_config(config: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
    """``config`` with one inter-op thread of the session's own, so ops run one at a time
    (each with the whole intra-op pool). ``inter_op_parallelism_threads`` alone does nothing
    once any session of the process made TF's global inter-op pool: measured on the resnet
    preset, op times summed to 1.6x the step's wall time with it, 0.99x with a pool of its
    own."""
    serial = tf.compat.v1.ConfigProto()
    serial.CopyFrom(config)
    serial.inter_op_parallelism_threads = 1
    serial.use_per_session_threads = True
    return serial


def step_config(item, num_cpu_devices: int = 1) -> tf.compat.v1.ConfigProto:
    """The configuration to run ``item``'s step with: ``session_config`` when a pass of the
    project rewrote it exactly (``EXACT_GRAPH``), else TF's defaults (``user_config``). A step no
    pass changed (``pipeline.optimize`` without a budget) is the user's graph under the user's
    configuration, so it is exactly as fast as the user's own."""
    return (session_config if item.config.get(EXACT_GRAPH) else user_config)(num_cpu_devices)


def make_session(graph: tf.Graph, num_cpu_devices: int = 1, target: str = "",
                 config: tf.compat.v1.ConfigProto | None = None) -> tf.compat.v1.Session:
    """A v1 session on ``graph`` (``target``: a gRPC address or local) with ``config``
    (default ``session_config``)."""
    return tf.compat.v1.Session(target=target, graph=graph,
                                config=config or session_config(num_cpu_devices))


def onednn_enabled() -> bool:
    """Whether this process's TF runs oneDNN's kernels and graph passes (chosen when TF loads,
    ``TF_ENABLE_ONEDNN_OPTS``)."""
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


class OpenSessions:
    """Sessions kept open across the stages of one computation, one per graph and
    configuration, so that each stage that runs the same step reuses the session instead of
    paying a new one's Grappler pass and executor: on ``keras.applications.ResNet50`` (64x64,
    batch 8) three traced steps, each in a session of its own, took 45 s, and six in one
    session 23 s, on a loaded machine (2026-12-06). Every user re-runs the step's initialiser
    first, as it does in a new session. ``reuse(sessions)`` is how a function takes an
    optional pool: the caller's, or one of its own closed when it returns. Each open session
    holds its step's variables and kernels' buffers: ``keep_only`` closes those of the steps a
    caller is done with.

    Examples:
        >>> with OpenSessions.reuse(None) as sessions:          # doctest: +SKIP
        ...     session = sessions.get(item.graph, user_config())
    """

    def __init__(self):
        self._open: dict[tuple[int, bytes], tuple[tf.Graph, tf.compat.v1.Session]] = {}

    def get(self, graph: tf.Graph, config: tf.compat.v1.ConfigProto | None = None
            ) -> tf.compat.v1.Session:
        """The open session of ``graph`` under ``config`` (default ``session_config``)."""
        config = config or session_config()
        key = (id(graph), config.SerializeToString(deterministic=True))
        if key not in self._open:     # the graph is kept too: its id stays its own
            self._open[key] = (graph, tf.compat.v1.Session(graph=graph, config=config))
        return self._open[key][1]

    def borrow(self, graph: tf.Graph, config: tf.compat.v1.ConfigProto | None = None
               ) -> contextlib.AbstractContextManager[tf.compat.v1.Session]:
        """``get`` as a context manager that leaves the session open, for code that runs a
        session in a ``with`` block (``profiler.trace.profile_graph``'s ``session_factory``)."""
        return contextlib.nullcontext(self.get(graph, config))

    def keep_only(self, graphs: Iterable[tf.Graph]) -> None:
        """Close the sessions of every graph but ``graphs``."""
        kept = {id(graph) for graph in graphs}
        for key in [key for key in self._open if key[0] not in kept]:
            self._open.pop(key)[1].close()

    def close(self) -> None:
        """Close every session."""
        self.keep_only(())

    def __enter__(self) -> "OpenSessions":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    @contextlib.contextmanager
    def reuse(sessions: "OpenSessions | None") -> Iterator["OpenSessions"]:
        """``sessions`` as it is, or a new pool closed when the block ends."""
        if sessions is not None:
            yield sessions
            return
        with OpenSessions() as own:
            yield own


class StepFailedError(GraphfitError):
    """An optimized step does not run on TensorFlow; the message has TF's error."""


@contextlib.contextmanager
def failing_step(what: str) -> Iterator[None]:
    """Turn TF's refusal to run a step inside the block into ``StepFailedError`` (``what``
    names the step in the message): for the first run of a rewritten step, wherever it is."""
    try:
        yield
    except tf.errors.OpError as error:
        raise StepFailedError(f"the {what} step does not run on TensorFlow "
                              f"({type(error).__name__}): {error.message}") from error


def run_once(item, what: str, session: Callable[[tf.Graph], Any]) -> None:
    """Initialise and run one step of ``item`` in ``session(graph)``: every pass that rewrites
    a step runs it once before handing it on, so a step that cannot run is never returned.

    Raises:
        StepFailedError: TF refused to run it (``what`` names the step in the message).
    """
    with failing_step(what), session(item.graph) as running:
        item.initialize(running)
        running.run([item.train_op, item.loss], item.feed_dict())
