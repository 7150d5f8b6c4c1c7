"""The Megatron experts apply to the code users write (issue 19): Flax default module names
(`Dense_0`), `nn.MultiHeadDotProductAttention`, nnx modules and flat dicts of weights. Megatron's
splits come from the program's structure (column-parallel matmul in, row-parallel out), and a flat
dict the optimizer updates is parameters, not data."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
import models

MESH = {"data": 2, "model": 4}
opt = optax.adam(1e-3)


def _step(loss):
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _specs(name, step, params, batch, mesh=MESH):
    args = _abstract((params, opt.init(params), batch))
    plan = autoshard.expert_plan(name, step, *args, mesh=mesh, hardware="cpu-sim")
    return plan.input_specs[0], plan


def _axes(spec):
    return {a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part)}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 128, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(64)(x)


@pytest.mark.slow
def test_flax_default_names_alternate_column_and_row():
    x = jnp.ones((16, 64))
    params = MLP().init(jax.random.key(0), x)
    step = _step(lambda p, b: jnp.mean((MLP().apply(p, b["x"]) - b["y"]) ** 2))
    specs, _ = _specs("data-megatron", step, params, {"x": x, "y": x})
    k = {name: specs["params"][name]["kernel"] for name in ("Dense_0", "Dense_1", "Dense_2", "Dense_3")}
    assert k["Dense_0"] == P(None, "model") and k["Dense_1"] == P("model", None)   # column, row
    assert k["Dense_2"] == P(None, "model") and k["Dense_3"] == P("model", None)
    assert specs["params"]["Dense_0"]["bias"] == P("model")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(32)(nn.gelu(nn.Dense(128)(h)))


@pytest.mark.slow
def test_multi_head_dot_product_attention_splits_heads():
    x = jnp.ones((8, 6, 32))
    params = Block().init(jax.random.key(0), x)
    step = _step(lambda p, b: jnp.mean((Block().apply(p, b["x"]) - b["y"]) ** 2))
    specs, plan = _specs("data-megatron", step, params, {"x": x, "y": x}, {"data": 2, "model": 2})
    attn = specs["params"]["MultiHeadDotProductAttention_0"]
    for name in ("query", "key", "value"):
        assert attn[name]["kernel"] == P(None, "model", None), name     # (features, heads, head_dim)
    assert attn["out"]["kernel"] == P("model", None, None)               # (heads, head_dim, features)
    # Dense(32)(gelu(Dense(128)(h))) creates the outer Dense first: Dense_1 is fc1, Dense_0 fc2
    assert specs["params"]["Dense_1"]["kernel"] == P(None, "model")
    assert specs["params"]["Dense_0"]["kernel"] == P("model", None)
    assert _axes(specs["params"]["LayerNorm_0"]["scale"]) == set()


def test_flat_dict_of_weights_is_parameters():
    params = {"w0": jnp.ones((64, 256)), "b0": jnp.zeros((256,)), "w1": jnp.ones((256, 64))}

    def loss(p, b):
        return jnp.mean((jax.nn.relu(b["x"] @ p["w0"] + p["b0"]) @ p["w1"] - b["y"]) ** 2)

    batch = {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 64))}
    graph = autoshard.trace(_step(loss), params, opt.init(params), batch)
    roles = {graph.values[v].keypath: graph.values[v].role for v in graph.inputs}
    assert roles["[0]['w0']"] == roles["[0]['w1']"] == "parameter" and roles["[2]['x']"] == "data"
    specs, _ = _specs("data-parallel", _step(loss), params, batch)
    assert all(_axes(s) == set() for s in specs.values())              # weights replicated, not batch-split
    specs, _ = _specs("megatron", _step(loss), params, batch)
    assert specs["w0"] == P(None, ("data", "model")) and specs["w1"] == P(("data", "model"), None)
    plan = autoshard.plan(_step(loss), *_abstract((params, opt.init(params), batch)), mesh=MESH, hardware="cpu-sim")
    # Megatron applies; Megatron-SP does not (no sequence between the two matmuls), and says so
    lines = plan.explain().splitlines()
    assert "[0]['w0']" in plan.explain()
    assert not [line for line in lines if "not applicable" in line and "megatron-sp" not in line], lines


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "gpt_nnx", "bert", "t5"])
def test_megatron_priced_for_every_zoo_transformer(name):
    m = models.get(name, "debug")
    params = jax.eval_shape(m.init, jax.random.key(0))
    args = (params, jax.eval_shape(m.init_opt_state, params), m.batch(abstract=True))
    plan = autoshard.plan(m.train_step, *args, mesh={"data": 2, "model": 2}, hardware="cpu-sim")
    lines = [line for line in plan.explain().splitlines() if "megatron" in line]
    assert len(lines) == 3 and not any("not applicable" in line for line in lines), lines


def test_explain_names_dims_that_cannot_split():
    params = {"w0": jnp.ones((60, 1000)), "w1": jnp.ones((1000, 60))}
    batch = {"x": jnp.ones((30, 60)), "y": jnp.ones((30, 60))}

    def loss(p, b):
        return jnp.mean((jax.nn.relu(b["x"] @ p["w0"]) @ p["w1"] - b["y"]) ** 2)

    args = _abstract((params, opt.init(params), batch))
    text = autoshard.plan(_step(loss), *args, mesh={"data": 4}, hardware="cpu-sim").explain()
    # 30 rows cannot split over 4 devices: said, with what padding would cost
    assert "[2]['x'] dim 0 (size 30) over data (4): padding to 32 would add 6.7% work" in text
    text = autoshard.plan(_step(loss), *args, mesh={"data": 2, "model": 2}, hardware="cpu-sim").explain()
    assert "could not split" not in text                           # everything divides
