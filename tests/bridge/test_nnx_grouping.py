"""nnx models with N identical pre-norm residual blocks group as one block type x N (issue 19): in an
`nnx.List`, an `nnx.Sequential` and scanned (`nnx.vmap` + `nnx.scan`). Without name scopes the
modules come from parameter data flow: a block's residual add must stay with the block that produced
it (not join the next block's norm or the head), and the first block, fed by data, computes no input
gradient residuals, which must not make it look different."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoshard


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(nnx.gelu(self.fc1(self.norm(x))))


class Net(nnx.Module):
    def __init__(self, n, form, rngs, d=16):
        self.form = form
        if form == "list":
            self.blocks = nnx.List([Block(d, rngs) for _ in range(n)])
        elif form == "sequential":
            self.blocks = nnx.Sequential(*[Block(d, rngs) for _ in range(n)])
        else:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(d, rngs)
            self.blocks = make(rngs)
        self.head = nnx.Linear(d, 4, rngs=rngs)

    def __call__(self, x):
        if self.form == "list":
            for block in self.blocks:
                x = block(x)
        elif self.form == "sequential":
            x = self.blocks(x)
        else:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(block, x):
                return block(x)
            x = body(self.blocks, x)
        return self.head(x)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["list", "sequential", "scanned"])
@pytest.mark.parametrize("n", [6, 12, 24])
def test_identical_nnx_blocks_group_as_one_type(form, n):
    graphdef, params = nnx.split(Net(n, form, nnx.Rngs(0)), nnx.Param)
    opt = optax.adam(1e-3)

    def loss(p, batch):
        return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

    def step(p, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    batch = {"x": jax.ShapeDtypeStruct((4, 16), jnp.float32), "y": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt.init(params)))
    grouping = autoshard.group(autoshard.trace(step, *abstract, batch))
    assert [len(bt.instances) for bt in grouping.block_types] == [n], grouping.block_types
    assert grouping.block_types[0].scanned == (form == "scanned")
