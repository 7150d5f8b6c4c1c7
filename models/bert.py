"""Encoder-only post-LayerNorm BERT (linen) with a masked-LM head tied to the word embedding.

Configs include BERT-large and RaNNC's enlarged BERTs ("bert-h{H}-l{L}", abstract use only).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._layers import INIT, SelfAttention
from ._registry import register

LN_EPS = 1e-12  # BERT value
MASK_PROB = 0.15


@dataclasses.dataclass(frozen=True)
class BERTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    hidden: int = 32
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int | None = None  # None -> 4 * hidden
    type_vocab_size: int = 2
    batch_size: int = 4
    dtype: str = "float32"
    scan_layers: bool = False
    remat: bool = False
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} not divisible by num_heads={self.num_heads}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.hidden


def _enlarged(hidden: int, layers: int) -> BERTConfig:
    # RaNNC (Tanaka et al., IPDPS'21) enlarged BERT: head dim 64, ff = 4H, seq 512, batch 256.
    return BERTConfig(vocab_size=30522, seq_len=512, hidden=hidden, num_heads=hidden // 64,
                      num_layers=layers, batch_size=256)


CONFIGS = {
    "debug": BERTConfig(),
    "bert-large": BERTConfig(vocab_size=30522, seq_len=512, hidden=1024, num_heads=16, num_layers=24,
                             d_ff=4096, batch_size=32),
    **{f"bert-h{h}-l{n}": _enlarged(h, n) for h in (1024, 1536, 2048) for n in (24, 48, 96, 144, 192, 256)},
}


class EncoderLayer(nn.Module):
    config: BERTConfig
    scanned: bool = False  # under nn.scan the body must return (carry, per-step output)

    @nn.compact
    def __call__(self, x: jax.Array):
        c = self.config
        dt = to_dtype(c.dtype)
        x = x + SelfAttention(c.num_heads, causal=False, dtype=dt, name="attn")(x)
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln1")(x)
        h = nn.Dense(c.ff_dim, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc1")(x)
        h = nn.Dense(c.hidden, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc2")(nn.gelu(h))
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln2")(x + h)
        return (x, None) if self.scanned else x


class BERT(nn.Module):
    config: BERTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, type_ids: jax.Array) -> jax.Array:
        """tokens, type_ids int [B, S] -> MLM logits [B, S, vocab]."""
        c = self.config
        dt = to_dtype(c.dtype)
        emb = lambda n, name: nn.Embed(n, c.hidden, dtype=dt, param_dtype=dt, embedding_init=INIT, name=name)
        word_emb = emb(c.vocab_size, "word_emb")
        x = word_emb(tokens) + emb(c.seq_len, "pos_emb")(jnp.arange(tokens.shape[1]))[None]
        x = x + emb(c.type_vocab_size, "type_emb")(type_ids)
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="emb_ln")(x)
        layer_cls = nn.remat(EncoderLayer) if c.remat else EncoderLayer
        if c.scan_layers:
            layers = nn.scan(layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=c.num_layers)(c, scanned=True, name="layers")
            x, _ = layers(x)
        else:
            for i in range(c.num_layers):
                x = layer_cls(c, name=f"layer_{i}")(x)
        # MLM head: transform, then decode with the tied word embedding plus an output bias.
        x = nn.gelu(nn.Dense(c.hidden, dtype=dt, param_dtype=dt, kernel_init=INIT, name="mlm_dense")(x))
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="mlm_ln")(x)
        bias = self.param("mlm_bias", nn.initializers.zeros, (c.vocab_size,), dt)
        return word_emb.attend(x) + bias


@register("bert", CONFIGS)
class BERTModel(Model):
    """Batch: {"tokens", "type_ids", "targets": int32 [B, S], "weights": float32 [B, S]};
    loss = sum(weights * CE(logits, targets)) / sum(weights), weights = 1 at masked positions."""

    @property
    def module(self) -> BERT:
        return BERT(self.config)

    def init(self, key: jax.Array) -> PyTree:
        zeros = jnp.zeros((1, self.config.seq_len), jnp.int32)
        return self.module.init(key, zeros, zeros)["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits = self.module.apply({"params": params}, batch["tokens"], batch["type_ids"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        w = batch["weights"].astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

    def _param_count_proxy(self) -> Model:
        cfg = dataclasses.replace(self.config, scan_layers=True, remat=False)
        return type(self)(self.name, self.config_name, cfg)

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        shape = (c.batch_size, c.seq_len)
        k_tok, k_mask, k_rand = jax.random.split(key, 3)
        targets = jax.random.randint(k_tok, shape, 0, c.vocab_size, jnp.int32)
        masked = jax.random.bernoulli(k_mask, MASK_PROB, shape)
        # Masked positions see a random token (stand-in for [MASK]), so targets are not copyable.
        tokens = jnp.where(masked, jax.random.randint(k_rand, shape, 0, c.vocab_size, jnp.int32), targets)
        type_ids = (jnp.arange(c.seq_len) >= c.seq_len // 2).astype(jnp.int32)  # two segments
        return {
            "tokens": tokens,
            "type_ids": jnp.broadcast_to(type_ids, shape),
            "targets": targets,
            "weights": masked.astype(jnp.float32),
        }
