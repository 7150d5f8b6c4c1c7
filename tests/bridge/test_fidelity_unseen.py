"""Audit fidelity on models written here, not taken from the zoo (issue 32): small linen, nnx and
plain-jax train steps with SGD and Adam, planned on 1-D, 2-D and 3-D meshes with sequence
parallelism on and automatic, and compiled on 8 simulated CPU devices. For each, the compiled
program's collective bytes per kind and mesh axes are within 10 % of the plan's prediction and its
argument + temp memory within 15 %."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard
import models

BYTES_TOL, MEMORY_TOL = 0.10, 0.15


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _linen_step(model, opt, loss_of):
    """A train step of a linen `model`: the loss closes over the batch."""
    def step(params, opt_state, batch):
        def loss(p):
            return loss_of(model.apply({"params": p}, batch["x"]), batch["y"])
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def _mse(out, y):
    return jnp.mean((out - y) ** 2)


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _linen_case(model, opt, x, y, loss_of=_mse):
    params = model.init(jax.random.key(0), x)["params"]
    step = _linen_step(model, opt, loss_of)
    return step, _abstract((params, opt.init(params), {"x": x, "y": y}))


def check(plan, step, args):
    """Audit `plan` and assert the compiled program is within tolerance of the prediction, per
    collective kind and axes and on argument + temp memory; returns the audit."""
    a = autoshard.audit(plan, step, *args)
    for key in set(a.predicted_collectives) | set(a.audited_collectives):
        p = a.predicted_collectives.get(key, 0.0)
        c = a.audited_collectives.get(key, {"bytes": 0.0})["bytes"]
        assert abs(c - p) <= BYTES_TOL * max(p, c), (key, p, c, a.report())
    p, c = a.predicted_memory["argument+temp"], a.memory["argument+temp"]
    assert abs(c - p) <= MEMORY_TOL * max(p, c), (p, c, a.report())
    assert a.fidelity_ok, a.report()
    return a


# --- MLPs ------------------------------------------------------------------------------------------

class MLP(nn.Module):
    hidden: int = 256
    out: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(x)


def _mlp(opt, layers=2, hidden=256, batch=32, width=64):
    x = jnp.ones((batch, width))
    return _linen_case(MLP(hidden, width, layers), opt, x, jnp.zeros((batch, width)))


@pytest.mark.parametrize("opt", [
    # each update reads its own gradient: XLA updates a weight as its gradient is produced, so the
    # gradients no reduction waits for are not all alive at the end of the backward (memory.py)
    pytest.param(optax.sgd(0.1), id="sgd"),
    pytest.param(optax.adam(1e-3), id="adam")])
def test_data_parallel_mlp(opt):
    step, args = _mlp(opt)
    plan = autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim")
    a = check(plan, step, args)
    assert a.audited_collectives                     # the gradients or activations are reduced over data


def test_mlp_clipped_by_global_norm():
    # small batch, large weights, one device (nothing reduced): the gradients outweigh the activations.
    # A global norm reads every gradient, so all of them wait for it (3.6 MB of temp); plain SGD updates
    # each weight as its gradient is produced (1 MB: the largest gradient beside the activations)
    for opt in (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), optax.sgd(0.1)):
        step, args = _mlp(opt, layers=4, hidden=512, width=128, batch=4)
        check(autoshard.plan(step, *args, mesh={"data": 1}, hardware="cpu-sim"), step, args)


def test_plain_jax_dict_mlp_data_parallel():
    k0, k1 = jax.random.split(jax.random.key(0))
    params = {"w_in": jax.random.normal(k0, (64, 256)) * 0.05, "b_in": jnp.zeros(256),
              "w_out": jax.random.normal(k1, (256, 64)) * 0.05}
    opt = optax.sgd(0.1, momentum=0.9)
    batch = {"x": jnp.ones((64, 64)), "y": jnp.zeros((64, 64))}

    def step(p, s, b):
        def loss(p):
            return _mse(jnp.tanh(b["x"] @ p["w_in"] + p["b_in"]) @ p["w_out"], b["y"])
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    args = _abstract((params, opt.init(params), batch))
    check(autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


def _fsdp_mlp():
    return _mlp(optax.adam(1e-3), hidden=512, width=128)


def test_fsdp_mlp_expert():
    step, args = _fsdp_mlp()
    check(autoshard.expert_plan("fsdp", step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


def test_fsdp_mlp_forced_zero3_storage():
    step, args = _fsdp_mlp()
    forced = autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim",
                            search={"storage_modes": ("zero3",)})
    check(forced, step, args)


def _megatron_mlp():
    return _mlp(optax.sgd(0.1), layers=4, hidden=512, width=128, batch=16)


def test_megatron_mlp_sgd_on_2x4_expert():
    step, args = _megatron_mlp()
    mesh = {"data": 2, "model": 4}
    check(autoshard.expert_plan("data-megatron", step, *args, mesh=mesh, hardware="cpu-sim"), step, args)


def test_megatron_mlp_sgd_on_2x4_auto():
    # 2-D tensor parallelism, batch replicated: no kernel gradient is reduced, each updates in place
    step, args = _megatron_mlp()
    check(autoshard.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim"), step, args)


# --- convolutional nets: XLA:CPU's parameter copies and reversed kernels ----------------------------

class GrowingCNN(nn.Module):
    """Strided 3 x 3 convolutions whose channels double each layer, then a Dense head (default names)."""

    @nn.compact
    def __call__(self, x):
        for c in (8, 16, 32, 64):
            x = nn.relu(nn.Conv(c, (3, 3), strides=(2, 2))(x))
        return nn.Dense(512)(x.reshape(x.shape[0], -1))


def _cnn(opt):
    x, y = jnp.ones((8, 16, 16, 3)), jnp.zeros((8,), jnp.int32)
    return _linen_case(GrowingCNN(), opt, x, y, loss_of=_xent)


@pytest.mark.parametrize("opt, mesh", [
    (optax.sgd(0.1), {"data": 1, "model": 8}),
    (optax.adam(1e-3), {"data": 2, "model": 4}),
])
def test_cnn_megatron_with_the_batch_replicated(opt, mesh):
    # no gradient is reduced, so XLA:CPU copies every kernel the backward reads (each kernel larger than
    # the last: no copy fits a buffer an earlier one vacated) and materialises the reversed kernels early;
    # the temporaries are mostly those, so they are checked on their own too
    step, args = _cnn(opt)
    a = check(autoshard.expert_plan("megatron", step, *args, mesh=mesh), step, args)
    p, c = a.predicted_memory["temp"], a.memory["temp"]
    assert abs(c - p) <= MEMORY_TOL * max(p, c), (p, c, a.report())


def test_cnn_data_parallel():
    step, args = _cnn(optax.adam(1e-3))
    check(autoshard.expert_plan("data-parallel", step, *args, mesh={"data": 8, "model": 1}), step, args)


class PoolingCNN(nn.Module):
    """'SAME' 3 x 3 convolutions (two per stage) and 2 x 2 max pooling."""

    @nn.compact
    def __call__(self, x):
        for c in (16, 32):
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.max_pool(nn.relu(nn.Conv(c, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(64)(x.reshape(x.shape[0], -1))


def test_pooling_cnn_auto_keeps_the_image_dims_whole():
    # splitting an image's rows or columns under a 3 x 3 window needs halo exchanges (collective-permutes)
    # the cost model does not price: the search splits the batch instead, and the program has no permute
    x, y = jnp.ones((8, 16, 16, 3)), jnp.zeros((8,), jnp.int32)
    step, args = _linen_case(PoolingCNN(), optax.sgd(0.1, momentum=0.9), x, y, loss_of=_xent)
    plan = autoshard.plan(step, *args, mesh={"data": 2, "model": 4})
    a = check(plan, step, args)
    assert not any(k.startswith("collective-permute") for k in a.audited_collectives)
    split = [desc for _, desc, _, axes in plan.factors if axes]
    assert split and all("['x'] dim 0" in d or "kernel" in d or "bias" in d for d in split), split


class NnxMLP(nnx.Module):
    def __init__(self, d, h, rngs):
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def test_nnx_mlp_data_parallel_adam():
    graphdef, params = nnx.split(NnxMLP(64, 256, nnx.Rngs(0)), nnx.Param)
    opt = optax.adam(1e-3)
    batch = {"x": jnp.ones((32, 64)), "y": jnp.zeros((32, 64))}

    def step(p, s, b):
        def loss(p):
            return _mse(nnx.merge(graphdef, p)(b["x"]), b["y"])
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    args = _abstract((params, opt.init(params), batch))
    check(autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


# --- encoders --------------------------------------------------------------------------------------

class PostLN(nn.Module):
    """BERT-style: attention and FFN, each followed by add + LayerNorm."""
    heads: int
    ffn: int

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(x, x))
        h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.ffn)(x)))
        return nn.LayerNorm()(x + h)


class PreLN(nn.Module):
    heads: int
    ffn: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.ffn)(nn.LayerNorm()(x))))


class Encoder(nn.Module):
    block: str = "post"
    layers: int = 2
    d: int = 64
    heads: int = 4
    vocab: int = 128
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        cls = PostLN if self.block == "post" else PreLN
        if self.remat:
            cls = nn.remat(cls)
        for _ in range(self.layers):
            x = cls(self.heads, 4 * self.d)(x)
        if self.block == "pre":
            x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab)(x)


def _encoder(block="post", opt=None, batch=8, seq=32, **kw):
    tokens = jnp.zeros((batch, seq), jnp.int32)
    return _linen_case(Encoder(block, **kw), opt or optax.adam(1e-3), tokens, tokens, _xent)


@pytest.mark.slow
def test_post_ln_encoder_data_parallel():
    step, args = _encoder("post", optax.sgd(0.1))
    check(autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


def _sequence_parallel(plan):
    """The plan splits the stream's sequence: Megatron-SP's reduce-scatter out of the row-parallel matmuls."""
    assert any(c["kind"] == "reduce-scatter" for c in plan.predicted["collectives"]), plan.explain()
    return plan


@pytest.mark.slow
def test_post_ln_encoder_on_model_4_auto():
    step, args = _encoder("post")
    check(autoshard.plan(step, *args, mesh={"model": 4}, hardware="cpu-sim"), step, args)


# a batch of 2 does not split over 4 devices: with sequence_parallel="on" the plan splits the sequence
@pytest.mark.slow
def test_post_ln_encoder_on_model_4_sequence_parallel():
    """The embedding's output is read split by the residual add and whole by the first layer's query/key/value:
    emission pins it split, so those gather it back, and that gather is priced (it was the one compiled
    all-gather more than predicted)."""
    step, args = _encoder("post", batch=2)
    plan = autoshard.plan(step, *args, mesh={"model": 4}, hardware="cpu-sim", search={"sequence_parallel": "on"})
    a = check(_sequence_parallel(plan), step, args)
    assert a.predicted_collectives["all-gather@model"] == pytest.approx(
        a.audited_collectives["all-gather@model"]["bytes"], rel=1e-9), a.report()


@pytest.mark.slow
def test_post_ln_encoder_megatron_sp_expert():
    step, args = _encoder("post")
    plan = autoshard.expert_plan("megatron-sp", step, *args, mesh={"model": 4}, hardware="cpu-sim")
    check(_sequence_parallel(plan), step, args)


@pytest.mark.slow
def test_post_ln_layers_crossing_into_the_next_layer_are_gathered_once_each():
    """Post-LN layers (the zoo's BERT, 4 layers, Megatron-SP on data 2 x model 4): each layer's last norm
    feeds the next layer's attention, a region cut crossing instances. The middle instance stands for
    two layers and no analysed op reads its own crossing: every crossing is priced by its reader's
    count, and the all-gathers are those compiled (two were missing: -11 %)."""
    m = models.get("bert", "debug", num_layers=4, hidden=256, num_heads=8, seq_len=64, batch_size=16,
                   vocab_size=4096)
    step, args = m.train_step, m.abstract_state()
    plan = autoshard.expert_plan("megatron-sp", step, *args, mesh={"data": 2, "model": 4}, hardware="h100-sxm")
    a = check(_sequence_parallel(plan), step, args)
    compiled = a.audited_collectives["all-gather@model"]["bytes"]
    assert a.predicted_collectives["all-gather@model"] == pytest.approx(compiled, rel=1e-9), a.report()


@pytest.mark.slow
def test_post_ln_encoder_megatron_sp_expert_five_layers():
    """Five post-LN layers: the third and fifth are analysed by none of their own (the second stands for
    them). They took the first layer's layouts, whose input cotangent is gathered whole for the embedding's
    table gradient, so XLA gathered their input cotangents too (24 stream all-gathers compiled for 21
    priced); now they take the second layer's."""
    step, args = _encoder("post", layers=5)
    plan = autoshard.expert_plan("megatron-sp", step, *args, mesh={"model": 4}, hardware="cpu-sim")
    a = check(_sequence_parallel(plan), step, args)
    # one stream gather per layer and pass, beside the embedding's (read back whole by the first layer) and the
    # head's
    assert a.predicted_collectives["all-gather@model"] == pytest.approx(
        a.audited_collectives["all-gather@model"]["bytes"], rel=1e-9), a.report()


@pytest.mark.slow
def test_pre_ln_encoder_on_2x4_sequence_parallel():
    step, args = _encoder("pre", batch=2)
    mesh = {"data": 2, "model": 4}
    check(_sequence_parallel(autoshard.expert_plan("megatron-sp", step, *args, mesh=mesh, hardware="cpu-sim")),
          step, args)
    # the search, sequence-parallel space only: since the embedding and the head are vocabulary regions its
    # best plan here keeps the stream whole (FFN on model, batch on data); audited whatever it picks
    check(autoshard.plan(step, *args, mesh=mesh, hardware="cpu-sim", search={"sequence_parallel": "on"}),
          step, args)


@pytest.mark.slow
def test_pre_ln_encoder_on_2x4_sp_on_without_a_sequence_split():
    """sequence_parallel="on" searches the sequence-parallel space only; with a batch of 8 its best plan
    splits the batch instead, and that plan is audited like any other."""
    step, args = _encoder("pre")
    plan = autoshard.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim",
                          search={"sequence_parallel": "on"})
    check(plan, step, args)


@pytest.mark.slow
def test_remat_encoder_on_model_4_auto():
    step, args = _encoder("post", remat=True)
    check(autoshard.plan(step, *args, mesh={"model": 4}, hardware="cpu-sim"), step, args)


@pytest.mark.slow
def test_remat_encoder_on_model_4_sequence_parallel():
    # nn.remat blocks, batch 2, SP on: XLA:CPU keeps the forward values the remat would drop (951,132 B
    # compiled, more than the 919,068 B without remat), so the audit on CPU prices the step unrecomputed
    step, args = _encoder("post", remat=True, batch=2)
    plan = autoshard.plan(step, *args, mesh={"model": 4}, hardware="cpu-sim", search={"sequence_parallel": "on"})
    check(_sequence_parallel(plan), step, args)



@pytest.mark.slow
def test_remat_blocks_recompute_as_planned_under_sequence_parallelism():
    """A user's nn.remat blocks are recomputed in the backward pass inside one checkpoint call per block.
    Emission pins that call's body too (it binds the call again with its ops constrained): left to XLA's
    propagation, the recomputation kept the stream split and gathered the query/key/value/out kernels and
    biases, then the keys and values (378,368 B of stream gathers per step); pinned, it gathers the stream
    (229,376 B). The recomputation moves a cut value again (the forward's gathered copy is not kept across
    the call): priced, 196,608 B (180,224 without). The step still trains as on one device."""
    opt = optax.sgd(0.1)        # (Adam turns the key bias's zero gradient, float noise, into steps of lr)
    step, args = _encoder("post", opt, remat=True, batch=2)
    plan = _sequence_parallel(autoshard.plan(step, *args, mesh={"model": 4}, hardware="cpu-sim",
                                             search={"sequence_parallel": "on"}))
    a = autoshard.audit(plan, step, *args)
    gathered = a.audited_collectives["all-gather@model"]["bytes"]
    assert gathered <= 1.2 * a.predicted_collectives["all-gather@model"], a.report()
    assert not [r for r in a.collectives if r.kind == "all-gather" and "kernel" in r.op_name], a.report()
    model = Encoder("post", remat=True)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 128)
    params = model.init(jax.random.key(0), tokens)["params"]
    real = (params, opt.init(params), {"x": tokens, "y": tokens})
    ref = jax.jit(step)(*real)
    out = autoshard.autoshard(plan=plan)(step)(*real)
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_zoo_remat_models_under_megatron_sp_compile_as_priced(name):
    """The zoo's GPT and BERT with remat=True (nn.remat blocks) under Megatron-SP on data 2 x model 4: with
    the recomputation unpinned the stream all-gathers compiled were 1.8x those priced (fidelity_ok false)."""
    m = models.get(name, "debug", remat=True)
    args = m.abstract_state()
    plan = autoshard.expert_plan("megatron-sp", m.train_step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
    a = autoshard.audit(plan, m.train_step, *args)
    assert a.fidelity_ok, a.report()
    assert a.audited_collectives["all-gather@model"]["bytes"] <= 1.2 * a.predicted_collectives["all-gather@model"]

def _checkpointed_encoder(d, vocab, seq):
    """An encoder step whose blocks are wrapped in jax.checkpoint inside the step (not nn.remat)."""
    model = Encoder("pre", layers=2, d=d, vocab=vocab)
    tokens = jnp.zeros((8, seq), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    opt = optax.adam(1e-3)
    embed, block = nn.Embed(vocab, d), PreLN(4, 4 * d)
    head_norm, head = nn.LayerNorm(), nn.Dense(vocab)

    def forward(p, t):
        x = embed.apply({"params": p["Embed_0"]}, t)
        for i in range(2):
            x = jax.checkpoint(lambda q, x: block.apply({"params": q}, x))(p[f"PreLN_{i}"], x)
        return head.apply({"params": p["Dense_0"]}, head_norm.apply({"params": p["LayerNorm_0"]}, x))

    def step(p, s, b):
        g = jax.grad(lambda p: _xent(forward(p, b["x"]), b["y"]))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step, _abstract((params, opt.init(params), {"x": tokens, "y": tokens}))


@pytest.mark.slow
def test_encoder_with_jax_checkpoint_data_parallel():
    step, args = _checkpointed_encoder(64, 128, 32)
    check(autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


@pytest.mark.slow
def test_tiny_checkpointed_encoder_replicated():
    # d=32: with one gradient-sync latency per kind of op (before gradients were priced as sharing
    # buckets) the planner replicated batch and weights here, and that plan's temp memory was 2.9x the
    # prediction (undiagnosed: recomputed blocks' full-batch buffers beside Adam temporaries); it now
    # plans data parallelism, whose compiled program matches
    step, args = _checkpointed_encoder(32, 64, 16)
    check(autoshard.plan(step, *args, mesh={"data": 8}, hardware="cpu-sim"), step, args)


@pytest.mark.slow
def test_pre_ln_encoder_on_3d_mesh():
    step, args = _encoder("pre")
    check(autoshard.plan(step, *args, mesh={"x": 2, "y": 2, "z": 2}, hardware="cpu-sim"), step, args)


@pytest.mark.slow
@pytest.mark.parametrize("sp", ["auto", "on"])
def test_encoder_planned_for_h100_audited_on_cpu(sp):
    step, args = _encoder("post", layers=4, d=128, seq=64, vocab=256, batch=2 if sp == "on" else 8)
    plan = autoshard.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="h100-sxm",
                          search={"sequence_parallel": sp})
    check(plan, step, args)
