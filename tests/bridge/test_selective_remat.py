"""remat "selective" as emitted (bridge/emit/remat.py): each block holding attention runs under a
jax.checkpoint policy that drops exactly the [B, H, Sq, Skv] scores / probabilities (and their softmax
rows) from the saved residuals; gradients equal the step's; a block without attention runs as "none".

What is saved is checked on jax's residuals and the lowered program, not on XLA:CPU's
`memory_analysis()`: XLA:CPU's temp bytes do not drop under any remat policy (a GPT at S=256, 6
layers: none 30.4 MB, selective 31.0 MB, full 31.8 MB), and it merges the recomputed scores matmul
with the forward one (the lowered program has it, the compiled one not)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import autoshard
import models
from autoshard._src.bridge import compat as jc
from autoshard._src.bridge.emit.remat import attention_grids, remat_loss
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.attention import attention_cores, recomputed_ops

from .test_three_d import train_both

B, S, D, HEADS = 2, 64, 8, 2


class HandBlock(nn.Module):
    """Causal attention written out: einsum scores, scale, jnp.where mask, softmax, einsum values."""

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(D, name=n)(x).reshape(B, S, HEADS, D // HEADS) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // HEADS)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(B, S, D)
        return x + nn.Dense(D, name="o")(jnp.tanh(o))


class FlaxBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, name="mha")(x, x)
        return x + jnp.tanh(y)


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(D, name="fc")(x))


class Net(nn.Module):
    block: type

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = self.block(name=f"block_{i}")(x)
        return jnp.mean(x ** 2)


def setup(block):
    net = Net(block)
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    params = net.init(jax.random.key(0), x)["params"]
    return (lambda p, x: net.apply({"params": p}, x)), params, x, ("Net/block_0", "Net/block_1")


def residuals(loss, params, x):
    """(bytes of everything saved, shapes saved) of `loss`'s backward, arguments excluded."""
    saved = [a for a, src in saved_residuals(loss, params, x) if "argument" not in src]
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in saved), [tuple(a.shape) for a in saved]


@pytest.mark.parametrize("block", [pytest.param(HandBlock, marks=pytest.mark.slow), FlaxBlock])
@pytest.mark.slow
def test_only_the_scores_are_recomputed(block):
    loss, params, x, labels = setup(block)
    grid = (B, HEADS, S, S)
    prog = jc.flatten_calls(jax.make_jaxpr(loss)(params, x))
    assert set().union(*attention_grids(prog).values()) >= {grid}
    got = {}
    for policy in ("none", "selective", "full"):
        run = remat_loss(loss, policy, labels)
        got[policy] = residuals(run, params, x)
        grads = jax.grad(run)(params, x)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.grad(loss)(params, x)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (none, none_shapes), (sel, sel_shapes), (full, _) = got["none"], got["selective"], got["full"]
    assert none_shapes.count(grid) >= 2 * 2          # per block at least the exponentials and probabilities
    assert grid not in sel_shapes
    # everything else stays saved: selective frees at least the f32 grids, and keeps more than full
    assert none - sel >= 2 * 2 * math.prod(grid) * 4 and sel > full


@pytest.mark.slow
def test_the_lowered_step_reruns_the_scores_matmul_and_softmax_only():
    """Per block, selective adds one [B, H, S, S] matmul (the scores) and one exp (the softmax) to the
    lowered step and no other matmul; full reruns every forward matmul."""
    layers, seq = 2, 64
    m = models.get("gpt", "debug", seq_len=seq, d_model=16, num_heads=HEADS, num_layers=layers, batch_size=B,
                   vocab_size=32)
    params, batch = jax.jit(m.init)(jax.random.key(0)), m.batch()
    labels = tuple(f"GPT/block_{i}" for i in range(layers))
    grid = f"tensor<{B}x{HEADS}x{seq}x{seq}xf32>"

    def counts(policy):
        text = jax.jit(jax.value_and_grad(remat_loss(m.loss, policy, labels))).lower(params, batch).as_text()
        dots = Counter(re.findall(r"stablehlo.dot_general .*-> (tensor<[^>]*>)", text))
        return dots, text.count("stablehlo.exponential")

    (none, exp_none), (sel, exp_sel), (full, _) = counts("none"), counts("selective"), counts("full")
    assert sel - none == Counter({grid: layers}) and not none - sel
    assert exp_sel == exp_none + layers
    assert sum((full - none).values()) > 3 * layers


class DropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, dropout_rate=0.1, broadcast_dropout=False,
                                            deterministic=False, name="mha")(x, x)
        return x + jnp.tanh(y)


@pytest.mark.slow
def test_dropout_on_the_probabilities_is_regenerated_not_saved():
    """The dropout mask's random bits, drawn on the grid from a key the step takes, are recomputed
    (priced among the recomputed ops; emitted: no grid residual, the same gradients)."""
    net = Net(DropoutBlock)
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    params = net.init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, x)["params"]

    def loss(p, x, key):
        return net.apply({"params": p}, x, rngs={"dropout": key})

    key = jax.random.key(3)
    graph = trace(lambda p, x, k: jax.value_and_grad(loss)(p, x, k), params, x, key)
    for core in attention_cores(graph):
        assert "random_bits" in {graph.ops[i].primitive for i in recomputed_ops(graph, core)}
    run = remat_loss(loss, "selective", ("Net/block_0", "Net/block_1"))
    saved = [tuple(a.shape) for a, src in saved_residuals(run, params, x, key) if "argument" not in src]
    assert (B, HEADS, S, S) not in saved
    for a, b in zip(jax.tree.leaves(jax.grad(run)(params, x, key)), jax.tree.leaves(jax.grad(loss)(params, x, key)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_without_attention_selective_runs_as_none():
    loss, params, x, labels = setup(MlpBlock)
    prog = jc.flatten_calls(jax.make_jaxpr(loss)(params, x))
    assert attention_grids(prog) == {}
    run = remat_loss(loss, "selective", labels)
    text = str(jax.make_jaxpr(run)(params, x))
    assert "checkpoint" not in text and "remat" not in text
    assert residuals(run, params, x) == residuals(loss, params, x)


def _train(plan_kw, steps=3):
    return train_both("gpt", steps, **plan_kw)


@pytest.mark.slow
def test_3d_plan_with_selective_remat_trains_like_one_device():
    fast, *_ = _train(dict(mesh={"pipe": 2, "data": 2}, pipeline="auto", num_microbatches=2, hardware="cpu-sim",
                           pipeline_options={"remat": "selective"}))
    plan = fast.plan
    assert plan.is_pipeline and all(st.remat == "selective" for st in plan.stages)
    assert "selective" in plan.explain()
    # the same plan without remat: the stages' compiled programs rerun the softmax (one exp per block more)
    # and at most the scores matmul (XLA:CPU may merge its rerun with the forward's), no other matmul
    plain = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, remat="none") for st in plan.stages))
    none, *_ = _train(dict(plan=plain, hardware="cpu-sim"), steps=1)
    hlo = {r: f.pipelined.program.checked_hlo for r, f in (("selective", fast), ("none", none))}
    ops = {r: Counter(re.findall(r"= \S+ (\w[\w-]*)\(", text)) for r, text in hlo.items()}
    blocks = len(plan.predicted["3d"]["unit_labels"])
    assert ops["selective"]["exponential"] == ops["none"]["exponential"] + blocks
    assert ops["none"]["dot"] <= ops["selective"]["dot"] <= ops["none"]["dot"] + blocks


@pytest.mark.slow
def test_tensor_plan_with_selective_remat_trains_like_one_device():
    fast, m, params, batch = _train(dict(mesh={"pipe": 1, "data": 2, "model": 2}, pipeline="auto", num_microbatches=1,
                                         hardware="cpu-sim", pipeline_options={"remat": "selective"}))
    plan = fast.plan
    assert not plan.is_pipeline and plan.stages[0].remat == "selective"
    # replayed in the traced backward pass (bridge/emit/remat_jaxpr.py): one more softmax exp per block than
    # the same plan without remat compiles
    plain = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat="none"),))
    args = (params, m.optimizer.init(params), batch)
    hlo = {r: autoshard.autoshard(m.train_step, plan=p, hardware="cpu-sim").lower(*args).compile().as_text()
           for r, p in (("selective", plan), ("none", plain))}
    exps = {r: len(re.findall(r"= \S+ exponential\(", text)) for r, text in hlo.items()}
    assert exps["selective"] == exps["none"] + len(plan.predicted["3d"]["unit_labels"]), exps
