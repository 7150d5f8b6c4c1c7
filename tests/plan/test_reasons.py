"""Every reason a plan gives is checked against the numbers beside it (issue 20): why an expert plan does
not apply, why it is over budget, why a mesh axis idles. A reason that contradicts its own plan's
numbers is a bug, like a wrong number."""

from __future__ import annotations

import re

import jax
import pytest

import autoshard
import models


def _plan(name, mesh, hardware="cpu-sim", memory_budget=None, **overrides):
    m = models.get(name, "debug", **overrides)
    return m, autoshard.plan(m.train_step, *m.abstract_state(), mesh=mesh, hardware=hardware,
                             memory_budget=memory_budget)


def _reasons(plan):
    return {k: e["reason"] for k, e in plan.predicted["experts"].items() if "reason" in e}


def test_batch_that_does_not_divide():
    m, plan = _plan("mlp", {"x": 8}, batch_size=12)
    why = _reasons(plan)["data-parallel"]
    n = int(re.search(r"does not divide the (\d+) devices", why).group(1))
    assert n == 8 and m.config.batch_size % n != 0, why
    assert _reasons(plan)["fsdp"] == why


def test_tensor_parallel_dims_that_do_not_divide():
    m, plan = _plan("gpt", {"x": 8}, num_heads=4, d_model=32)
    why = _reasons(plan)["megatron"]
    sizes = [int(s) for s in re.search(r"of size \[([\d, ]+)\]", why).group(1).split(",")]
    whole = int(re.search(r"parts of the dim of size (\d+)", why).group(1))
    assert sizes == [4] and whole == 32 and all(s % 8 for s in sizes), why
    assert "('x',)" in why


def test_two_axes_needed_and_no_stream():
    _, plan = _plan("gpt", {"x": 4}, num_heads=4, d_model=32)
    assert _reasons(plan)["data-megatron"] == "needs a mesh with at least two axes"
    assert len(plan.mesh) == 1
    # a two-matmul flat MLP has no sequence between its tensor-parallel regions
    params = {"w0": jax.ShapeDtypeStruct((64, 256), "float32"), "w1": jax.ShapeDtypeStruct((256, 64), "float32")}
    import optax
    opt = optax.sgd(0.1)

    def step(p, s, b):
        loss = lambda p: ((jax.nn.relu(b["x"] @ p["w0"]) @ p["w1"] - b["y"]) ** 2).mean()  # noqa: E731
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    batch = {"x": jax.ShapeDtypeStruct((32, 64), "float32"), "y": jax.ShapeDtypeStruct((32, 64), "float32")}
    flat = autoshard.plan(step, params, jax.eval_shape(opt.init, params), batch, mesh={"x": 4}, hardware="cpu-sim")
    why = _reasons(flat)["megatron-sp"]
    assert "no sequence to split" in why and "step_time" in flat.predicted["experts"]["megatron"], why


@pytest.mark.parametrize("budget", [None, 4.5e5])
def test_over_budget_flags_agree_with_memory(budget):
    _, plan = _plan("gpt", {"data": 2, "model": 4}, memory_budget=budget, batch_size=8, num_heads=8)
    limit = plan.predicted["memory_budget"]
    text = plan.explain()
    for name, e in plan.predicted["experts"].items():
        if "reason" in e:
            assert f"{name:<15} not applicable: {e['reason']}" in text
            continue
        assert e["feasible"] == (e["memory"] <= limit), (name, e, limit)
        line = next(x for x in text.splitlines() if x.strip().startswith(name + " "))
        assert ("exceeds the memory budget" in line) == (not e["feasible"]), line
    assert plan.predicted["feasible"] and plan.predicted["memory"]["total"] <= limit
    if budget is not None:    # the tight budget leaves some expert over it: both branches are checked
        assert any(not e.get("feasible", True) for e in plan.predicted["experts"].values())


def test_idle_axis_warning_states_sizes():
    # batch 6 and every dim of a tiny model indivisible by 4: the axis of size 4 idles, and says why
    _, plan = _plan("mlp", {"data": 2, "odd": 4}, batch_size=6, hidden_dim=6, in_dim=6, out_dim=6)
    idle = [w for w in plan.warnings if w.startswith("mesh axis 'odd'")]
    assert idle, plan.warnings
    dims = [int(d) for d in re.search(r"candidate dims \[([\d, ]+)\]", idle[0]).group(1).split(",")]
    assert dims and all(d % 4 for d in dims), idle[0]


def test_data_megatron_batch_that_does_not_divide_the_data_axis():
    m, plan = _plan("gpt", {"data": 4, "model": 2}, batch_size=6, num_heads=4, d_model=32)
    why = _reasons(plan)["data-megatron"]
    axes = re.search(r"does not divide axes (\(.*?\))", why).group(1)
    assert axes == "('data',)" and m.config.batch_size % dict(plan.mesh)["data"] != 0, why


def test_sequence_that_does_not_divide_the_tensor_parallel_axis():
    m, plan = _plan("gpt", {"model": 4}, seq_len=6, num_heads=4, d_model=32)
    why = _reasons(plan)["megatron-sp"]
    sizes = [int(s) for s in re.search(r"of size \[([\d, ]+)\]", why).group(1).split(",")]
    assert m.config.seq_len in sizes and all(s % 4 for s in sizes), why
    assert "step_time" in plan.predicted["experts"]["megatron"]     # Megatron itself still applies


def test_no_tensor_parallel_parameter_and_moe_regions():
    import optax
    opt = optax.sgd(0.1)
    params = {"scale": jax.ShapeDtypeStruct((64,), "float32")}

    def step(p, s, b):
        g = jax.grad(lambda p: ((b["x"] * p["scale"]) ** 2).mean())(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    batch = {"x": jax.ShapeDtypeStruct((32, 64), "float32")}
    plan = autoshard.plan(step, params, jax.eval_shape(opt.init, params), batch, mesh={"x": 4}, hardware="cpu-sim")
    why = _reasons(plan)
    assert why["megatron"].startswith("no tensor-parallel dim: no forward matmul"), why
    assert why["megatron"] == why["megatron-sp"]
    assert not any(len(r.shape) == 2 for r in plan.params)      # nothing a matmul reads
    m, moe = _plan("moe", {"data": 2, "model": 4})
    assert m.config.num_experts > 1
    assert _reasons(moe).get("megatron-sp") == "sequence parallelism is not searched with mixture-of-experts regions"
