"""The Transformer (Vaswani et al. 2017): encoder-decoder, or encoder-only (``decoder_layers=0``).

The base architecture of the paper: token embeddings scaled by sqrt(d_model) plus sinusoidal
position encodings; ``encoder_layers`` layers of multi-head self-attention and a ReLU
feed-forward network; ``decoder_layers`` layers of causal self-attention, attention over the
encoder output and a feed-forward network. Every sub-layer is ``LayerNorm(x + Dropout(f(x)))``
(post-norm, §5.4 dropout). One embedding matrix is shared by source, target and the pre-softmax
projection (§3.4). Layer norm and attention are written out with raw ops.

Encoder-only (``decoder_layers=0``) predicts one target token per source position from the
encoder output (a token tagger, the shape of a BERT-style masked-LM step). Batches are uniformly
random token ids; the decoder input is the target shifted right behind a start token (id 0).
All sequences are full length, so no padding mask is needed.

Reference: Vaswani, Shazeer, Parmar, Uszkoreit, Jones, Gomez, Kaiser & Polosukhin, "Attention
Is All You Need", NIPS 2017.
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
        batch_size=4, seq_len=8, vocab_size=64, d_model=32, num_heads=2, d_ff=64,
        encoder_layers=1, decoder_layers=1, dropout=0.1,
    ),
    "default": dict(
        batch_size=16, seq_len=32, vocab_size=4096, d_model=256, num_heads=4, d_ff=1024,
        encoder_layers=2, decoder_layers=2, dropout=0.1,
    ),
    "activations": dict(
        batch_size=16, seq_len=256, vocab_size=1024, d_model=128, num_heads=4, d_ff=512,
        encoder_layers=4, decoder_layers=0, dropout=0.1,
    ),
}

LAYER_NORM_EPSILON = 1e-6
MASKED_LOGIT = -1e9


def _positional_encoding(seq_len: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)  (§3.5)."""
    positions = np.arange(seq_len)[:, None]
    rates = 1.0 / np.power(10000.0, np.arange(0, d_model, 2) / d_model)
    encoding = np.zeros((seq_len, d_model), dtype=np.float32)
    encoding[:, 0::2] = np.sin(positions * rates)
    encoding[:, 1::2] = np.cos(positions * rates)[:, : d_model // 2]
    return encoding


def _layer_norm(x: tf.Tensor, name: str) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        width = x.shape[-1]
        gamma = layers.variable("gamma", [width], tf.compat.v1.ones_initializer())
        beta = layers.variable("beta", [width], tf.compat.v1.zeros_initializer())
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(variance + LAYER_NORM_EPSILON) * gamma + beta


class _Shapes:
    """Batch, length and head layout; activations are kept 2-D: [batch * length, d_model]."""

    def __init__(self, batch_size: int, seq_len: int, d_model: int, num_heads: int):
        self.batch_size, self.seq_len = batch_size, seq_len
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads

    def split_heads(self, x: tf.Tensor) -> tf.Tensor:
        """[batch * length, d_model] -> [batch, heads, length, head_dim]."""
        x = tf.reshape(x, [self.batch_size, self.seq_len, self.num_heads, self.head_dim])
        return tf.transpose(x, [0, 2, 1, 3])

    def merge_heads(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.transpose(x, [0, 2, 1, 3])
        return tf.reshape(x, [self.batch_size * self.seq_len, self.d_model])


def _attention(query_in, memory, shapes: _Shapes, mask, dropout, name):
    """Multi-head scaled dot-product attention (§3.2.2) of ``query_in`` over ``memory``."""
    with tf.compat.v1.variable_scope(name):
        d_model = shapes.d_model
        q = shapes.split_heads(layers.dense(query_in, d_model, "query", use_bias=False))
        k = shapes.split_heads(layers.dense(memory, d_model, "key", use_bias=False))
        v = shapes.split_heads(layers.dense(memory, d_model, "value", use_bias=False))
        logits = tf.matmul(q, k, transpose_b=True) * (shapes.head_dim ** -0.5)
        if mask is not None:
            logits += mask
        weights = layers.dropout(tf.nn.softmax(logits), dropout)
        context = shapes.merge_heads(tf.matmul(weights, v))
        return layers.dense(context, d_model, "output", use_bias=False)


def _feed_forward(x, d_ff, d_model, dropout, name):
    with tf.compat.v1.variable_scope(name):
        hidden = layers.dropout(layers.dense(x, d_ff, "hidden", activation=tf.nn.relu), dropout)
        return layers.dense(hidden, d_model, "output")


def _residual(x, sublayer_output, dropout, name):
    return _layer_norm(x + layers.dropout(sublayer_output, dropout), name)


def build(
    batch_size: int = 16,
    seq_len: int = 32,
    vocab_size: int = 4096,
    d_model: int = 256,
    num_heads: int = 4,
    d_ff: int = 1024,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    dropout: float = 0.1,
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    seed: int = 0,
) -> GraphItem:
    """The Transformer training step.

    Parameters:
        batch_size: sequences per step.
        seq_len: source and target length.
        vocab_size: shared vocabulary size.
        d_model: model width (512 in the paper's base model).
        num_heads: attention heads; must divide ``d_model``.
        d_ff: feed-forward inner width (2048 in the base model).
        encoder_layers: encoder layers (>= 1).
        decoder_layers: decoder layers; 0 makes an encoder-only model.
        dropout: residual, attention and feed-forward dropout; 0 removes the ops.
        optimizer: one of ``models.training.OPTIMIZER_NAMES``.
        learning_rate: ``None`` for the optimizer's default.
        seed: graph seed and batch seed.

    Raises:
        ValueError: ``num_heads`` does not divide ``d_model``, or ``encoder_layers`` < 1.

    Feeds: ``source:0`` and ``target_output:0``, int32 [batch_size, seq_len], and with a
    decoder ``target_input:0`` likewise.
    """
    config = dict(locals())
    if d_model % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    if encoder_layers < 1:
        raise ValueError(f"transformer needs encoder_layers >= 1, got {encoder_layers}")
    shapes = _Shapes(batch_size, seq_len, d_model, num_heads)

    def forward(rng: np.random.Generator):
        feeds: dict[str, np.ndarray] = {}
        source_ids = rng.integers(1, vocab_size, (batch_size, seq_len), dtype=np.int32)
        target_ids = rng.integers(1, vocab_size, (batch_size, seq_len), dtype=np.int32)
        source = layers.input_placeholder(feeds, "source", source_ids)
        target_output = layers.input_placeholder(feeds, "target_output", target_ids)
        table = layers.variable(
            "embedding",
            [vocab_size, d_model],
            tf.compat.v1.random_normal_initializer(stddev=d_model ** -0.5),
        )
        position = tf.constant(_positional_encoding(seq_len, d_model), name="position_encoding")

        def embed(ids, name):
            with tf.name_scope(name):
                x = layers.embedding(ids, table) * (d_model ** 0.5) + position
                return layers.dropout(tf.reshape(x, [-1, d_model]), dropout)

        with tf.compat.v1.variable_scope("encoder"):
            x = embed(source, "embed")
            for i in range(encoder_layers):
                with tf.compat.v1.variable_scope(f"layer_{i}"):
                    x = _residual(
                        x, _attention(x, x, shapes, None, dropout, "self_attention"),
                        dropout, "norm_attention",
                    )
                    x = _residual(
                        x, _feed_forward(x, d_ff, d_model, dropout, "feed_forward"),
                        dropout, "norm_feed_forward",
                    )
        if decoder_layers:
            memory = x
            start = np.zeros((batch_size, 1), dtype=np.int32)
            target_input = layers.input_placeholder(
                feeds, "target_input", np.concatenate([start, target_ids[:, :-1]], axis=1)
            )
            # Position j may attend to positions <= j only.
            causal_mask = tf.constant(
                np.triu(np.full((seq_len, seq_len), MASKED_LOGIT, dtype=np.float32), k=1),
                name="causal_mask",
            )
            with tf.compat.v1.variable_scope("decoder"):
                x = embed(target_input, "embed")
                for i in range(decoder_layers):
                    with tf.compat.v1.variable_scope(f"layer_{i}"):
                        x = _residual(
                            x, _attention(x, x, shapes, causal_mask, dropout, "self_attention"),
                            dropout, "norm_self_attention",
                        )
                        x = _residual(
                            x, _attention(x, memory, shapes, None, dropout, "encoder_attention"),
                            dropout, "norm_encoder_attention",
                        )
                        x = _residual(
                            x, _feed_forward(x, d_ff, d_model, dropout, "feed_forward"),
                            dropout, "norm_feed_forward",
                        )
        logits = tf.matmul(x, table, transpose_b=True, name="logits")
        return layers.cross_entropy(logits, tf.reshape(target_output, [-1])), feeds

    return build_training_step("transformer", config, forward)
