"""`@autoshard` runs the pipeline plans the single-program runtime cannot run as planned: MPMD stage programs
for the loss, per-stage programs for the optimizer (its global gradient norm included: per-stage sums sent
as scalars). Trains like the same step under jax.jit; parameters and optimizer state stay on their stage."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.runtimes.mpmd import MpmdPipeline

from .._reference import run_steps


def make_step(m, opt, clip=True):
    def step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(m.loss)(params, batch)
        if clip:
            grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def trains_like_jit(fast, step, params, opt, batch):
    got, p1, o1 = run_steps(fast, params, opt.init(params), batch, 3)
    want, p2, o2 = run_steps(jax.jit(step), params, opt.init(params), batch, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    return p1, o1


def stage_devices(run: MpmdPipeline) -> dict[str, set]:
    return {k: set(run.meshes[o].devices.flat) for k, o in zip(run.cut.keys, run.cut.owner, strict=True)}


def test_graphpipe_plan_with_unequal_replicas_under_the_decorator():
    m = models.get("candle_uno", "debug", batch_size=64, hidden=64, feature_dim=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    opt = optax.adam(1e-2)
    step = make_step(m, opt)
    fast = autoshard.autoshard(step, mesh={"data": 8}, pipeline="graphpipe", hardware="cpu-sim")
    p1, _ = trains_like_jit(fast, step, params, opt, batch)
    run = fast.pipelined
    assert isinstance(run, MpmdPipeline) and len({mesh.size for mesh in run.meshes}) > 1
    assert [mesh.size for mesh in run.meshes] == [st.replicas for st in fast.plan.stages]
    # every parameter came back on its owner stage's devices (no gather onto one device between steps)
    where = stage_devices(run)
    flat = dict(zip(run.cut.keys, jax.tree.leaves(p1), strict=True))
    assert all(set(flat[k].sharding.device_set) == where[k] for k in run.cut.keys)
    text = fast.explain()
    assert "Runtime (MPMD)" in text and "after the gradients" in text
    with pytest.raises(autoshard.PlanError, match="no single program to lower"):
        fast.lower(params, opt.init(params), batch)


def test_graphpipe_per_stage_microbatch_counts_under_the_decorator():
    # a plan file whose join stage runs 2 micro-batches of 32 while the branches run 8 of 8
    m = models.get("candle_uno", "debug", batch_size=64, hidden=64, feature_dim=64)
    params, batch = m.init(jax.random.key(2)), m.batch()
    opt = optax.sgd(0.1)
    step = make_step(m, opt)
    plan = autoshard.plan(step, params, opt.init(params), batch, mesh={"data": 8}, pipeline="graphpipe",
                          hardware="cpu-sim")
    stages = tuple(dataclasses.replace(st, microbatches=2 if st.after else 8) for st in plan.stages)
    plan = autoshard.Plan.from_json(dataclasses.replace(plan, stages=stages).to_json())
    assert plan.runtime == "mpmd"
    fast = autoshard.autoshard(step, plan=plan)
    trains_like_jit(fast, step, params, opt, batch)
    assert fast.pipelined.counts == tuple(st.microbatches for st in stages)


def test_rannc_plan_with_unequal_replicas_under_the_decorator():
    m = models.get("mlp", "debug", batch_size=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    opt = optax.sgd(0.1)
    step = make_step(m, opt, clip=False)
    fast = autoshard.autoshard(step, mesh={"data": 8}, pipeline="rannc", hardware="cpu-sim")
    trains_like_jit(fast, step, params, opt, batch)
    assert sorted(mesh.size for mesh in fast.pipelined.meshes) == [2, 6]
    # step.mesh: all the plan's devices, the stages' submeshes inside it
    stage_devices = set().union(*(set(mesh.devices.flat) for mesh in fast.pipelined.meshes))
    assert fast.mesh.axis_names == ("data",) and set(fast.mesh.devices.flat) == stage_devices


def test_a_loss_reading_a_key_made_in_the_step_is_a_typed_error():
    # the key changes every step; a loss cut once would keep the first one
    m = models.get("mlp", "debug", batch_size=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    opt = optax.sgd(0.1)

    def step(params, opt_state, batch, key):
        noise = jax.random.fold_in(key, 1)

        def loss(p, b):
            return m.loss(p, b) + 0.0 * jax.random.normal(noise, ())

        value, grads = autoshard.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    fast = autoshard.autoshard(step, mesh={"data": 8}, pipeline="rannc", hardware="cpu-sim")
    opt_state = opt.init(params)
    with pytest.raises(autoshard.PlanError, match="computed from the step's arguments"):
        fast(params, opt_state, batch, jax.random.key(3))
    assert all(not x.is_deleted() for x in jax.tree.leaves((params, opt_state, batch)))


@pytest.mark.slow
def test_unequal_3d_plan_under_the_decorator():
    # the 3-D search's stages of 2, 2 and 4 devices (tests/bridge/test_mpmd_runtime.py), given as plan=
    m = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=8, seq_len=64)
    opt = optax.sgd(0.1)
    step = make_step(m, opt)
    params, batch = m.init(jax.random.key(0)), m.batch()
    plan = autoshard.plan(step, params, opt.init(params), batch, mesh="auto", devices=8, hardware="h100-sxm")
    assert plan.runtime == "mpmd" and sorted(d * t for d, t in plan.predicted["3d"]["chosen"]["submeshes"]) == [2, 2, 4]
    fast = autoshard.autoshard(step, plan=plan)
    p1, _ = trains_like_jit(fast, step, params, opt, batch)
    run = fast.pipelined
    assert sorted(mesh.size for mesh in run.meshes) == [2, 2, 4]
    where = stage_devices(run)
    flat = dict(zip(run.cut.keys, jax.tree.leaves(p1), strict=True))
    assert all(set(flat[k].sharding.device_set) == where[k] for k in run.cut.keys)
