"""Interleaved 1F1B in the SPMD runtime: 4 stage functions on a pipe axis of 2 (stage k on rank
k % 2, a ring ppermute at the chunk boundary) equal single-device jax.value_and_grad."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pipeline
from autoshard import PipelineError
from autoshard._src.bridge.runtime import pipeline_value_and_grad
from tests.bridge.test_runtime import assert_close, chain_problem, mesh


@pytest.mark.parametrize(("shape", "names", "stages", "microbatches"), [
    ((2,), ("pipe",), 4, 4),
    ((2, 2), ("pipe", "data"), 4, 2),
    ((2,), ("pipe",), 6, 2),
])
def test_interleaved_matches_single_device(shape, names, stages, microbatches):
    m = mesh(shape, names)
    fns, params, data, full_loss = chain_problem(stages)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=microbatches, schedule="interleaved-1f1b")
    assert prog.schedule.rank_of == tuple(k % 2 for k in range(stages))
    loss, grads = prog.value_and_grad(params, data)
    want_loss, want_grads = jax.value_and_grad(full_loss)(params, data)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, atol=1e-5)
    assert_close(grads, want_grads)


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
