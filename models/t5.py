"""T5 encoder-decoder (linen): pre-RMSNorm layers, bias-free projections, relative position bias.

Two variants, selected by config: the original T5 (ReLU FFN, LM head tied to the shared embedding
with the d_model**-0.5 rescale) and T5 v1.1 (gated-GELU FFN, untied LM head).

Each stack computes its relative position bias once (HF/Mesh-TF keep it in the first layer and
share it with the others); here it lives in the stack (`encoder/relative_attention_bias`) so all
layers of a stack have identical parameters: `encoder/layer_{i}` and `decoder/layer_{i}` are two
block types with `num_layers` instances each. The parameter count is unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register

RMS_EPS = 1e-6  # T5 value
NEG_INF = -1e9  # additive mask (scores are f32)


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 128
    seq_len: int = 16      # encoder input length
    target_len: int = 16   # decoder length
    d_model: int = 32
    d_kv: int = 8          # per-head dim; heads * d_kv need not equal d_model
    num_heads: int = 4
    num_layers: int = 2    # per stack (encoder and decoder each)
    d_ff: int = 64
    ffn: str = "relu"      # "relu" (T5) or "gated-gelu" (T5 v1.1)
    tie_embeddings: bool = True  # T5: LM head = shared embedding; v1.1: separate lm_head
    num_buckets: int = 32
    max_distance: int = 128
    batch_size: int = 4
    dtype: str = "float32"
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.ffn not in ("relu", "gated-gelu"):
            raise ValueError(f"ffn={self.ffn!r}; valid: ['gated-gelu', 'relu']")


CONFIGS = {
    "debug": T5Config(),
    # Raffel et al. 2020, "Large": 24+24 layers, d 1024, ff 4096, 16 heads x 64, vocab 32128.
    # Inputs 512 / targets 128 tokens (pre-training used 512/114), batch 128 as in the paper.
    # 737.67M parameters (the released checkpoint's count; the paper rounds it to "770M").
    "t5-large": T5Config(vocab_size=32128, seq_len=512, target_len=128, d_model=1024, d_kv=64,
                         num_heads=16, num_layers=24, d_ff=4096, batch_size=128),
    # T5 v1.1 large: gated-GELU FFN with d_ff 2816, untied LM head: 783.15M parameters.
    "t5-v1_1-large": T5Config(vocab_size=32128, seq_len=512, target_len=128, d_model=1024, d_kv=64,
                              num_heads=16, num_layers=24, d_ff=2816, ffn="gated-gelu",
                              tie_embeddings=False, batch_size=128),
}


def relative_position_bucket(q_len: int, k_len: int, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> np.ndarray:
    """T5's bucketing of (key - query) offsets: int [q_len, k_len], static (numpy), so the
    traced program only holds a constant and one embedding gather."""
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    buckets = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    large = max_exact + (np.log(np.maximum(rel, 1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(rel.dtype)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(rel < max_exact, rel, large)


class RelativeBias(nn.Module):
    """[1, heads, q, k] f32 additive attention bias from T5 relative position buckets."""

    config: T5Config
    bidirectional: bool

    @nn.compact
    def __call__(self, q_len: int, k_len: int) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        buckets = relative_position_bucket(q_len, k_len, self.bidirectional, c.num_buckets, c.max_distance)
        table = nn.Embed(c.num_buckets, c.num_heads, dtype=dt, param_dtype=dt,
                         embedding_init=nn.initializers.normal(stddev=c.d_model ** -0.5), name="embedding")
        return jnp.transpose(table(jnp.asarray(buckets)), (2, 0, 1))[None].astype(jnp.float32)


def _dense(features: int, fan_in: int, dt: jnp.dtype, name: str, scale: float = 1.0) -> nn.Dense:
    # T5 init: normal(fan_in**-0.5); q additionally gets d_kv**-0.5 (T5 does not scale scores).
    init = nn.initializers.normal(stddev=scale * fan_in ** -0.5)
    return nn.Dense(features, use_bias=False, dtype=dt, param_dtype=dt, kernel_init=init, name=name)


class T5Attention(nn.Module):
    """Multi-head attention of x over kv with an additive f32 bias (position bias and/or mask);
    plain einsums so every matmul is visible to the auto-sharder; submodules q, k, v, o."""

    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array, kv: jax.Array, bias: jax.Array | None) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        b, s, d = x.shape
        t = kv.shape[1]
        h, dk = c.num_heads, c.d_kv
        q = _dense(h * dk, d, dt, "q", scale=dk ** -0.5)(x).reshape(b, s, h, dk)
        k = _dense(h * dk, d, dt, "k")(kv).reshape(b, t, h, dk)
        v = _dense(h * dk, d, dt, "v")(kv).reshape(b, t, h, dk)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        if bias is not None:
            scores = scores + bias
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * dk)
        return _dense(d, h * dk, dt, "o")(out)


class FeedForward(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        if c.ffn == "relu":
            h = nn.relu(_dense(c.d_ff, c.d_model, dt, "wi")(x))
        else:  # gated-GELU (T5 v1.1, tanh-approximated GELU)
            h = nn.gelu(_dense(c.d_ff, c.d_model, dt, "wi_0")(x)) * _dense(c.d_ff, c.d_model, dt, "wi_1")(x)
        return _dense(c.d_model, c.d_ff, dt, "wo")(h)


def _norm(dt: jnp.dtype, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=RMS_EPS, dtype=dt, param_dtype=dt, name=name)


class EncoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        h = _norm(dt, "ln_self")(x)
        x = x + T5Attention(c, name="self_attn")(h, h, bias)
        return x + FeedForward(c, name="ffn")(_norm(dt, "ln_ffn")(x))


class DecoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, y: jax.Array, memory: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        h = _norm(dt, "ln_self")(y)
        y = y + T5Attention(c, name="self_attn")(h, h, bias)
        y = y + T5Attention(c, name="cross_attn")(_norm(dt, "ln_cross")(y), memory, None)
        return y + FeedForward(c, name="ffn")(_norm(dt, "ln_ffn")(y))


class Encoder(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        s = x.shape[1]
        bias = RelativeBias(c, bidirectional=True, name="relative_attention_bias")(s, s)
        for i in range(c.num_layers):
            x = EncoderLayer(c, name=f"layer_{i}")(x, bias)
        return _norm(to_dtype(c.dtype), "ln_f")(x)


class Decoder(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, y: jax.Array, memory: jax.Array) -> jax.Array:
        c = self.config
        t = y.shape[1]
        bias = RelativeBias(c, bidirectional=False, name="relative_attention_bias")(t, t)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        bias = jnp.where(causal, bias, NEG_INF)
        for i in range(c.num_layers):
            y = DecoderLayer(c, name=f"layer_{i}")(y, memory, bias)
        return _norm(to_dtype(c.dtype), "ln_f")(y)


class T5(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, inputs: jax.Array, decoder_inputs: jax.Array) -> jax.Array:
        """inputs int [B, S], decoder_inputs int [B, T] -> logits [B, T, vocab]."""
        c = self.config
        dt = to_dtype(c.dtype)
        shared = nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=dt,
                          embedding_init=nn.initializers.normal(stddev=1.0), name="shared")
        memory = Encoder(c, name="encoder")(shared(inputs))
        y = Decoder(c, name="decoder")(shared(decoder_inputs), memory)
        if c.tie_embeddings:
            return shared.attend(y * c.d_model ** -0.5)
        return _dense(c.vocab_size, c.d_model, dt, "lm_head")(y)


@register("t5", CONFIGS)
class T5Model(Model):
    """Batch: {"inputs": int32 [B, S], "decoder_inputs": int32 [B, T], "targets": int32 [B, T]};
    decoder_inputs are the targets shifted right (start token 0). Loss: mean token CE."""

    @property
    def module(self) -> T5:
        return T5(self.config)

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        return self.module.init(key, jnp.zeros((1, c.seq_len), jnp.int32),
                                jnp.zeros((1, c.target_len), jnp.int32))["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits = self.module.apply({"params": params}, batch["inputs"], batch["decoder_inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                               batch["targets"]).mean()

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        k_in, k_tgt = jax.random.split(key)
        inputs = jax.random.randint(k_in, (c.batch_size, c.seq_len), 0, c.vocab_size, jnp.int32)
        targets = jax.random.randint(k_tgt, (c.batch_size, c.target_len), 1, c.vocab_size, jnp.int32)
        start = jnp.zeros((c.batch_size, 1), jnp.int32)
        return {"inputs": inputs, "decoder_inputs": jnp.concatenate([start, targets[:, :-1]], axis=1),
                "targets": targets}
