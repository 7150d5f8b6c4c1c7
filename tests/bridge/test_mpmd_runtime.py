"""The MPMD pipeline runtime: each stage its own jitted program on its own submesh (stages of 2, 2 and 4
devices, Alpa's unequal 3-D plan shape), activations moved between submeshes by cross-mesh device_put,
the schedule's tasks issued without blocking. Training equals one device; a bad stage assignment is a
typed error before anything runs."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.runtimes.mpmd import issue_order, mpmd_pipelined
from autoshard._src.bridge.runtimes.submeshes import stage_meshes
from autoshard._src.pipeline.schedules.registry import schedule as build_schedule

from .._reference import run_steps

SUBMESHES = [(2, 1), (1, 2), (2, 2)]      # data x model: 2, 2 and 4 devices


def reference(m, params, batch, steps=3):
    def step(p, o, b):
        v, g = jax.value_and_grad(m.loss)(p, b)
        u, o = m.optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, v

    return run_steps(jax.jit(step), params, m.optimizer.init(params), batch, steps)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gpt_on_stages_of_2_2_and_4_devices_trains_like_one_device(schedule):
    m = models.get("gpt", "debug", batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = mpmd_pipelined(m.loss, params, batch, submeshes=SUBMESHES, num_microbatches=2, schedule=schedule)
    # three programs on three disjoint device sets of 2, 2 and 4, covering the 8 devices
    devs = [set(mesh.devices.flat) for mesh in run.meshes]
    assert [len(d) for d in devs] == [2, 2, 4] and set.union(*devs) == set(jax.devices())
    state = run.init(params, m.optimizer)
    losses = []
    for _ in range(3):
        state, loss = run.step(state, batch, m.optimizer)
        losses.append(float(loss))
    want, p_ref, _ = reference(m, params, batch)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = run.gather(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # parameters and optimizer state stayed on their stage, with the stage's own shardings (no data-parallel
    # fallback: the model-parallel stages keep matrices split over "model")
    for s, (p, o) in enumerate(zip(state.params, state.opt_states, strict=True)):
        assert all(set(x.sharding.device_set) == devs[s] for x in jax.tree.leaves((p, o)))
        assert any("model" in str(x.sharding.spec) for x in p.values()) == (SUBMESHES[s][1] > 1)
    # the tied embedding has a copy on the first and the last stage, equal after the updates
    tied = [k for k, held in zip(run.cut.keys, run.cut.holders, strict=True) if len(held) > 1]
    for k in tied:
        held = sorted(run.cut.holders[run.cut.keys.index(k)])
        np.testing.assert_array_equal(np.asarray(state.params[held[0]][k]), np.asarray(state.params[held[-1]][k]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_issue_order_respects_every_dependency_and_each_rank_order(name):
    kw = {"virtual_stages": 2} if name.startswith("interleaved") else {}
    sched = build_schedule(name, num_stages=3, num_microbatches=6, **kw)
    order = issue_order(sched)
    seen = set()
    for t in order:
        assert all(d in seen for d in sched.dependencies(t)), t
        seen.add(t)
    for tasks in sched.ranks:
        assert [t for t in order if t in set(tasks)] == list(tasks)


@pytest.mark.parametrize("assignment, match", [
    ([{"devices": [0, 1], "shape": (2, 1)}, {"devices": [1, 2], "shape": (2, 1)},
      {"devices": [3, 4, 5, 6, 7], "shape": (5, 1)}], "both claim device 1"),
    ([(2, 1), (1, 2), (1, 2)], r"devices \[6, 7\] belong to no stage"),
    ([(2, 1), (2, 1), (2, 4)], "needs 8 devices"),
    ([{"devices": [0, 1, 2], "shape": (2, 1)}, (2, 1), (1, 3)], "has 3 devices but shape"),
    ([(2, 1), (0, 2), (2, 2)], "positive ints"),
])
def test_a_bad_stage_assignment_is_a_typed_error_before_anything_runs(assignment, match):
    m = models.get("gpt", "debug", batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()
    with pytest.raises(autoshard.PipelineError, match=match):
        stage_meshes(assignment)
    with pytest.raises(autoshard.PipelineError, match=match):
        mpmd_pipelined(m.loss, params, batch, submeshes=assignment, num_microbatches=2)
    # nothing was placed or donated: the caller's arrays are intact
    assert all(not x.is_deleted() for x in jax.tree.leaves((params, batch)))
    np.testing.assert_allclose(float(jax.jit(m.loss)(params, batch)), float(m.loss(params, batch)), rtol=1e-6)
