"""A 3-D plan with schedule "interleaved-1f1b" and v x pipe stages runs through the decorator: a tiny
GPT on pipe 2 with two chunks per rank (stage k on rank k % 2) trains 3 steps like one device, both
as the 3-D search plans it and as a 4-stage plan of pipe 4 rewritten to pipe 2."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.plan.plan import Plan

from .._reference import run_steps


@pytest.mark.slow
@pytest.mark.parametrize("rewritten", [False, True])
def test_interleaved_plan_trains_like_one_device(rewritten):
    m = models.get("gpt", "debug", num_layers=4, d_model=16, num_heads=2, vocab_size=64, seq_len=8, batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()

    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (params, m.optimizer.init(params), batch)
    if rewritten:
        plan = autoshard.plan(step, *args, mesh={"pipe": 4}, pipeline="auto", num_microbatches=4,
                              hardware="cpu-sim")
        inter = dataclasses.replace(plan, mesh=(("pipe", 2),), schedule="interleaved-1f1b")
    else:
        inter = autoshard.plan(step, *args, mesh={"pipe": 2}, pipeline="auto", schedule="interleaved-1f1b",
                               num_microbatches=4, pipeline_options={"virtual_stages": 2}, hardware="cpu-sim")
    assert inter.schedule == "interleaved-1f1b" and len(inter.stages) == 4 and inter.mesh == (("pipe", 2),)
    again = Plan.from_json(inter.to_json())
    assert again.schedule == "interleaved-1f1b" and len(again.stages) == 4

    fast = autoshard.autoshard(step, plan=inter, hardware="cpu-sim")
    got, p1, _ = run_steps(fast, params, m.optimizer.init(params), batch, 3)
    want, p2, _ = run_steps(jax.jit(step), params, m.optimizer.init(params), batch, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    prog = fast.pipelined.program
    assert prog.schedule.name == "interleaved-1f1b" and prog.schedule.rank_of == (0, 1, 0, 1)
    assert dict(prog.mesh.shape) == {"pipe": 2} and prog.auto
    # every pipe rank stores the rows of its two chunks
    assert {b.shape[0] for b in jax.tree.leaves(fast.pipelined.stack(params).flat)} == {4}

    with pytest.raises(autoshard.PlanError, match="has 4 stages, not a multiple of 3"):
        autoshard.autoshard(step, plan=dataclasses.replace(inter, mesh=(("pipe", 3),)), hardware="cpu-sim")(*args)
