"""DLRM (linen), the GraphPipe benchmark (Jeon et al. 2024, appendix A.2): `num_dense` dense-feature
branches (`dense_{b}/fc_{i}`, Dense + ReLU) and `num_sparse` embedding-bag branches
(`embedding_{b}`: a [num_entries, emb_dim] table, a bag of `bag_size` ids per sample, summed),
concatenated, then a top MLP (`top/fc_{i}`, the last one a single logit); binary cross-entropy.

The interaction is concatenation: GraphPipe concatenates the branches, and FlexFlow's DLRM (its
base) supports only "cat"; DLRM's pairwise-dot interaction needs every feature vector at the
embedding width, which the 4096-wide dense branches are not. Bags are summed (EmbeddingBag
mode "sum", FlexFlow's AGGR_MODE_SUM). The top MLP's depth is not given: 4 hidden layers.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    num_dense: int = 7       # dense-feature branches
    num_sparse: int = 7      # embedding-bag branches
    dense_dim: int = 32      # width of each dense feature input
    dense_layers: int = 4
    hidden: int = 32         # dense branch and top MLP width
    num_entries: int = 1000  # rows per embedding table
    emb_dim: int = 8
    bag_size: int = 4
    top_layers: int = 4      # hidden layers of the top MLP, then a Dense(1) logit
    batch_size: int = 8
    dtype: str = "float32"
    learning_rate: float = 1e-3


CONFIGS = {
    "debug": DLRMConfig(),
    # GraphPipe A.2: 7 dense branches x 4 layers (features and layers 4096 wide), 7 embedding
    # bags (1M x 64, bag 100), top MLP 4096 wide; mini-batch 256 (their 4-GPU setting).
    "dlrm-paper": DLRMConfig(dense_dim=4096, hidden=4096, num_entries=1_000_000, emb_dim=64, bag_size=100,
                             batch_size=256),
}


class MLPBranch(nn.Module):
    config: DLRMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        for i in range(c.dense_layers):
            x = nn.relu(nn.Dense(c.hidden, dtype=dt, param_dtype=dt, name=f"fc_{i}")(x))
        return x


class Top(nn.Module):
    config: DLRMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        for i in range(c.top_layers):
            x = nn.relu(nn.Dense(c.hidden, dtype=dt, param_dtype=dt, name=f"fc_{i}")(x))
        return nn.Dense(1, dtype=dt, param_dtype=dt, name=f"fc_{c.top_layers}")(x)[:, 0]


class DLRM(nn.Module):
    config: DLRMConfig

    @nn.compact
    def __call__(self, dense: list[jax.Array], sparse: list[jax.Array]) -> jax.Array:
        """num_dense float [B, dense_dim], num_sparse int [B, bag_size] -> logits [B]."""
        c = self.config
        dt = to_dtype(c.dtype)
        feats = [MLPBranch(c, name=f"dense_{b}")(x) for b, x in enumerate(dense)]
        for b, ids in enumerate(sparse):
            table = nn.Embed(c.num_entries, c.emb_dim, dtype=dt, param_dtype=dt,
                             embedding_init=nn.initializers.uniform(scale=c.num_entries ** -0.5),
                             name=f"embedding_{b}")
            feats.append(jnp.sum(table(ids), axis=1))  # embedding bag, mode "sum"
        return Top(c, name="top")(jnp.concatenate(feats, axis=-1))


@register("dlrm", CONFIGS)
class DLRMModel(Model):
    """Batch: {"dense_{b}": float [B, dense_dim] (dtype = config.dtype), "sparse_{b}": int32
    [B, bag_size], "labels": float32 [B] in {0, 1}}. Loss: sigmoid binary cross-entropy."""

    @property
    def module(self) -> DLRM:
        return DLRM(self.config)

    def _inputs(self, batch: Batch) -> tuple[list[jax.Array], list[jax.Array]]:
        c = self.config
        return [batch[f"dense_{b}"] for b in range(c.num_dense)], [batch[f"sparse_{b}"] for b in range(c.num_sparse)]

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        dense = [jnp.zeros((1, c.dense_dim), to_dtype(c.dtype))] * c.num_dense
        sparse = [jnp.zeros((1, c.bag_size), jnp.int32)] * c.num_sparse
        return self.module.init(key, dense, sparse)["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits = self.module.apply({"params": params}, *self._inputs(batch))
        return optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), batch["labels"]).mean()

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        dt = to_dtype(c.dtype)
        keys = jax.random.split(key, c.num_dense + c.num_sparse + 1)
        batch = {f"dense_{b}": jax.random.normal(keys[b], (c.batch_size, c.dense_dim), dt) for b in range(c.num_dense)}
        for b in range(c.num_sparse):
            batch[f"sparse_{b}"] = jax.random.randint(keys[c.num_dense + b], (c.batch_size, c.bag_size), 0,
                                                      c.num_entries, jnp.int32)
        batch["labels"] = jax.random.bernoulli(keys[-1], 0.5, (c.batch_size,)).astype(jnp.float32)
        return batch
