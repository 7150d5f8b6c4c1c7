"""Multi-Modal Transformer (linen), the GraphPipe benchmark (Jeon et al. 2024, appendix A.2):
`num_branches` parallel Transformer encoders, one per input modality, whose mean-pooled outputs
are concatenated and classified.

Each branch projects its float input features [B, S, feature_dim] with a Dense (`in_proj`), adds a
learned position embedding and runs `num_layers` pre-LayerNorm bidirectional layers
(`branch_{b}/layer_{i}`, all the same class and shapes, so grouping sees one block type with
num_branches * num_layers instances).
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

LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class MMTConfig:
    num_branches: int = 4
    num_layers: int = 2           # per branch
    seq_len: int = 8
    hidden: int = 32
    num_heads: int = 4
    d_ff: int | None = None       # None -> 4 * hidden
    feature_dim: int | None = None  # input feature width per modality; None -> hidden
    num_classes: int = 10
    batch_size: int = 4
    dtype: str = "float32"
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} not divisible by num_heads={self.num_heads}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.hidden

    @property
    def in_dim(self) -> int:
        return self.feature_dim if self.feature_dim is not None else self.hidden


CONFIGS = {
    "debug": MMTConfig(),
    # GraphPipe A.2: 4 branches x 8 layers, seq 256, hidden = embedding = 1024, 16 heads, ff 4096;
    # mini-batch 64 (their 4-GPU setting). The paper does not give a class count: 1000 here.
    "mmt-paper": MMTConfig(num_branches=4, num_layers=8, seq_len=256, hidden=1024, num_heads=16,
                           d_ff=4096, feature_dim=1024, num_classes=1000, batch_size=64),
}


class Layer(nn.Module):
    config: MMTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln1")(x)
        x = x + SelfAttention(c.num_heads, causal=False, dtype=dt, name="attn")(h)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln2")(x)
        h = nn.gelu(nn.Dense(c.ff_dim, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc1")(h))
        return x + nn.Dense(c.hidden, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc2")(h)


class Branch(nn.Module):
    """One modality: features [B, S, feature_dim] -> pooled [B, hidden]."""

    config: MMTConfig

    @nn.compact
    def __call__(self, feats: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        x = nn.Dense(c.hidden, dtype=dt, param_dtype=dt, kernel_init=INIT, name="in_proj")(feats)
        pos = nn.Embed(c.seq_len, c.hidden, dtype=dt, param_dtype=dt, embedding_init=INIT, name="pos_emb")
        x = x + pos(jnp.arange(feats.shape[1]))[None]
        for i in range(c.num_layers):
            x = Layer(c, name=f"layer_{i}")(x)
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln_f")(x)
        return jnp.mean(x, axis=1)


class MMT(nn.Module):
    config: MMTConfig

    @nn.compact
    def __call__(self, features: list[jax.Array]) -> jax.Array:
        """num_branches float [B, S, feature_dim] -> logits [B, num_classes]."""
        c = self.config
        dt = to_dtype(c.dtype)
        pooled = [Branch(c, name=f"branch_{b}")(f) for b, f in enumerate(features)]
        x = jnp.concatenate(pooled, axis=-1)
        return nn.Dense(c.num_classes, dtype=dt, param_dtype=dt, kernel_init=INIT, name="head")(x)


def _features(batch: Batch, n: int) -> list[jax.Array]:
    return [batch[f"features_{b}"] for b in range(n)]


@register("mmt", CONFIGS)
class MMTModel(Model):
    """Batch: {"features_{b}": float [B, S, feature_dim] for each branch b (dtype = config.dtype),
    "labels": int32 [B]}. Loss: softmax CE."""

    @property
    def module(self) -> MMT:
        return MMT(self.config)

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        x = jnp.zeros((1, c.seq_len, c.in_dim), to_dtype(c.dtype))
        return self.module.init(key, [x] * c.num_branches)["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits = self.module.apply({"params": params}, _features(batch, self.config.num_branches))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        keys = jax.random.split(key, c.num_branches + 1)
        shape = (c.batch_size, c.seq_len, c.in_dim)
        batch = {f"features_{b}": jax.random.normal(keys[b], shape, to_dtype(c.dtype)) for b in range(c.num_branches)}
        batch["labels"] = jax.random.randint(keys[-1], (c.batch_size,), 0, c.num_classes, jnp.int32)
        return batch
