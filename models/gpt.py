"""Decoder-only pre-LayerNorm GPT (linen) with tied input/output embeddings.

Optional `scan_layers` (one `nn.scan`-ed Block with params stacked on a leading layer axis)
and `remat` (Block wrapped in `nn.remat`).
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

LN_EPS = 1e-5  # GPT-2 value


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int | None = None  # None -> 4 * d_model (kept None so overriding d_model follows)
    batch_size: int = 4
    dtype: str = "float32"  # params and compute; loss is always f32
    scan_layers: bool = False
    remat: bool = False
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by num_heads={self.num_heads}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model


CONFIGS = {
    "debug": GPTConfig(),
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, num_heads=12, num_layers=12, batch_size=8),
    "gpt2-medium": GPTConfig(vocab_size=50257, seq_len=1024, d_model=1024, num_heads=16, num_layers=24, batch_size=8),
    # ~175B params: abstract use only.
    "gpt3-175b": GPTConfig(vocab_size=50257, seq_len=2048, d_model=12288, num_heads=96, num_layers=96, batch_size=1),
}


class Block(nn.Module):
    config: GPTConfig
    scanned: bool = False  # under nn.scan the body must return (carry, per-step output)

    @nn.compact
    def __call__(self, x: jax.Array):
        c = self.config
        dt = to_dtype(c.dtype)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln1")(x)
        x = x + SelfAttention(c.num_heads, causal=True, dtype=dt, name="attn")(h)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln2")(x)
        h = nn.Dense(c.ff_dim, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc1")(h)
        h = nn.gelu(h)
        x = x + nn.Dense(c.d_model, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc2")(h)
        return (x, None) if self.scanned else x


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int [B, S] (S <= seq_len) -> logits [B, S, vocab]."""
        c = self.config
        dt = to_dtype(c.dtype)
        wte = nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        block_cls = nn.remat(Block) if c.remat else Block
        if c.scan_layers:
            blocks = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.num_layers,
            )(c, scanned=True, name="blocks")
            x, _ = blocks(x)
        else:
            for i in range(c.num_layers):
                x = block_cls(c, name=f"block_{i}")(x)
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln_f")(x)
        return wte.attend(x)  # tied output embedding


def next_token_batch(key: jax.Array, c: GPTConfig) -> Batch:
    """{"inputs", "targets"}: int32 [B, S]; targets are inputs shifted left by one."""
    tokens = jax.random.randint(key, (c.batch_size, c.seq_len + 1), 0, c.vocab_size, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@register("gpt", CONFIGS)
class GPTModel(Model):
    """Batch: {"inputs": int32 [B, S], "targets": int32 [B, S]} (next-token targets)."""

    @property
    def module(self) -> GPT:
        return GPT(self.config)

    def init(self, key: jax.Array) -> PyTree:
        return self.module.init(key, jnp.zeros((1, self.config.seq_len), jnp.int32))["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        return lm_loss(self.module.apply({"params": params}, batch["inputs"]), batch["targets"])

    def _param_count_proxy(self) -> Model:
        cfg = dataclasses.replace(self.config, scan_layers=True, remat=False)
        return type(self)(self.name, self.config_name, cfg)

    def _make_batch(self, key: jax.Array) -> Batch:
        return next_token_batch(key, self.config)
