"""Pipeline plans the one-program SPMD runtime could not run as planned, run MPMD through
`autoshard.pipelined`: a GraphPipe DAG whose join stage has more replicas than the branches, per-stage
micro-batch counts (activations re-chunked between stages, both ways), a RaNNC plan with unequal
replicas, and an interleaved 3-D plan. Each trains like one device (3 steps, SGD)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.runtimes.choose import runs_mpmd
from autoshard._src.bridge.runtimes.from_plan import mpmd_from_plan
from autoshard._src.bridge.runtimes.mpmd import MpmdPipeline

SGD = optax.sgd(0.1)


def reference(m, params, batch, steps=3):
    def step(p, o, b):
        v, g = jax.value_and_grad(m.loss)(p, b)
        u, o = SGD.update(g, o, p)
        return optax.apply_updates(p, u), o, v

    p, o, losses = params, SGD.init(params), []
    for _ in range(steps):
        p, o, v = jax.jit(step)(p, o, batch)
        losses.append(float(v))
    return losses, p


def check_trains_like_one_device(run, m, params, batch):
    state, losses = run.init(params, SGD), []
    for _ in range(3):
        state, loss = run.step(state, batch, SGD)
        losses.append(float(loss))
    want, p_ref = reference(m, params, batch)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(run.gather(state)), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # each stage's parameters stayed on its own devices
    for s, p in enumerate(state.params):
        assert all(set(x.sharding.device_set) == set(run.meshes[s].devices.flat) for x in jax.tree.leaves(p))


@pytest.fixture(scope="module")
def candle():
    m = models.get("candle_uno", "debug", batch_size=64, hidden=64, feature_dim=64)
    plan = autoshard.plan(m.train_step, *m.abstract_state(), mesh={"data": 8}, pipeline="graphpipe",
                          hardware="cpu-sim")
    return m, plan


def test_graphpipe_plan_with_unequal_replicas_runs_mpmd(candle):
    m, plan = candle
    replicas = [st.replicas for st in plan.stages]
    assert len(set(replicas)) > 1 and plan.schedule == "graph-1f1b" and runs_mpmd(plan)
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = autoshard.pipelined(m.loss, params, batch, mesh={"data": 8}, num_microbatches=plan.microbatches,
                              plan=plan)
    assert isinstance(run, MpmdPipeline) and run.schedule.name == "graph-1f1b"
    assert [mesh.size for mesh in run.meshes] == replicas       # as planned, not one replica count for all
    assert run.schedule.edges == tuple(sorted((a, st.index) for st in plan.stages for a in st.after))
    check_trains_like_one_device(run, m, params, batch)


@pytest.mark.parametrize("branch, join", [(8, 2), (2, 8), (4, 4)])
def test_per_stage_microbatch_counts_train_like_one_device(candle, branch, join):
    # the join stage assembles its micro-batch from several branch micro-batches (8, 2) or a slice of one
    # (2, 8); the gradients go back cut the same way
    m, plan = candle
    stages = tuple(dataclasses.replace(st, microbatches=join if st.after else branch) for st in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    assert runs_mpmd(plan)
    params, batch = m.init(jax.random.key(1)), m.batch()
    run = mpmd_from_plan(m.loss, params, batch, plan)
    assert run.counts == tuple(st.microbatches for st in stages) and run.M == join
    check_trains_like_one_device(run, m, params, batch)


def test_rannc_plan_with_unequal_replicas_runs_mpmd():
    m = models.get("mlp", "debug", batch_size=64)
    plan = autoshard.plan(m.train_step, *m.abstract_state(), mesh={"data": 8}, pipeline="rannc", hardware="cpu-sim")
    replicas = [st.replicas for st in plan.stages]
    assert len(set(replicas)) > 1 and sum(replicas) == 8
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = autoshard.pipelined(m.loss, params, batch, mesh={"data": 8}, num_microbatches=plan.microbatches,
                              plan=plan)
    assert isinstance(run, MpmdPipeline) and [mesh.size for mesh in run.meshes] == replicas
    check_trains_like_one_device(run, m, params, batch)


@pytest.mark.slow
def test_interleaved_3d_plan_runs_mpmd():
    m = models.get("gpt", "debug", num_layers=4, d_model=16, num_heads=2, vocab_size=64, seq_len=8, batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()

    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    plan = autoshard.plan(step, params, m.optimizer.init(params), batch, mesh={"pipe": 2}, pipeline="auto",
                          schedule="interleaved-1f1b", num_microbatches=4, pipeline_options={"virtual_stages": 2},
                          hardware="cpu-sim")
    assert plan.schedule == "interleaved-1f1b" and len(plan.stages) == 4
    run = mpmd_from_plan(m.loss, params, batch, plan, devices=jax.devices()[:2])
    assert run.schedule.name == "interleaved-1f1b" and run.schedule.rank_of == (0, 1, 0, 1)
    assert len(run.rank_meshes) == 2
    check_trains_like_one_device(run, m, params, batch)
