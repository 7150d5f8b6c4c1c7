"""The `gpt` model written in flax.nnx: same configs, same parameter names and count.

Deliberately carries no `jax.named_scope` calls: nnx programs have no module-name scopes in
their jaxprs, which is the case this model exists to exercise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register
from .gpt import CONFIGS, LN_EPS, GPTConfig, lm_loss, next_token_batch

INIT = nnx.initializers.normal(stddev=0.02)  # same init as the linen GPT


def _linear(d_in: int, d_out: int, dt: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, dtype=dt, param_dtype=dt, kernel_init=INIT, rngs=rngs)


def _ln(d: int, dt: jnp.dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=LN_EPS, dtype=dt, param_dtype=dt, rngs=rngs)


class SelfAttention(nnx.Module):
    """Causal multi-head attention with plain jnp ops; mirrors models._layers.SelfAttention."""

    def __init__(self, d: int, num_heads: int, dt: jnp.dtype, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.dtype = dt
        self.q = _linear(d, d, dt, rngs)
        self.k = _linear(d, d, dt, rngs)
        self.v = _linear(d, d, dt, rngs)
        self.o = _linear(d, d, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.num_heads
        q = self.q(x).reshape(b, s, h, d // h)
        k = self.k(x).reshape(b, s, h, d // h)
        v = self.v(x).reshape(b, s, h, d // h)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h).astype(self.dtype)
        scores = scores.astype(jnp.float32)
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return self.o(out)


class Block(nnx.Module):
    def __init__(self, c: GPTConfig, *, rngs: nnx.Rngs):
        dt = to_dtype(c.dtype)
        self.ln1 = _ln(c.d_model, dt, rngs)
        self.attn = SelfAttention(c.d_model, c.num_heads, dt, rngs=rngs)
        self.ln2 = _ln(c.d_model, dt, rngs)
        self.fc1 = _linear(c.d_model, c.ff_dim, dt, rngs)
        self.fc2 = _linear(c.ff_dim, c.d_model, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


@functools.partial(nnx.jit, static_argnums=0)
def _make_block(c: GPTConfig, key: jax.Array) -> Block:
    # Each block is built in its own (nested) trace. nnx's RNG counter update inspects
    # `tracer.sharding`, whose error message walks the whole enclosing jaxpr; in one flat trace
    # that made abstract init quadratic in depth (~45 s for gpt3-175b). Nested, it is linear.
    return Block(c, rngs=nnx.Rngs(key))


def _apply_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


class GPT(nnx.Module):
    def __init__(self, c: GPTConfig, *, rngs: nnx.Rngs):
        if c.scan_layers:
            raise ValueError("gpt_nnx does not support scan_layers=True; use the linen 'gpt' model")
        dt = to_dtype(c.dtype)
        self.remat = c.remat
        self.wte = nnx.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, rngs=rngs)
        self.wpe = nnx.Embed(c.seq_len, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, rngs=rngs)
        keys = jax.random.split(rngs.params(), c.num_layers)
        # flax >= 0.12 rejects plain lists of submodules as (static) attributes; nnx.List is a pytree.
        self.blocks = nnx.List([_make_block(c, keys[i]) for i in range(c.num_layers)])
        self.ln_f = _ln(c.d_model, dt, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int [B, S] (S <= seq_len) -> logits [B, S, vocab]."""
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        apply = nnx.remat(_apply_block) if self.remat else _apply_block
        for block in self.blocks:
            x = apply(block, x)
        return self.wte.attend(self.ln_f(x))  # tied output embedding


@register("gpt_nnx", CONFIGS)
class GPTNNXModel(Model):
    """Batch: {"inputs": int32 [B, S], "targets": int32 [B, S]}; params are an `nnx.State`."""

    def __init__(self, name: str, config_name: str, config: GPTConfig):
        if config.scan_layers:  # fail at get() time, not deep inside init
            raise ValueError("gpt_nnx does not support scan_layers=True; use the linen 'gpt' model")
        super().__init__(name, config_name, config)

    def init(self, key: jax.Array) -> PyTree:
        _, params = nnx.split(GPT(self.config, rngs=nnx.Rngs(key)))
        return params

    @functools.cached_property
    def graphdef(self) -> nnx.GraphDef:
        # Built abstractly: no parameter memory even for gpt3-175b.
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(self.config, rngs=nnx.Rngs(0))))
        return graphdef

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        model = nnx.merge(self.graphdef, params)
        return lm_loss(model(batch["inputs"]), batch["targets"])

    def _make_batch(self, key: jax.Array) -> Batch:
        return next_token_batch(key, self.config)
