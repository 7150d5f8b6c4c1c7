"""CANDLE-Uno (linen), the GraphPipe benchmark (Jeon et al. 2024, appendix A.2): `num_branches`
parallel feature encoders (`branch_{b}/dense_{i}`, Dense + ReLU) on separate float inputs,
concatenated, then a top MLP (`top/dense_{i}`, the last one a single regression output); MSE loss.

GraphPipe gives 7 branches of 4 feed-forward layers, all 4096 wide, but not the input widths (the
original Uno's inputs are 942 to 5270 wide); all branches here take `feature_dim` features, so
the branches are identical. The top MLP's depth is not given either: 4 hidden layers, as in the
FlexFlow CANDLE-Uno example GraphPipe builds on.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register


@dataclasses.dataclass(frozen=True)
class CandleUnoConfig:
    num_branches: int = 7
    branch_layers: int = 4
    top_layers: int = 4      # hidden layers of the top MLP, then a Dense(1) output
    hidden: int = 32
    feature_dim: int = 32
    batch_size: int = 8
    dtype: str = "float32"
    learning_rate: float = 1e-3


CONFIGS = {
    "debug": CandleUnoConfig(),
    # GraphPipe A.2: 7 branches x 4 layers, all 4096 wide; mini-batch 4096 (their 4-GPU setting).
    "candle-uno-paper": CandleUnoConfig(hidden=4096, feature_dim=4096, batch_size=4096),
}


class Branch(nn.Module):
    config: CandleUnoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        for i in range(c.branch_layers):
            x = nn.relu(nn.Dense(c.hidden, dtype=dt, param_dtype=dt, name=f"dense_{i}")(x))
        return x


class Top(nn.Module):
    config: CandleUnoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        for i in range(c.top_layers):
            x = nn.relu(nn.Dense(c.hidden, dtype=dt, param_dtype=dt, name=f"dense_{i}")(x))
        return nn.Dense(1, dtype=dt, param_dtype=dt, name=f"dense_{c.top_layers}")(x)


class CandleUno(nn.Module):
    config: CandleUnoConfig

    @nn.compact
    def __call__(self, features: list[jax.Array]) -> jax.Array:
        """num_branches float [B, feature_dim] -> prediction [B, 1]."""
        c = self.config
        encoded = [Branch(c, name=f"branch_{b}")(f) for b, f in enumerate(features)]
        return Top(c, name="top")(jnp.concatenate(encoded, axis=-1))


@register("candle_uno", CONFIGS)
class CandleUnoModel(Model):
    """Batch: {"features_{b}": float [B, feature_dim] for each branch b, "targets": float [B, 1]}
    (dtype = config.dtype). Loss: MSE."""

    @property
    def module(self) -> CandleUno:
        return CandleUno(self.config)

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        x = jnp.zeros((1, c.feature_dim), to_dtype(c.dtype))
        return self.module.init(key, [x] * c.num_branches)["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        features = [batch[f"features_{b}"] for b in range(self.config.num_branches)]
        pred = self.module.apply({"params": params}, features)
        return jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["targets"].astype(jnp.float32)))

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        dt = to_dtype(c.dtype)
        keys = jax.random.split(key, c.num_branches + 1)
        batch = {f"features_{b}": jax.random.normal(keys[b], (c.batch_size, c.feature_dim), dt)
                 for b in range(c.num_branches)}
        batch["targets"] = jax.random.normal(keys[-1], (c.batch_size, 1), dt)
        return batch
