"""A pipeline plan under @autoshard: the step's autoshard.value_and_grad runs as pipeline stages and
training matches the single-device step; the state stays the user's pytrees, stored ZeRO-style;
misuse gets typed errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard import ConfigError, PipelineError, PlanError

from .._reference import run_steps
from .test_repack import check_repack_traffic


def assert_close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def make_step(m, loss=None):
    loss = loss or m.loss

    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def train_like_one_device(fast, step, m, params, batch, steps=2):
    """Run `fast` and jax.jit(step) side by side; losses and final parameters must agree."""
    losses, p1, o1 = run_steps(fast, params, m.optimizer.init(params), batch, steps)
    want, p2, _ = run_steps(jax.jit(step), params, m.optimizer.init(params), batch, steps)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert_close(p1, p2)
    return p1, o1


@pytest.mark.slow      # the default suite trains the same path in test_pipelined_losses_as_users_write_them
def test_pipelined_decorator_trains_like_one_device():
    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    step = make_step(m)
    fast = autoshard.autoshard(step, mesh={"pipe": 4, "data": 2}, pipeline="rannc", hardware="cpu-sim",
                               num_microbatches=2)
    p1, o1 = train_like_one_device(fast, step, m, params, batch)
    assert jax.tree.structure(p1) == jax.tree.structure(params)
    # the loss ran as the plan's 4 stages; the rest of the step around it
    assert len(fast.pipelined.stages) == 4 and len(fast.plan.stages) == 4
    assert "Runtime cut of the loss" in fast.explain()
    # state between steps: ZeRO-style, each device holds 1/8 of every divisible leaf
    wte = p1["wte"]["embedding"]
    assert wte.sharding.shard_shape(wte.shape)[0] == wte.shape[0] // 8
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((p1, o1)))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((p1, o1)))
    assert per_device < state_bytes / 4
    # the user's arrays from before the first call are intact (only the placed copies are donated)
    assert np.isfinite(np.asarray(params["wte"]["embedding"])).all()


def test_value_and_grad_outside_a_pipeline_is_jax():
    def f(p, x):
        return jnp.sum(jnp.sin(p * x)), jnp.cos(x)

    p, x = jnp.arange(3.0), jnp.ones(3)
    got = autoshard.value_and_grad(lambda p, x: f(p, x)[0])(p, x)
    want = jax.value_and_grad(lambda p, x: f(p, x)[0])(p, x)
    assert_close(got, want)
    got = autoshard.value_and_grad(lambda p, x: f(p, x), argnums=1, has_aux=True)(p, x)
    want = jax.value_and_grad(lambda p, x: f(p, x), argnums=1, has_aux=True)(p, x)
    assert_close(got, want)


@pytest.mark.slow
def test_pipelined_decorator_errors():
    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    opt_state = m.optimizer.init(params)
    kw = dict(mesh={"pipe": 2, "data": 4}, pipeline="rannc", hardware="cpu-sim", num_microbatches=1)

    def plain(params, opt_state, batch):       # jax.value_and_grad: nothing to pipeline
        loss, grads = jax.value_and_grad(m.loss)(params, batch)
        return params, opt_state, loss

    with pytest.raises(PlanError, match="never calls autoshard.value_and_grad"):
        autoshard.autoshard(plain, **kw)(params, opt_state, batch)

    def with_options(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(m.loss, allow_int=True)(params, batch)
        return params, opt_state, loss

    with pytest.raises(PlanError, match=r"options \['allow_int'\] are not supported"):
        autoshard.autoshard(with_options, **kw)(params, opt_state, batch)

    from autoshard._src.bridge.trace.loss_call import LossCall

    with pytest.raises(PlanError, match="reads no array with the step's batch size 4"):
        LossCall(lambda p: jnp.sum(p["wte"]["embedding"] ** 2), (params,), 0, False, 4)
    with pytest.raises(PlanError, match="argnums=3 does not index"):
        LossCall(m.loss, (params, batch), 3, False, 4)

    def twice(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(m.loss)(params, batch)
        loss2, _ = autoshard.value_and_grad(m.loss)(params, batch)
        return params, opt_state, loss + loss2

    with pytest.raises(PlanError, match="one loss, once per step"):
        autoshard.autoshard(twice, **kw)(params, opt_state, batch)

    with pytest.raises(PlanError, match="needs concrete example arguments"):
        autoshard.autoshard(make_step(m), **kw).lower(*m.abstract_state())

    with pytest.raises(ConfigError, match="pipeline plans only"):
        autoshard.autoshard(make_step(m), mesh={"data": 8}, num_microbatches=4)

    # a loss micro-batching cannot compute (a max over samples) is refused when the step is built
    def worst(params, batch):
        per = jnp.mean(m.module.apply({"params": params}, batch["inputs"]) ** 2, axis=(1, 2))
        return jnp.max(per)

    with pytest.raises(PipelineError, match="'reduce_max' in the loss combines the samples"):
        autoshard.autoshard(make_step(m, worst), **kw)(params, opt_state, batch)


def _user_losses():
    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    kw = dict(mesh={"pipe": 4, "data": 2}, pipeline="rannc", hardware="cpu-sim", num_microbatches=2)

    def closure(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(lambda p: m.loss(p, batch))(params)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def nested_aux_argnums(params, opt_state, batch):
        scale = jnp.float32(1.0)

        def loss(tag, p):           # differentiated in its second argument, returns (loss, aux)
            value = m.loss(p, batch) * scale
            return value, {"tag": tag, "twice": 2 * value}

        (value, aux), grads = autoshard.value_and_grad(loss, argnums=1, has_aux=True)(jnp.int32(7), params)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value + 0 * aux["twice"] + 0 * aux["tag"]

    return m, params, batch, kw, {"closure": closure, "nested_aux_argnums": nested_aux_argnums}


@pytest.mark.parametrize("idiom", ["nested_aux_argnums", pytest.param("closure", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_pipelined_losses_as_users_write_them(idiom):
    """A lambda closing over the batch, a nested def reading it with argnums and has_aux: the
    pipelined step trains like the same step under jax.jit (the batch found among the closed-over
    values, micro-batched, the aux computed on the whole batch)."""
    m, params, batch, kw, steps = _user_losses()
    fast = autoshard.autoshard(steps[idiom], **kw)
    p1, o1 = train_like_one_device(fast, steps[idiom], m, params, batch)
    assert len(fast.pipelined.stages) == 4 and jax.tree.structure(p1) == jax.tree.structure(params)
    # state between steps: ZeRO-style, each device holds 1/8 of every divisible leaf
    wte = p1["wte"]["embedding"]
    assert wte.sharding.shard_shape(wte.shape)[0] == wte.shape[0] // 8
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((p1, o1)))
    assert per_device < sum(x.nbytes for x in jax.tree.leaves((p1, o1))) / 4
    assert np.isfinite(np.asarray(params["wte"]["embedding"])).all()   # the caller's arrays survive donation
    check_repack_traffic(fast, p1, o1, batch)       # storage <-> stage rows: about a stage per device


@pytest.mark.slow      # DAG runtime numerics stay in the default suite via tests/bridge/test_runtime.py
def test_graphpipe_dag_plan_trains_like_one_device():
    # CANDLE-Uno's feature branches become concurrent stages feeding the join stage (graph-1F1B)
    m = models.get("candle_uno", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    step = make_step(m)
    fast = autoshard.autoshard(step, mesh={"data": 8}, pipeline="graphpipe", hardware="v100-sxm")
    p1, o1 = train_like_one_device(fast, step, m, params, batch)
    stages = fast.pipelined.stages
    assert len(stages) == len(fast.plan.stages) > 2
    joins = [st for st in stages if len(st.after) > 1]
    assert len(joins) == 1 and fast.pipelined.program.schedule.name == "graph-1f1b"
    assert fast.pipelined.mesh.shape["pipe"] == len(stages)
