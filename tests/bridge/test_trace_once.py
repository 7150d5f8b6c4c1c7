"""The first decorated call traces the step once: one jaxpr and one OpGraph serve the fingerprint,
the planner and the emission (jit then traces the emitted function, as it must)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard._src.bridge.trace import trace as trace_module


def _counting(monkeypatch):
    counts = {"make_jaxpr": 0, "eval_shape": 0, "opgraph": 0}
    make_jaxpr, eval_shape, builder_init = jax.make_jaxpr, jax.eval_shape, trace_module._Builder.__init__

    def counted_make_jaxpr(*a, **k):
        counts["make_jaxpr"] += 1
        return make_jaxpr(*a, **k)

    def counted_eval_shape(*a, **k):
        counts["eval_shape"] += 1
        return eval_shape(*a, **k)

    def counted_builder(self):
        counts["opgraph"] += 1
        builder_init(self)

    monkeypatch.setattr(jax, "make_jaxpr", counted_make_jaxpr)
    monkeypatch.setattr(jax, "eval_shape", counted_eval_shape)
    monkeypatch.setattr(trace_module._Builder, "__init__", counted_builder)
    return counts


@pytest.mark.slow
def test_first_call_traces_once(monkeypatch):
    opt = optax.adam(1e-2)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}
    opt_state = opt.init(params)
    want = train_step(params, opt_state, batch)[2]
    step = autoshard.autoshard(train_step, mesh={"data": 4, "model": 2}, donate=False)
    counts = _counting(monkeypatch)
    params, opt_state, loss = step(params, opt_state, batch)
    assert counts == {"make_jaxpr": 1, "eval_shape": 0, "opgraph": 1}, counts
    assert step.plan.predicted["timing"]["trace_seconds"] > 0
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    step(params, opt_state, batch)                     # later calls do not trace at all
    assert counts["make_jaxpr"] == 1 and counts["opgraph"] == 1


def test_numpy_batches_do_not_retrace_the_step():
    """Batches from a data loader are numpy arrays: every call places them as the first call did, so their
    type (with its planned sharding) is the compiled program's and jax neither traces nor compiles again."""
    opt = optax.sgd(0.1)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    events: list[str] = []

    def listen(name, secs, **kw):
        events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _three_numpy_steps(train_step, opt, events)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _three_numpy_steps(train_step, opt, events):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    step = autoshard.autoshard(train_step, mesh={"data": 4, "model": 2}, hardware="cpu-sim")
    opt_state, losses = opt.init(params), []
    for _ in range(3):
        batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 8)).astype(np.float32)}
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        if len(losses) == 1:
            first = len(events)
    again = [e for e in events[first:] if e.endswith(("jaxpr_trace_duration", "backend_compile_duration"))]
    assert not again, again
    assert len(set(losses)) == 3
