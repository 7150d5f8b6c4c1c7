"""Linen layers shared by the linen transformers (gpt, bert)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

# GPT-2/BERT style init; also keeps tied-embedding logits small at init.
INIT = nn.initializers.normal(stddev=0.02)


class SelfAttention(nn.Module):
    """Multi-head softmax attention written with plain jnp ops (einsum, softmax) so every
    matmul is visible to the auto-sharder; submodules q, k, v, o."""

    num_heads: int
    causal: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.num_heads
        dense = lambda name: nn.Dense(d, dtype=self.dtype, param_dtype=self.dtype, kernel_init=INIT, name=name)
        q = dense("q")(x).reshape(b, s, h, d // h)
        k = dense("k")(x).reshape(b, s, h, d // h)
        v = dense("v")(x).reshape(b, s, h, d // h)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h).astype(self.dtype)
        scores = scores.astype(jnp.float32)  # softmax in f32 for bf16 stability
        if self.causal:
            mask = jnp.tril(jnp.ones((s, s), dtype=bool))
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return dense("o")(out)
