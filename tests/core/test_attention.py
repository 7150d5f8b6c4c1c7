"""Attention cores recognised from structure (core/attention.py) on traced steps: every way of writing
attention, the zoo models (every layer's attention, nothing else), and models without attention."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.attention import attention_cores

B, S, H, D = 2, 16, 4, 8
QKV = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)


def _step(attn):
    """A loss over attention's output, differentiated in q, k, v (the backward a train step has)."""
    def loss(q, k, v):
        return (attn(q, k, v).astype(jnp.float32) ** 2).sum()
    return lambda q, k, v: jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _tril():
    return jnp.tril(jnp.ones((S, S), bool))


def _einsum_where(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D)
    s = jnp.where(_tril(), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _additive_causal(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + jnp.where(_tril(), 0.0, -1e9), -1), v)


def _data_bias(q, k, v):
    bias = jnp.einsum("bqhd,bkhd->bhqk", q, q)[:, :1] * 0.1       # computed from the data: read by the kernel
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + bias, -1), v)


CASES = {
    "dot_product_attention causal": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), True),
    "dot_product_attention": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v), False),
    "einsum + where mask": (_einsum_where, True),
    "additive causal bias": (_additive_causal, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_way_of_writing_attention_is_one_core(name):
    attn, causal = CASES[name]
    g = trace(_step(attn), QKV, QKV, QKV)
    (core,) = attention_cores(g)
    assert core.dims == (B, H, S, S, D)
    assert core.causal is causal
    ops = g.ops
    assert ops[core.scores].primitive == ops[core.values].primitive == "dot_general"
    assert {ops[i].phase for i in core.forward} == {"forward"}
    assert {ops[i].phase for i in core.backward} == {"backward"}
    prims = {ops[i].primitive for i in core.forward}
    assert {"exp", "reduce_sum"} <= prims
    # the backward: dP, dV, dQ, dK
    assert sum(ops[i].primitive == "dot_general" for i in core.backward) == 4
    assert g.values[core.out].shape[0] == B and len(g.values[core.lse].shape) >= 3


def test_data_bias_is_read_by_the_kernel_and_its_matmul_is_no_attention():
    g = trace(_step(_data_bias), QKV, QKV, QKV)
    (core,) = attention_cores(g)          # q q^T feeds the bias but has no softmax before a values matmul
    assert not core.causal and len(core.extra) == 1
    assert g.ops[core.scores].in_shapes[1] == (B, S, H, D)


class _FlaxCausal(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(x, x, mask=mask)


def test_flax_multi_head_attention_with_a_causal_mask():
    m = _FlaxCausal()
    x = jax.ShapeDtypeStruct((B, S, H * D), jnp.float32)
    params = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)
    g = trace(lambda p, x: jax.value_and_grad(lambda p: (m.apply(p, x) ** 2).sum())(p), params, x)
    (core,) = attention_cores(g)
    assert core.dims == (B, H, S, S, D) and core.causal


# model, config overrides, {attention module: causal}
ZOO = {
    "gpt": ({}, {"GPT/block_0/attn": True, "GPT/block_1/attn": True}),
    "gpt-scan": ({"scan_layers": True}, {"GPT/blocks/attn": True}),
    "gpt-gpu": ({}, {"GPTGPU/block_0/attn": True, "GPTGPU/block_1/attn": True}),
    "bert": ({}, {"BERT/layer_0/attn": False, "BERT/layer_1/attn": False}),
    "t5": ({"target_len": 8}, {**{f"T5/encoder/layer_{i}/self_attn": False for i in range(2)},
                               **{f"T5/decoder/layer_{i}/self_attn": True for i in range(2)},
                               **{f"T5/decoder/layer_{i}/cross_attn": False for i in range(2)}}),
    "mlp": ({}, {}),
    "resnet": ({}, {}),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_every_attention_found_and_nothing_else(name):
    overrides, want = ZOO[name]
    m = models.get(name.removesuffix("-scan"), "debug", **overrides)
    g = trace(m.train_step, *m.abstract_state())
    cores = attention_cores(g)
    found = {g.ops[c.scores].module: c.causal for c in cores}
    assert found == want
    seen: set[int] = set()
    for c in cores:
        module = g.ops[c.scores].module
        ops = set(c.forward) | set(c.backward)
        assert not ops & seen                                  # cores do not overlap
        seen |= ops
        assert all(g.ops[i].module.startswith(module) for i in ops)   # nothing outside the attention
        assert c.backward, "the train step differentiates every attention"
    if name == "t5":     # cross-attention: 8 decoder queries over 16 encoder keys, with T5's position bias
        cross = [c for c in cores if "cross" in g.ops[c.scores].module]
        assert all(c.dims[2:4] == (8, 16) and not c.extra for c in cross)
        assert all(c.extra for c in cores if "self" in g.ops[c.scores].module)
