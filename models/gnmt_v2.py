"""GNMT v2: Google's LSTM encoder-decoder with attention (Wu et al. 2016), statically unrolled.

The ``gnmt_v2`` architecture of the TensorFlow NMT tutorial (``nmt/gnmt_model.py``), which
Baechi placed (Baechi used 4 layers of 512 units, batch 128, sequences of 40, 30000 words):

- Encoder: ``num_layers`` LSTM layers. The first is bidirectional (forward and backward LSTMs,
  outputs concatenated) when ``bidirectional``; the rest are unidirectional. The decoder's
  layer ``i`` starts from the final state of encoder layer ``i`` (the backward half of the
  bidirectional layer).
- Attention: normalised Bahdanau (additive) attention over the top encoder outputs, queried
  by the bottom decoder layer's new output at every step ("v2": the *current* step's context).
- Decoder: layer 0 reads the target embedding concatenated with the previous step's context;
  every higher layer reads the layer below concatenated with the current context. The output
  layer projects the top decoder layer to the vocabulary.
- Residual connections (``residual``) on layers 2 and up of encoder and decoder; in the
  decoder the shortcut adds the first ``num_units`` features of the layer's input (the layer
  below, without the context), as the tutorial's ``gnmt_residual_fn`` does.

Every LSTM is a hand-written cell (one matmul over [input, h], sigmoid/tanh gates, forget bias
1) with one kernel per layer, unrolled by a Python loop over ``seq_len`` steps: the graph
holds every time step's ops, like Baechi's static-RNN GNMT. Dropout (``dropout`` > 0) drops
each cell input at every step, as the tutorial's ``DropoutWrapper`` does. Source and target
sequences have the same length and vocabulary; batches are uniformly random token ids, with
the decoder input being the target shifted right behind a start token (id 0).

Reference: Wu, Schuster, Chen, Le, Norouzi et al., "Google's Neural Machine Translation
System: Bridging the Gap between Human and Machine Translation", arXiv:1609.08144, 2016.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graphfit.models import layers
from graphfit.models.graph_item import GraphItem
from graphfit.models.training import build_training_step

__all__ = ["PRESETS", "build"]

PRESETS = {
    "tiny": dict(
        batch_size=4, num_layers=2, num_units=32, vocab_size=64, seq_len=5,
        bidirectional=True, residual=True, dropout=0.2,
    ),
    "default": dict(
        batch_size=32, num_layers=4, num_units=256, vocab_size=4096, seq_len=20,
        bidirectional=True, residual=True, dropout=0.2,
    ),
}

FORGET_BIAS = 1.0
INIT_SCALE = 0.1  # uniform(-0.1, 0.1) initialisation, as in the NMT tutorial


class _LSTM:
    """One LSTM layer's variables and its cell step; state is (c, h)."""

    def __init__(self, input_dim: int, num_units: int, name: str):
        self.num_units = num_units
        with tf.compat.v1.variable_scope(name):
            self.kernel = layers.variable("kernel", [input_dim + num_units, 4 * num_units], None)
            self.bias = layers.variable("bias", [4 * num_units], tf.compat.v1.zeros_initializer())
        self.name = name

    def step(self, x, state, t: int):
        c, h = state
        with tf.name_scope(f"{self.name}/t{t}"):
            gates = tf.nn.bias_add(tf.matmul(tf.concat([x, h], axis=1), self.kernel), self.bias)
            i, j, f, o = tf.split(gates, 4, axis=1)
            c = tf.sigmoid(f + FORGET_BIAS) * c + tf.sigmoid(i) * tf.tanh(j)
            h = tf.sigmoid(o) * tf.tanh(c)
        return h, (c, h)

    def run(self, inputs, state, dropout: float, reverse: bool = False):
        """Outputs for every step of ``inputs`` (in input order) and the final state."""
        order = range(len(inputs) - 1, -1, -1) if reverse else range(len(inputs))
        outputs = [None] * len(inputs)
        for t in order:
            outputs[t], state = self.step(layers.dropout(inputs[t], dropout), state, t)
        return outputs, state


class _NormedBahdanauAttention:
    """score(q, k_s) = g * v/|v| . tanh(W_m m_s + W_q q + b); context = softmax(score) . m."""

    def __init__(self, memory: tf.Tensor, num_units: int):
        self.memory = memory  # [batch, source steps, memory width]
        batch, steps, width = memory.shape
        with tf.compat.v1.variable_scope("attention"):
            self.query_kernel = layers.variable("query_kernel", [num_units, num_units], None)
            memory_kernel = layers.variable("memory_kernel", [width, num_units], None)
            v = layers.variable("v", [num_units], None)
            g = layers.variable(
                "g", [], tf.compat.v1.constant_initializer(np.sqrt(1.0 / num_units))
            )
            self.bias = layers.variable("bias", [num_units], tf.compat.v1.zeros_initializer())
            self.normed_v = g * v * tf.math.rsqrt(tf.reduce_sum(tf.square(v)))
            self.keys = tf.reshape(
                tf.matmul(tf.reshape(memory, [-1, width]), memory_kernel),
                [batch, steps, num_units],
                name="keys",
            )

    def context(self, query: tf.Tensor, t: int) -> tf.Tensor:
        with tf.name_scope(f"attention/t{t}"):
            processed = tf.expand_dims(tf.matmul(query, self.query_kernel), 1)
            scores = tf.reduce_sum(
                self.normed_v * tf.tanh(self.keys + processed + self.bias), axis=2
            )
            alignments = tf.nn.softmax(scores)
            return tf.squeeze(tf.matmul(tf.expand_dims(alignments, 1), self.memory), axis=1)


def build(
    batch_size: int = 32,
    num_layers: int = 4,
    num_units: int = 256,
    vocab_size: int = 4096,
    seq_len: int = 20,
    bidirectional: bool = True,
    residual: bool = True,
    dropout: float = 0.2,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The GNMT v2 training step.

    Parameters:
        batch_size: sentence pairs per step.
        num_layers: LSTM layers in the encoder (the bidirectional layer counts as one) and in
            the decoder; GNMT used 8, Baechi 4.
        num_units: LSTM units per layer, also the embedding and attention width.
        vocab_size: source and target vocabulary size.
        seq_len: source and target sentence length (time steps unrolled).
        bidirectional: make the first encoder layer bidirectional (needs ``num_layers`` >= 2).
        residual: residual connections on layers 2 and up.
        dropout: drop probability of every cell input; 0 removes the ops.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Raises:
        ValueError: ``num_layers`` < 1, or < 2 with ``bidirectional``.

    Feeds: ``source:0``, ``target_input:0``, ``target_output:0``, each int32
    [batch_size, seq_len].
    """
    config = dict(locals())
    if num_layers < (2 if bidirectional else 1):
        raise ValueError(
            f"gnmt_v2 needs num_layers >= {2 if bidirectional else 1}"
            f"{' with a bidirectional first layer' if bidirectional else ''}, got {num_layers}"
        )

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        source_ids = rng.integers(1, vocab_size, (batch_size, seq_len), dtype=np.int32)
        target_ids = rng.integers(1, vocab_size, (batch_size, seq_len), dtype=np.int32)
        start = np.zeros((batch_size, 1), dtype=np.int32)
        source = layers.input_placeholder(feeds, "source", source_ids)
        target_input = layers.input_placeholder(
            feeds, "target_input", np.concatenate([start, target_ids[:, :-1]], axis=1)
        )
        target_output = layers.input_placeholder(feeds, "target_output", target_ids)

        with tf.compat.v1.variable_scope(
            "gnmt", initializer=tf.compat.v1.random_uniform_initializer(-INIT_SCALE, INIT_SCALE)
        ):
            with tf.compat.v1.variable_scope("embeddings"):
                source_table = layers.variable("source", [vocab_size, num_units], None)
                target_table = layers.variable("target", [vocab_size, num_units], None)
            zero_state = (tf.zeros([batch_size, num_units]),) * 2

            with tf.compat.v1.variable_scope("encoder"):
                inputs = tf.unstack(layers.embedding(source, source_table), axis=1)
                final_states = []
                first_uni = 0
                if bidirectional:
                    forward_outputs, _ = _LSTM(num_units, num_units, "bidi_fw").run(
                        inputs, zero_state, dropout
                    )
                    backward_outputs, backward_state = _LSTM(num_units, num_units, "bidi_bw").run(
                        inputs, zero_state, dropout, reverse=True
                    )
                    inputs = [
                        tf.concat(pair, axis=1) for pair in zip(forward_outputs, backward_outputs)
                    ]
                    final_states.append(backward_state)
                    first_uni = 1
                for i in range(first_uni, num_layers):
                    lstm = _LSTM(int(inputs[0].shape[-1]), num_units, f"layer_{i}")
                    outputs, state = lstm.run(inputs, zero_state, dropout)
                    if residual and i >= 2:
                        outputs = [x + y for x, y in zip(inputs, outputs)]
                    inputs = outputs
                    final_states.append(state)
                memory = tf.stack(inputs, axis=1, name="memory")

            with tf.compat.v1.variable_scope("decoder"):
                attention = _NormedBahdanauAttention(memory, num_units)
                cells = [
                    _LSTM(2 * num_units, num_units, f"layer_{i}") for i in range(num_layers)
                ]
                states = list(final_states)
                context = tf.zeros([batch_size, num_units])
                embedded = tf.unstack(layers.embedding(target_input, target_table), axis=1)
                top_outputs = []
                for t, x in enumerate(embedded):
                    x = tf.concat([x, context], axis=1)
                    x, states[0] = cells[0].step(layers.dropout(x, dropout), states[0], t)
                    context = attention.context(x, t)
                    for i in range(1, num_layers):
                        below = x
                        x, states[i] = cells[i].step(
                            layers.dropout(tf.concat([below, context], axis=1), dropout),
                            states[i],
                            t,
                        )
                        if residual and i >= 2:
                            x = x + below
                    top_outputs.append(x)
                logits = layers.dense(
                    tf.reshape(tf.stack(top_outputs, axis=1), [-1, num_units]),
                    vocab_size,
                    "output_projection",
                    use_bias=False,
                )
        return layers.cross_entropy(logits, tf.reshape(target_output, [-1])), feeds

    return build_training_step("gnmt_v2", config, forward)
