"""Unroll TF2 ``While`` loops whose trip count is known when the step is traced.

A traced Keras 3 step with an RNN layer (``LSTM``, ``GRU``, ``SimpleRNN`` with Keras's default
``unroll=False``) holds a forward ``While`` and, under ``GradientTape``, a gradient
``StatelessWhile`` whose cond and body live in the GraphDef's function library. Their bodies are
opaque to profiling, rematerialization and placement, and the forward loop hands every
per-step intermediate to the gradient loop through TensorList accumulators
(``TensorListPushBack`` forward, ``TensorListPopBack`` backward): one variant tensor that pins
all of them for the whole backward pass. This pass (GraphDef in, GraphDef out) rewrites each
such loop into straight-line ops:

- **Trip count.** The loop variables the condition reads are folded as constants (small
  integer and boolean tensors, numpy over a whitelist of ops: counters, ``Less``,
  ``LogicalAnd``, ``Max`` over constants, ...) from their initial values and the body's
  updates, iteration by iteration; a gradient loop's bound is the forward loop's final counter,
  known once that loop is unrolled. A condition that cannot be folded (a bound computed from
  data) is refused with the node it depends on.
- **Body copies.** Iteration ``i`` of loop ``W`` copies the body's nodes as
  ``W/iteration_i/<name>`` (the body node's name without the scope it shares with ``W``), with
  each loop variable threaded from the previous copy. Loop-invariant nodes (constants, reads of
  variables the loop does not write, what is computed from them only) are copied once as
  ``W/invariant/<name>``. Integer bookkeeping (counters, indices) becomes constants.
- **TensorLists become tensors.** A list entering the loop is tracked symbolically (its base
  tensor plus the pushes and constant-index sets done to it), through later loops too: a pop
  or get returns the pushed/set tensor directly, a get from ``TensorListFromTensor(x)`` becomes
  a ``GatherV2`` of ``x``, and ``TensorListStack`` of a list whose every element is known
  becomes a ``Pack``. A list read any other way is built for real from its base
  (``TensorListPushBack``/``TensorListSetItem`` chains), so the result is always correct.
- **Names of the loop.** Consumers of ``W:k`` read the final value of loop variable ``k``;
  when ``W`` is a control input or a kept node, a ``NoOp`` named ``W`` waits for every copy
  of a stateful op (variable reads) and every final value, so ordering edges to the loop
  still mean "after the loop".
- **Sums from zero.** An ``AddN`` that adds an all-zero tensor (``Fill`` of 0,
  ``ZerosLike``: a gradient loop's initial running sums, the gradients of unused step
  outputs) drops it, so no zeros wait in memory from the step's start for the first add.
- **Order.** Copies of iteration ``i`` that read nothing of the iteration but constants wait
  (control edges) for the results of iteration ``i - 1`` (the first iteration for the loop's
  own control inputs): TF runs the steps in order, as the loop did, rather than every step's
  input projection ahead in an order that changes from run to run.

Refused (``LoopUnrollError``, naming the loop and what to change): an unknown trip count,
more than ``MAX_ITERATIONS`` iterations, bodies with stateful ops other than variable reads
(random ops, assignments: their order and draws would change), nested loops or function
calls inside a body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework import function_def_to_graph, op_def_registry

from graphfit.errors import GraphfitError

__all__ = ["LoopUnrollError", "MAX_ITERATIONS", "UnrollReport", "unroll_loops"]

MAX_ITERATIONS = 4096          # beyond this the unrolled step would be unreasonably large
_LOOP_OPS = frozenset({"While", "StatelessWhile"})
_SAFE_STATEFUL_OPS = frozenset({"ReadVariableOp"})       # hoisted: the loop writes nothing
_MAX_FOLDED_ELEMENTS = 64
_BINARY = {"Add": np.add, "AddV2": np.add, "Sub": np.subtract, "Mul": np.multiply,
           "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Maximum": np.maximum,
           "Minimum": np.minimum, "Less": np.less, "LessEqual": np.less_equal,
           "Greater": np.greater, "GreaterEqual": np.greater_equal, "Equal": np.equal,
           "NotEqual": np.not_equal, "LogicalAnd": np.logical_and,
           "LogicalOr": np.logical_or}
_REDUCTIONS = {"Max": np.max, "Min": np.min, "Sum": np.sum, "Prod": np.prod}


class LoopUnrollError(GraphfitError, ValueError):
    """A loop of the step cannot be unrolled; the message says which and what to change."""


def _split(tensor: str) -> tuple[str, int]:
    name, _, port = tensor.partition(":")
    return name, int(port) if port else 0


def _tensor(node: str, port: int) -> str:
    return node if port == 0 else f"{node}:{port}"


def _data_inputs(node: node_def_pb2.NodeDef) -> list[str]:
    return [i for i in node.input if not i.startswith("^")]


def _control_inputs(node: node_def_pb2.NodeDef) -> list[str]:
    return [i[1:] for i in node.input if i.startswith("^")]


def _is_stateful(op_type: str) -> bool:
    op_def = op_def_registry.get(op_type)
    return op_def is None or op_def.is_stateful


def _topological(nodes: list[node_def_pb2.NodeDef]) -> list[node_def_pb2.NodeDef]:
    """``nodes`` in an order where every node follows its (data and control) inputs; ties
    keep the given order."""
    by_name = {node.name: node for node in nodes}
    done: set[str] = set()
    ordered = []
    for root in nodes:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node.name in done:
                continue
            if expanded:
                done.add(node.name)
                ordered.append(node)
                continue
            stack.append((node, True))
            for name in reversed([_split(i.lstrip("^"))[0] for i in node.input]):
                if name in by_name and name not in done:
                    stack.append((by_name[name], False))
    return ordered


class _StaticValues:
    """Values of small integer and boolean tensors computable when the step is traced
    (constant folding over ``_BINARY``, ``_REDUCTIONS`` and a few more ops). Tensors are named
    ``"node:port"``; ``unknown_path`` explains a failed lookup."""

    def __init__(self, nodes: Mapping[str, node_def_pb2.NodeDef],
                 known: Mapping[str, np.ndarray | None]):
        self._nodes = nodes
        self._known = dict(known)
        self._unknown_input: dict[str, str] = {}     # node -> its first input not known

    def know(self, tensor: str, value: np.ndarray | None) -> None:
        self._known[_full(tensor)] = value

    def value(self, tensor: str) -> np.ndarray | None:
        key = _full(tensor)
        if key not in self._known:
            self._known[key] = self._fold(*_split(key))
        return self._known[key]

    def _fold(self, name: str, port: int) -> np.ndarray | None:
        node = self._nodes.get(name)
        if node is None or port != 0:
            return None
        if node.op == "Const":
            value = tf.make_ndarray(node.attr["value"].tensor)
            return value if _foldable(value) else None
        inputs = [self.value(i) for i in _data_inputs(node)]
        if any(x is None for x in inputs):
            self._unknown_input[name] = next(_split(i)[0] for i, x in
                                             zip(_data_inputs(node), inputs) if x is None)
            return None
        try:
            value = self._apply(node, inputs)
        except (ValueError, TypeError, IndexError):
            value = None
        return value if value is not None and _foldable(value) else None

    def unknown_path(self, tensor: str) -> list[str]:
        """The nodes from ``tensor``'s producer down to the first one that is not known."""
        path = [_split(tensor)[0]]
        while path[-1] in self._unknown_input and len(path) <= len(self._nodes):
            path.append(self._unknown_input[path[-1]])
        return path

    @staticmethod
    def _apply(node: node_def_pb2.NodeDef, x: list[np.ndarray]) -> np.ndarray | None:
        if node.op in ("Identity", "StopGradient"):
            return x[0]
        if node.op in _BINARY:
            return np.asarray(_BINARY[node.op](x[0], x[1]))
        if node.op == "LogicalNot":
            return np.logical_not(x[0])
        if node.op == "Neg":
            return np.negative(x[0])
        if node.op in _REDUCTIONS:
            axes = tuple(np.atleast_1d(x[1]).tolist())
            return np.asarray(_REDUCTIONS[node.op](x[0], axis=axes,
                                                   keepdims=node.attr["keep_dims"].b))
        if node.op == "Range":
            return np.arange(x[0], x[1], x[2], dtype=x[0].dtype)
        if node.op == "Cast":
            return x[0].astype(tf.as_dtype(node.attr["DstT"].type).as_numpy_dtype)
        return None


def _foldable(value: np.ndarray) -> bool:
    return value.size <= _MAX_FOLDED_ELEMENTS and (np.issubdtype(value.dtype, np.integer)
                                                   or value.dtype == np.bool_)


def _const_node(name: str, value: np.ndarray) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


@dataclasses.dataclass(frozen=True)
class _ListValue:
    """A TensorList tracked symbolically: ``base`` (a real list tensor) after ``log``, the
    pushes ``("push", tensor)`` and constant-index sets ``("set", index, tensor)`` done to it
    since, oldest first."""

    base: str
    element_dtype: int
    log: tuple = ()

    def push(self, tensor: str) -> _ListValue:
        return dataclasses.replace(self, log=(*self.log, ("push", tensor)))

    def set(self, index: int, tensor: str) -> _ListValue:
        return dataclasses.replace(self, log=(*self.log, ("set", index, tensor)))

    def top(self) -> tuple[_ListValue, str] | None:
        """(the list after a pop, the popped tensor) when the last change was a push."""
        if self.log and self.log[-1][0] == "push":
            return dataclasses.replace(self, log=self.log[:-1]), self.log[-1][1]
        return None

    def item(self, index: int) -> str | None:
        """The tensor at ``index`` when a set since ``base`` wrote it (no push since)."""
        for entry in reversed(self.log):
            if entry[0] == "push":
                return None
            if entry[1] == index:
                return entry[2]
        return None


_Value = str | _ListValue        # a tensor name of the output graph, or a tracked list


@dataclasses.dataclass
class _Loop:
    """One ``While`` node with its cond and body as plain GraphDefs."""

    node: node_def_pb2.NodeDef
    cond_args: list[str]
    cond_nodes: dict[str, node_def_pb2.NodeDef]
    cond_result: str
    body_args: list[str]
    body_nodes: list[node_def_pb2.NodeDef]          # topological
    body_results: list[str]


def _function_graph(fdef) -> tuple[list[str], list[node_def_pb2.NodeDef], list[str]]:
    """A ``FunctionDef`` as (argument names, nodes, result tensors ``"node:port"``)."""
    graph_def, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    args = [arg.name for arg in fdef.signature.input_arg]
    results = [flat.get(fdef.ret[arg.name], fdef.ret[arg.name])
               for arg in fdef.signature.output_arg]
    results = [r if ":" in r else f"{r}:0" for r in results]
    arg_set = set(args)
    nodes = [node for node in graph_def.node if node.name not in arg_set]
    return args, nodes, results


def _loop(node: node_def_pb2.NodeDef, library: Mapping[str, object]) -> _Loop:
    cond_args, cond_nodes, cond_results = _function_graph(library[node.attr["cond"].func.name])
    body_args, body_nodes, body_results = _function_graph(library[node.attr["body"].func.name])
    for body_node in [*cond_nodes, *body_nodes]:
        if body_node.op in _LOOP_OPS or body_node.op in library \
                or _called_functions(body_node):
            raise LoopUnrollError(
                f"cannot unroll the loop {node.name} ({node.op}): its body calls "
                f"{body_node.name} ({body_node.op}), a nested loop or function. Unroll the "
                "inner loop in the model (unroll=True on a Keras RNN layer) or call the inner "
                "code directly instead of through a tf.function")
    for body_node in body_nodes:
        if _is_stateful(body_node.op) and body_node.op not in _SAFE_STATEFUL_OPS:
            raise LoopUnrollError(
                f"cannot unroll the loop {node.name} ({node.op}): its body runs the stateful "
                f"op {body_node.name} ({body_node.op}), whose order or random draws would "
                "change. Use unroll=True on the Keras RNN layer, or move the op out of the "
                "loop (e.g. draw dropout masks before it)")
    return _Loop(node, cond_args, {n.name: n for n in cond_nodes}, cond_results[0],
                 body_args, _topological(body_nodes), body_results)


def _relative_name(loop_name: str, name: str) -> str:
    """``name`` without the name scopes it shares with the loop node's ``loop_name/``."""
    shared = 0
    for a, b in zip(f"{loop_name}/", name):
        if a != b:
            break
        shared += 1
    cut = name.rfind("/", 0, shared) + 1
    return name[cut:]


_LIST_SOURCES = frozenset({"EmptyTensorList", "TensorListReserve", "TensorListFromTensor"})


@dataclasses.dataclass
class _Copy:
    """Where the copies of one body node go: scope, the loop's device, the loop's stateful
    copies so far."""

    scope: str
    device: str
    stateful: list[str]


class _Unroller:
    """Unrolls every loop of one GraphDef, in topological order (see the module docstring)."""

    def __init__(self, graph_def: graph_pb2.GraphDef, keep: set[str]):
        self._library = {f.signature.name: f for f in graph_def.library.function}
        self._keep = keep
        self._outer = {node.name: node for node in graph_def.node}
        self._nodes: dict[str, node_def_pb2.NodeDef] = dict(self._outer)   # + emitted
        self._out: list[node_def_pb2.NodeDef] = []
        self._env: dict[str, _Value] = {}             # outer tensor "node:port" -> new value
        self._outer_static = _StaticValues(self._nodes, {})
        self._materialized: dict[tuple, str] = {}
        self.emitted: set[str] = set()
        self.unrolled: dict[str, int] = {}             # loop name -> trip count

    # ---- the outer graph ----------------------------------------------------------------
    def run(self, order: list[node_def_pb2.NodeDef]) -> list[node_def_pb2.NodeDef]:
        for node in order:
            values = [self._env.get(_full(i), _tensor(*_split(i))) for i in _data_inputs(node)]
            if node.op in _LOOP_OPS:
                self._unroll(_loop(node, self._library), values)
                continue
            if node.op == "Identity" and isinstance(values[0], _ListValue) \
                    and node.name not in self._keep:
                self._env[f"{node.name}:0"] = values[0]
                continue
            forwarded = self._forward_list_op(node, values, self._outer_static.value,
                                              node.name)
            if forwarded is not None and (node.name not in self._keep
                                          or forwarded == [node.name]):
                for port, value in enumerate(forwarded):
                    self._env[f"{node.name}:{port}"] = value
                continue
            rewritten = node_def_pb2.NodeDef()
            rewritten.CopyFrom(node)
            del rewritten.input[:]
            rewritten.input.extend([self._real(v, node.name) for v in values]
                                   + [f"^{c}" for c in _control_inputs(node)])
            self._add(rewritten)
        return self._out

    def _add(self, node: node_def_pb2.NodeDef, emitted: bool = False) -> str:
        self._nodes[node.name] = node
        self._out.append(node)
        if emitted:
            self.emitted.add(node.name)
        return node.name

    # ---- one loop -------------------------------------------------------------------------
    def _trip_count(self, loop: _Loop, initial: list[_Value]
                    ) -> tuple[list[_StaticValues], list[np.ndarray | None]]:
        """Fold the condition iteration by iteration; returns the body's static values per
        iteration and the loop variables' static values at exit."""
        static = [self._outer_static.value(v) if isinstance(v, str) else None for v in initial]
        body_nodes = {n.name: n for n in loop.body_nodes}
        iterations: list[_StaticValues] = []
        while True:
            cond = _StaticValues(loop.cond_nodes, dict(zip(
                (f"{a}:0" for a in loop.cond_args), static)))
            go = cond.value(loop.cond_result)
            if go is None:
                raise LoopUnrollError(self._unknown_trip_count(loop, cond, initial))
            if not bool(go):
                return iterations, static
            if len(iterations) == MAX_ITERATIONS:
                raise LoopUnrollError(
                    f"cannot unroll the loop {loop.node.name}: it runs more than "
                    f"{MAX_ITERATIONS} iterations. Shorten the sequence or split it")
            body = _StaticValues(body_nodes, dict(zip((f"{a}:0" for a in loop.body_args),
                                                      static)))
            iterations.append(body)
            static = [body.value(r) for r in loop.body_results]

    def _unknown_trip_count(self, loop: _Loop, cond: _StaticValues,
                            initial: list[_Value]) -> str:
        path = cond.unknown_path(loop.cond_result)
        shown = [f"{n} ({loop.cond_nodes[n].op})" for n in path if n in loop.cond_nodes
                 and loop.cond_nodes[n].op not in ("Identity", "Placeholder")]
        cause = " <- ".join(shown) or "its result"
        if path[-1] in loop.cond_args:
            start = initial[loop.cond_args.index(path[-1])]
            origin = _StaticValues(self._nodes, {})
            if isinstance(start, str) and origin.value(start) is None:
                first = origin.unknown_path(start)[-1]
                start = f"{start} ({self._nodes[first].op})" if first == _split(start)[0] \
                    else f"{start}, computed from {first} ({self._nodes[first].op})"
            cause += f" <- a loop variable that starts as {start}"
        return (f"cannot unroll the loop {loop.node.name} ({loop.node.op}): its trip count is "
                f"not known when the step is traced (the condition depends on {cause}, "
                "known only when the step runs). Give the loop a fixed length: for a Keras "
                "RNN layer, a fixed sequence length (keras.Input with a static time "
                "dimension) or unroll=True; for tf.while_loop, a bound from Python numbers or "
                "static shapes")

    def _unroll(self, loop: _Loop, initial: list[_Value]) -> None:
        name = loop.node.name
        iterations, final_static = self._trip_count(loop, initial)
        invariant = _invariant_nodes(loop)
        roots_control = [f"^{c}" for c in _control_inputs(loop.node)]
        stateful: list[str] = []
        env: dict[str, _Value] = {}
        values = [self._as_list(v) for v in initial]
        history: list[list[_Value]] = []
        first_copy = len(self._out)
        for i, static in enumerate(iterations):
            env = {k: v for k, v in env.items() if _split(k)[0] in invariant}
            env.update((f"{arg}:0", value) for arg, value in zip(loop.body_args, values))
            for node in loop.body_nodes:
                if node.name in invariant and i > 0:
                    continue
                scope = f"{name}/invariant" if node.name in invariant \
                    else f"{name}/iteration_{i}"
                self._copy_body_node(node, env, static, _relative_name(name, node.name),
                                     _Copy(scope, loop.node.device, stateful))
            self._order_after(first_copy, roots_control if i == 0 else [
                f"^{_split(v)[0]}" for v in values if isinstance(v, str)
                and _split(v)[0] in self.emitted and self._nodes[_split(v)[0]].op != "Const"])
            first_copy = len(self._out)
            values = [env[_full(r)] for r in loop.body_results]
            history.append(values)
        for sums in zip(*history):
            self._keep_running_sum_apart(list(sums))
        for port, (value, known) in enumerate(zip(values, final_static)):
            self._env[f"{name}:{port}"] = value
            self._outer_static.know(f"{name}:{port}", known)
        if name in self._keep or any(f"^{name}" in n.input for n in self._outer.values()):
            barrier = node_def_pb2.NodeDef(name=name, op="NoOp")
            finals = [_split(v)[0] for v in values
                      if isinstance(v, str) and _split(v)[0] in self.emitted]
            barrier.input.extend(f"^{n}" for n in dict.fromkeys([*stateful, *finals]))
            barrier.input.extend(roots_control)
            self._add(barrier)
        self.unrolled[name] = len(iterations)

    def _order_after(self, first: int, controls: list[str]) -> None:
        """Control inputs ``controls`` for the copies from ``self._out[first:]`` (one iteration)
        that read nothing else of the iteration but constants: the loop's own control inputs
        for the first iteration, the previous iteration's results for the others. The
        executor then runs iteration ``i`` after ``i - 1`` as the loop did, instead of running
        every step's input projection ahead, in an order that changes from run to run and
        that the profile and the plan did not see."""
        if not controls:
            return
        copies = self._out[first:]
        inner = {node.name for node in copies if node.op != "Const"}
        for node in copies:
            if node.op != "Const" and not any(_split(i.lstrip("^"))[0] in inner
                                              for i in node.input):
                node.input.extend(c for c in dict.fromkeys(controls) if c not in node.input)

    def _keep_running_sum_apart(self, sums: list[_Value]) -> None:
        """A loop variable that adds one contribution per iteration (a gradient loop's weight
        gradient) unrolls into a chain of adds, which Grappler's arithmetic optimizer would
        fold into one ``AddN`` of every contribution when the step runs. A control edge from
        each earlier sum to the last add, as ``remat.grad_accumulation`` gives its chains,
        keeps the adds apart (Grappler leaves an add that drives a control edge alone); it
        orders nothing the data edges do not."""
        if len(sums) < 3 or not all(isinstance(v, str) for v in sums):
            return
        adds = [self._nodes.get(_split(v)[0]) for v in sums]
        if not all(add is not None and add.name in self.emitted
                   and add.op in ("AddN", "AddV2", "Add") and previous in add.input
                   for add, previous in zip(adds[1:], sums[:-1])):
            return
        adds[-1].input.extend(f"^{add.name}" for add in adds[:-2])

    def _as_list(self, value: _Value) -> _Value:
        """A list made outside the loop enters it tracked."""
        producer = self._nodes.get(_split(value)[0]) if isinstance(value, str) else None
        if producer is not None and producer.op in _LIST_SOURCES:
            return _ListValue(value, producer.attr["element_dtype"].type)
        return value

    def _copy_body_node(self, node: node_def_pb2.NodeDef, env: dict[str, _Value],
                        static: _StaticValues, relative: str, where: _Copy) -> None:
        values = [env[_full(i)] for i in _data_inputs(node)]
        new_name = f"{where.scope}/{relative}"

        def bind(outputs: list[_Value]) -> None:
            for port, value in enumerate(outputs):
                env[f"{node.name}:{port}"] = value

        if node.op == "Identity":
            bind(values)
            return
        forwarded = self._forward_list_op(node, values, lambda t: static.value(t), new_name)
        if forwarded is not None:
            bind(forwarded)
            return
        folded = None if node.op == "Const" or _is_stateful(node.op) else \
            static.value(f"{node.name}:0")
        if folded is not None:
            bind([self._add(_const_node(new_name, folded), emitted=True)])
            return
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(node)
        copy.name = new_name
        copy.attr.pop("_class", None)       # colocation with body node names
        copy.device = copy.device or where.device
        del copy.input[:]
        copy.input.extend(self._real(v, new_name) for v in values)
        controls = [env.get(f"{c}:0") for c in _control_inputs(node)]
        copy.input.extend(dict.fromkeys(f"^{_split(c)[0]}" for c in controls
                                        if isinstance(c, str) and _split(c)[0] in self.emitted))
        self._add(copy, emitted=True)
        if _is_stateful(node.op):
            where.stateful.append(new_name)
        env[f"{node.name}:0"] = new_name           # for control inputs on output-less ops
        bind([_tensor(new_name, port) for port in range(_num_outputs(copy))])

    # ---- TensorLists --------------------------------------------------------------------
    def _forward_list_op(self, node: node_def_pb2.NodeDef, values: list[_Value],
                         static: Callable[[str], np.ndarray | None], new_name: str
                         ) -> list[_Value] | None:
        """The outputs of a TensorList op on a tracked list without running it (reads and
        ``Pack``/``GatherV2`` replacements named ``new_name``); None: it must run."""
        if not values or not isinstance(values[0], _ListValue):
            return None
        lst: _ListValue = values[0]
        if node.op == "TensorListPushBack" and isinstance(values[1], str):
            return [lst.push(values[1])]
        if node.op == "TensorListPopBack":
            top = lst.top()
            return None if top is None else [top[0], top[1]]
        if node.op == "TensorListStack":
            return self._stacked(lst, node, new_name)
        if node.op not in ("TensorListSetItem", "TensorListGetItem"):
            return None
        index = static(_data_inputs(node)[1])
        if index is None or index.size != 1:
            return None
        index = int(index)
        if node.op == "TensorListSetItem":
            if isinstance(values[2], str) and not node.attr["resize_if_index_out_of_bounds"].b:
                return [lst.set(index, values[2])]
            return None
        item = lst.item(index)
        return [item] if item is not None else self._slice_of_source(lst, index, new_name)

    def _list_source(self, lst: _ListValue, op: str) -> node_def_pb2.NodeDef | None:
        base = self._nodes.get(_split(lst.base)[0])
        return base if base is not None and base.op == op and _split(lst.base)[1] == 0 \
            else None

    def _slice_of_source(self, lst: _ListValue, index: int, new_name: str
                         ) -> list[_Value] | None:
        """Element ``index`` of ``TensorListFromTensor(x)`` (nothing pushed since) as
        ``GatherV2(x, index)``: a buffer of its own, which the planner can free and recompute
        (a ``StridedSlice`` view would keep, and be profiled as, all of ``x``)."""
        source = self._list_source(lst, "TensorListFromTensor")
        if source is None or any(entry[0] == "push" for entry in lst.log):
            return None
        position, axis = (self._add(_const_node(f"{new_name}/{part}", np.array(v, np.int32)),
                                    emitted=True)
                          for part, v in (("index", index), ("axis", 0)))
        node = node_def_pb2.NodeDef(name=new_name, op="GatherV2",
                                    input=[source.input[0], position, axis])
        node.attr["Tparams"].type = lst.element_dtype
        node.attr["Tindices"].type = tf.int32.as_datatype_enum
        node.attr["Taxis"].type = tf.int32.as_datatype_enum
        node.attr["batch_dims"].i = 0
        return [self._add(node, emitted=True)]

    def _stacked(self, lst: _ListValue, node: node_def_pb2.NodeDef, new_name: str
                 ) -> list[_Value] | None:
        """``TensorListStack`` of a list whose elements are all known, as a ``Pack``."""
        reserve = self._list_source(lst, "TensorListReserve")
        if reserve is not None and all(entry[0] == "set" for entry in lst.log):
            size = self._outer_static.value(reserve.input[1])
            items = [lst.item(i) for i in range(int(size))] if size is not None else []
        elif self._list_source(lst, "EmptyTensorList") is not None \
                and all(entry[0] == "push" for entry in lst.log):
            items = [entry[1] for entry in lst.log]
        else:
            return None
        if not items or any(item is None for item in items):
            return None
        pack = node_def_pb2.NodeDef(name=new_name, op="Pack", input=[
            *items, *(i for i in node.input if i.startswith("^"))])
        pack.attr["N"].i = len(items)
        pack.attr["T"].type = lst.element_dtype
        pack.attr["axis"].i = 0
        return [self._add(pack, emitted=True)]

    def _real(self, value: _Value, context: str) -> str:
        """A tensor name for ``value``: a tracked list is built for real from its base."""
        if isinstance(value, str):
            return value
        key = (value.base, value.log)
        if key not in self._materialized:
            current = value.base
            for k, entry in enumerate(value.log):
                name = f"{context}/list_{len(self._materialized)}_{k}"
                if entry[0] == "push":
                    node = node_def_pb2.NodeDef(name=name, op="TensorListPushBack",
                                                input=[current, entry[1]])
                else:
                    index = self._add(_const_node(f"{name}/index",
                                                  np.array(entry[1], np.int32)), emitted=True)
                    node = node_def_pb2.NodeDef(name=name, op="TensorListSetItem",
                                                input=[current, index, entry[2]])
                node.attr["element_dtype"].type = value.element_dtype
                current = self._add(node, emitted=True)
            self._materialized[key] = current
        return self._materialized[key]


def _invariant_nodes(loop: _Loop) -> set[str]:
    """Body nodes whose values are the same in every iteration: computed from constants and
    loop variables the body passes through unchanged, with no state other than reads of
    variables (which the body does not write: ``_loop`` refused it)."""
    passthrough = {f"{arg}:0" for arg, result in zip(loop.body_args, loop.body_results)
                   if result == f"{arg}:0"}
    invariant: set[str] = set()
    for node in loop.body_nodes:
        if node.op.startswith("TensorList"):
            continue
        if all(_full(i) in passthrough or _split(i)[0] in invariant
               for i in _data_inputs(node)) \
                and all(c in invariant for c in _control_inputs(node)):
            invariant.add(node.name)
    return invariant


def _full(tensor: str) -> str:
    name, port = _split(tensor)
    return f"{name}:{port}"


def _num_outputs(node: node_def_pb2.NodeDef) -> int:
    count = 0
    for arg in op_def_registry.get(node.op).output_arg:
        if arg.number_attr:
            count += node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count += len(node.attr[arg.type_list_attr].list.type)
        else:
            count += 1
    return count


def _prune(nodes: list[node_def_pb2.NodeDef], candidates: set[str], keep: set[str]
           ) -> list[node_def_pb2.NodeDef]:
    """Drop stateless ``candidates`` nothing reads any more (transitively)."""
    readers: dict[str, int] = {}
    for node in nodes:
        for i in node.input:
            name = _split(i.lstrip("^"))[0]
            readers[name] = readers.get(name, 0) + 1
    by_name = {node.name: node for node in nodes}
    dead: set[str] = set()
    stack = [n for n in candidates if n in by_name]
    while stack:
        name = stack.pop()
        node = by_name[name]
        if name in dead or name in keep or readers.get(name, 0) or _is_stateful(node.op) \
                or node.op == "Placeholder":
            continue
        dead.add(name)
        for i in node.input:
            producer = _split(i.lstrip("^"))[0]
            readers[producer] -= 1
            if producer in candidates:
                stack.append(producer)
    return [node for node in nodes if node.name not in dead]


def _zeros(nodes: list[node_def_pb2.NodeDef]) -> set[str]:
    """Nodes whose output is all zeros: ``ZerosLike``, and ``Fill`` of a constant 0."""
    by_name = {node.name: node for node in nodes}
    found = set()
    for node in nodes:
        if node.op == "ZerosLike":
            found.add(node.name)
        elif node.op == "Fill":
            value = by_name.get(_split(node.input[1])[0])
            if value is not None and value.op == "Const" and not np.any(
                    tf.make_ndarray(value.attr["value"].tensor)):
                found.add(node.name)
    return found


def _drop_zero_addends(nodes: list[node_def_pb2.NodeDef]) -> set[str]:
    """Drop, in place, the all-zero inputs of every ``AddN`` (whose inputs all have its
    shape: nothing broadcasts); an ``AddN`` left with one input becomes an ``Identity`` of it.
    Returns the zero nodes that were read.

    A gradient loop starts each weight gradient's running sum from zeros, and adds zeros for
    the gradient of every step output the loss does not read. Unrolled, the executor runs
    such a ``Fill`` as soon as the step starts (nothing orders it later) and holds it until
    the first iteration's add: on a Keras LSTM of 128 units, 320 KiB through the whole forward
    pass, 6% of the step's peak."""
    zeros = _zeros(nodes)
    dropped: set[str] = set()
    for node in nodes:
        if node.op != "AddN":
            continue
        data = _data_inputs(node)
        kept = [i for i in data if _split(i)[0] not in zeros]
        if len(kept) == len(data) or not kept:
            continue
        dropped |= {_split(i)[0] for i in data} - {_split(i)[0] for i in kept}
        controls = [i for i in node.input if i.startswith("^")]
        del node.input[:]
        node.input.extend(kept + controls)
        if len(kept) == 1:
            node.op = "Identity"
            del node.attr["N"]
        else:
            node.attr["N"].i = len(kept)
    return dropped


@dataclasses.dataclass(frozen=True)
class UnrollReport:
    """What ``unroll_loops`` did: trip count per loop, ops before and after, TensorList ops
    left (lists that had to be built for real)."""

    trip_counts: dict[str, int]
    ops_before: int
    ops_after: int
    list_ops_left: int


def unroll_loops(graph_def: graph_pb2.GraphDef, keep: Iterable[str] = ()
                 ) -> tuple[graph_pb2.GraphDef, UnrollReport]:
    """Unroll every ``While``/``StatelessWhile`` of ``graph_def`` (see the module docstring).

    Parameters:
        graph_def: a traced step (nodes in creation order, loops' functions in its library).
        keep: node names that must stay (the step's outputs and control outputs); they keep
            their names, a kept loop becomes a ``NoOp`` that waits for the unrolled loop.

    Returns:
        (the new GraphDef, an ``UnrollReport``). Without loops the input itself comes back.
        The new GraphDef has no ``While``; its library keeps only functions still called.

    Raises:
        LoopUnrollError: a loop cannot be unrolled (the message names it and what to do).
    """
    if not any(node.op in _LOOP_OPS for node in graph_def.node):
        return graph_def, UnrollReport({}, len(graph_def.node), len(graph_def.node), 0)
    keep = set(keep)
    unroller = _Unroller(graph_def, keep)
    nodes = unroller.run(_topological(list(graph_def.node)))
    read_before = {_split(i.lstrip("^"))[0] for node in graph_def.node for i in node.input}
    zeros = _drop_zero_addends(nodes)
    nodes = _prune(nodes, unroller.emitted | read_before | zeros, keep)
    names = [node.name for node in nodes]
    if len(set(names)) != len(names) or any(node.op in _LOOP_OPS for node in nodes):
        raise AssertionError("unrolling produced duplicate names or left a loop")
    result = graph_pb2.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.node.extend(nodes)
    called = {name for node in nodes for name in _called_functions(node)}
    if called:
        result.library.CopyFrom(graph_def.library)
    return result, UnrollReport(dict(unroller.unrolled), len(graph_def.node), len(nodes),
                                sum(node.op.startswith("TensorList") for node in nodes))


def _called_functions(node: node_def_pb2.NodeDef) -> list[str]:
    names = [value.func.name for value in node.attr.values() if value.HasField("func")]
    names += [f.name for value in node.attr.values() for f in value.list.func]
    return names
