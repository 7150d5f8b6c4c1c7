"""The MPMD pipeline runtime: each stage its own jitted program on its own submesh (stages of 2, 2 and 4
devices, Alpa's unequal 3-D plan shape), activations moved between submeshes by cross-mesh device_put,
the schedule's tasks issued without blocking. Training equals one device; a bad stage assignment is a
typed error before anything runs."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.runtimes.from_plan import mpmd_from_plan
from autoshard._src.bridge.runtimes.mpmd import MpmdPipeline, issue_order, mpmd_pipelined
from autoshard._src.bridge.runtimes.submeshes import stage_meshes
from autoshard._src.pipeline.schedules.registry import schedule as build_schedule

from .._reference import run_steps

SUBMESHES = [(2, 1), (1, 2), (2, 2)]      # data x model: 2, 2 and 4 devices


# Adam's first steps move a weight by lr * g / (|g| + eps): a tied-embedding row with |g| ~ 3e-7 turns the
# float-rounding difference of its gradient (~3e-8, stages sum their micro-batches in another order) into
# ~1e-5 of its value. Plain SGD keeps the strict 1e-5 parameter comparison meaningful; Adam runs once with
# that one conditioning allowance.
SGD = optax.sgd(0.1)
ADAM_ATOL = 3e-5


def reference(m, params, batch, opt, steps=3):
    def step(p, o, b):
        v, g = jax.value_and_grad(m.loss)(p, b)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, v

    return run_steps(jax.jit(step), params, opt.init(params), batch, steps)


def train(run, m, params, batch, opt, steps=3):
    state = run.init(params, opt)
    losses = []
    for _ in range(steps):
        state, loss = run.step(state, batch, opt)
        losses.append(float(loss))
    return losses, state


@pytest.mark.parametrize("schedule, adam", [("1f1b", False), pytest.param("gpipe", False, marks=pytest.mark.slow),
                                            pytest.param("1f1b", True, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_gpt_on_stages_of_2_2_and_4_devices_trains_like_one_device(schedule, adam):
    m = models.get("gpt", "debug", batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = mpmd_pipelined(m.loss, params, batch, submeshes=SUBMESHES, num_microbatches=2, schedule=schedule)
    # three programs on three disjoint device sets of 2, 2 and 4, covering the 8 devices
    devs = [set(mesh.devices.flat) for mesh in run.meshes]
    assert [len(d) for d in devs] == [2, 2, 4] and set.union(*devs) == set(jax.devices())
    opt = m.optimizer if adam else SGD
    losses, state = train(run, m, params, batch, opt)
    want, p_ref, _ = reference(m, params, batch, opt)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = run.gather(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=ADAM_ATOL if adam else 1e-5)
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


def alpa_like_plan():
    """tests/plan/test_joint_plan.py's model: on 8 H100s the 3-D search gives its 3 stages unequal submeshes
    (2, 2 and 4 devices), a plan only the MPMD runtime runs (`runtime` "mpmd"). Planned abstractly at batch 64."""
    big = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=64, seq_len=64)
    return autoshard.plan(big.train_step, *big.abstract_state(), mesh="auto", devices=8, hardware="h100-sxm")


@pytest.mark.slow
def test_the_3d_searchs_unequal_plan_runs_mpmd_like_one_device():
    plan = alpa_like_plan()
    chosen = plan.predicted["3d"]["chosen"]
    assert plan.runtime == "mpmd" and sorted(d * t for d, t in chosen["submeshes"]) == [2, 2, 4]
    m = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=8, seq_len=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = mpmd_from_plan(m.loss, params, batch, plan)
    assert [math.prod(mesh.shape.values()) for mesh in run.meshes] == [d * t for d, t in chosen["submeshes"]]
    assert run.M == chosen["microbatches"] and run.schedule.name == chosen["schedule"]
    assert run.batch_axes == [st.batch_axes for st in plan.stages]
    losses, state = train(run, m, params, batch, SGD)
    want, p_ref, _ = reference(m, params, batch, SGD)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(run.gather(state)), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_plan_file_edited_to_drop_a_device_is_a_typed_error():
    data = json.loads(alpa_like_plan().to_json())
    data["predicted"]["3d"]["chosen"]["submeshes"] = [[2, 1], [2, 1], [1, 2]]      # 6 of the 8 devices
    plan = autoshard.Plan.from_json(json.dumps(data))
    m = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=8, seq_len=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    with pytest.raises(autoshard.PipelineError, match=r"devices \[6, 7\] belong to no stage"):
        mpmd_from_plan(m.loss, params, batch, plan)
    assert all(not x.is_deleted() for x in jax.tree.leaves((params, batch)))


@pytest.mark.slow
def test_autoshard_pipelined_runs_an_unequal_plan_mpmd():
    plan = alpa_like_plan()
    m = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=8, seq_len=64)
    params, batch = m.init(jax.random.key(0)), m.batch()
    run = autoshard.pipelined(m.loss, params, batch, mesh={"devices": 8}, num_microbatches=2, plan=plan)
    assert isinstance(run, MpmdPipeline) and "MPMD: 3 stages" in run.describe()
    loss, grads = run.value_and_grad(params, batch)
    want, want_g = jax.jit(jax.value_and_grad(m.loss))(params, batch)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
