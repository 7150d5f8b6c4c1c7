"""Interleaved 1F1B in the SPMD runtime: 4 stage functions on a pipe axis of 2 (stage k on rank
k % 2, a ring ppermute at the chunk boundary) equal single-device jax.value_and_grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import pipeline
from autoshard import PipelineError
from autoshard._src.bridge.runtimes.runtime import pipeline_value_and_grad
from tests.bridge.test_runtime import assert_close, chain_problem, mesh


@pytest.mark.parametrize(("shape", "names", "stages", "microbatches"), [
    ((2,), ("pipe",), 4, 4),
    ((2, 2), ("pipe", "data"), 4, 2),
    ((2,), ("pipe",), 6, 2),
])
@pytest.mark.slow
def test_interleaved_matches_single_device(shape, names, stages, microbatches):
    m = mesh(shape, names)
    fns, params, data, full_loss = chain_problem(stages)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=microbatches, schedule="interleaved-1f1b")
    assert prog.schedule.rank_of == tuple(k % 2 for k in range(stages))
    loss, grads = prog.value_and_grad(params, data)
    want_loss, want_grads = jax.value_and_grad(full_loss)(params, data)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, atol=1e-5)
    assert_close(grads, want_grads)


@pytest.mark.slow
def test_each_rank_holds_its_chunks_parameters():
    m = mesh((2,), ("pipe",))
    fns, params, data, _ = chain_problem(4, width=8)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=2, schedule="interleaved-1f1b")
    stacked = prog.stack(params)
    rows = {s.device: np.asarray(s.data) for s in stacked.flat.addressable_shards}
    for r, device in enumerate(m.devices.flat):
        assert rows[device].shape[0] == 2      # stages r and r + 2, in that order
        for c in range(2):
            assert np.isin(np.asarray(params[2 * c + r]["w"]).ravel(), rows[device][c]).all()
    back = prog.unstack(stacked)
    assert_close(back, params, tol=0)


def test_interleaved_errors():
    m = mesh((2,), ("pipe",))
    fns, _, _, _ = chain_problem(3)
    with pytest.raises(PipelineError, match="must be a multiple of the 'pipe' axis size 2"):
        pipeline_value_and_grad(fns, m, num_microbatches=2, schedule="interleaved-1f1b")
    fns, _, _, _ = chain_problem(4)
    with pytest.raises(PipelineError, match="not a multiple of num_stages=2"):
        pipeline_value_and_grad(fns, m, num_microbatches=3, schedule="interleaved-1f1b")
    sched = pipeline.schedule("interleaved-1f1b", num_stages=4, num_microbatches=4, virtual_stages=1)
    with pytest.raises(PipelineError, match="runs on 4 ranks; the mesh's 'pipe' axis has 2"):
        pipeline_value_and_grad(fns, m, schedule=sched)


def _mlp(width=8, layers=4, batch=16):
    keys = jax.random.split(jax.random.key(1), layers + 1)
    params = {f"l{i}": {"w": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
                        "b": jnp.full((width,), 0.01 * i)} for i in range(layers)}
    data = {"x": jax.random.normal(keys[-1], (batch, width)),
            "y": jax.random.normal(jax.random.fold_in(keys[-1], 1), (batch, width))}

    def loss(p, b):
        x = b["x"]
        for i in range(layers):
            x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((x - b["y"]) ** 2)

    return params, data, loss


@pytest.mark.slow
def test_pipelined_cuts_v_stages_per_rank_and_trains_like_one_device():
    """`autoshard.pipelined(..., schedule="interleaved-1f1b", virtual_stages=2)` on pipe 2: 4 stages,
    3 SGD steps equal to one device."""
    params, data, loss = _mlp()
    run = autoshard.pipelined(loss, params, data, mesh={"pipe": 2}, num_microbatches=4,
                              schedule="interleaved-1f1b", virtual_stages=2)
    assert len(run.stages) == 4 and run.program.schedule.rank_of == (0, 1, 0, 1)
    opt = optax.sgd(0.1)
    mine, ref = params, params
    state_m, state_r = opt.init(params), opt.init(params)
    ref_vg = jax.jit(jax.value_and_grad(loss))
    for _ in range(3):
        lm, gm = run.value_and_grad(mine, data)
        lr, gr = ref_vg(ref, data)
        np.testing.assert_allclose(float(lm), float(lr), rtol=1e-5, atol=1e-5)
        assert_close(gm, gr)
        up, state_m = opt.update(gm, state_m, mine)
        mine = optax.apply_updates(mine, up)
        up, state_r = opt.update(gr, state_r, ref)
        ref = optax.apply_updates(ref, up)
    assert_close(mine, ref)
    with pytest.raises(PipelineError, match="virtual_stages=3 needs schedule='interleaved-1f1b'"):
        autoshard.pipelined(loss, params, data, mesh={"pipe": 2}, num_microbatches=4, virtual_stages=3)
