"""PRNG keys are never split and never the batch (issue 34): a step that takes a dropout key, as Hugging
Face's Flax training scripts do (`train_step(state, batch, dropout_rng)`), plans and runs like one without.
A key is found by dataflow (a jax.random primitive reads it), not by its name or shape alone."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard._src.core.graph import traced_batch

BATCH, IN, HIDDEN, OUT = 32, 32, 64, 16


class _DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(HIDDEN)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(OUT)(x)


_MODEL = _DropoutMLP()
_TX = optax.adam(1e-3)


def _step(params, opt_state, batch, dropout_rng):
    rng, sub = jax.random.split(dropout_rng)

    def loss(p):
        y = _MODEL.apply({"params": p}, batch["x"], rngs={"dropout": sub})
        return jnp.mean((y - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, rng


@pytest.fixture(scope="module")
def state():
    params = _MODEL.init(jax.random.PRNGKey(1), jnp.zeros((BATCH, IN)), train=False)["params"]
    x = jax.random.normal(jax.random.PRNGKey(2), (BATCH, IN))
    batch = {"x": x, "y": jnp.tanh(x[:, :OUT])}
    return params, _TX.init(params), batch, jax.random.PRNGKey(0)


def _roles(graph):
    return {graph.values[v].keypath: graph.values[v].role for v in graph.inputs}


def test_a_key_is_found_by_what_reads_it(state):
    params, opt_state, batch, key = state
    graph = autoshard.trace(_step, params, opt_state, batch, key)
    roles = _roles(graph)
    assert roles["[3]"] == "rng"                                 # legacy uint32[2] PRNGKey
    assert roles["[2]['x']"] == roles["[2]['y']"] == "data"
    assert traced_batch(graph) == BATCH
    typed = autoshard.trace(_step, params, opt_state, batch, jax.random.key(0))
    assert _roles(typed)["[3]"] == "rng"                         # typed key<fry>[]

    def picks(batch, keys, pairs):                               # keys[1] reaches random_wrap via slice + squeeze
        noise = jax.random.normal(keys[1], batch.shape)
        return jnp.sum(batch + noise) + jnp.sum(pairs.astype(jnp.float32))

    keys = jax.random.split(jax.random.PRNGKey(0), 4)            # uint32[4, 2]
    pairs = jnp.zeros((BATCH, 2), jnp.uint32)                    # a key's shape and dtype, read by no random op
    roles = _roles(autoshard.trace(picks, batch["x"], keys, pairs))
    assert roles == {"[0]": "data", "[1]": "rng", "[2]": "data"}


def test_a_planned_step_keeps_the_key_whole_and_runs(state):
    params, opt_state, batch, key = state
    plan = autoshard.plan(_step, params, opt_state, batch, key, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
    assert plan.specs_by_keypath()["[3]"] == ((),)
    text = plan.explain()
    assert "[3] dim" not in text, text                           # the key is no logical dim of the plan
    # the batch is the batch's 32 rows, not the key's 2 words: data parallelism over 8 devices applies
    dp = plan.predicted["experts"]["data-parallel"]
    assert "step_time" in dp, dp
    assert "unknown primitive 'random_" not in " ".join(plan.warnings), plan.warnings

    step = autoshard.autoshard(_step, mesh={"data": 2, "model": 4}, hardware="cpu-sim", plan=plan)
    got = step(params, opt_state, batch, key)
    want = jax.jit(_step)(params, opt_state, batch, key)
    assert got[3].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
