"""Remat without changing the step (issue 33): an ordinary `jax.value_and_grad` step (the zoo's
`train_step`, as in every Flax / optax tutorial) is rematerialised by replaying its blocks' forward in
the traced backward pass (bridge/emit/remat_jaxpr.py), and a tensor plan that does not fit without remat is
planned with it."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.emit.emit import jit_step, make_mesh
from autoshard._src.bridge.emit.remat_jaxpr import replays
from autoshard._src.bridge.trace.trace import trace_step

MESH = {"data": 2, "model": 4}


def _copy(tree):
    return jax.tree.map(jnp.array, tree)


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
def test_replayed_blocks_keep_the_values_and_free_the_activations():
    m = models.get("gpt", "debug", num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=8, vocab_size=64)
    abstract = m.abstract_state()
    leaves, tree = jax.tree.flatten(abstract[0])         # random weights: flax's eager init takes seconds
    keys = jax.random.split(jax.random.key(0), len(leaves))
    params = jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, x.dtype)
                                       for k, x in zip(keys, leaves, strict=True)])
    args = (params, m.init_opt_state(params), m.batch())
    plan = autoshard.plan(m.train_step, *abstract, mesh={"data": 2}, hardware="cpu-sim")
    labels = tuple(f"GPT/block_{i}" for i in range(2))
    traced, mesh = trace_step(m.train_step, *abstract), make_mesh(plan)
    temps, outs = {}, {}
    for policy in ("none", "dots", "full"):
        p = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat=policy),),
                                predicted={**plan.predicted, "remat_labels": labels})
        compiled = jit_step(traced, p, mesh, abstract, donate=False, remat=policy != "none").lower(*abstract).compile()
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
        outs[policy] = compiled(*args)
        if policy != "none":       # one replay per block, each triggered in the backward pass
            schedule = replays(traced.closed, traced.graph, labels, policy)
            assert sorted(r.label for rs in schedule.values() for r in rs) == sorted(labels)
    assert temps["full"] < temps["dots"] < temps["none"], temps
    for policy in ("dots", "full"):
        assert _max_diff(outs[policy], outs["none"]) < 1e-4, policy
        assert float(outs[policy][2]) == pytest.approx(float(outs["none"][2]), rel=1e-6)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(4 * x.shape[-1])(x)))


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = Block()(x)
        return x


def test_a_flax_step_with_jax_grad_replays_its_blocks():
    model, opt = Tower(), optax.sgd(0.1)
    x, y = jax.random.normal(jax.random.key(1), (512, 32)), jnp.zeros((512, 32))
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x, y):          # as a tutorial writes it: jax.grad, nothing of autoshard's
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = (params, opt.init(params), x, y)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    plan = autoshard.plan(step, *abstract, mesh={"data": 2}, hardware="cpu-sim")
    traced, mesh = trace_step(step, *abstract), make_mesh(plan)
    labels = ("Tower/Block_0", "Tower/Block_1", "Tower/Block_2")
    assert len(replays(traced.closed, traced.graph, labels, "full")) == 3
    out, temp = {}, {}
    for policy in ("none", "full"):
        p = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat=policy),),
                                predicted={**plan.predicted, "remat_labels": labels})
        compiled = jit_step(traced, p, mesh, abstract, donate=False, remat=policy != "none").lower(*abstract).compile()
        temp[policy], out[policy] = compiled.memory_analysis().temp_size_in_bytes, compiled(*args)
    assert temp["full"] < temp["none"], temp
    assert _max_diff(out["full"], out["none"]) < 1e-6


@pytest.mark.slow
def test_an_ordinary_step_over_its_budget_is_planned_and_run_with_remat():
    m = models.get("gpt", "debug", batch_size=16, seq_len=64, num_layers=8, vocab_size=128)
    params, batch = m.init(jax.random.key(0)), m.batch()
    args = (params, m.init_opt_state(params), batch)
    step = m.train_step                                     # jax.value_and_grad, unmodified
    free = autoshard.plan(step, *args, mesh=MESH, hardware="cpu-sim")
    budget = 0.4 * free.predicted["memory"]["total"]
    plan = autoshard.plan(step, *args, mesh=MESH, hardware="cpu-sim", memory_budget=budget)
    assert free.stages[0].remat == "none" and plan.stages[0].remat != "none" and not plan.is_pipeline
    assert plan.mesh == tuple(MESH.items()) and plan.predicted["memory"]["total"] <= budget
    assert f"rematerialisation {plan.stages[0].remat!r} in 8 block(s)" in plan.explain()
    fast = autoshard.autoshard(step, plan=plan, hardware="cpu-sim")
    p1, o1, p2, o2 = _copy(args[0]), _copy(args[1]), _copy(args[0]), _copy(args[1])
    plain = jax.jit(step)
    for _ in range(3):
        p1, o1, l1 = fast(p1, o1, batch)
        p2, o2, l2 = plain(p2, o2, batch)
        assert float(l1) == pytest.approx(float(l2), rel=1e-5)
    assert _max_diff(p1, p2) < 1e-5
    compiled = fast.lower(*args).compile().memory_analysis()
    got = compiled.argument_size_in_bytes + compiled.temp_size_in_bytes
    want = plan.memory_on("cpu")["argument+temp"]
    assert abs(got - want) <= 0.15 * max(got, want), (got, want)
    temp, want_temp = compiled.temp_size_in_bytes, plan.memory_on("cpu")["temp"]
    assert abs(temp - want_temp) <= 0.15 * max(temp, want_temp), (temp, want_temp)
    whole = autoshard.autoshard(step, plan=free, hardware="cpu-sim").lower(*args).compile().memory_analysis()
    assert compiled.temp_size_in_bytes < 0.5 * whole.temp_size_in_bytes
    # the replayed forward re-issues its collectives (the sequence-parallel gathers): predicted too
    report = autoshard.audit(plan, step, *args)
    assert report.fidelity_ok, report.report()
    assert any(c["phase"] == "backward" and c["kind"] == "all-gather" for c in plan.predicted["collectives"])


def test_remat_is_not_tried_on_axes_the_3d_tables_do_not_name():
    m = models.get("gpt", "debug", batch_size=16, seq_len=64, num_layers=8, vocab_size=128)
    args = m.abstract_state()
    free = autoshard.plan(m.train_step, *args, mesh={"x": 2, "y": 4}, hardware="cpu-sim")
    with pytest.raises(autoshard.InfeasiblePlanError, match="no plan fits the memory budget"):
        autoshard.plan(m.train_step, *args, mesh={"x": 2, "y": 4}, hardware="cpu-sim",
                       memory_budget=0.4 * free.predicted["memory"]["total"])



class ScannedTower(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(lambda mdl, carry, _: (Block()(carry), None), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        return blocks(self, x, None)[0]


def test_a_scanned_tower_is_not_replayed_and_says_so():
    # one loop over the layers: replaying it would rebuild every layer's residuals at once
    model, opt = ScannedTower(), optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(1), (64, 16))
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, opt.init(params), x))
    plan = autoshard.plan(step, *abstract, mesh={"data": 2}, hardware="cpu-sim")
    traced = trace_step(step, *abstract)
    modules = {op.module for op in traced.graph.ops if op.phase == "forward" and op.module}
    label = min(modules, key=len)
    assert replays(traced.closed, traced.graph, (label,), "full") == {}
    p = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat="full"),),
                            predicted={**plan.predicted, "remat_labels": (label,)})
    with pytest.warns(UserWarning, match="nothing of them is replayed"):
        jit_step(traced, p, make_mesh(plan), abstract, remat=True)
