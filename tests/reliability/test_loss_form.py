"""Losses under pipeline plans equal one device on every batch, or are refused on every batch (issue 29,
bad case 1): a masked ratio sum(l * mask) / sum(mask) trained on batches whose padding changes from
step to step, a token-weighted mean over [B, S] with per-sequence lengths, a per-sample mean, and losses
no chunking computes (refused with a PipelineError naming the eqn and the fix). The caller's arrays
survive every call, refused ones included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard import PipelineError

M = models.get("mlp", "debug")          # batch 8: {"x": [8, 32], "y": [8, 32]}
MESH = {"pipe": 2, "data": 2}           # 2 micro-batches x 2 replicas: chunks of 2 samples
MASKS = [np.ones(8), [1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1], [1, 0, 0, 1, 0, 1, 1, 1]]
LENGTHS = [[32] * 8, [32, 5, 1, 17, 32, 2, 9, 30], [1, 1, 1, 1, 1, 1, 1, 32], [0, 4, 8, 12, 16, 20, 24, 28]]


def batches(key, values):
    """The model's batch with one more leaf per step ("key": a mask or lengths); the first step's
    values pass any check on one batch (all ones, full lengths), the later ones pad."""
    base = M.batch()
    return [dict(base, **{key: jnp.asarray(v, jnp.int32 if key == "lengths" else jnp.float32)}) for v in values]


def masked_mean(params, batch):
    """Padding mask over samples: the mean over real samples only."""
    pred = M.module.apply({"params": params}, batch["x"])
    per = jnp.mean((pred - batch["y"]) ** 2, axis=1)
    return jnp.sum(per * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


def token_mean(params, batch):
    """A token-weighted mean over [B, S] (the output's 32 features as positions), per-sequence lengths."""
    pred = M.module.apply({"params": params}, batch["x"])
    mask = jnp.arange(pred.shape[1])[None, :] < batch["lengths"][:, None]
    return jnp.sum((pred - batch["y"]) ** 2 * mask) / jnp.sum(mask)


def make_step(loss):
    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(loss)(params, batch)
        updates, opt_state = M.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def assert_close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def copies(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@pytest.mark.slow
@pytest.mark.parametrize("loss,key,values", [(masked_mean, "mask", MASKS), (token_mean, "lengths", LENGTHS)],
                         ids=["masked_mean", "token_mean"])
def test_ratio_loss_trains_like_one_device_on_every_batch_under_rannc(loss, key, values):
    params = M.init(jax.random.key(0))
    kept = copies(params)
    step = make_step(loss)
    fast = autoshard.autoshard(step, mesh=MESH, pipeline="rannc", hardware="cpu-sim", num_microbatches=2)
    ref = jax.jit(step)
    p1, o1 = params, M.optimizer.init(params)
    p2, o2 = params, M.optimizer.init(params)
    for batch in batches(key, values):
        p1, o1, l1 = fast(p1, o1, batch)
        p2, o2, l2 = ref(p2, o2, batch)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
        assert_close(p1, p2)
    assert_close(params, kept, tol=0)         # the caller's first arguments are untouched


@pytest.mark.slow      # ~20 s: the 3-D cut (stages see whole micro-batches, split by XLA over data/model)
def test_ratio_loss_trains_like_one_device_under_a_3d_plan():
    params = M.init(jax.random.key(0))
    step = make_step(masked_mean)
    fast = autoshard.autoshard(step, mesh={"pipe": 2, "data": 2, "model": 2}, pipeline="auto", hardware="cpu-sim",
                               num_microbatches=2)
    ref = jax.jit(step)
    p1, o1 = params, M.optimizer.init(params)
    p2, o2 = params, M.optimizer.init(params)
    for batch in batches("mask", MASKS):
        p1, o1, l1 = fast(p1, o1, batch)
        p2, o2, l2 = ref(p2, o2, batch)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
        assert_close(p1, p2)
    assert fast.pipelined.program.auto and fast.pipelined.program.batch_globals is not None


def test_ratio_loss_trains_like_one_device_on_a_fixed_pipe_mesh():
    params = M.init(jax.random.key(0))
    kept = copies(params)
    first = batches("mask", MASKS)[0]
    run = autoshard.pipelined(masked_mean, params, first, mesh=MESH, num_microbatches=2)
    assert run.program.batch_globals is not None      # sum(mask) comes from the whole batch
    opt = optax.adam(1e-2)
    state, opt_state = run.stack(params), None
    opt_state = opt.init(state)
    ref, ref_opt = params, opt.init(params)
    for batch in batches("mask", MASKS):
        loss, grads = run(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
        want, ref_grads = jax.value_and_grad(masked_mean)(ref, batch)
        ref_updates, ref_opt = opt.update(ref_grads, ref_opt, ref)
        ref = optax.apply_updates(ref, ref_updates)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
        assert_close(run.unstack(state), ref)
    assert_close(params, kept, tol=0)


@pytest.mark.parametrize("explicit", [False, True], ids=["dict", "explicit-axes"])
def test_per_sample_mean_is_unchanged(explicit):
    """Also on a mesh from jax.make_mesh, whose axes are Explicit by default: taken as Auto."""
    params = M.init(jax.random.key(0))
    batch = M.batch()
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH), devices=jax.devices()[:4]) if explicit else MESH
    run = autoshard.pipelined(M.loss, params, batch, mesh=mesh, num_microbatches=2)
    assert run.program.batch_globals is None           # nothing taken from the whole batch
    loss, grads = run.value_and_grad(params, batch)
    want, want_grads = jax.value_and_grad(M.loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert_close(grads, want_grads)


def worst_sample(params, batch):
    pred = M.module.apply({"params": params}, batch["x"])
    return jnp.max(jnp.mean((pred - batch["y"]) ** 2, axis=1))


def learned_weights(params, batch):
    """A denominator that depends on the parameters: its chunks cannot be summed before the backward pass."""
    pred = M.module.apply({"params": params}, batch["x"])
    w = jax.nn.sigmoid(pred[:, 0])
    return jnp.sum(jnp.mean((pred - batch["y"]) ** 2, axis=1) * w) / jnp.sum(w)


def square_of_mean(params, batch):
    pred = M.module.apply({"params": params}, batch["x"])
    return jnp.mean(pred - batch["y"]) ** 2


@pytest.mark.parametrize("loss,eqn", [(worst_sample, "'reduce_max' in the loss combines the samples"),
                                      (learned_weights, "'div' in the loss is not linear in a sum"),
                                      (square_of_mean, "'integer_pow' in the loss is not linear in a sum")])
def test_loss_no_chunking_computes_is_refused_on_every_batch(loss, eqn):
    params = M.init(jax.random.key(0))
    kept = copies(params)
    for batch in batches("mask", MASKS[:2]):
        with pytest.raises(PipelineError, match=eqn) as err:
            autoshard.pipelined(loss, params, batch, mesh=MESH, num_microbatches=2)
        assert "check_loss=False" in str(err.value) and "mesh {'pipe': 2, 'data': 2}" in str(err.value)
    step = autoshard.autoshard(make_step(loss), mesh=MESH, pipeline="rannc", hardware="cpu-sim", num_microbatches=2)
    opt_state = M.optimizer.init(params)
    for batch in batches("mask", MASKS[:2]):        # the step is refused again on a later batch
        with pytest.raises(PipelineError, match=eqn):
            step(params, opt_state, batch)
    assert_close(params, kept, tol=0)


def test_check_loss_false_trains_on_the_chunk_mean_as_documented():
    params = M.init(jax.random.key(0))
    batch = M.batch()
    run = autoshard.pipelined(worst_sample, params, batch, mesh=MESH, num_microbatches=2, check_loss=False)
    loss, _ = run.value_and_grad(params, batch)
    chunks = [float(worst_sample(params, jax.tree.map(lambda x, i=i: x[2 * i:2 * i + 2], batch))) for i in range(4)]
    np.testing.assert_allclose(float(loss), np.mean(chunks), rtol=1e-5)


def test_a_batch_of_another_size_is_refused():
    params = M.init(jax.random.key(0))
    first = batches("mask", MASKS)[0]
    run = autoshard.pipelined(masked_mean, params, first, mesh=MESH, num_microbatches=2)
    bigger = jax.tree.map(lambda x: jnp.concatenate([x, x]), first)
    kept = copies(bigger)
    with pytest.raises(PipelineError, match="cut for a batch of 8 samples"):
        run.value_and_grad(params, bigger)
    assert_close(bigger, kept, tol=0)
