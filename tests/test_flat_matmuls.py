"""The shared-matrix pass: batch products against one weight matrix, and their weight gradients,
run as single matrix products and compute the same step."""

import numpy as np
import tensorflow as tf

from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step
from graphfit.profiler.step_compare import compare_steps, compare_weights
from graphfit.remat.flat_matmuls import flatten_shared_matmuls


def _sequence_step(batch: "int | None" = 4) -> GraphItem:
    """Two per-position projections of a [batch, 8, 16] sequence (as Keras's ``EinsumDense``
    emits them), a product of two per-example tensors, trained by Adam."""
    def forward(rng: np.random.Generator):
        x = tf.compat.v1.placeholder(tf.float32, [batch, 8, 16], name="x")
        init = tf.compat.v1.random_normal_initializer(0, 0.3)
        w1 = tf.compat.v1.get_variable("w1", [16, 12], initializer=init, use_resource=True)
        w2 = tf.compat.v1.get_variable("w2", [12, 16], initializer=init, use_resource=True)
        h = tf.nn.relu(tf.linalg.matmul(x, w1, name="project"))
        y = tf.linalg.matmul(h, w2, name="back")
        scores = tf.linalg.matmul(y, x, adjoint_b=True, name="scores")   # [batch, 8, 8]
        loss = tf.reduce_sum(scores * scores) + tf.reduce_sum(y)
        return loss, {"x:0": rng.standard_normal((batch or 4, 8, 16), dtype=np.float32)}

    return build_training_step("sequence", {"optimizer": "adam", "learning_rate": 1e-2,
                                            "seed": 0}, forward)


def test_shared_matrix_products_and_their_weight_gradients_become_single_products():
    item = _sequence_step()
    flat, record = flatten_shared_matmuls(item)
    # Forward: project and back; backward: both input gradients (TF's gradient function makes
    # the one of x too, which the step never runs). The per-example scores product and its
    # gradients keep their batch kernels.
    assert record == {"changed": True, "products": 4, "weight_gradients": 2}
    products = [op for op in flat.graph.get_operations() if op.type == "BatchMatMulV2"]
    assert products and all(op.inputs[1].shape.rank == 3 for op in products)
    for gradient in item.gradients:
        op = flat.graph.get_tensor_by_name(gradient).op
        assert op.type == "MatMul" and op.get_attr("transpose_a")
    assert compare_steps(item, flat).equal
    assert compare_weights(item, flat)[0]


def test_a_step_without_shared_matrix_products_is_left_alone():
    once, _ = flatten_shared_matmuls(_sequence_step())
    again, record = flatten_shared_matmuls(once)
    assert again is once and record == {"changed": False, "products": 0, "weight_gradients": 0}
    # Shapes known only when the step runs: nothing to flatten to.
    unknown = _sequence_step(batch=None)
    assert flatten_shared_matmuls(unknown) == (unknown, record)
