"""Sequence parallelism as a per-stage choice of the 3-D search (issue 31): the 3-D tables price the
sequence-parallel space beside the plain one, a stage may take it, and the plan trains like one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autoshard
import models

from .._reference import run_steps

SIZES = dict(d_model=64, num_heads=4, seq_len=32, batch_size=8, vocab_size=256, num_layers=4)
MESH = {"pipe": 2, "model": 4}


@pytest.fixture(scope="module")
def gpt():
    m = models.get("gpt", "debug", **SIZES)
    params = m.init(jax.random.key(0))

    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return m, step, (params, m.init_opt_state(params), m.batch())


def _sequence_split(stage) -> bool:
    return any("sequence" in desc and axes for _, desc, _, axes in stage.factors)


@pytest.mark.slow
def test_sequence_parallel_stage_trains_like_one_device(gpt):
    m, step, args = gpt
    # Megatron's stage plans: the search itself may prefer a plan that leaves the sequence whole (XLA keeps
    # the gathered stream for the backward without remat, so the split saves little memory here)
    kw = dict(mesh=MESH, pipeline="auto", num_microbatches=2, hardware="cpu-sim",
              pipeline_options={"expert": "megatron", "remat": "none"})
    plain = autoshard.plan(step, *args, **kw, search={"sequence_parallel": "off"})
    sp = autoshard.plan(step, *args, **kw, search={"sequence_parallel": "on"})
    assert not any(_sequence_split(s) for s in plain.stages)
    assert any(_sequence_split(s) for s in sp.stages), sp.explain()
    # the stream split over 'model' holds less than the same stage without it
    assert sp.stages[0].memory < plain.stages[0].memory
    ref_losses, ref_params, _ = run_steps(jax.jit(step), *args)
    losses, params, _ = run_steps(autoshard.autoshard(plan=sp)(step), *args)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_megatron_grid_prices_megatron_with_and_without_sequence_parallelism(gpt):
    m, step, args = gpt
    kw = dict(mesh=MESH, pipeline="auto", num_microbatches=2, hardware="cpu-sim",
              pipeline_options={"expert": "megatron", "remat": "none"})
    off = autoshard.plan(step, *args, **kw, search={"sequence_parallel": "off"}).predicted["3d"]["chosen"]
    on = autoshard.plan(step, *args, **kw, search={"sequence_parallel": "on"}).predicted["3d"]["chosen"]
    assert "sequence parallel" not in off["label"] and "sequence parallel" in on["label"]
    assert on["memory"] < off["memory"]
