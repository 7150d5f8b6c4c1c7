"""Alpa-style MLP benchmark model: (L-1) x [Dense(H) + relu] + Dense(out), MSE loss."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    num_layers: int = 4
    hidden_dim: int = 32
    in_dim: int = 32
    out_dim: int = 32
    batch_size: int = 8
    dtype: str = "float32"
    learning_rate: float = 1e-3


CONFIGS = {
    "debug": MLPConfig(),
    # Alpa's MLP benchmark shape: wide layers so intra-op (tensor) parallelism pays off.
    "alpa": MLPConfig(num_layers=8, hidden_dim=8192, in_dim=8192, out_dim=8192, batch_size=1024),
}


class MLP(nn.Module):
    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        for i in range(c.num_layers - 1):
            x = nn.relu(nn.Dense(c.hidden_dim, dtype=dt, param_dtype=dt, name=f"dense_{i}")(x))
        return nn.Dense(c.out_dim, dtype=dt, param_dtype=dt, name=f"dense_{c.num_layers - 1}")(x)


@register("mlp", CONFIGS)
class MLPModel(Model):
    """Batch: {"x": float [B, in_dim], "y": float [B, out_dim]} (dtype = config.dtype)."""

    @property
    def module(self) -> MLP:
        return MLP(self.config)

    def init(self, key: jax.Array) -> PyTree:
        x = jnp.zeros((1, self.config.in_dim), to_dtype(self.config.dtype))
        return self.module.init(key, x)["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        pred = self.module.apply({"params": params}, batch["x"])
        return jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["y"].astype(jnp.float32)))

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        dt = to_dtype(c.dtype)
        kx, ky = jax.random.split(key)
        return {
            "x": jax.random.normal(kx, (c.batch_size, c.in_dim), dt),
            "y": jax.random.normal(ky, (c.batch_size, c.out_dim), dt),
        }
