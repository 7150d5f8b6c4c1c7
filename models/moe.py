"""Switch-style mixture-of-experts decoder (linen): a pre-LayerNorm causal LM in which every other
layer's FFN (odd layers) is a top-1 routed mixture of experts (Fedus et al. 2021).

Routing is dense and static-shaped (Mesh-TF/GShard style): tokens are grouped per sequence, each
expert takes at most `capacity = ceil(capacity_factor * seq_len / num_experts)` tokens per group,
and dispatch/combine are one-hot [G, T, E, C] tensors applied with einsums; overflow tokens skip
the FFN (residual only). Expert kernels carry an explicit leading expert axis: `wi` [E, d, ff] and
`wo` [E, ff, d]. The loss adds the Switch load-balancing loss E * sum_e f_e * P_e of every MoE
layer, weighted by `aux_loss_weight` (0.01).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._layers import INIT, SelfAttention
from ._registry import register

LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 4    # layers 1, 3, 5, ... are MoE (Switch: every other FFN)
    d_ff: int = 64
    num_experts: int = 4
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    batch_size: int = 4
    dtype: str = "float32"  # params and compute; router and losses are always f32
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by num_heads={self.num_heads}")

    @property
    def capacity(self) -> int:
        """Tokens per expert per group (a group is one sequence)."""
        return max(1, math.ceil(self.capacity_factor * self.seq_len / self.num_experts))

    def is_moe(self, layer: int) -> bool:
        return layer % 2 == 1


CONFIGS = {
    "debug": MoEConfig(),
    # switch-base-8's dimensions (T5-base: d 768, ff 3072, 12 heads, vocab 32128; 8 experts,
    # capacity factor 1.25) as a 12-layer decoder-only LM with 6 MoE layers, seq 512:
    # 308.3M parameters: about half of the released encoder-decoder switch-base-8 (12 + 12 layers,
    # bias-free, about 620M), since it is one such stack (with biases) plus the embedding.
    "switch-base-8": MoEConfig(vocab_size=32128, seq_len=512, d_model=768, num_heads=12, num_layers=12,
                               d_ff=3072, num_experts=8, batch_size=128),
}


class MLP(nn.Module):
    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        h = nn.gelu(nn.Dense(c.d_ff, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc1")(x))
        return nn.Dense(c.d_model, dtype=dt, param_dtype=dt, kernel_init=INIT, name="fc2")(h)


class Experts(nn.Module):
    """E expert FFNs applied to their dispatched tokens [E, G, C, d] (batched einsums)."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        wi = self.param("wi", INIT, (c.num_experts, c.d_model, c.d_ff), dt)
        wo = self.param("wo", INIT, (c.num_experts, c.d_ff, c.d_model), dt)
        h = nn.gelu(jnp.einsum("egcd,edf->egcf", x, wi))
        return jnp.einsum("egcf,efd->egcd", h, wo)


class SwitchFFN(nn.Module):
    """Top-1 routed experts with a fixed capacity. Returns (output, load-balancing loss)."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        e, cap = c.num_experts, c.capacity
        # Router in f32 (Switch's selective precision).
        logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=to_dtype(c.dtype),
                          kernel_init=INIT, name="router")(x.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)                      # [G, T, E]
        expert = jnp.argmax(probs, axis=-1)                          # [G, T]
        gate = jnp.max(probs, axis=-1)                               # [G, T]
        mask = jax.nn.one_hot(expert, e, dtype=jnp.float32)          # [G, T, E]
        # Load balancing: fraction of tokens routed to each expert times its mean probability.
        aux = e * jnp.mean(jnp.sum(jnp.mean(mask, axis=1) * jnp.mean(probs, axis=1), axis=-1))
        # Position of each token in its expert's buffer; one_hot drops positions >= capacity.
        position = jnp.sum((jnp.cumsum(mask, axis=1) - 1.0) * mask, axis=-1).astype(jnp.int32)  # [G, T]
        slot = jax.nn.one_hot(position, cap, dtype=jnp.float32)     # [G, T, C]
        dispatch = mask[..., None] * slot[:, :, None, :]             # [G, T, E, C]
        combine = dispatch * gate[..., None, None]
        dt = x.dtype
        expert_in = jnp.einsum("gtec,gtd->egcd", dispatch.astype(dt), x)
        expert_out = Experts(c, name="experts")(expert_in)
        return jnp.einsum("gtec,egcd->gtd", combine.astype(dt), expert_out), aux


class Block(nn.Module):
    config: MoEConfig
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = to_dtype(c.dtype)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln1")(x)
        x = x + SelfAttention(c.num_heads, causal=True, dtype=dt, name="attn")(h)
        h = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln2")(x)
        if self.moe:
            y, aux = SwitchFFN(c, name="moe")(h)
            self.sow("intermediates", "aux_loss", aux)
        else:
            y = MLP(c, name="mlp")(h)
        return x + y


class MoETransformer(nn.Module):
    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int [B, S] -> logits [B, S, vocab] (aux losses sown in "intermediates")."""
        c = self.config
        dt = to_dtype(c.dtype)
        wte = nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.d_model, dtype=dt, param_dtype=dt, embedding_init=INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        for i in range(c.num_layers):
            x = Block(c, moe=c.is_moe(i), name=f"layer_{i}")(x)
        x = nn.LayerNorm(epsilon=LN_EPS, dtype=dt, param_dtype=dt, name="ln_f")(x)
        return wte.attend(x)  # tied output embedding


@register("moe", CONFIGS)
class MoEModel(Model):
    """Batch: {"inputs": int32 [B, S], "targets": int32 [B, S]} (next-token targets).
    Loss: token CE + aux_loss_weight * sum over MoE layers of the load-balancing loss."""

    @property
    def module(self) -> MoETransformer:
        return MoETransformer(self.config)

    def init(self, key: jax.Array) -> PyTree:
        return self.module.init(key, jnp.zeros((1, self.config.seq_len), jnp.int32))["params"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        logits, state = self.module.apply({"params": params}, batch["inputs"], mutable=["intermediates"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"]).mean()
        aux = sum(jax.tree.leaves(state.get("intermediates", {})), jnp.float32(0.0))
        return ce + self.config.aux_loss_weight * aux

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        tokens = jax.random.randint(key, (c.batch_size, c.seq_len + 1), 0, c.vocab_size, jnp.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
