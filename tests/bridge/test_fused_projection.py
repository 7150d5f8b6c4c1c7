"""Fused q/k/v projections (GPT-2's `c_attn`, `Dense(3 * d)` + `jnp.split` in hand-written attention):
the trace exposes the composite dim (bridge/trace/fused.py), so a head-parallel plan moves no
activation, its compiled collectives match the plan, and the step trains as on one device."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoshard
from autoshard._src.bridge.trace.fused import expose_fused
from autoshard._src.tensor.factors import _merged_minor_dims

from .._reference import run_steps

HEADS, D, SEQ, BATCH, VOCAB = 8, 64, 16, 8, 128
MESH = {"data": 2, "model": 4}


class FusedAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        qkv = nn.Dense(3 * D)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        heads = lambda t: t.reshape(t.shape[:2] + (HEADS, D // HEADS))  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(x.shape)
        return nn.Dense(D)(o)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D)(ids)
        for _ in range(2):
            x = x + FusedAttention()(nn.LayerNorm()(x))
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL, OPT = TinyLM(), optax.adam(1e-3)


def _loss(params, batch):
    logits = MODEL.apply({"params": params}, batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(lambda p: _loss(p, batch))(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def _args():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    params = MODEL.init(jax.random.key(0), ids)["params"]
    return params, OPT.init(params), {"ids": ids, "labels": labels}


def _flat(args):
    return jax.tree.leaves(args)


def test_the_rewrite_removes_the_fused_split_and_concat_and_computes_the_same():
    args = _args()
    closed = jax.make_jaxpr(step)(*args)
    new = expose_fused(closed)
    names = lambda c: [e.primitive.name for e in c.jaxpr.eqns]  # noqa: E731
    assert names(closed).count("split") == 2 and names(new).count("split") == 0
    # the backward's concatenate of (B, S, 3*D) cotangents is gone: only chunk stacks remain
    fused_cat = [e for e in new.jaxpr.eqns if e.primitive.name == "concatenate"
                 and e.outvars[0].aval.shape == (BATCH, SEQ, 3 * D)]
    assert not fused_cat
    # the same matmuls: one per projection (no chunked dots), forward and backward
    assert names(closed).count("dot_general") == names(new).count("dot_general")
    got = jax.core.eval_jaxpr(new.jaxpr, new.consts, *_flat(args))
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *_flat(args))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_a_fused_value_read_elsewhere_is_left_as_traced():
    def f(w, x):
        y = x @ w
        q, k, v = jnp.split(y, 3, axis=-1)
        return (q * k * v).sum() + y.sum()       # y is read besides the split
    closed = jax.make_jaxpr(f)(jnp.ones((8, 24)), jnp.ones((4, 8)))
    assert expose_fused(closed) is closed


def test_a_merge_gathers_a_split_minor_dim_only():
    # (heads, head_dim) -> heads*head_dim: head_dim is merged into the heads' dim
    assert _merged_minor_dims((8, 16, 4, 16), (8, 16, 64)) == [3]
    assert _merged_minor_dims((8, 16, 64), (8, 16, 4, 16)) == []     # a split: any layout stays local
    assert _merged_minor_dims((3, 64, 64), (192, 64)) == [1]
    assert _merged_minor_dims((8, 1, 16), (8, 16)) == []


def test_a_head_parallel_plan_compiles_no_activation_reshuffle_and_matches_its_prediction():
    args = _args()
    plan = autoshard.expert_plan("data-megatron", step, *args, mesh=MESH, hardware="cpu-sim")
    specs = dict(zip(plan._args.keypaths, plan.input_specs_flat, strict=True))
    qkv = [k for k in specs if k.startswith("[0]") and "FusedAttention_0" in k and "Dense_0']['kernel" in k]
    assert qkv and all(specs[k] == ((), ()) for k in qkv)      # the fused kernel is stored whole ...
    a = autoshard.audit(plan, step, *args)
    kinds = {k.split("@")[0] for k in a.audited_collectives}
    assert not kinds & {"all-to-all", "collective-permute"}, a.report()   # ... and split by heads in compute
    # its gradient is gathered over the heads' axis (weight-sized), as the plan predicts
    assert a.predicted_collectives.get("all-gather@model", 0) > 0, a.report()
    assert a.fidelity_ok, a.report()


def test_the_auto_plan_trains_like_one_device():
    # SGD: Adam turns the key bias's zero gradient (softmax ignores a shift of the keys) into
    # rounding noise scaled up to the learning rate, under any change of summation order
    sgd = optax.sgd(0.1)

    def sgd_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: _loss(p, batch))(params)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, _, batch = _args()
    args = (params, sgd.init(params), batch)
    fast = autoshard.autoshard(sgd_step, mesh=MESH, hardware="cpu-sim")
    slow = jax.jit(sgd_step)
    got, p1, _ = run_steps(fast, *args, 3)
    want, p2, _ = run_steps(slow, *args, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    assert any(sp != ((),) * len(sp) for sp in fast.plan.input_specs_flat)     # something is split
    audit = autoshard.audit(fast.plan, sgd_step, *args)
    assert audit.fidelity_ok, audit.report()
