"""The GPU-style GPT (`gpt-gpu`): mixed precision shapes, training under @autoshard equal to one
device, and the planner splitting the fused qkv kernel on its heads dim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
import models

from .._reference import run_steps

# near-zero link latency, so the planner really shards this tiny model (as tests/integration does)
FAST_LINKS = {"base": "cpu-sim", "intra_node_latency": 1e-12, "inter_node_latency": 1e-12}
MESH = {"data": 2, "model": 4}


def _model(**kw):
    return models.get("gpt-gpu", "debug", batch_size=8, **kw)


def _small(**kw):
    """One layer: the autoshard runs compile on 8 devices, the slow part of this file."""
    return _model(num_layers=1, **kw)


def test_forward_shapes_and_dtypes():
    m = _model()
    c = m.config
    params = m.abstract_params()      # shapes only: nothing compiled
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))     # float32 master weights
    attn = params["block_0"]["attn"]
    assert attn["qkv"]["kernel"].shape == (c.d_model, 3, c.num_heads, c.head_dim)
    assert attn["proj"]["kernel"].shape == (c.num_heads, c.head_dim, c.d_model)
    assert params["block_0"]["fc1"]["kernel"].shape == (c.d_model, 4 * c.d_model)
    assert set(params) == {"wte", "wpe", "block_0", "block_1", "ln_f"}       # tied output: no head
    logits = jax.eval_shape(m.module.apply, {"params": params}, m.batch(abstract=True)["inputs"])
    assert logits.shape == (c.batch_size, c.seq_len, c.vocab_size) and logits.dtype == jnp.bfloat16
    assert jax.eval_shape(m.loss, params, m.batch(abstract=True)).dtype == jnp.float32


@pytest.mark.slow
def test_causal():
    """A later token never changes an earlier position's logits."""
    m = _model(dtype="float32")
    params = jax.jit(m.init)(jax.random.key(0))
    tokens = m.batch()["inputs"]
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % m.config.vocab_size)
    apply = jax.jit(m.module.apply)
    a, b = (apply({"params": params}, t) for t in (tokens, changed))
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not np.allclose(a[:, -1], b[:, -1]) and np.isfinite(a).all()


def _train(m, step, steps=3):
    params = jax.jit(m.init)(jax.random.key(0))
    return run_steps(step, params, m.init_opt_state(params), m.batch(), steps)


@pytest.mark.slow
def test_autoshard_equals_single_device():
    m = _small(dtype="float32")
    ref_losses, ref_params, _ = _train(m, jax.jit(m.train_step))
    step = autoshard.autoshard(m.train_step, mesh=MESH, hardware=FAST_LINKS)
    losses, params, _ = _train(m, step)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-5
    assert any(any(s) for s in step.plan.input_specs_flat), step.explain()


@pytest.mark.slow
def test_autoshard_bfloat16_smoke():
    m = _small()
    step = autoshard.autoshard(m.train_step, mesh=MESH, hardware=FAST_LINKS)
    losses, params, _ = _train(m, step, steps=2)
    assert all(np.isfinite(losses)) and losses[0] > losses[-1], losses
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


@pytest.mark.parametrize("expert", [None, "data-megatron"])
def test_plan_splits_fused_qkv_on_heads(expert):
    """[D, 3, heads, head_dim]: the heads dim (2) goes on 'model', never the 3 (q/k/v) or head_dim;
    the output projection [heads, head_dim, D] is split on its heads dim to match."""
    m = _model(dtype="float32")
    args = m.abstract_state()
    plan = autoshard.plan(m.train_step, *args, mesh=MESH, hardware=FAST_LINKS) if expert is None else \
        autoshard.expert_plan(expert, m.train_step, *args, mesh=MESH, hardware=FAST_LINKS)
    specs = plan.specs_by_keypath()
    assert specs["[0]['block_0']['attn']['qkv']['kernel']"] == ((), (), ("model",), ())
    assert specs["[0]['block_0']['attn']['proj']['kernel']"] == (("model",), (), ())
