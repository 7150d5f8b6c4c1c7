"""run_clm_flax.py's step (issue 34): a flax TrainState carrying a legacy uint32[2] dropout key, dropout on.
The key is a PRNG key by dataflow (a jax.random primitive reads it), so it is never split and never taken
for the batch; the step trains as on one device. Needs the `hf` extra (slow CI step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard

pytest.importorskip("transformers")
import models.hf as hf  # noqa: E402

MESH = {"data": 2, "model": 4}
pytestmark = pytest.mark.slow


def _whole(spec) -> bool:
    return not any(spec)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_dropout_train_state_trains_like_one_device_and_keeps_the_key_whole(name):
    # SGD: Adam's update divides rounding noise of near-zero gradients by its own tiny second moment
    step, (state, batch) = hf.build_train_state(name, optimizer=optax.sgd(0.1))
    assert state.dropout_rng.dtype == jnp.uint32 and state.dropout_rng.shape == (2,)
    fast = autoshard.autoshard(step, mesh=MESH, hardware="cpu-sim")
    s1, s2, losses = state, state, []
    for _ in range(3):
        s1, l1 = fast(s1, batch)
        s2, l2 = jax.jit(step)(s2, batch)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
        losses.append(float(l2))
    assert len(set(losses)) == 3                       # the key advances: dropout draws anew every step
    np.testing.assert_array_equal(np.asarray(s1.dropout_rng), np.asarray(s2.dropout_rng))
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    specs = fast.plan.specs_by_keypath()
    keys = [kp for kp in specs if "dropout_rng" in kp]
    assert len(keys) == 1 and _whole(specs[keys[0]]), {kp: specs[kp] for kp in keys}
    assert s1.dropout_rng.sharding.is_fully_replicated


def test_batch_experts_apply_beside_a_legacy_key_and_keep_it_whole():
    step, args = hf.build_train_state("gpt2")
    plan = autoshard.plan(step, *args, mesh=MESH, hardware="cpu-sim")
    experts = plan.predicted["experts"]
    assert all("step_time" in experts[n] for n in ("data-parallel", "fsdp")), experts
    fsdp = autoshard.expert_plan("fsdp", step, *args, mesh=MESH, hardware="cpu-sim")
    key = next(kp for kp in fsdp.specs_by_keypath() if "dropout_rng" in kp)
    assert _whole(fsdp.specs_by_keypath()[key]), fsdp.specs_by_keypath()[key]
