"""Run the suite with oneDNN's graph passes off, unless ``TF_ENABLE_ONEDNN_OPTS`` says otherwise.

TF turns them on by default only on a CPU with AVX-512, and the machines CI runs on differ:
without this the same suite would test two runtimes on two machines. Several tests are of the
default kernels: under oneDNN on an AVX-512 VM (2026-12-06) the four of the kernel passes
failed (the passes step aside under oneDNN, as they should), a hand-made Conv2D + BiasAdd graph
with control edges aborted TF (the merge ``tests/test_remat_onednn.py`` describes), and two
allocator-statistics tests and a property test failed in the full run but passed alone. That
file runs the rewrite with oneDNN on and off in subprocesses, whatever is set here. TF reads
the variable when it loads, so it is set before any test module imports TF.
"""

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


import pytest  # noqa: E402  (after the environment is set, as TF must be)


@pytest.fixture
def run_optimized():
    """A function that imports a GraphDef, runs its ``result:0`` on ``x`` fed as ``x:0`` in a
    session with the project's configuration (Grappler at work), and returns the value and
    the nodes of the graph the session ran (its partition graphs): what tests of passes that
    keep Grappler's rewrites (fusions, ``Pow`` conversions) look at."""
    import tensorflow as tf

    from graphfit.profiler.session import session_config

    def run(graph_def, x):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=graph, config=session_config()) as session:
            value = session.run("result:0", {"x:0": x}, run_metadata=metadata,
                                options=tf.compat.v1.RunOptions(output_partition_graphs=True))
        return value, [node for g in metadata.partition_graphs for node in g.node]
    return run
