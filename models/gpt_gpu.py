"""GPT as GPU training code writes it (Megatron-LM style), for the GPU-facing benches.

The zoo `gpt` keeps one dtype for parameters and compute and hand-writes attention so every op is
visible. Real GPU training (Megatron-LM, Shoeybi et al. 2019; Narayanan et al., SC'21) differs in
ways the cost model must see:

* mixed precision: float32 master parameters, matmuls and activations in half precision
  (`dtype`: "bfloat16" by default, "float16" as the A100 runs of SC'21, "float32" for exact tests),
  the loss in float32;
* one fused qkv projection (`DenseGeneral` to (3, heads, head_dim)) instead of three;
* attention by `jax.nn.dot_product_attention(..., is_causal=True)`, which jax lowers to cuDNN flash
  attention on GPUs (`attention_impl="cudnn"` forces it, None lets jax pick, "xla" is the plain
  composition);
* pre-LayerNorm blocks, a 4h tanh-GELU MLP, learned positions, an output embedding tied to the
  input one (Megatron's default), final LayerNorm.

No dropout: Megatron-LM trained with 0.1 (attention and hidden); see bench/published_runs.py for how
that is (not) priced.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register

LN_EPS = 1e-5                                  # Megatron-LM's --layernorm-epsilon default
INIT = nn.initializers.normal(stddev=0.02)     # Megatron-LM's --init-method-std default
PARAM_DTYPE = jnp.float32                      # master weights (Micikevicius et al., mixed precision)


@dataclasses.dataclass(frozen=True)
class GPTGPUConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    batch_size: int = 4
    dtype: str = "bfloat16"           # compute dtype; parameters are float32, the loss float32
    attention_impl: str | None = None  # jax.nn.dot_product_attention's `implementation`
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by num_heads={self.num_heads}")
        to_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# Published runs are sized by the benches' field overrides (bench/published_runs.py).
CONFIGS = {"debug": GPTGPUConfig()}


def _dense(features, cfg: GPTGPUConfig, name: str, **kw) -> nn.Module:
    return nn.DenseGeneral(features, dtype=to_dtype(cfg.dtype), param_dtype=PARAM_DTYPE, kernel_init=INIT,
                           name=name, **kw)


def _norm(cfg: GPTGPUConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LN_EPS, dtype=to_dtype(cfg.dtype), param_dtype=PARAM_DTYPE, name=name)


class Attention(nn.Module):
    config: GPTGPUConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        qkv = _dense((3, c.num_heads, c.head_dim), c, "qkv")(x)           # [B, S, 3, N, Hd]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=c.attention_impl)
        return _dense(c.d_model, c, "proj", axis=(-2, -1))(out)          # [B, S, N, Hd] -> [B, S, D]


class Block(nn.Module):
    config: GPTGPUConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x + Attention(c, name="attn")(_norm(c, "ln1")(x))
        h = _dense(4 * c.d_model, c, "fc1")(_norm(c, "ln2")(x))
        return x + _dense(c.d_model, c, "fc2")(nn.gelu(h, approximate=True))


class GPTGPU(nn.Module):
    config: GPTGPUConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int [B, S] (S <= seq_len) -> logits [B, S, vocab] in the compute dtype."""
        c = self.config
        dt = to_dtype(c.dtype)
        wte = nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=PARAM_DTYPE, embedding_init=INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.d_model, dtype=dt, param_dtype=PARAM_DTYPE, embedding_init=INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        for i in range(c.num_layers):
            x = Block(c, name=f"block_{i}")(x)
        return wte.attend(_norm(c, "ln_f")(x))      # tied output embedding


@register("gpt-gpu", CONFIGS)
class GPTGPUModel(Model):
    """Batch: {"inputs": int32 [B, S], "targets": int32 [B, S]} (next-token targets)."""

    @property
    def module(self) -> GPTGPU:
        return GPTGPU(self.config)

    def init(self, key: jax.Array) -> PyTree:
        return self.module.init(key, jnp.zeros((1, self.config.seq_len), jnp.int32))["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits = self.module.apply({"params": params}, batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        tokens = jax.random.randint(key, (c.batch_size, c.seq_len + 1), 0, c.vocab_size, jnp.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
