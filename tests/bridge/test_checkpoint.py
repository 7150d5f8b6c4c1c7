"""Checkpoints across meshes and plans: state saved under one plan restores straight into another
step's layout (`step.shardings`), optax states come back as optax states, and training continues
exactly like an uninterrupted run."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autoshard
import models

from .._reference import run_steps


def _setup():
    m = models.get("gpt", "debug", batch_size=8)      # a batch every device of `data=8` gets part of
    params, batch = m.init(jax.random.key(0)), m.batch()
    return m, params, m.optimizer.init(params), batch


def _expert_step(m, name, mesh, *state_and_batch):
    plan = autoshard.expert_plan(name, m.train_step, *state_and_batch, mesh=mesh, hardware="h100-sxm")
    return autoshard.autoshard(m.train_step, mesh=mesh, hardware="h100-sxm", plan=plan)


def _megatron_step_saved(m, params, opt_state, batch, path):
    """One step under a data x model Megatron plan, its state saved at `path`: (losses, p, o, step)."""
    first = _expert_step(m, "data-megatron", {"data": 2, "model": 4}, params, opt_state, batch)
    got, p1, o1 = run_steps(first, params, opt_state, batch, 1)
    autoshard.save(path, (p1, o1), plan=first.plan)
    return got, p1, o1, first


def _like(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@pytest.mark.slow
def test_megatron_state_restores_into_an_fsdp_step_and_training_continues(tmp_path):
    m, params, opt_state, batch = _setup()
    want, _, _ = run_steps(jax.jit(m.train_step), params, opt_state, batch, 3)

    got, p1, o1, first = _megatron_step_saved(m, params, opt_state, batch, tmp_path / "ckpt")
    assert autoshard.Plan.from_json((tmp_path / "ckpt" / "plan.json").read_text()).mesh == first.plan.mesh

    second = _expert_step(m, "fsdp", {"data": 8}, params, opt_state, batch)
    shardings = second.shardings(params, opt_state, batch)[:2]
    like = _like((params, opt_state), shardings)
    p2, o2 = autoshard.restore(tmp_path / "ckpt", like=like)

    # the optax state's own types, each leaf already in the new plan's layout, values as saved
    assert jax.tree.structure(o2) == jax.tree.structure(opt_state)
    assert type(o2[0]).__name__ == type(opt_state[0]).__name__
    for x, s in zip(jax.tree.leaves((p2, o2)), jax.tree.leaves(shardings), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    more, _, _ = run_steps(second, p2, o2, batch, 2)
    np.testing.assert_allclose(got + more, want, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_misuse_is_a_typed_error(tmp_path):
    m, params, opt_state, _ = _setup()
    with pytest.raises(autoshard.ConfigError, match="no checkpoint at"):
        autoshard.restore(tmp_path / "missing", like=params)
    autoshard.save(tmp_path / "c", params)
    with pytest.raises(autoshard.ConfigError, match="exists and is not empty; pass overwrite=True"):
        autoshard.save(tmp_path / "c", params)
    autoshard.save(tmp_path / "c", params, overwrite=True)
    with pytest.raises(autoshard.ConfigError, match=r"has \d+ arrays, like= has \d+") as err:
        autoshard.restore(tmp_path / "c", like=(params, opt_state))
    assert "structure of the saved tree" in str(err.value)
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct((*x.shape[:-1], x.shape[-1] + 1), x.dtype), params)
    with pytest.raises(autoshard.ConfigError, match="does not hold"):
        autoshard.restore(tmp_path / "c", like=other)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("mine")
    with pytest.raises(autoshard.ConfigError, match="not an autoshard checkpoint"):
        autoshard.save(tmp_path / "notes", params, overwrite=True)
    assert (tmp_path / "notes" / "x.txt").read_text() == "mine"
    with pytest.raises(autoshard.ConfigError, match="checkpoints hold arrays"):
        autoshard.save(tmp_path / "d", {"w": params["wte"]["embedding"], "name": "gpt"})
    # asynchronous: returns before the write is done; the arrays may change meanwhile
    saving = autoshard.save(tmp_path / "e", optax.tree_utils.tree_zeros_like(params), wait=False)
    assert saving.wait() == (tmp_path / "e").absolute()
    back = autoshard.restore(tmp_path / "e", like=params)
    assert all(float(np.abs(np.asarray(x)).max()) == 0.0 for x in jax.tree.leaves(back))


@pytest.mark.slow
def test_tensor_plan_state_restores_into_a_pipelined_step(tmp_path):
    """From a data x model tensor plan to a pipe x data pipeline plan's ZeRO-style storage."""
    m, params, opt_state, batch = _setup()
    want, _, _ = run_steps(jax.jit(m.train_step), params, opt_state, batch, 2)
    got, *_ = _megatron_step_saved(m, params, opt_state, batch, tmp_path / "ckpt")

    def step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    piped = autoshard.autoshard(step, mesh={"pipe": 4, "data": 2}, pipeline="rannc", hardware="cpu-sim",
                                num_microbatches=2)
    shardings = piped.shardings(params, opt_state, batch)[:2]
    like = _like((params, opt_state), shardings)
    p2, o2 = autoshard.restore(tmp_path / "ckpt", like=like)
    more, _, _ = run_steps(piped, p2, o2, batch, 1)
    np.testing.assert_allclose(got + more, want, rtol=1e-5)
