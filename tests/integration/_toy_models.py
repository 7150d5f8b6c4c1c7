"""Small Flax models used only by the tests: a T5-like encoder-decoder (two layer types) and a
plain-jax MLP with a list of layer dicts (no module names at all)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class EncoderLayer(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln1")(x)
        h = nn.Dense(self.d, name="attn_out")(jax.nn.softmax(h @ h.swapaxes(-1, -2)) @ h)
        x = x + h
        h = nn.LayerNorm(name="ln2")(x)
        return x + nn.Dense(self.d, name="fc2")(jax.nn.relu(nn.Dense(4 * self.d, name="fc1")(h)))


class DecoderLayer(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x, memory):
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.Dense(self.d, name="self_out")(jax.nn.softmax(h @ h.swapaxes(-1, -2)) @ h)
        h = nn.LayerNorm(name="ln2")(x)
        q = nn.Dense(self.d, name="cross_q")(h)
        x = x + nn.Dense(self.d, name="cross_out")(jax.nn.softmax(q @ memory.swapaxes(-1, -2))
                                                    @ memory)
        h = nn.LayerNorm(name="ln3")(x)
        return x + nn.Dense(self.d, name="fc2")(jax.nn.relu(nn.Dense(4 * self.d, name="fc1")(h)))


class TinyT5(nn.Module):
    layers: int = 3
    d: int = 16
    vocab: int = 32

    @nn.compact
    def __call__(self, src, tgt):
        emb = nn.Embed(self.vocab, self.d, name="shared")
        x = emb(src)
        for i in range(self.layers):
            x = EncoderLayer(self.d, name=f"encoder_block_{i}")(x)
        memory = nn.LayerNorm(name="encoder_final_ln")(x)
        y = emb(tgt)
        for i in range(self.layers):
            y = DecoderLayer(self.d, name=f"decoder_block_{i}")(y, memory)
        y = nn.LayerNorm(name="decoder_final_ln")(y)
        return emb.attend(y)


def t5_step_and_args(layers: int = 3):
    model = TinyT5(layers=layers)
    src = jnp.zeros((2, 8), jnp.int32)
    tgt = jnp.zeros((2, 6), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), src, tgt)
    opt = optax.adamw(1e-3)
    opt_state = jax.eval_shape(opt.init, params)

    def loss(p, batch):
        logits = model.apply(p, batch["src"], batch["tgt"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()

    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        with jax.named_scope("optimizer"):
            updates, s = opt.update(grads, s, p)
            p = optax.apply_updates(p, updates)
        return p, s, value

    batch = {"src": jax.ShapeDtypeStruct((2, 8), jnp.int32),
             "tgt": jax.ShapeDtypeStruct((2, 6), jnp.int32)}
    return step, (params, opt_state, batch)


def plain_mlp_step_and_args(layers: int = 4, width: int = 16, batch: int = 8):
    """A plain-jax MLP: params {"layers": [{"w", "b"}, ...], "head": {...}}, SGD by hand."""
    key = jax.random.key(0)
    params = {"layers": [{"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) * 0.1,
                          "b": jnp.zeros((width,))} for i in range(layers)],
              "head": {"w": jnp.ones((width, 1)) * 0.1}}

    def loss(p, x, y):
        for layer in p["layers"]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean((x @ p["head"]["w"] - y) ** 2)

    def step(p, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        p = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
        return p, value

    x = jnp.ones((batch, width))
    y = jnp.zeros((batch, 1))
    return step, (params, x, y)
