"""Remat without changing the step (issue 33): an ordinary `jax.value_and_grad` step (the zoo's
`train_step`, as in every Flax / optax tutorial) is rematerialised by replaying its blocks' forward in
the traced backward pass (bridge/remat_jaxpr.py), and a tensor plan that does not fit without remat is
planned with it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
import models
from autoshard._src.bridge.emit import jit_step, make_mesh
from autoshard._src.bridge.remat_jaxpr import replays
from autoshard._src.bridge.trace import trace_step

MESH = {"data": 2, "model": 4}


def _copy(tree):
    return jax.tree.map(jnp.array, tree)


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_replayed_blocks_keep_the_values_and_free_the_activations():
    m = models.get("gpt", "debug", num_layers=4, d_model=64, num_heads=4, seq_len=64, batch_size=16, vocab_size=128)
    params = m.init(jax.random.key(0))
    args = (params, m.init_opt_state(params), m.batch())
    abstract = m.abstract_state()
    plan = autoshard.plan(m.train_step, *abstract, mesh={"data": 8}, hardware="cpu-sim")
    labels = tuple(f"GPT/block_{i}" for i in range(4))
    traced, mesh = trace_step(m.train_step, *abstract), make_mesh(plan)
    temps, outs = {}, {}
    for policy in ("none", "dots", "full"):
        p = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat=policy),),
                                predicted={**plan.predicted, "remat_labels": labels})
        fn = jit_step(traced, p, mesh, abstract, donate=False, remat=policy != "none")
        temps[policy] = fn.lower(*abstract).compile().memory_analysis().temp_size_in_bytes
        outs[policy] = fn(*args)
        if policy != "none":       # one replay per block, each triggered in the backward pass
            schedule = replays(traced.closed, traced.graph, labels, policy)
            assert sorted(r.label for rs in schedule.values() for r in rs) == sorted(labels)
    assert temps["full"] < temps["dots"] < temps["none"], temps
    for policy in ("dots", "full"):
        assert _max_diff(outs[policy], outs["none"]) < 1e-4, policy
        assert float(outs[policy][2]) == pytest.approx(float(outs["none"][2]), rel=1e-6)


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
