"""One training step of two graphs from identical initial variables: same loss and gradients?

A graph pass must change where or when ops run, never what they compute: a rematerialization
rewrite (``remat.rewrite``) and a placement (``baechi.apply``) are both checked by running one step
of the original graph and one of the transformed graph and comparing the loss and every gradient
with ``tensors_close``: within ``atol + rtol * max |reference|`` of the reference, tensor by
tensor. The tolerance is relative to each tensor's largest magnitude rather than to each element
(``numpy.allclose``) because the rounding of a sum computed in another order (devices, oneDNN's
fused against unfused kernels) scales with the sum's terms, not with its result: an element
where large terms cancel to nearly zero differs by far more than ``rtol`` of itself (seen: a
rematerialized ResNet-50 under oneDNN, 6.4e-5 on gradients of magnitude up to 113).

Some steps amplify rounding far beyond any fixed tolerance: ``keras.applications.ResNet50`` at
64x64, batch 8 (BatchNorm over 2x2 maps) gives gradients up to 1.6 apart, of magnitude 99, with
oneDNN on against off, each run deterministic. A rematerialization rewrite runs some fusable ops
apart (its ordering edges keep TF's fusing passes off them), so its gradients differ from the
original's by that step's rounding, not by ``rtol``. With ``kernel_order_noise`` the check
measures that rounding on the ORIGINAL step in the same run: one more step of the reference with
TF's fusions left apart (``unfused_twin``: each reader of a tensor waits for the one before it,
and Grappler's remapper is off), so the same arithmetic runs in unfused kernels. Each tensor's
tolerance then grows by ``NOISE_FACTOR`` times that tensor's own largest difference between the
two runs of the original. Only tensors the original's own kernel order moves get a wider
tolerance, by what the original itself showed; a wrong value on any other tensor still fails at
``rtol`` (``tests/test_remat_rewrite.py``: a mis-wired clone). Measured on that ResNet-50 under
oneDNN at ratio 0.5: the twin moved 7 of 214 gradients, by up to 1.9e-4: the biases of the first
7 convolutions, each feeding a BatchNorm, so their gradient is zero in exact arithmetic and the
computed one (2e-6 to 2.7e-4) is cancelling terms summed in another order by oneDNN's fused
``Conv2DBackpropFilterWithBias`` than by ``BiasAddGrad``. The rewritten step moved the same 7,
each by at most the twin's difference (ratio 1.0), and no other. A tolerance from the step's
conditioning would not do: initial values one float32 ulp apart moved every gradient, by up to
3.2.

Both steps start from the same variables whatever their initialisers would draw: the reference's
initialisers run first, the values they assign are fetched, and those values are fed into the
candidate's initialisers (the tensors of the same names). So the check does not depend on random
ops keeping their seeds through a transformation. The reference runs in a one-device session with
the configuration it runs with (``profiler.session.step_config``: TF's defaults for the user's
step, so the reference is the user's own step: under the project's configuration the
un-rewritten ``EfficientNetB0`` step already moved one BatchNorm gradient by 5.9e-4); the
candidate runs in a session the caller
chooses (several devices, a gRPC target).

Random ops in the step are treated explicitly. An unseeded one (``tf.nn.dropout`` without a
graph or op seed: ``seed == seed2 == 0``) draws new numbers in every session, so two runs of the
very same graph differ. For the comparison only, both graphs get copies in which each such op
has a fixed seed derived from its name (passes keep the names of random ops: they are never
cloned), so both draw the same mask; the comparison lists the ops it seeded.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.tensor_pb2 import TensorProto
from tensorflow.core.protobuf import rewriter_config_pb2

from graphfit.errors import GraphfitError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.conv_kernels import EIGEN_KERNEL_LABEL, takes_eigen_kernel, uses_eigen
from graphfit.profiler.session import OpenSessions, make_session, session_config, step_config
from graphfit.profiler.trace import step_fetches

__all__ = ["NOISE_FACTOR", "ReferenceStep", "StepComparison", "StepMismatchError", "WeightCheck",
           "compare_steps", "compare_weights", "run_reference", "seed_random_ops",
           "tensors_close", "unfused_twin"]

# How many times the original step's own kernel-order difference a candidate may differ by,
# tensor by tensor: a rewrite runs a different subset of ops unfused than the twin (all of
# them), so its rounding is of the same size, not bounded by the twin's exactly.
NOISE_FACTOR = 4.0
# TF1 control flow: a control edge into a Merge (from its NextIteration) or out of a Switch
# changes what runs, so the twin adds none to or from these.
_CONTROL_FLOW_OP_TYPES = frozenset({"Switch", "Merge", "Enter", "Exit", "NextIteration",
                                    "LoopCond", "RefSwitch", "RefMerge", "RefEnter", "RefExit",
                                    "RefNextIteration"})


class StepMismatchError(GraphfitError, AssertionError):
    """The candidate step's loss or gradients differ from the reference step's."""


@dataclasses.dataclass(frozen=True)
class WeightCheck:
    """Compare the variables after the step too (``compare_steps``), with these tolerances;
    ``kernel_order_noise`` widens them by the reference's ``unfused_twin`` (module
    docstring) where they differ without it. The check for passes that move optimizer updates (``remat.early_updates``):
    equal gradients do not prove the updates read the right values. Optimizer slots and
    counters are variables too, so Adam's moments and iteration count are compared as well."""

    rtol: float = 1e-5
    atol: float = 1e-6
    kernel_order_noise: bool = False


@dataclasses.dataclass
class _StepValues:
    """What one step of a graph gave: the initial values its initialisers assigned, the loss,
    the gradients, and (when read) every variable after the step."""

    initial: dict[str, np.ndarray | TensorProto]
    loss: float
    gradients: list[np.ndarray]
    weights: dict[str, np.ndarray] | None


@dataclasses.dataclass
class StepComparison:
    """One step of a candidate graph against one step of the reference graph.

    Attributes:
        loss_reference / loss_candidate: the two losses.
        loss_equal: the losses are ``tensors_close(rtol, atol)``.
        gradients_equal: every gradient is ``tensors_close(rtol, atol)`` to the reference's.
        max_abs_gradient_diff: largest elementwise |difference| over all gradients.
        max_abs_gradient: largest |gradient| of the reference, for scale.
        rtol, atol: the tolerances used.
        max_kernel_noise: largest |difference| of a gradient between the reference and its
            ``unfused_twin`` (``None``: not measured); each tensor's tolerance grows by
            ``NOISE_FACTOR`` times its own such difference.
        seeded_random_ops: unseeded random ops given a fixed seed, by name, in both graphs
            for this comparison (see the module docstring).
        weights_equal: every variable after the step is ``tensors_close`` to the reference's
            under ``WeightCheck``'s tolerances (``None``: not compared); not part of ``equal``.
        max_abs_weight_diff: largest elementwise |difference| over the variables after it.
    """

    loss_reference: float
    loss_candidate: float
    loss_equal: bool
    gradients_equal: bool
    max_abs_gradient_diff: float
    max_abs_gradient: float
    rtol: float
    atol: float
    max_kernel_noise: float | None = None
    seeded_random_ops: list[str] = dataclasses.field(default_factory=list)
    weights_equal: bool | None = None
    max_abs_weight_diff: float | None = None

    @property
    def equal(self) -> bool:
        """Loss and every gradient are equal within the tolerances."""
        return self.loss_equal and self.gradients_equal

    def check(self) -> None:
        """Raise ``StepMismatchError`` unless the steps are equal."""
        if not self.equal:
            noise = ("" if self.max_kernel_noise is None else
                     f", plus {NOISE_FACTOR:g}x each tensor's kernel-order noise (largest "
                     f"{self.max_kernel_noise:.3g})")
            raise StepMismatchError(
                f"the step differs from the reference step: loss {self.loss_candidate!r} vs "
                f"{self.loss_reference!r}, max |gradient difference| "
                f"{self.max_abs_gradient_diff:.3g} (max |gradient| {self.max_abs_gradient:.3g}, "
                f"rtol {self.rtol}, atol {self.atol}{noise}; unseeded random ops seeded alike "
                f"in both: {len(self.seeded_random_ops)}): the pass changed what the step "
                "computes")


def seed_random_ops(item: GraphItem) -> tuple[GraphItem, list[str]]:
    """``item`` with every unseeded random op (attributes ``seed == seed2 == 0``) given a seed
    derived from its name, and the names of those ops; ``item`` itself when it has none.

    A seeded stateful random op draws the same numbers in every new session, so two graphs
    seeded this way draw the same dropout masks wherever their ops run.
    """
    graph_def = item.graph.as_graph_def()
    seeded = []
    for node in graph_def.node:
        if ("seed" in node.attr and "seed2" in node.attr and node.attr["seed"].i == 0
                and node.attr["seed2"].i == 0):
            node.attr["seed"].i = 1
            node.attr["seed2"].i = zlib.crc32(node.name.encode()) & 0x7FFFFFFF or 1
            seeded.append(node.name)
    if not seeded:
        return item, []
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return item.with_graph(graph), sorted(seeded)


def _execution_order(graph_def: tf.compat.v1.GraphDef) -> dict[str, int]:
    """Node name -> position in a topological order of data and control edges (edges into a
    ``Merge``, a TF1 loop's back edges among them, do not count)."""
    inputs = {node.name: [] if node.op in ("Merge", "RefMerge") else
              [name.lstrip("^").split(":")[0] for name in node.input] for node in graph_def.node}
    waiting = {name: len(producers) for name, producers in inputs.items()}
    readers = collections.defaultdict(list)
    for name, producers in inputs.items():
        for producer in producers:
            readers[producer].append(name)
    ready = [name for name, count in waiting.items() if count == 0]
    order = {}
    while ready:
        name = ready.pop()
        order[name] = len(order)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    return order


def _step_ops(item: GraphItem) -> list[tf.Operation]:
    """The ops one training step runs: the fetches' ancestors (data and control)."""
    elements = [item.graph.as_graph_element(name) for name in step_fetches(item)]
    stack = [e if isinstance(e, tf.Operation) else e.op for e in elements]
    seen = {op.name: op for op in stack}
    while stack:
        op = stack.pop()
        for producer in [t.op for t in op.inputs] + list(op.control_inputs):
            if producer.name not in seen:
                seen[producer.name] = producer
                stack.append(producer)
    return list(seen.values())


def unfused_twin(item: GraphItem) -> tuple[GraphItem, tf.compat.v1.ConfigProto]:
    """``item`` in which every reader of a tensor waits (control edge) for the reader before
    it, each stride-1 convolution gradient on the other of its two CPU kernels
    (``profiler.conv_kernels``), and the project's session configuration with Grappler's
    remapper off: the same arithmetic with TF's fusions left apart and the other kernels
    (module docstring), so its step differs from ``item``'s only by the rounding of the
    kernels. (On the Keras DenseNet-style step with Adam, ``remat.conv_grad_kernels``'
    kernels moved the weights after one step by up to 2.2e-6, beyond ``rtol``; a twin with
    only the fusions apart did not show that noise, 2026-12-05.)

    Why these edges: Grappler drops a control edge that repeats a data edge, so only an edge
    from another node keeps a fusion apart. oneDNN's merge of two readers of one gradient
    (``Conv2DBackpropFilter`` + ``BiasAddGrad``: the fused kernel sums the bias gradient in
    another order) needs both to have the same control inputs; chained, the later one waits
    for the earlier, the earlier cannot wait for itself. A ``Conv2D`` + ``BiasAdd`` fused or
    not rounds alike (one float32 sum, then the bias). Stateful and TF1 control-flow ops get
    no edges, ops outside the step none either (an edge would make the step run them)."""
    graph_def = item.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    position = _execution_order(graph_def)
    readers = collections.defaultdict(set)            # tensor -> step ops reading it
    for op in _step_ops(item):
        # Stateful ops (updates, variable reads) are not fused, and edges to them could order
        # reads and updates the step leaves free.
        if op.type in _CONTROL_FLOW_OP_TYPES or op.op_def.is_stateful or op.name not in position:
            continue
        for tensor in op.inputs:
            if tensor.op.type not in _CONTROL_FLOW_OP_TYPES and tensor.dtype != tf.resource \
                    and tensor.dtype == tensor.dtype.base_dtype:
                readers[tensor.name].add(op.name)
    for siblings in readers.values():
        chain = sorted(siblings, key=position.get)
        for earlier, later in zip(chain, chain[1:]):
            if f"^{earlier}" not in nodes[later].input:
                nodes[later].input.append(f"^{earlier}")
    for node in graph_def.node:
        if takes_eigen_kernel(node):
            if uses_eigen(node):
                del node.attr["_kernel"]
            else:
                node.attr["_kernel"].s = EIGEN_KERNEL_LABEL
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    config = session_config()
    config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    return item.with_graph(graph), config


def _initial_value_tensors(item: GraphItem) -> list[str]:
    """The tensors the initialiser writes into variables (the value input of each assign)."""
    init = item.graph.get_operation_by_name(item.init_op)
    stack, seen, values = [init], {init.name}, []
    while stack:
        op = stack.pop()
        if op.type in ("AssignVariableOp", "Assign"):
            values.append(op.inputs[1].name)
        for producer in [t.op for t in op.inputs] + list(op.control_inputs):
            if producer.name not in seen:
                seen.add(producer.name)
                stack.append(producer)
    return sorted(values)


def _one_step(item: GraphItem, session: tf.compat.v1.Session,
              initial_values: Mapping[str, np.ndarray | TensorProto] | None
              ) -> tuple[dict[str, np.ndarray | TensorProto], float, list[np.ndarray]]:
    """Initialise (with ``initial_values`` fed, if given) and run one step: (initial values,
    loss, gradients).

    An initial value the item feeds (``GraphItem.init_feeds``, a traced step's weights) is
    its array, and one that is a ``Const`` its ``TensorProto``, read from the graph: neither
    is fetched, and a constant equal to the step's own is not fed, so the step is
    initialised as every other run of it was, with no new executor of its session (fetching
    and feeding the 322 initial values of ``keras.applications.ResNet50`` took 3-4 s a step,
    2026-12-07)."""
    graph = item.graph
    producers = {n: graph.get_tensor_by_name(n).op for n in _initial_value_tensors(item)}
    constants = {n: op.get_attr("value") for n, op in producers.items() if op.type == "Const"}
    fed = {n: item.init_feeds[n] for n in producers if n in item.init_feeds}
    computed = [n for n in producers if n not in constants and n not in fed]
    feeds = item.init_feed_dict()
    for name, value in (initial_values or {}).items():
        if isinstance(value, TensorProto):
            if constants.get(name) == value:
                continue
            value = tf.make_ndarray(value)
        feeds[graph.get_tensor_by_name(name)] = value
    values = session.run([item.init_op, computed], feeds)[1]
    outputs = session.run(step_fetches(item), item.feed_dict())
    return ({**constants, **fed, **dict(zip(computed, values))}, float(outputs[1]),
            list(outputs[2:]))


def tensors_close(candidate: np.ndarray, reference: np.ndarray, rtol: float,
                  atol: float, noise: float = 0.0) -> bool:
    """Is ``candidate`` within ``atol + rtol * max |reference| + NOISE_FACTOR * noise`` of
    ``reference`` everywhere (module docstring: why the largest magnitude, not each element's;
    ``noise``: the reference's own largest kernel-order difference on this tensor)?"""
    candidate, reference = np.asarray(candidate), np.asarray(reference)
    if candidate.shape != reference.shape:
        return False
    scale = float(np.max(np.abs(reference), initial=0.0))
    return bool(np.all(np.abs(candidate - reference)
                       <= atol + rtol * scale + NOISE_FACTOR * noise))


def _max_abs_diff(first: np.ndarray, second: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(first) - np.asarray(second)), initial=0.0))


def _with_variable_reads(item: GraphItem) -> tuple[GraphItem, dict[str, str]]:
    """A copy of ``item`` whose graph also reads every variable (``item``'s own graph is the
    caller's and stays as it is): (the copy, variable name -> its read tensor)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(item.graph.as_graph_def(), name="")
        reads = {}
        for op in graph.get_operations():
            if op.type == "VarHandleOp":
                reads[op.name] = tf.raw_ops.ReadVariableOp(resource=op.outputs[0],
                                                           dtype=op.get_attr("dtype")).name
            elif op.type in ("VariableV2", "Variable"):
                reads[op.name] = tf.identity(op.outputs[0]).name
    return item.with_graph(graph), reads


def _variable_reads(graph: tf.Graph) -> dict[str, str] | None:
    """Variable name -> a tensor of ``graph`` that reads that variable and nothing else (a
    ``ReadVariableOp`` of its handle with no control inputs), so that fetched after the step
    it is the variable's new value without a copy of the graph, whose session is a new one
    (two on ``keras.applications.ResNet50``: 7,600 nodes each); ``None`` when a variable has
    no such read (or is a reference variable)."""
    handles = {op.name for op in graph.get_operations() if op.type == "VarHandleOp"}
    if any(op.type in ("VariableV2", "Variable") for op in graph.get_operations()):
        return None
    reads = {}
    for op in graph.get_operations():
        if (op.type == "ReadVariableOp" and not op.control_inputs
                and op.inputs[0].op.name in handles):
            reads.setdefault(op.inputs[0].op.name, op.outputs[0].name)
    return reads if len(reads) == len(handles) else None


def _run_step(item: GraphItem, session: Callable[[tf.Graph], tf.compat.v1.Session],
              initial_values: Mapping[str, np.ndarray] | None, read_weights: bool
              ) -> _StepValues:
    """One step of ``item`` in ``session(graph)`` from ``initial_values`` (``None``: its own
    initialisers'), reading the variables after it when ``read_weights`` (with the graph's own
    reads, ``_variable_reads``, else in a copy of the graph that adds them)."""
    reads: dict[str, str] = {}
    if read_weights:
        reads = _variable_reads(item.graph)
        if reads is None:
            item, reads = _with_variable_reads(item)
    with session(item.graph) as running:
        initial, loss, gradients = _one_step(item, running, initial_values)
        weights = dict(zip(reads, running.run(list(reads.values())))) if read_weights else None
    return _StepValues(initial, loss, gradients, weights)


@dataclasses.dataclass
class ReferenceStep:
    """One step of the reference, run before the candidate exists (``run_reference``): the
    reference with its random ops seeded (``seed_random_ops``), the ops seeded, and what the
    step gave."""

    item: GraphItem
    seeded: list[str]
    values: _StepValues


def _draws_random(graph: tf.Graph) -> bool:
    """Whether ``graph`` has a stateful random op (a seeded dropout among them): each run of
    it in a session draws the next numbers of the op's stream."""
    return any(op.op_def.is_stateful and "seed2" in op.node_def.attr
               for op in graph.get_operations())


def _pool_session(item: GraphItem, sessions: OpenSessions | None
                  ) -> Callable[[tf.Graph], tf.compat.v1.Session]:
    """graph -> the pool's session of ``item``'s own graph, or a new one, both with the
    configuration ``item``'s step runs with. A new one also for a graph that draws random
    numbers: there a seeded op draws its first numbers, as on the other side of the
    comparison, where the pool's session has drawn as many as it ran steps (the zoo cifarnet's
    dropout, two measured steps before the reference and four before the rewritten step:
    losses 2.30109 and 2.30243 from the same initial values, 2026-12-07)."""
    def session(graph: tf.Graph) -> tf.compat.v1.Session:
        if sessions is not None and graph is item.graph and not _draws_random(graph):
            return sessions.borrow(graph, step_config(item))
        return make_session(graph, config=step_config(item))
    return session


def run_reference(reference: GraphItem, read_weights: bool = False,
                  sessions: OpenSessions | None = None) -> ReferenceStep:
    """Run one step of ``reference`` from its own initialisers, as ``compare_steps`` does
    first, so that a caller can run it ahead (``remat.closed_loop`` runs it while it plans:
    the step's gradients are a new executor of its session, a Grappler pass of seconds on
    ``keras.applications.ResNet50``). ``read_weights``: also read the variables after it."""
    seeded_item, seeded = seed_random_ops(reference)
    values = _run_step(seeded_item, _pool_session(reference, sessions), None, read_weights)
    return ReferenceStep(seeded_item, seeded, values)


def compare_steps(reference: GraphItem, candidate: GraphItem,
                  candidate_session: Callable[[tf.Graph], tf.compat.v1.Session] | None = None,
                  rtol: float = 1e-5, atol: float = 1e-6,
                  kernel_order_noise: bool = False, loss_rtol: float | None = None,
                  atol_of_max: float = 0.0, weights: WeightCheck | None = None,
                  sessions: OpenSessions | None = None,
                  reference_step: ReferenceStep | None = None) -> StepComparison:
    """Run one step of ``reference`` on one device and one of ``candidate`` in
    ``candidate_session`` from the same initial variables, and compare loss and gradients
    (and, with ``weights``, the variables after the step, from the same runs).

    Parameters:
        reference: the untransformed step.
        candidate: the transformed step; its initialisers and step fetches keep the reference's
            names (as ``GraphItem.with_graph`` requires).
        candidate_session: graph -> a session to run ``candidate`` in, e.g.
            ``baechi.run.RunTarget.session`` for several devices or a gRPC cluster; by default
            one device with the configuration the step runs with
            (``profiler.session.step_config``), as the reference.
        rtol, atol: tolerances of ``tensors_close`` (devices may sum in another order).
        loss_rtol: the loss's ``rtol`` (default ``rtol``).
        atol_of_max: each gradient's ``atol`` grows by this times the largest |gradient| of
            the reference (float32 rounding scales with the step's largest terms).
        kernel_order_noise: also run the reference's ``unfused_twin`` and widen each tensor's
            tolerance by ``NOISE_FACTOR`` times its difference there (module docstring): for
            passes that keep TF's fusions off some ops.
        weights: compare the variables after the step as well (``WeightCheck``); one twin
            run serves both noises.
        sessions: run both steps (the default ``candidate_session``) in the pool's open
            sessions where the graphs are the pool's (no random op to seed, the variables'
            own reads: ``_variable_reads``): each step starts from its initialisers, run
            again, and a new session of a large graph costs seconds.
        reference_step: ``reference``'s step, already run (``run_reference``, reading the
            variables if ``weights`` is given); by default it is run here.

    Returns:
        The comparison (``seeded_random_ops``: the unseeded random ops both graphs ran with a
        fixed seed); ``.check()`` raises ``StepMismatchError`` if the loss or gradients
        differ (the variables are reported, ``weights_equal``, not checked).

    Raises:
        KeyError: ``candidate`` lacks a tensor the reference's initialisers assign from, or
            a variable of the reference.
    """
    read_weights = weights is not None
    reference_step = reference_step or run_reference(reference, read_weights, sessions)
    if read_weights and reference_step.values.weights is None:
        raise ValueError("compare_steps(weights=...) needs a reference step that read the "
                         "variables: run_reference(..., read_weights=True)")
    reference, seeded, ran = reference_step.item, reference_step.seeded, reference_step.values
    candidate_session = candidate_session or _pool_session(candidate, sessions)
    candidate, _ = seed_random_ops(candidate)
    other = _run_step(candidate, candidate_session, ran.initial, read_weights)

    def twin_run() -> _StepValues:
        twin_item, config = unfused_twin(reference)
        return _run_step(twin_item, lambda graph: make_session(graph, config=config),
                         ran.initial, read_weights)

    twin = twin_run() if kernel_order_noise else None
    loss_noise, noise = 0.0, [0.0] * len(ran.gradients)
    if kernel_order_noise:
        loss_noise = _max_abs_diff(twin.loss, ran.loss)
        noise = [_max_abs_diff(t, r) for t, r in zip(twin.gradients, ran.gradients)]
    pairs = list(zip(other.gradients, ran.gradients, noise))
    max_abs_gradient = max((float(np.max(np.abs(r), initial=0.0))
                            for r in ran.gradients), default=0.0)
    gradient_atol = atol + atol_of_max * max_abs_gradient
    comparison = StepComparison(
        loss_reference=ran.loss, loss_candidate=other.loss,
        loss_equal=tensors_close(other.loss, ran.loss,
                                 rtol if loss_rtol is None else loss_rtol, atol, loss_noise),
        gradients_equal=all(tensors_close(c, r, rtol, gradient_atol, n) for c, r, n in pairs),
        max_abs_gradient_diff=max((_max_abs_diff(c, r) for c, r, _ in pairs), default=0.0),
        max_abs_gradient=max_abs_gradient, rtol=rtol, atol=gradient_atol,
        max_kernel_noise=max(noise, default=0.0) if kernel_order_noise else None,
        seeded_random_ops=seeded)
    if read_weights:
        comparison.weights_equal, comparison.max_abs_weight_diff = _weights_close(
            other.weights, ran.weights, None, weights)
        # The twin's noise only widens the tolerance: run it only when the weights differ
        # without it (a twin is a third step in a fresh session: 5 s on keras.applications.
        # ResNet50, 2026-12-06).
        if not comparison.weights_equal and weights.kernel_order_noise:
            twin = twin or twin_run()
            comparison.weights_equal, comparison.max_abs_weight_diff = _weights_close(
                other.weights, ran.weights, twin.weights, weights)
    return comparison


def _weights_close(candidate: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                   twin: Mapping[str, np.ndarray] | None, check: WeightCheck
                   ) -> tuple[bool, float]:
    """Whether every variable of ``reference`` is close in ``candidate`` (widened by its
    difference in ``twin``, if given), and the largest |difference|."""
    noise = {name: 0.0 if twin is None else _max_abs_diff(twin[name], value)
             for name, value in reference.items()}
    diffs = [_max_abs_diff(candidate[name], value) for name, value in reference.items()]
    equal = all(tensors_close(candidate[name], value, check.rtol, check.atol, noise[name])
                for name, value in reference.items())
    return equal, max(diffs, default=0.0)


def compare_weights(reference: GraphItem, candidate: GraphItem, rtol: float = 1e-5,
                    atol: float = 1e-6, kernel_order_noise: bool = False
                    ) -> tuple[bool, float]:
    """One training step of each from identical initial variables: are the variables after
    the step equal (``tensors_close``; ``WeightCheck``)? Returns ``(equal, max |difference|)``.

    Raises:
        KeyError: ``candidate`` lacks a variable of ``reference``.
    """
    comparison = compare_steps(reference, candidate,
                               weights=WeightCheck(rtol, atol, kernel_order_noise))
    return comparison.weights_equal, comparison.max_abs_weight_diff
