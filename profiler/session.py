"""The one session configuration every measurement and every run in this project uses.

Grappler's meta optimizer and the classic graph optimizer are switched off: common-subexpression
elimination (Grappler's arithmetic optimizer and the classic pass), the dependency optimizer and
constant folding merge rematerialization clones back into their originals and rename nodes, and its remapper renames fused ops, which would break
both the rewrite and the mapping from trace back to graph (DESIGN.md §3, §4). Baselines are
measured under the same configuration, so comparisons stay fair.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["session_config", "make_session"]


def session_config(num_cpu_devices: int = 1) -> tf.compat.v1.ConfigProto:
    """A ConfigProto with ``num_cpu_devices`` CPU devices and Grappler's rewrites off.

    Soft placement stays off so an op pinned to a device runs there or fails loudly.
    """
    config = tf.compat.v1.ConfigProto(device_count={"CPU": num_cpu_devices})
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    # The classic graph optimizer (run before Grappler) would fold constants and merge
    # common subexpressions too.
    options = config.graph_options.optimizer_options
    options.opt_level = tf.compat.v1.OptimizerOptions.L0
    options.do_common_subexpression_elimination = False
    options.do_constant_folding = False
    return config


def make_session(graph: tf.Graph, num_cpu_devices: int = 1,
                 target: str = "") -> tf.compat.v1.Session:
    """A v1 session on ``graph`` with ``session_config`` (``target``: a gRPC address or local)."""
    return tf.compat.v1.Session(target=target, graph=graph,
                                config=session_config(num_cpu_devices))
