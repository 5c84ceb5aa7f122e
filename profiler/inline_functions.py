"""Inline the nested function calls of a traced step, so the passes see one flat graph.

A ``tf.function`` step that calls another ``tf.function`` (a user's helper, or Keras' grouped
``Conv2D``, which runs each convolution as a nested, XLA-marked function) traces to a graph
whose ``StatefulPartitionedCall`` / ``PartitionedCall`` nodes hide their bodies in the
function library, and whose backward pass calls the gradient function the same way. Profiling,
rematerialization and placement cannot see into them. ``inline_functions`` replaces each call
by its body, as Grappler's function optimizer does when it inlines:

- a body node ``n`` becomes ``<call>/n``; the function's arguments are wired to the call's
  inputs, and every body node waits for the call's control inputs;
- a reader of ``<call>:k`` reads the body's ``k``-th result itself, so each result is ready
  as soon as the body made it, as after Grappler's inlining; the call keeps its name as a
  ``NoOp`` that waits for every body node, so readers of ``^<call>`` (the step's control
  outputs) need no rewiring and still wait for the whole body. An ``IdentityN`` of the results
  in the call's place (the first version) made every reader wait for every result: the
  backward pass of ``keras.applications.ConvNeXtTiny`` (64x64, batch 4) waited at each
  depthwise convolution for its filter gradient, the slowest op of the step, before the next
  layer's input gradient could start, and under the project's session configuration
  (Grappler's dependency optimizer off, so nothing relaxed it) the step took 1.08-1.26x the
  user's (2026-12-07, ``bench/RESULTS.md``);
- a call that reads the backward pass is the gradient of a nested function: its body and its
  ``NoOp`` go under the ``gradient_tape/`` scope, where ``profiler.tf_function`` looks for
  gradients (the tensors of that scope read outside it), and its control readers are rewired
  to it.

Calls inside bodies are inlined in turn. Other function-valued attributes (``If``/``Case``
branches, loop bodies, which ``profiler.unroll_loops`` handles) are left as they are.
"""

from __future__ import annotations

import re

from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

__all__ = ["CALL_OPS", "inline_functions"]

CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
_BACKWARD_SCOPE = re.compile(r"(^|/)(gradient_tape|gradients)(_\d+)?/")
# Inlining bodies that call functions again, a few levels deep at most (Keras nests one).
_MAX_DEPTH = 16


def _node_of(tensor: str) -> str:
    return tensor.lstrip("^").split(":")[0]


def _body(call: node_def_pb2.NodeDef, library: dict, backward: bool
          ) -> tuple[list[node_def_pb2.NodeDef], list[str]]:
    """The nodes that replace ``call`` (its function's body, renamed under the call, then the
    call itself as a ``NoOp`` that waits for the body) and the tensors of its results."""
    fdef = library[call.attr["f"].func.name]
    body, flat_name = function_def_to_graph_def(fdef)
    prefix = ("gradient_tape/" if backward and not _BACKWARD_SCOPE.search(call.name) else "") \
        + call.name + "/"
    data_inputs = [i for i in call.input if not i.startswith("^")]
    controls = [i for i in call.input if i.startswith("^")]
    args = {arg.name: data_inputs[k] for k, arg in enumerate(fdef.signature.input_arg)}

    def renamed(tensor: str) -> str:
        control, name = tensor.startswith("^"), tensor.lstrip("^")
        node, _, port = name.partition(":")
        if node in args:
            return "^" + _node_of(args[node]) if control else args[node]
        return ("^" if control else "") + prefix + node + (":" + port if port else "")

    nodes = []
    for node in body.node:
        if node.name in args:
            continue
        inlined = node_def_pb2.NodeDef()
        inlined.CopyFrom(node)
        inlined.name = prefix + node.name
        del inlined.input[:]
        inlined.input.extend([renamed(i) for i in node.input] + controls)
        colocated = inlined.attr["_class"].list.s if "_class" in inlined.attr else []
        for k, label in enumerate(colocated):
            target = label.decode().removeprefix("loc:@")
            colocated[k] = f"loc:@{_node_of(renamed(target))}".encode()
        nodes.append(inlined)
    results = []
    for arg in fdef.signature.output_arg:
        ret = fdef.ret[arg.name]
        results.append(args[ret] if ret in args else renamed(flat_name.get(ret, ret)))
    end = node_def_pb2.NodeDef(name=prefix.rstrip("/"), op="NoOp")
    end.input.extend([f"^{n.name}" for n in nodes] + controls)
    return nodes + [end], results


def _rewired(node: node_def_pb2.NodeDef, results: dict[str, list[str]], moved: dict[str, str]
             ) -> node_def_pb2.NodeDef:
    """A copy of ``node`` reading the results of inlined calls instead of the calls, and
    waiting for the moved calls under their new names."""
    def new(tensor: str) -> str:
        name = _node_of(tensor)
        if not tensor.startswith("^") and name in results:
            return results[name][int(tensor.partition(":")[2] or 0)]
        return tensor.replace(name, moved[name], 1) if name in moved else tensor

    rewired = node_def_pb2.NodeDef()
    rewired.CopyFrom(node)
    del rewired.input[:]
    rewired.input.extend(new(i) for i in node.input)
    return rewired


def inline_functions(graph_def: graph_pb2.GraphDef) -> tuple[graph_pb2.GraphDef, int]:
    """Replace every ``StatefulPartitionedCall`` / ``PartitionedCall`` of ``graph_def`` by its
    body (module docstring), until none is left.

    Parameters:
        graph_def: a traced step, its nodes in creation (topological) order.

    Returns:
        ``(the flat GraphDef, the number of calls inlined)``; ``graph_def`` itself when it
        calls no function. The library keeps only the functions still referenced.

    Raises:
        ValueError: calls nested deeper than 16 levels (a recursive function).
    """
    inlined = 0
    for _ in range(_MAX_DEPTH):
        library = {f.signature.name: f for f in graph_def.library.function}
        if not any(node.op in CALL_OPS for node in graph_def.node):
            break
        backward: set[str] = set()
        results: dict[str, list[str]] = {}   # a call's name -> the tensors of its results
        moved: dict[str, str] = {}           # a backward call's name -> its NoOp's
        nodes = []
        for node in graph_def.node:
            if any(_node_of(i) in results for i in node.input):
                node = _rewired(node, results, moved)
            reads_backward = any(_node_of(i) in backward for i in node.input
                                 if not i.startswith("^"))
            if _BACKWARD_SCOPE.search(node.name) or reads_backward and node.op in CALL_OPS:
                backward.add(node.name)
            if node.op not in CALL_OPS:
                nodes.append(node)
                continue
            body, results[node.name] = _body(node, library, node.name in backward)
            if node.name in backward:
                backward.update(n.name for n in body)
                moved[node.name] = body[-1].name
            nodes += body
            inlined += 1
        flat = graph_pb2.GraphDef()
        flat.versions.CopyFrom(graph_def.versions)
        flat.node.extend(nodes)
        called = {value.func.name for node in nodes for value in node.attr.values()
                  if value.HasField("func")}
        called |= {f.name for node in nodes for value in node.attr.values()
                   for f in value.list.func}
        called |= {node.op for node in nodes if node.op in library}
        flat.library.function.extend(f for f in graph_def.library.function
                                     if f.signature.name in called)
        graph_def = flat
    else:
        raise ValueError(f"function calls nested deeper than {_MAX_DEPTH} levels")
    return graph_def, inlined
