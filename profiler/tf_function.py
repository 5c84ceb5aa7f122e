"""The TF2 entry: a traced ``tf.function`` training step as a ``GraphItem``, and back.

Keras 3 users write a ``@tf.function`` step (``GradientTape`` + ``optimizer.apply_gradients``)
instead of a v1 graph. Tracing it gives a plain GraphDef with no function library for
ordinary models, backward ops under a ``gradient_tape/`` scope, and the variables entering as
resource placeholders after the data inputs (DESIGN.md §8). This module turns that GraphDef
into the project's unit of work and a rewritten GraphDef back into something that trains the
user's own model:

- ``graph_item_from_function`` builds a SELF-CONTAINED ``FunctionItem`` (a ``GraphItem``): each
  captured variable's placeholder becomes a ``VarHandleOp`` of the same name, initialised to
  the variable's current value (fed to the initialiser, ``GraphItem.init_feeds``); other
  captured tensors become constants; the data
  placeholders are fed with the traced batch. Every node keeps its name from the function
  graph, so a pass's output maps back node for node. Profiling, planning and rewriting
  work on it like on any v1 step.
- ``to_callable`` runs a (possibly rewritten) item as a TF2 function on the REAL variables:
  the step's nodes are imported into ``tf.compat.v1.wrap_function`` with each variable
  handle mapped to the captured handle of the user's variable, so calling it updates the
  Keras model in place.

Rules:

- **Loss.** The step must return its loss: one scalar float tensor (or a mapping with a
  ``"loss"`` entry).
- **Gradients.** The tensors made by the gradient computation (ops under a ``gradient_tape``
  or ``gradients`` name scope, as ``tf.GradientTape`` and ``tf.gradients`` name them, plus the
  ``AddN`` ops the tape creates outside its scope to sum gradients) that an op outside it
  reads: the optimizer, or whatever the user applies to the gradients first (clipping,
  casting). They are ordered by their first reader (op order, then input
  position), which for Keras optimizers is the order of ``trainable_variables``.
- **Train op.** A ``NoOp`` grouping the function's control outputs (every stateful op the
  function ran, as automatic control dependencies collected them).
- **Loops** (``While``: Keras RNN layers with ``unroll=False``, ``tf.while_loop``) whose trip
  count is known when the step is traced are unrolled into the step by
  ``profiler.unroll_loops`` (per-step intermediates become ordinary tensors the passes see);
  other loops are refused with what to change (a fixed sequence length, ``unroll=True``).
- **Nested functions** called through ``StatefulPartitionedCall`` / ``PartitionedCall`` (a
  user's helper ``tf.function``, Keras' grouped ``Conv2D``) and their gradient functions are
  inlined (``profiler.inline_functions``), as Grappler's function optimizer does; a grouped
  convolution Keras ran under XLA then runs on TF's depthwise kernels
  (``profiler.grouped_convolutions``). Other
  function-valued attributes (``If``/``Case`` branches) stay opaque to the passes: such a
  step is refused with the names of the nodes (e.g. trace the step without ``tf.cond`` on
  tensors, or without Keras ``jit_compile``).
- **Sums.** Each tree of adds is summed as TF's function runtime sums it (Grappler's
  arithmetic optimizer: one ``AddN`` per input shape, ``profiler.sum_groups``), so that the
  passes' edges and clones cannot change what the step computes.

Example (``train_step`` a Keras 3 ``@tf.function`` step returning the loss)::

    item = graph_item_from_function(train_step, x_batch, y_batch, name="my_model")
    profile = profiler.trace.profile_graph(item)            # like any GraphItem
    rewritten = remat.rewrite.rewrite(item, cost_graph, plan)
    step = to_callable(rewritten)                          # trains the Keras model
    loss = step(x_batch, y_batch)

Runs of the callable use ``profiler.session.step_config``: for a rewritten step the project's
session configuration (Grappler at TF's defaults without CSE and the dependency optimizer),
under which a rematerialized step keeps its clones and ordering edges; for a step no pass
changed, TF's defaults, as the user's own ``tf.function`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as eager_context

from graphfit.errors import GraphfitError
from graphfit.models.graph_item import GraphItem
from graphfit.profiler.grouped_convolutions import use_depthwise_kernels
from graphfit.profiler.inline_functions import inline_functions
from graphfit.profiler.session import step_config
from graphfit.profiler.sum_groups import regroup_sums
from graphfit.profiler.tf_import import step_operations
from graphfit.profiler.unroll_loops import LoopUnrollError, unroll_loops

__all__ = ["BACKWARD_SCOPE", "FunctionItem", "FunctionItemError", "classifier_train_step",
           "graph_item_from_function", "to_callable", "on_variable_copies",
           "gradient_tensors"]

# A name scope of the backward pass: tf.GradientTape names it ``gradient_tape``,
# tf.gradients ``gradients``; later ones in the same graph get a ``_N`` suffix.
BACKWARD_SCOPE = re.compile(r"(^|/)(gradient_tape|gradients)(_\d+)?/")
# tf.GradientTape sums the gradients of a tensor with several readers with AddN ops created in
# the caller's name scope, outside ``gradient_tape/``.
_GRADIENT_AGGREGATION_OP_TYPES = frozenset({"AddN"})


class FunctionItemError(GraphfitError, ValueError):
    """A ``tf.function`` step cannot become a ``GraphItem``, or an item cannot run as one."""


@dataclasses.dataclass
class FunctionItem(GraphItem):
    """A ``GraphItem`` traced from a ``tf.function`` step, with what maps it back to the
    user's objects.

    Attributes (besides ``GraphItem``'s):
        data_inputs: the step's data placeholders (``"name:0"``), in call order.
        captures: placeholder tensor name of each captured input (``"name:0"``; a
            ``VarHandleOp`` or ``Const`` of the same name in ``graph``) -> the captured eager
            tensor (a variable's handle, or a captured constant).
        input_signature: the traced function's flattened ``structured_input_signature``:
            ``tf.TensorSpec`` where an argument is a data input, the traced Python value
            elsewhere.
    """

    data_inputs: list[str] = dataclasses.field(default_factory=list)
    captures: dict[str, Any] = dataclasses.field(default_factory=dict)
    input_signature: list[Any] = dataclasses.field(default_factory=list)


def _check_no_functions(graph_def: tf.compat.v1.GraphDef) -> None:
    """Refuse a graph that calls functions: their bodies are invisible to the passes."""
    library = {f.signature.name for f in graph_def.library.function}
    calls = [f"{node.name} ({node.op})" for node in graph_def.node
             if node.op in library or any(value.HasField("func") or value.list.func
                                          for value in node.attr.values())]
    if calls:
        shown = ", ".join(calls[:5]) + (f" and {len(calls) - 5} more" if len(calls) > 5 else "")
        raise FunctionItemError(
            f"the traced step calls nested functions: {shown}. Their bodies are opaque to "
            "the profile, rematerialization and placement passes; inline them (call the "
            "inner code directly instead of through a nested tf.function, avoid "
            "jit_compile and tf.cond with tensor predicates in the step)")


def _loss_tensor(concrete: Any) -> tf.Tensor:
    """The traced step's loss: its one scalar float output (or the ``"loss"`` entry)."""
    outputs = concrete.structured_outputs
    if isinstance(outputs, Mapping) and "loss" in outputs:
        outputs = outputs["loss"]
    if not isinstance(outputs, tf.Tensor) or not outputs.dtype.is_floating \
            or outputs.shape.rank not in (0, None):
        raise FunctionItemError(
            f"the training step must return its loss (one scalar float tensor, or a dict "
            f"with a 'loss' entry); it returned {outputs!r}. Add `return loss` to the step")
    return outputs


def _variables_by_handle(concrete: Any) -> dict[int, tf.Variable]:
    return {id(v.handle): v for v in concrete.graph.variables}


def _replace_captures(graph_def: tf.compat.v1.GraphDef, captures: dict[str, Any],
                      variables: dict[int, tf.Variable]) -> dict[str, np.ndarray]:
    """Turn each captured placeholder into a ``VarHandleOp`` (variables) or ``Const`` in
    place; returns variable handle tensor name -> its current value."""
    nodes = {node.name: node for node in graph_def.node}
    values = {}
    for name, captured in captures.items():
        node = nodes[name.split(":")[0]]
        if captured.dtype == tf.resource:
            variable = variables.get(id(captured))
            if variable is None:
                raise FunctionItemError(
                    f"the step captures a resource that is not a tf.Variable at "
                    f"{node.name!r}: only variables (and constant tensors) can be captured")
            values[name] = variable.numpy()
            node.op = "VarHandleOp"
            node.ClearField("attr")
            node.attr["dtype"].type = variable.dtype.as_datatype_enum
            node.attr["shape"].shape.CopyFrom(variable.shape.as_proto())
            # Deterministic and unique within the graph: the node's own name.
            node.attr["shared_name"].s = node.name.encode()
            node.attr["container"].s = b""
        else:
            node.op = "Const"
            node.ClearField("attr")
            node.attr["dtype"].type = captured.dtype.as_datatype_enum
            node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(captured.numpy()))
    return values


def _captures_first(graph_def: tf.compat.v1.GraphDef, captures: dict[str, Any]) -> None:
    """Move the captured inputs' nodes to the front of the graph, as variables are in a v1
    graph. Tracing creates a capture where the step first uses it (Keras's optimizer step
    counter comes after the backward pass); graph order breaks ties of the IR's topological
    ids, and a rewrite that pins nodes after a recomputation in id order would otherwise make
    a variable handle, and with it the initialiser, wait for the step."""
    first = {name.split(":")[0] for name in captures}
    nodes = sorted(graph_def.node, key=lambda node: node.name not in first)
    del graph_def.node[:]
    graph_def.node.extend(nodes)


def gradient_tensors(graph: tf.Graph) -> list[str]:
    """The gradient tensors of a traced step, by the rule of the module docstring.

    Parameters:
        graph: the step's graph (a traced function graph or an item's graph).

    Returns:
        Tensor names (``"op:port"``): tensors made by the backward pass (ops under a
        ``gradient_tape``/``gradients`` scope, and the ``AddN`` ops the tape adds outside its
        scope to sum the gradients of a tensor read twice) that an op outside the backward
        pass reads, ordered by their first such reader.

    Raises:
        FunctionItemError: no such tensor (the step computes no gradients, or names them
            otherwise).
    """
    operations = graph.get_operations()      # creation order: topological
    backward: set[str] = set()
    first_reader: dict[str, tuple[int, int]] = {}
    for position, op in enumerate(operations):
        made_by_backward = [t.op.name in backward for t in op.inputs]
        if BACKWARD_SCOPE.search(op.name) or (
                op.type in _GRADIENT_AGGREGATION_OP_TYPES and all(made_by_backward)):
            backward.add(op.name)
            continue
        for k, (tensor, is_gradient) in enumerate(zip(op.inputs, made_by_backward)):
            if is_gradient:
                first_reader[tensor.name] = min(first_reader.get(tensor.name, (position, k)),
                                                (position, k))
    if not first_reader:
        raise FunctionItemError(
            "found no gradients: no tensor made under a 'gradient_tape/' or 'gradients/' "
            "name scope is read outside it. Compute gradients in the step with "
            "tf.GradientTape (or tf.gradients) and apply them there")
    return sorted(first_reader, key=first_reader.get)


def classifier_train_step(model: Any, optimizer: Any, loss_as_dict: bool = False) -> Any:
    """The training step a Keras 3 user writes for a classifier with logits out: a
    ``tf.function`` of ``(x, y)`` (integer labels) that takes the sparse cross-entropy under a
    ``GradientTape``, applies the gradients with ``optimizer`` and returns the loss (or
    ``{"loss": loss}``). One definition for the benchmarks and tests that trace such steps."""
    import keras

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return {"loss": loss} if loss_as_dict else loss

    return train_step


def graph_item_from_function(fn: Any, *args: Any, name: str = "function") -> FunctionItem:
    """Trace ``fn(*args)`` and return its step as a self-contained ``FunctionItem``.

    Parameters:
        fn: a ``tf.function`` training step that returns its loss (see the module docstring).
        *args: a batch, as the step is called (numpy arrays or tensors; Python values are
            traced as constants). It becomes the item's feeds.
        name: the item's name, for reports.

    Returns:
        A ``FunctionItem`` whose graph keeps every node name of the traced graph; variables
        are ``VarHandleOp`` nodes initialised (``init_op``) to their values at this call.

    Raises:
        FunctionItemError: ``fn`` is no ``tf.function``, returns no loss, computes no
            gradients, runs a loop that cannot be unrolled, calls other nested functions, or
            captures a resource that is no variable.

    References:
        DESIGN.md §8 (what a traced Keras 3 step looks like).
    """
    if not hasattr(fn, "get_concrete_function"):
        raise FunctionItemError(
            f"{fn!r} is not a tf.function: decorate the training step with @tf.function")
    concrete = fn.get_concrete_function(*args)
    graph_def = concrete.graph.as_graph_def()
    kept = {t.op.name for t in [*concrete.inputs, *concrete.outputs]} | \
        {op.name for op in concrete.graph.control_outputs}
    graph_def, inlined = inline_functions(graph_def)
    try:
        graph_def, unrolled = unroll_loops(graph_def, keep=kept)
    except LoopUnrollError as error:
        raise FunctionItemError(str(error)) from None
    _check_no_functions(graph_def)
    loss = _loss_tensor(concrete)
    num_data = len(concrete.inputs) - len(concrete.captured_inputs)
    data_inputs = [t.name for t in concrete.inputs[:num_data]]
    if any(t.dtype == tf.resource for t in concrete.inputs[:num_data]):
        raise FunctionItemError("pass variables to the step by closure, not as arguments")
    captures = {t.name: c for t, c in zip(concrete.inputs[num_data:], concrete.captured_inputs)}
    values = _replace_captures(graph_def, captures, _variables_by_handle(concrete))
    _captures_first(graph_def, captures)
    graph_def, depthwise = use_depthwise_kernels(graph_def)     # needs the variables' shapes

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
        gradients = gradient_tensors(graph)
        with tf.name_scope("function_item"):
            initial_values = {handle: tf.compat.v1.placeholder(value.dtype, value.shape)
                              for handle, value in values.items()}
            assigns = [tf.raw_ops.AssignVariableOp(resource=graph.get_tensor_by_name(handle),
                                                   value=initial)
                       for handle, initial in initial_values.items()]
            init_op = tf.group(*assigns, name="init")
            train_op = tf.group(*[graph.get_operation_by_name(op.name)
                                  for op in concrete.graph.control_outputs], name="train_op")
    signature = tf.nest.flatten(concrete.structured_input_signature)
    feeds = {tensor_name: np.asarray(value)
             for tensor_name, value in zip(data_inputs, _data_values(signature, args))}
    item = FunctionItem(graph=graph, train_op=train_op.name, loss=loss.name,
                        gradients=gradients, init_op=init_op.name, feeds=feeds, name=name,
                        init_feeds={initial_values[handle].name: value
                                    for handle, value in values.items()},
                        config={"source": "tf.function",
                                "function": getattr(fn, "__name__", str(fn)),
                                "unrolled_loops": unrolled.trip_counts,
                                "inlined_calls": inlined, "depthwise_kernels": depthwise},
                        data_inputs=data_inputs, captures=captures, input_signature=signature)
    # The sums as TF's function runtime makes them, before any pass can change them.
    return regroup_sums(item)[0]


def _data_values(signature: list[Any], args: tuple) -> list[Any]:
    """The arguments that are data inputs of the traced step, in input order (``signature``:
    the flattened ``structured_input_signature`` of a step traced without keyword
    arguments)."""
    flat = tf.nest.flatten((args, {}))
    if len(flat) != len(signature):
        raise FunctionItemError(
            f"the step was traced with {len(signature)} flattened arguments, got "
            f"{len(flat)}: call it with the structure it was traced with")
    for k, (value, spec) in enumerate(zip(flat, signature)):
        shape = tf.TensorShape(getattr(value, "shape", np.shape(value)))
        if isinstance(spec, tf.TensorSpec) and not spec.shape.is_compatible_with(shape):
            raise FunctionItemError(
                f"argument {k} has shape {shape} but the step was traced for shape "
                f"{spec.shape} ({spec.dtype.name}): the optimized graph keeps the traced "
                "shapes; trace and optimize the step again for this shape")
    return [value for value, spec in zip(flat, signature) if isinstance(spec, tf.TensorSpec)]


@contextlib.contextmanager
def _function_options(config: tf.compat.v1.ConfigProto) -> Iterator[None]:
    """Run eager function calls with ``config`` (``profiler.session.step_config`` of the
    step: the project's when a pass rewrote it, TF's defaults otherwise)."""
    ctx = eager_context.context()
    previous = ctx.function_call_options
    options = eager_context.FunctionCallOptions(
        executor_type=previous.executor_type, config_proto=config)
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = previous


def to_callable(item: GraphItem, original: FunctionItem | None = None
                ) -> Callable[..., tf.Tensor]:
    """A TF2 callable that runs ``item``'s step on the user's real variables.

    Parameters:
        item: the step, e.g. ``original`` rewritten by a pass (it must keep the names of the
            data placeholders and variable handles, as the project's passes do).
        original: the ``FunctionItem`` the step came from; ``None`` when ``item`` is one
            (passes that use ``GraphItem.with_graph`` keep its fields).

    Returns:
        ``step(*args) -> loss``: called like the traced ``tf.function`` (same argument
        structure and tensor shapes: the graph was traced for one batch shape), it runs
        ``item``'s train op and returns the loss tensor, updating the captured variables (the
        Keras model and optimizer) in place.

    Raises:
        FunctionItemError: no ``FunctionItem`` to map back to, or ``item`` lost one of its
            data placeholders or variable handles.

    References:
        DESIGN.md §8 (``wrap_function`` + ``import_graph_def`` with an ``input_map``).
    """
    source = original if original is not None else item
    wrapped, config = _imported_step(item, source)

    def step(*args: Any) -> tf.Tensor:
        return _call(wrapped, config, _data_values(source.input_signature, args), [])

    return step


def _imported_step(item: GraphItem, source: GraphItem | None
                   ) -> tuple[Callable[..., tf.Tensor], tf.compat.v1.ConfigProto]:
    """``to_callable``'s work: ``item``'s step imported into a function of the data inputs
    on ``source``'s captured variables, and the configuration to call it with."""
    if not isinstance(source, FunctionItem):
        raise FunctionItemError(
            "to_callable needs the FunctionItem the step was traced from: pass it as "
            "`original` (made by graph_item_from_function)")
    graph = item.graph
    op_names = {op.name for op in graph.get_operations()}
    missing = [name for name in [*source.data_inputs, *source.captures]
               if name.split(":")[0] not in op_names]
    if missing:
        raise FunctionItemError(
            f"the step lost inputs of the traced function: {missing}; passes must keep the "
            "names of data placeholders and variable handles")
    step_ops = step_operations(graph, [item.train_op, item.loss])
    kept = {op.name for op in step_ops}
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    graph_def.node.extend(node for node in graph.as_graph_def().node if node.name in kept)
    data_specs = [tf.TensorSpec.from_tensor(graph.get_tensor_by_name(name))
                  for name in source.data_inputs]

    def import_step(*data: tf.Tensor) -> tf.Tensor:
        func_graph = tf.compat.v1.get_default_graph()
        input_map = {name: func_graph.capture(handle)
                     for name, handle in source.captures.items() if name.split(":")[0] in kept}
        input_map.update((name, tensor) for name, tensor in zip(source.data_inputs, data)
                         if name.split(":")[0] in kept)
        # A pass may order an op after a data input (remat.rewrite holds a floating event
        # for every producer it reads): without this remap the imported placeholder would
        # have to run, fed by nothing.
        input_map.update({f"^{name.split(':')[0]}": tensor
                          for name, tensor in list(input_map.items())})
        loss, train_op = tf.compat.v1.import_graph_def(
            graph_def, input_map=input_map, return_elements=[item.loss, item.train_op],
            name=source.name or "step")
        with tf.control_dependencies([train_op]):
            return tf.identity(loss)

    return tf.compat.v1.wrap_function(import_step, data_specs), step_config(item)


def on_variable_copies(item: GraphItem, original: FunctionItem) -> Callable[[], tf.Tensor]:
    """A call of ``item``'s step as ``to_callable(item, original)`` runs it (the same imported
    function and configuration) on ``original``'s traced batch and on new variables holding
    the current values of the user's: the user's call of the step, without training the
    user's model. ``remat.measure`` reads TF's allocator over such calls: the same rewritten
    step reads differently run in a session and called so. The copies live as long as the
    returned call."""
    copies = {}
    for name, captured in original.captures.items():
        if captured.dtype == tf.resource:
            dtype = original.graph.get_operation_by_name(name.split(":")[0]).get_attr("dtype")
            with tf.device(captured.device):
                copies[name] = tf.Variable(tf.raw_ops.ReadVariableOp(resource=captured,
                                                                     dtype=dtype))
    wrapped, config = _imported_step(item, dataclasses.replace(original, captures={
        name: copies[name].handle if name in copies else captured
        for name, captured in original.captures.items()}))
    return functools.partial(_call, wrapped, config,
                             [item.feeds[name] for name in original.data_inputs],
                             list(copies.values()))


def _call(wrapped: Callable[..., tf.Tensor], config: tf.compat.v1.ConfigProto, data: list,
          variables: list[tf.Variable]) -> tf.Tensor:
    """One call of ``wrapped`` on ``data`` under ``config``. ``variables`` are the ones it runs
    on: held by the partial call, they live as long as it (a variable's resource is destroyed
    with its last Python reference, whatever handles a function captured)."""
    del variables
    with _function_options(config):
        return wrapped(*data)
