"""Generated cost graphs for benchmarks and property tests.

Four families, all seeded and deterministic:

- ``training_like``: a stack of dense layers with the shape of a real training step — forward
  ops, a loss, the backward ops in reverse layer order (each layer's gradient reads the saved
  forward activation) and one update per weight — plus occasional residual connections. Its
  activation memory peaks at the loss, as in real training, which is what rematerialization and
  liveness-aware placement exploit.
- ``random_dag``: ops reading 1-3 recent ops' outputs, with random sizes and costs.
- ``layered``: layers of equal width, each op reading 1-3 ops of the layer before; the live
  set is a whole layer (what wide models such as Inception or multi-branch networks look like
  to a placer), so memory, not the critical path, is what constrains placing it.
- ``fork_join``: stages that fork into many parallel branches (chains of different lengths
  and tensor sizes) joined by a tree of adds, as in multi-branch blocks: every branch's last
  output waits for the join, so the live set is the stage's branch outputs.
"""

from __future__ import annotations

import numpy as np

from graphfit.profiler.cost_graph import CostGraph, OpSpec

__all__ = ["training_like", "random_dag", "layered", "fork_join"]

_OPS_PER_LAYER = 10


def training_like(num_ops: int, seed: int = 0, residual_every: int = 4) -> CostGraph:
    """A training step of about ``num_ops`` ops (10 per dense layer, plus input and loss).

    Per layer: variable, read, matmul, bias add, relu (forward); relu grad, input grad,
    weight grad, bias grad, weight update (backward). Every ``residual_every``-th layer adds
    its input to its output. Sizes vary by layer so heuristics have choices to make.
    """
    rng = np.random.default_rng(seed)
    layers = max(1, (num_ops - 3) // _OPS_PER_LAYER)
    batch = 64
    widths = rng.choice([256, 512, 1024, 2048], size=layers + 1)
    specs = [OpSpec("input", "Placeholder", output_bytes=[4 * batch * int(widths[0])])]
    h = "input"
    bytes_of = {"input": specs[0].output_bytes[0]}
    forward = []
    for k in range(layers):
        w_bytes = 4 * int(widths[k]) * int(widths[k + 1])
        act = 4 * batch * int(widths[k + 1])
        flops = 2 * batch * int(widths[k]) * int(widths[k + 1])
        mm_us = flops / 20_000.0 + 5
        p = f"layer{k}"
        specs += [
            OpSpec(f"{p}/w", "VarHandleOp", output_bytes=[8], persistent_bytes=w_bytes,
                   is_variable=True, is_stateful=True),
            OpSpec(f"{p}/read", "ReadVariableOp", inputs=[(f"{p}/w", 0)],
                   output_bytes=[w_bytes], compute_us=2, reads_resource=True,
                   colocation_group=f"{p}/w"),
            OpSpec(f"{p}/matmul", "MatMul", inputs=[(h, 0), (f"{p}/read", 0)],
                   output_bytes=[act], compute_us=mm_us),
            OpSpec(f"{p}/bias", "BiasAdd", inputs=[(f"{p}/matmul", 0)], output_bytes=[act],
                   compute_us=act / 4000.0 + 2),
            OpSpec(f"{p}/relu", "Relu", inputs=[(f"{p}/bias", 0)], output_bytes=[act],
                   compute_us=act / 4000.0 + 2),
        ]
        out = f"{p}/relu"
        if residual_every and k % residual_every == residual_every - 1 and widths[k] == widths[k + 1]:
            specs.append(OpSpec(f"{p}/residual", "AddV2", inputs=[(out, 0), (h, 0)],
                                output_bytes=[act], compute_us=act / 4000.0 + 2))
            out = f"{p}/residual"
        bytes_of[out] = act
        forward.append((p, h, out, w_bytes, act, mm_us))
        h = out
    specs.append(OpSpec("loss", "Mean", inputs=[(h, 0)], output_bytes=[4], compute_us=5))
    grad = ("loss", 0)
    for p, x, out, w_bytes, act, mm_us in reversed(forward):
        specs += [
            OpSpec(f"{p}/relu_grad", "ReluGrad", inputs=[grad, (f"{p}/relu", 0)],
                   output_bytes=[act], compute_us=act / 4000.0 + 2),
            OpSpec(f"{p}/bias_grad", "BiasAddGrad", inputs=[(f"{p}/relu_grad", 0)],
                   output_bytes=[act // batch], compute_us=act / 4000.0 + 2),
            OpSpec(f"{p}/input_grad", "MatMul", inputs=[(f"{p}/relu_grad", 0), (f"{p}/read", 0)],
                   output_bytes=[bytes_of[x]], compute_us=mm_us),
            OpSpec(f"{p}/weight_grad", "MatMul", inputs=[(x, 0), (f"{p}/relu_grad", 0)],
                   output_bytes=[w_bytes], compute_us=mm_us),
            OpSpec(f"{p}/update", "ResourceApplyGradientDescent",
                   inputs=[(f"{p}/w", 0), (f"{p}/weight_grad", 0)], compute_us=w_bytes / 4000.0,
                   is_stateful=True, reads_resource=True, colocation_group=f"{p}/w"),
        ]
        grad = (f"{p}/input_grad", 0)
    return CostGraph.from_ops(specs)


def random_dag(num_ops: int, seed: int = 0, window: int = 50) -> CostGraph:
    """``num_ops`` ops, each reading 1-3 outputs of the ``window`` ops before it."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(num_ops):
        lo = max(0, i - window)
        k = min(i - lo, int(rng.integers(1, 4)))
        sources = sorted(set(rng.integers(lo, i, size=k).tolist())) if k else []
        specs.append(OpSpec(
            f"op{i}", "Random" if not sources else "Compute",
            inputs=[(f"op{j}", 0) for j in sources],
            output_bytes=[int(rng.integers(1, 1 << 20))],
            compute_us=float(rng.uniform(1, 500))))
    return CostGraph.from_ops(specs)


def layered(num_ops: int, seed: int = 0, width: int = 64,
            output_bytes: tuple[int, int] = (1 << 18, 1 << 21)) -> CostGraph:
    """``num_ops`` ops in layers of ``width``; an op of layer ``k > 0`` reads 1-3 distinct
    outputs of layer ``k - 1``, chosen at random; output sizes are uniform in
    ``output_bytes`` (low, high)."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(num_ops):
        layer, column = divmod(i, width)
        sources = []
        if layer:
            previous = range((layer - 1) * width, layer * width)
            k = int(rng.integers(1, 4))
            sources = sorted(rng.choice(previous, size=k, replace=False).tolist())
        specs.append(OpSpec(
            f"layer{layer}/n{column}", "Compute" if sources else "Input",
            inputs=[(specs[j].name, 0) for j in sources],
            output_bytes=[int(rng.integers(*output_bytes))],
            compute_us=float(rng.uniform(1, 500))))
    return CostGraph.from_ops(specs)


def fork_join(num_ops: int, seed: int = 0, branches: int = 64,
              branch_ops: tuple[int, int] = (2, 16),
              output_bytes: tuple[int, int] = (1 << 18, 1 << 21)) -> CostGraph:
    """About ``num_ops`` ops in fork-join stages: each stage's input feeds ``branches`` chains
    of ``branch_ops`` (low, high) ops each, whose last outputs are summed pairwise (a tree of
    adds) into the next stage's input. A chain keeps one output size, uniform in
    ``output_bytes``; compute times are uniform in 1-500 µs."""
    rng = np.random.default_rng(seed)
    specs = [OpSpec("input", "Placeholder", output_bytes=[int(rng.integers(*output_bytes))],
                    compute_us=1.0)]
    stage = 0
    while len(specs) < num_ops:
        source = specs[-1].name
        ends = []
        for b in range(branches):
            size = int(rng.integers(*output_bytes))
            previous = source
            for k in range(int(rng.integers(branch_ops[0], branch_ops[1] + 1))):
                name = f"stage{stage}/branch{b}/op{k}"
                specs.append(OpSpec(name, "Compute", inputs=[(previous, 0)], output_bytes=[size],
                                    compute_us=float(rng.uniform(1, 500))))
                previous = name
            ends.append((previous, size))
        level = 0
        while len(ends) > 1:  # join: sum pairwise
            joined = []
            for k in range(0, len(ends) - 1, 2):
                (a, size_a), (b, size_b) = ends[k], ends[k + 1]
                name = f"stage{stage}/join{level}/add{k // 2}"
                size = max(size_a, size_b)
                specs.append(OpSpec(name, "AddV2", inputs=[(a, 0), (b, 0)], output_bytes=[size],
                                    compute_us=size / 4000.0 + 2))
                joined.append((name, size))
            ends = joined + ends[len(ends) - len(ends) % 2:]
            level += 1
        stage += 1
    return CostGraph.from_ops(specs)
