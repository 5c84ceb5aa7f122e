"""Keep Grappler's ``Pow`` conversion, and with it all of Grappler, in a step with ordering edges.

Grappler's arithmetic optimizer turns ``Pow(x, c)`` of a constant ``c`` into cheaper kernels
(``ConvertPow``: ``Square`` for 2, ``Sqrt`` for 0.5, ``x * Square(x)`` for 3, ...). For 3 it
copies the ``Pow`` node into the inner ``Square`` and drops the copy's last input, taking that
to be the exponent; when the ``Pow`` has a control input, the control input is dropped instead
and the ``Square`` keeps two data inputs (TF 2.21). The session then refuses the optimized graph
(``Grappler optimization failed. Error: Input 1 of node ...ConvertPow__inner_Pow does not
exist``, logged at ``VLOG(2)`` only) and runs the step with no Grappler optimization at all: no
constant folding, no remapper fusion, no arithmetic rewrite anywhere in the graph, and every
``Pow`` on TF's generic kernel.

GELU's tanh approximation (keras-hub's GPT-2) is ``x + 0.044715 * Pow(x, 3)``, and its
gradient reads ``Pow(x, 2)``. A rematerialization rewrite pins such ``Pow`` nodes with control
edges, and on the keras-hub GPT-2 step (4 layers, width 256, seq 128, batch 8, Adam; oneDNN on;
2026-12-06) each ``Pow`` of 4 MiB then took 11.2 ms against 0.13-0.74 ms in the user's step:
134 ms of a 517 ms traced step, which the plan, costed on Grappler's graph, never counted.

The pass moves every control input of a ``Pow`` onto a gate, an ``Identity`` of its base (input
0) that carries them (the same gates ``profiler.remapper_fusions`` uses, and named like
them): the ``Pow`` still starts after every op it waited for, an identity allocates nothing,
and Grappler converts the ``Pow`` and keeps its output. Precondition: an acyclic graph; the
gate is a new node between the base and the ``Pow``, so what reaches what is unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from graphfit.profiler.graph_def_walk import GraphDefPassError
from graphfit.profiler.remapper_fusions import GATE_SUFFIX, gate_node

__all__ = ["keep_pow_conversions"]


def keep_pow_conversions(graph_def: tf.compat.v1.GraphDef) -> int:
    """Move the control inputs of every ``Pow`` of ``graph_def`` onto a gate on its base, in
    place (module docstring); a gate an earlier run made takes the new ones. Returns the
    number of ``Pow`` nodes whose control inputs moved.

    Raises:
        GraphDefPassError: a node other than the ``Pow``'s gate has the gate's name.
    """
    nodes = {node.name: node for node in graph_def.node}
    gated = 0
    for node in list(graph_def.node):
        controls = [name for name in node.input if name.startswith("^")]
        if node.op != "Pow" or not controls:
            continue
        data = [name for name in node.input if not name.startswith("^")]
        name = node.name + GATE_SUFFIX
        if data[0] != name:
            if name in nodes:
                raise GraphDefPassError(f"cannot gate {node.name!r}: the graph already has "
                                        f"a node {name!r}")
            graph_def.node.append(gate_node(name, data[0], node))    # appends a copy
            nodes[name] = graph_def.node[-1]
            data[0] = name
        gate_inputs = nodes[name].input
        gate_inputs.extend([c for c in controls if c not in gate_inputs])
        del node.input[:]
        node.input.extend(data)
        gated += 1
    return gated
