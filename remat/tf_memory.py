"""A cost graph whose memory accounting is what TF's CPU executor really allocates.

The planners share one memory model (``remat.validate.replay_plan``): persistent bytes, plus
every resident tensor's bytes, plus the running op's temporary bytes, sampled at each op. A
profile's ``output_bytes`` are the *requested* bytes of each output, which over-counts what TF
allocates, so this module calibrates a cost graph against one traced step:

- **Aliases are free.** A ``ReadVariableOp`` returns the variable's own buffer, ``Const``
  returns the kernel's tensor, ``Identity``/``Reshape`` return their input: no allocation in the
  step (``allocation_id`` 0, or the buffer of an input). Such outputs get 0 bytes; constants'
  buffers are resident, so they join the op's persistent bytes.
- **Fed inputs are resident.** The caller's feeds are held for the whole step: placeholder
  outputs become persistent bytes of the placeholder.
- **Forwarded buffers are one node.** ``BiasAdd``, ``Relu``, ``ReluGrad`` (and other
  element-wise ops) reuse an input buffer whose only reader they are: ``MatMul -> BiasAdd ->
  Relu`` is one buffer. Such chains become one node of the planning graph (``MemoryModel.
  plan_graph``): its output is the chain's last tensor, its compute the sum, its temporary the
  largest. Planning on ops would count the buffer once per tensor, and giving the intermediate
  tensors 0 bytes instead would let a planner keep an intermediate alive "for free" and
  recompute only the tail of the chain: TF then cannot forward the buffer and allocates a new
  one (measured: +28 MiB over the plan on the 16-layer MLP). ``expand_plan`` turns a plan of
  chains back into a plan of ops, which clones a chain whole. A producer joins a chain when
  its op has one output, whatever the trace shows: with oneDNN on, a filter gradient fused
  with its ``BiasAddGrad`` traces the bias gradient as its second output, and SGD's
  ``lr * gradient`` still writes into the filter gradient's buffer (counted as a new buffer,
  it raised ``keras.applications.ResNet50``'s lower bound from 0.46 to 0.50 of its peak).
- **Run-time fusions are one node.** Grappler's remapper (e.g. ``MatMul`` + ``BiasAdd`` +
  ``Relu`` into ``_FusedMatMul``) and, with oneDNN on, TF's ``MklLayoutRewritePass`` (e.g.
  ``Conv2D`` into its ``BiasAdd``, ``FUSABLE_PAIRS``) run an op inside its reader; the trace
  shows the fused node under the last op's name and never the inner ops or their outputs.
  An untraced op with one output read by one op joins that reader's chain: the planning
  graph never separates the pair, and the output, which never exists, is not counted.
- **Identities are views.** ``Identity``/``IdentityN`` outputs that are their inputs' buffers
  (and do not continue a chain) allocate nothing: they get 0 bytes, and in the planning graph
  every reader of such a view also reads the viewed tensor, whose buffer lives as long as the
  view is read. Keras 3 optimizers pass all gradients through one ``IdentityN`` (the default
  replica context's all-reduce); counting its outputs as new buffers would double the
  gradients' bytes (twice over: it lists each gradient twice). An identity Grappler pruned
  from the trace is a view of its input all the same: Keras wraps each swish of
  ``keras.applications.EfficientNetB0`` in a custom gradient's ``IdentityN``, and its
  backward readers hold the activation. ``remat.rewrite`` reads a recomputed source directly
  where a plan recomputes it after the view was taken.
- **Slices are views.** Several outputs at one input's buffer share it: ``Unpack`` along
  axis 0 (a Keras RNN with ``unroll=True`` unstacks its input sequence) returns slices of
  its input without copying, and the trace shows each slice at the input's own address with
  the input's size. They get 0 bytes and are views like the identities' (counted once per
  slice, a sequence of 32 steps would count 32 times its bytes: +8 MiB, 1.5x the measured
  peak, on a Keras LSTM of 256 units after the graph passes).
- **A chain does not wait.** A planning node reads all its ops' inputs when its first op
  runs. An op whose other input the step allocated after the chain's first op started (a
  running sum's next contribution, which takes the partial sum's buffer over) does not join
  the chain: its reuse of the buffer is a last reader's (below).
- **Only the step's buffers move.** A buffer is taken over only from an input the step
  allocated: constants and variable reads are the runtime's buffers, and an op returning one
  of them (a ``Reshape`` of a ``Const``, an empty ``Prod``) aliases it, which is free; it never
  joins the constant's chain (a chain is cloned whole, and a constant cannot be).
- **Last readers reuse buffers.** An element-wise op that is the last of several readers of
  a tensor writes its output into that tensor's buffer (``Softmax_grad/sub``,
  ``AddN`` of gradients, ...). A plan cannot make this a node (which reader is last depends on
  the plan), so ``MemoryModel.reuses`` lists such pairs and ``tf_peak_bytes`` gives a plan's
  peak with the reuse applied wherever the plan frees the tensor right after that reader.
- **Execution order.** Op ids follow the order the executor started the ops in the traced step
  (a topological order), so a plan's order is the one TF runs unconstrained ops in.

What stays approximate (it shows as prediction error in ``remat.measure`` reports): a variable
update that runs while a read of the variable is still alive copies the variable
(copy-on-write); the profile sees the copy as the update's temporary bytes, but it lives until
the last reader finished. A plan that recomputes a tensor ``Unpack`` sliced keeps its old
buffer alive in TF, since the slices' readers still read the old slices (``remat.rewrite``
reads around identity views only; the Keras RNNs with ``unroll=True`` measured here recompute
nothing at 0.5). Planners plan with the shared replay, which counts the reuses above as new
buffers: a plan is conservative by at most one such buffer.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses

import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.profiler.cost_graph import FEED_OP_TYPES, CostGraph, OpSpec
from graphfit.profiler.profile import Profile
from graphfit.profiler.session import OpenSessions, session_config
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.remat.plan import FREE, Event, RematPlan
from graphfit.remat.recompute_graph import viewed

__all__ = ["MemoryModel", "StepTrace", "trace_steps", "step_trace", "tf_memory_model",
           "TracedOrders", "expand_plan",
           "tf_peak_bytes", "step_item", "IDENTITY_OP_TYPES", "FEED_OP_TYPES", "FUSABLE_PAIRS"]

_SOURCE_OP_TYPES = FEED_OP_TYPES | {"Const"}
# Ops whose outputs are their inputs, unchanged: views of the input buffers.
IDENTITY_OP_TYPES = frozenset({"Identity", "IdentityN"})
# Op-type pairs oneDNN's MklLayoutRewritePass (TF's mkl_layout_pass.cc, its merge rules) turns
# into one node: (first, second, input port of the second that the first feeds, or None for
# siblings reading the same tensor: Conv2DBackpropFilter's input 2, BiasAddGrad's input 0).
FUSABLE_PAIRS = (("Conv2D", "BiasAdd", 0), ("Pad", "Conv2D", 0), ("Pad", "_FusedConv2D", 0),
                 ("Conv2DBackpropFilter", "BiasAddGrad", None))



def step_item(item: GraphItem) -> GraphItem:
    """``item`` as ``tools.train`` runs it: fetch the update and the loss, not the gradients.

    Fetching gradients would hold every gradient until the step ends; a training step frees
    each one after its update, and the memory plans assume so.
    """
    return dataclasses.replace(item, gradients=[])


@dataclasses.dataclass
class StepTrace:
    """Facts of one traced step: per node its start time and, per output port, whether the
    step allocated the buffer (``allocation_id`` set) and the buffer's address."""

    start_us: dict[str, int]
    allocated: dict[str, dict[int, bool]]
    address: dict[str, dict[int, int]]


def trace_steps(item: GraphItem, count: int = 1, warmup: int = 1, num_cpu_devices: int = 1,
                sessions: OpenSessions | None = None) -> list[StepTrace]:
    """Run ``item``'s training step (update and loss) ``warmup`` times, then ``count`` times
    traced, all in one session: a new session costs its own Grappler pass and executor (on
    ``keras.applications.ResNet50``, 64x64, batch 8, in one process on a loaded VM: six traced
    steps in one session took 23.3 s, three in sessions of their own 45.0 s, 2026-12-06), and
    TF's executor starts the ops of each run in its own order, in one session as in several
    (six distinct orders of six traces either way). ``sessions``: run in the
    pool's session of the step (``profiler.session.OpenSessions``)."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    fetches = [item.train_op, item.loss]
    traces = []
    with OpenSessions.reuse(sessions) as pool:
        session = pool.get(item.graph, session_config(num_cpu_devices))
        item.initialize(session)
        feeds = item.feed_dict()
        for _ in range(warmup):
            session.run(fetches, feeds)
        for _ in range(count):
            metadata = tf.compat.v1.RunMetadata()
            session.run(fetches, feeds, options=options, run_metadata=metadata)
            traces.append(step_trace(metadata))
    return traces


def step_trace(metadata: tf.compat.v1.RunMetadata) -> StepTrace:
    """The ``StepTrace`` of one traced run (its ``RunMetadata``).

    An output is the step's buffer when a node of the step allocated it (the node has
    allocation records and the output an ``allocation_id``) or when it is at the address of
    such a buffer (forwarded, a view). An ``allocation_id`` alone does not say so: TF's BFC
    allocator (GPUs, ``TF_CPU_ALLOCATOR_USE_BFC=true``) numbers every buffer it ever
    allocated, so the variables' reads show the ids of buffers the initialiser allocated
    (``keras.applications.ResNet50``, oneDNN off, BFC: all 53 convolution kernels' reads,
    60 MB planned as new buffers although no read allocated a byte, 2026-12-06).
    """
    trace = StepTrace({}, {}, {})
    step_buffers: set[int] = set()
    stats = sorted((ns for device in metadata.step_stats.dev_stats for ns in device.node_stats),
                   key=lambda ns: ns.all_start_micros)
    for ns in stats:
        trace.start_us[ns.node_name] = ns.all_start_micros
        allocates = any(r.alloc_bytes > 0 for m in ns.memory for r in m.allocation_records)
        for out in ns.output:
            description = out.tensor_description.allocation_description
            ours = description.allocation_id != 0 and (allocates
                                                       or description.ptr in step_buffers)
            if ours:
                step_buffers.add(description.ptr)
            trace.allocated.setdefault(ns.node_name, {})[out.slot] = ours
            trace.address.setdefault(ns.node_name, {})[out.slot] = description.ptr
    return trace


@dataclasses.dataclass
class MemoryModel:
    """A step's cost graph calibrated to TF's allocations, and its planning graph.

    Attributes:
        cost_graph: one node per TF op (what ``remat.rewrite`` lowers plans into).
        plan_graph: forwarding chains collapsed into one node (what planners plan on).
        members: per ``plan_graph`` node, its ``cost_graph`` op ids in execution order.
        reuses: per ``plan_graph`` node, the ``plan_graph`` tensors (read by other ops too)
            whose buffer TF hands to the node's output when the node is their last reader.
    """

    cost_graph: CostGraph
    plan_graph: CostGraph
    members: list[list[int]]
    reuses: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def tf_memory_model(item: GraphItem, profile: Profile | None = None,
                    trace: StepTrace | None = None) -> MemoryModel:
    """The cost graphs of ``item``'s step, with bytes and op order calibrated to TF's executor.

    Parameters:
        item: the training step (the step is its update and loss, see ``step_item``).
        profile: measured costs of ``item`` (``profiler.trace.profile_graph``); ``None``
            estimates compute times from static shapes.
        trace: a traced step of ``item`` (``trace_steps``); ``None`` runs one.

    Returns:
        The ``MemoryModel``; its ``cost_graph`` has the op names ``cost_graph_from_graph``
        gives, so plans expanded onto it lower with ``remat.rewrite.rewrite``.
    """
    base = cost_graph_from_graph(item.graph, [item.train_op, item.loss], profile)
    return _calibrated(base, trace if trace is not None else trace_steps(item)[0])


class TracedOrders(collections.abc.Sequence):
    """``count`` ``MemoryModel``s of ``item``, each of its own traced order (TF's executor
    starts the ops of each run in its own order), traced when first asked for, in the
    session of the step (``trace_steps``; ``sessions``' if given), on one uncalibrated cost
    graph built once: a search that stops at its first plan (``remat.pipeline.
    ORDER_SEARCH_SLACK``) traces one step, not ``count`` (six traced steps took 6 s of
    ``keras.applications.ResNet50``'s ``optimize``, 2026-12-06). ``first``: a step already
    traced in that session (``session_config(num_cpu_devices)``: the profile's,
    ``remat.measure.measure_step``'s ``on_traced_step``), taken as the first order instead of
    tracing one."""

    def __init__(self, item: GraphItem, profile: Profile | None, count: int,
                 sessions: OpenSessions | None = None, first: StepTrace | None = None,
                 num_cpu_devices: int = 1):
        self._item, self._profile, self._count, self._sessions = item, profile, count, sessions
        self._num_cpu_devices = num_cpu_devices
        self._base: CostGraph | None = None
        self._models: list[MemoryModel] = []
        self._traces = [] if first is None else [first]

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(f"order {index} of {self._count}")
        index %= self._count
        if self._base is None:
            self._base = cost_graph_from_graph(self._item.graph,
                                               [self._item.train_op, self._item.loss],
                                               self._profile)
        while len(self._models) <= index:
            if len(self._traces) <= len(self._models):
                self._traces += trace_steps(self._item, warmup=0 if self._traces else 1,
                                            num_cpu_devices=self._num_cpu_devices,
                                            sessions=self._sessions)
            self._models.append(_calibrated(self._base, self._traces[len(self._models)]))
        return self._models[index]


def _calibrated(base: CostGraph, trace: StepTrace) -> MemoryModel:
    """``base`` with its bytes and op order calibrated to one traced step (``tf_memory_model``;
    ``base`` itself is not changed)."""
    specs = base.to_specs()
    readers: dict[tuple[str, int], int] = {}
    for spec in specs:
        for producer_port in set(map(tuple, spec.inputs)):
            readers[producer_port] = readers.get(producer_port, 0) + 1
    # An op other ops wait for (control edges) stays a node of its own: merging it into its
    # reader's chain could put the chain on a cycle through the waiting op.
    awaited = {name for spec in specs for name in spec.control_inputs}
    forwarded_into: dict[str, str] = {}   # producer -> the only reader that took its buffer
    chained: set[str] = set()             # readers that took a producer's buffer
    num_outputs = {spec.name: len(spec.output_bytes) for spec in specs}
    specs_by_name = {spec.name: spec for spec in specs}
    for spec in specs:
        for producer, port in spec.inputs:
            if (producer not in trace.start_us and producer not in awaited and port == 0
                    and num_outputs[producer] == 1 and readers[(producer, 0)] == 1
                    and base.op_types[base.index[producer]] not in _SOURCE_OP_TYPES
                    and not base.is_stateful[base.index[producer]]
                    and spec.name not in chained):
                forwarded_into[producer] = spec.name     # fused at run time (docstring)
                chained.add(spec.name)
    views: dict[tuple[str, int], tuple[str, int]] = {}   # identity output -> tensor it shows
    last_reader_forwards = []             # (reader, producer, port): a shared buffer taken over
    head = {}                             # chained reader -> the first op of its chain
    for spec in specs:
        forwards = _calibrate(spec, trace)
        sharing = collections.Counter(forwards.values())
        for output_port, (producer, port) in forwards.items():
            if (len(forwards) == 1 and readers[(producer, port)] == 1
                    and num_outputs[producer] == 1 and producer not in awaited
                    and spec.name not in chained
                    and not _reads_later_buffer(spec, producer, head.get(producer, producer),
                                               trace)):
                forwarded_into[producer] = spec.name
                chained.add(spec.name)
                head[spec.name] = head.get(producer, producer)
            elif spec.op_type in IDENTITY_OP_TYPES or sharing[(producer, port)] > 1:
                spec.output_bytes[output_port] = 0
                views[(spec.name, output_port)] = (producer, port)
            else:
                last_reader_forwards.append((spec.name, producer, port))
        fused_into = _fused_into_producer(spec, trace, readers, specs_by_name)
        if fused_into is not None:
            last_reader_forwards.append((spec.name, *fused_into))
    view_reads = {spec.name: [viewed(views, tuple(source)) for source in spec.inputs
                              if tuple(source) in views] for spec in specs}
    order = {name: k for k, name in enumerate(sorted(
        (spec.name for spec in specs),
        key=lambda name: (trace.start_us.get(name, 0), base.index[name])))}
    cost_graph = CostGraph.from_ops(sorted(specs, key=lambda spec: order[spec.name]))
    plan_graph, members = _collapse_chains(cost_graph, forwarded_into, view_reads)
    head_node = {cost_graph.names[chain[0]]: k for k, chain in enumerate(members)}
    reuses: dict[int, list[int]] = {}
    for reader, producer, port in last_reader_forwards:
        node = plan_graph.index.get(producer)    # None: an inner op of a chain
        if node is not None and reader in head_node:
            reuses.setdefault(head_node[reader], []).append(
                int(plan_graph.output_offset[node]) + port)
    return MemoryModel(cost_graph, plan_graph, members, reuses)


def _fused_into_producer(spec: OpSpec, trace: StepTrace, readers: dict[tuple[str, int], int],
                         specs_by_name: dict[str, OpSpec]) -> tuple[str, int] | None:
    """The input ``(producer, port)`` that ``spec`` was fused into at run time, its output being
    that input's buffer; ``None`` if it was not.

    Grappler's remapper fuses ``FusedBatchNormV3 + Relu`` into ``_FusedBatchNormEx`` under the
    batch norm's name (its other outputs have readers of their own): the trace shows the batch
    norm writing the activation's output, and no ``Relu``. Counted as a buffer of its own, the
    ``Relu``'s output is held twice while it runs (the zoo resnet on four 10.5 MiB devices
    planned 2 MiB more than it measured at such a ``Relu``, 2026-12-07). Where the placed step
    keeps the two apart (the remapper fuses no op with control edges, and the memory-order
    edges give most ops some) the ``Relu`` is the batch norm output's only reader and takes its
    buffer over: one buffer either way, a last reader's reuse (``MemoryModel.reuses``). So: an
    op the trace does not show, of one output as large as the tensor it reads, which it alone
    reads, from a producer the trace shows allocating it."""
    if spec.name in trace.start_us or len(spec.output_bytes) != 1:
        return None
    sources = set(map(tuple, spec.inputs))
    if len(sources) != 1:
        return None
    (producer, port), = sources
    if not trace.allocated.get(producer, {}).get(port) or readers[(producer, port)] != 1:
        return None
    produced = specs_by_name[producer].output_bytes
    return (producer, port) if produced[port] == spec.output_bytes[0] > 0 else None


def _reads_later_buffer(spec: OpSpec, forwarded: str, chain_head: str, trace: StepTrace
                        ) -> bool:
    """Whether ``spec`` reads, besides ``forwarded``'s buffer that it takes over, a buffer the
    step allocated after ``chain_head`` started.

    A chain is one planning node, which reads all its members' inputs at once when its head
    runs. A running sum ``s_k = s_{k-1} + c_{k+1}`` takes ``s_{k-1}``'s buffer over, but its
    contribution ``c_{k+1}`` appears later, after ops that the chain must not wait for:
    folded into one node, every contribution of the sum would be alive together, which is the
    pile-up ``remat.grad_accumulation`` removes. Such a reader stays a node of its own, and
    its reuse of the buffer is a last-reader reuse (``MemoryModel.reuses``).
    """
    start = trace.start_us.get(chain_head)
    return start is not None and any(
        producer != forwarded and trace.allocated.get(producer, {}).get(port)
        and trace.start_us.get(producer, start) > start for producer, port in spec.inputs)


def _calibrate(spec: OpSpec, trace: StepTrace) -> dict[int, tuple[str, int]]:
    """Rewrite ``spec``'s bytes in place (rules in the module docstring); return, per output
    port whose buffer is an input's, that input ``(producer, port)``."""
    output_bytes = list(spec.output_bytes)
    if spec.op_type in FEED_OP_TYPES or spec.op_type == "Const":
        spec.persistent_bytes += sum(output_bytes)
        spec.output_bytes = [0] * len(output_bytes)
        return {}
    allocated = trace.allocated.get(spec.name, {})
    address = trace.address.get(spec.name, {})
    input_address = {trace.address[p][port]: (p, port) for p, port in spec.inputs
                     if trace.allocated.get(p, {}).get(port)}
    taken = {}
    for port in range(len(output_bytes)):
        if port not in allocated:
            if spec.op_type in IDENTITY_OP_TYPES:
                # A view, whatever Grappler pruned from the trace: of the input it shows, or
                # its readers would read a tensor the plan frees after its own readers.
                output_bytes[port] = 0
                if port < len(spec.inputs):
                    taken[port] = tuple(spec.inputs[port])
            continue            # not traced: keep the profile's (or static) estimate
        source = input_address.get(address.get(port))
        if source is not None:
            taken[port] = source
        elif not allocated[port]:
            output_bytes[port] = 0
    spec.output_bytes = output_bytes
    return taken


def _chain_colocation_labels(graph: CostGraph, chains: list[list[int]], head_of: dict[str, int],
                             node_name: list[str]) -> list[str]:
    """One colocation label per chain node, such that nodes share a label exactly when TF would
    keep some of their ops on one device: ops with one ``_class`` label, or an op and the op its
    label names (``baechi.grouping.tf_colocation_groups``'s rule). A node carries one label
    while its ops may carry several: without this, joint placement split e.g. the zoo resnet's
    ``gradients/AddN_1`` from the ``Conv2DBackpropInput`` colocated with it."""
    import networkx as nx

    chains_of = nx.utils.UnionFind(range(len(chains)))
    by_label: dict[str, int] = {}
    for c, chain in enumerate(chains):
        for j in chain:
            own = graph.colocation_groups[j]
            chains_of.union(by_label.setdefault(own, c), c)
            if own in head_of:
                chains_of.union(head_of[own], c)
    return [node_name[chains_of[c]] for c in range(len(chains))]


def _collapse_chains(graph: CostGraph, forwarded_into: dict[str, str],
                     view_reads: dict[str, list[tuple[str, int]]]
                     ) -> tuple[CostGraph, list[list[int]]]:
    """One node per forwarding chain (a chain of one op is the op itself); a node also reads
    the tensors behind the identity views its ops read (``view_reads``: op -> tensors)."""
    head_of = {}
    chains: list[list[int]] = []
    for i in range(graph.num_ops):      # topological: a chain's head comes first
        name = graph.names[i]
        if name in head_of:
            continue
        chain = [i]
        while graph.names[chain[-1]] in forwarded_into:
            chain.append(graph.index[forwarded_into[graph.names[chain[-1]]]])
        for j in chain:
            head_of[graph.names[j]] = len(chains)
        chains.append(chain)
    node_name = [graph.names[chain[-1]] for chain in chains]
    label = _chain_colocation_labels(graph, chains, head_of, node_name)
    specs = []
    for chain in chains:
        members = set(chain)
        inputs, controls = [], set()
        for j in chain:
            reads = [(graph.names[int(graph.tensor_producer[t])], int(graph.tensor_port[t]))
                     for t in graph.op_inputs(j)] + view_reads.get(graph.names[j], [])
            for producer, port in reads:
                if graph.index[producer] not in members:
                    inputs.append((node_name[head_of[producer]], port))
            controls |= {node_name[head_of[graph.names[c]]] for c in graph.control_inputs(j)
                         if c not in members}
        last = chain[-1]
        specs.append(OpSpec(
            name=graph.names[last], op_type="+".join(graph.op_types[j] for j in chain),
            inputs=inputs, control_inputs=sorted(controls),
            output_bytes=graph.output_bytes(last).tolist(),
            compute_us=float(graph.compute_us[chain].sum()),
            temp_bytes=int(graph.temp_bytes[chain].max()),
            persistent_bytes=int(graph.persistent_bytes[chain].sum()),
            device=graph.devices[last], colocation_group=label[head_of[graph.names[last]]],
            is_stateful=bool(graph.is_stateful[chain].any()),
            is_random=bool(graph.is_random[chain].any()),
            is_variable=bool(graph.is_variable[chain].any()),
            reads_resource=bool(graph.reads_resource[chain].any()),
            measured=bool(graph.measured[chain].all())))
    plan_graph = CostGraph.from_ops(specs)
    return plan_graph, [chains[head_of[name]] for name in plan_graph.names]


def expand_plan(model: MemoryModel, plan: RematPlan) -> RematPlan:
    """``plan`` (over ``model.plan_graph``) as a plan over ``model.cost_graph``.

    A (re)computation of a chain becomes the (re)computations of its ops in order; a free of a
    chain's output frees its last op's tensor (the intermediate tensors die at once: their only
    reader is the next op of the chain). Peak and compute predictions are kept.
    """
    cost_graph, events = model.cost_graph, []
    for kind, index in plan.events:
        if kind == FREE:
            producer = model.members[int(model.plan_graph.tensor_producer[index])][-1]
            port = int(model.plan_graph.tensor_port[index])
            events.append(Event(FREE, int(cost_graph.output_offset[producer]) + port))
        else:
            events.extend(Event(kind, j) for j in model.members[index])
    return dataclasses.replace(plan, events=events)


def tf_peak_bytes(model: MemoryModel, plan: RematPlan) -> int:
    """The peak TF's executor shows for ``plan`` (over ``model.plan_graph``).

    The shared replay (``remat.validate.replay_plan``) with one TF rule added: a node that is
    the last reader of a tensor listed in ``model.reuses`` (the plan frees the tensor right
    after it) writes its output into that tensor's buffer, so it allocates nothing new.
    """
    graph = model.plan_graph
    live_bytes, peak_bytes = 0, 0
    resident = set()
    events = plan.events
    for position, (kind, index) in enumerate(events):
        if kind == FREE:
            resident.discard(index)
            live_bytes -= int(graph.tensor_bytes[index])
            continue
        for t in graph.op_outputs(index):
            if t not in resident:
                resident.add(t)
                live_bytes += int(graph.tensor_bytes[t])
        freed_next, later = set(), position + 1
        while later < len(events) and events[later].kind == FREE:
            freed_next.add(events[later].index)
            later += 1
        reused = sum(int(graph.tensor_bytes[t]) for t in model.reuses.get(index, ())
                     if t in freed_next)
        peak_bytes = max(peak_bytes, live_bytes + int(graph.temp_bytes[index]) - reused)
    return int(graph.persistent_bytes.sum()) + peak_bytes
