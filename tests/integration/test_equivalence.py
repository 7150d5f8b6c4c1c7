"""The backbone: training under the auto plan equals single-device training.

Every zoo model at debug size, on every 8-device mesh shape, 3 steps: losses and parameters match
the unsharded run. The hardware has near-zero collective latency so that the planner really
shards these tiny models (on real latencies it would rightly replicate them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
import models

from .._reference import run_steps

# ~4 minutes of compiles on this machine: the default run skips it, CI runs it as a second step
pytestmark = pytest.mark.slow

FAST_LINKS = {"base": "cpu-sim", "intra_node_latency": 1e-12, "inter_node_latency": 1e-12}
MESHES = {"1x8": {"a": 1, "b": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2},
          "8x1": {"data": 8, "model": 1}, "2x2x2": {"x": 2, "y": 2, "z": 2}}
MODELS = {"mlp": {}, "gpt": {"num_layers": 2}, "gpt_nnx": {"num_layers": 2}, "bert": {"num_layers": 2}}


def _reference(m, steps):
    params = m.init(jax.random.key(0))
    losses, params, _ = run_steps(jax.jit(m.train_step), params, m.init_opt_state(params), m.batch(), steps)
    return losses, params


_REF: dict = {}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(MODELS))
def test_auto_plan_matches_single_device(name, mesh):
    m = models.get(name, "debug", **MODELS[name])
    if name not in _REF:
        _REF[name] = _reference(m, 3)
    ref_losses, ref_params = _REF[name]
    step = autoshard.autoshard(m.train_step, mesh=MESHES[mesh], hardware=FAST_LINKS)
    params = m.init(jax.random.key(0))
    losses, params, _ = run_steps(step, params, m.init_opt_state(params), m.batch(), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-5
    # the plan really distributes something on multi-axis meshes
    specs = [s for s in step.plan.input_specs_flat if any(s)]
    assert specs, f"nothing sharded on {mesh}:\n{step.explain()}"
    # and the arrays carry the planned shardings
    leaf_specs = dict(zip(step.plan.input_keypaths, step.plan.input_specs_flat, strict=True))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in flat[:5]:
        kp = "[0]" + jax.tree_util.keystr(path)
        want = leaf_specs[kp]
        got = leaf.sharding.spec
        assert tuple(tuple(a) if isinstance(a, tuple) else ((a,) if a else ()) for a in got) + \
            ((),) * (len(want) - len(got)) == want


@pytest.mark.parametrize("storage", ["zero1", "zero3"])
def test_zero_storage_matches_single_device(storage):
    """Parameters / optimizer state split over the data axis (ZeRO) train the same."""
    m = models.get("gpt", "debug", num_layers=2)
    if "gpt" not in _REF:
        _REF["gpt"] = _reference(m, 3)
    ref_losses, ref_params = _REF["gpt"]
    opts = {"storage_modes": (storage,)}
    step = autoshard.autoshard(m.train_step, mesh={"data": 4, "model": 2}, hardware=FAST_LINKS,
                               options=opts)
    params = m.init(jax.random.key(0))
    losses, params, _ = run_steps(step, params, m.init_opt_state(params), m.batch(), 3)
    assert step.plan.storage == storage
    state_specs = [s for k, s in step.plan.specs_by_keypath().items() if k.startswith("[1]") and any(s)]
    assert state_specs, step.explain()
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-5


@pytest.mark.parametrize("overrides", [{"scan_layers": True, "num_layers": 3}, {"remat": True, "num_layers": 2}])
def test_scan_and_remat_variants_match_single_device(overrides):
    m = models.get("gpt", "debug", **overrides)
    losses, ref_params = _reference(m, 3)
    step = autoshard.autoshard(m.train_step, mesh={"data": 2, "model": 4}, hardware=FAST_LINKS)
    params = m.init(jax.random.key(0))
    got, params, _ = run_steps(step, params, m.init_opt_state(params), m.batch(), 3)
    np.testing.assert_allclose(got, losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-5
    if overrides.get("scan_layers"):
        # the stacked layer axis is sliced by the scan, never split across devices
        for k, spec in step.plan.specs_by_keypath().items():
            if "['blocks']" in k:
                assert spec[0] == (), (k, spec)
