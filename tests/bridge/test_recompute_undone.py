"""A user's remat blocks, undone for the XLA:CPU pricing (core/recompute.py): XLA:CPU keeps the forward
values a remat block would recompute, so an audit on CPU devices prices the step as if nothing were
recomputed; the plan itself (made for any hardware) keeps its own numbers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.recompute import recomputed_values, without_recomputation
from autoshard._src.plan.platform_memory import memory_terms_on


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


class Net(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        for _ in range(3):
            x = block()(x)
        return nn.Dense(8)(x)


def _case(remat: bool):
    model, opt = Net(remat), optax.adam(1e-3)
    x, y = jnp.ones((16, 32)), jnp.ones((16, 8))
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, opt_state, batch):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
        updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, opt.init(params), {"x": x, "y": y}))
    return step, args


@pytest.fixture(scope="module")
def rematted():
    step, args = _case(True)
    return step, args, trace(step, *args)


def test_every_recomputed_value_has_its_forward_original(rematted):
    _, _, graph = rematted
    alias, recomputing = recomputed_values(graph)
    assert recomputing and len(alias) >= len(recomputing)
    for r, f in alias.items():
        rv, fv = graph.values[r], graph.values[f]
        assert graph.ops[rv.producer].phase == "backward" and graph.ops[fv.producer].phase == "forward"
        assert (rv.shape, rv.dtype) == (fv.shape, fv.dtype)
        assert graph.ops[rv.producer].primitive == graph.ops[fv.producer].primitive
    # every matmul of the blocks is found again; what else reads no cotangent is the linearisation's own
    # arithmetic (a derivative's coefficients: 2 * x, a mask), which has no forward twin to stand for
    # (each block's first Dense is recomputed: the backward reads its output through the GELU; the second
    # Dense's output it never reads)
    assert sum(1 for i in recomputing if graph.ops[i].primitive == "dot_general") == 3
    for op in graph.ops:
        if op.phase == "backward" and op.remat_eqn >= 0 and op.index not in recomputing:
            reads_cotangent = any(x not in alias and graph.values[x].producer is not None
                                  and graph.ops[graph.values[x].producer].phase == "backward" for x in op.inputs)
            assert reads_cotangent or op.primitive != "dot_general", op


def test_without_recomputation_the_backward_reads_the_forward_values(rematted):
    _, _, graph = rematted
    alias, recomputing = recomputed_values(graph)
    plain = without_recomputation(graph)
    assert [op.index for op in plain.ops] == [op.index for op in graph.ops]      # ids kept
    for op in plain.ops:
        if op.phase == "backward":
            assert op.index not in recomputing and not any(x in alias for x in op.inputs)
    for v, val in plain.values.items():
        assert all(v in plain.ops[c].inputs for c in val.consumers)
    plain_step, plain_args = _case(False)
    assert without_recomputation(trace(plain_step, *plain_args)) is None


def test_the_cpu_audit_prices_remat_blocks_like_plain_ones(rematted):
    step, args, graph = rematted
    mesh = {"data": 8}
    with_remat = autoshard.expert_plan("data-parallel", step, *args, mesh=mesh, hardware="cpu-sim")
    plain_step, plain_args = _case(False)
    plain = autoshard.expert_plan("data-parallel", plain_step, *plain_args, mesh=mesh, hardware="cpu-sim")
    # the plan keeps what the remat saves (a GPU recomputes); on CPU the activations are the plain step's
    assert with_remat.predicted["memory"]["activations"] < plain.predicted["memory"]["activations"]
    on_cpu = memory_terms_on(with_remat, graph, "cpu")
    plain_on_cpu = memory_terms_on(plain, trace(plain_step, *plain_args), "cpu")
    assert on_cpu["activations"] == pytest.approx(plain_on_cpu["activations"], rel=0.02)
    assert memory_terms_on(with_remat, graph, "gpu") == with_remat.predicted["memory"]
