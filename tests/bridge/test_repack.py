"""Pipelined state between steps: ZeRO-stored parameters move into the runtime's stage rows and the
gradients back by one all-to-all over `pipe` each way (bridge/runtimes/repack.py), with the same values as
the runtime's own stack/unstack, and the decorated step's compiled program moves about one stage's
parameters per device for it, not the whole model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import autoshard
from autoshard._src.bridge.audit.hlo import collectives
from autoshard._src.bridge.runtimes.repack import storage_spec


def _loss(params, batch):
    """Four dense layers; `emb` is read by the first and the last (a tied leaf held by two stages);
    `scale` (3 elements) divides by no device count, so it is stored replicated."""
    h = jnp.tanh(batch["x"] @ params["emb"])
    for w in params["layers"]:
        h = jnp.tanh(h @ w)
    logits = h @ params["emb"].T
    return jnp.mean((logits[:, :3] * params["scale"] - batch["y"]) ** 2)


def _problem():
    k = jax.random.split(jax.random.key(0), 6)
    params = {"emb": jax.random.normal(k[0], (16, 32)) * 0.3,
              "layers": [jax.random.normal(k[i], (32, 32)) * 0.2 for i in range(1, 4)],
              "scale": jnp.array([1.0, 0.5, 2.0])}
    batch = {"x": jax.random.normal(k[4], (16, 16)), "y": jax.random.normal(k[5], (16, 3))}
    return params, batch


@pytest.mark.parametrize(("shape", "kw"), [
    ({"pipe": 4, "data": 2}, {}),
    ({"data": 2, "pipe": 4}, {}),
    # interleaved: 4 stages on 2 pipe ranks, each rank's block carries the pieces of its two stages
    ({"pipe": 2, "data": 2}, {"schedule": "interleaved-1f1b", "virtual_stages": 2}),
])
@pytest.mark.slow
def test_repack_equals_the_runtime_stack_and_unstack(shape, kw):
    params, batch = _problem()
    run = autoshard.pipelined(_loss, params, batch, mesh=shape, num_microbatches=2, **kw)
    assert len(run.stages) == 4
    mesh = run.mesh
    assert sum(len(h) > 1 for h in run._holders) >= 1          # the tied leaf is in two stages
    repack = run.repacker(params)
    stored = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, storage_spec(mesh, x.shape))), params)
    assert storage_spec(mesh, (3,)) == jax.sharding.PartitionSpec()

    want = run.stack(params)
    got = jax.jit(repack.stack)(stored)
    np.testing.assert_array_equal(np.asarray(got.flat), np.asarray(want.flat))
    assert got.flat.sharding.is_equivalent_to(want.flat.sharding, 2)

    # gradients: the runtime's stage rows back to the user's tree, each leaf in its storage layout,
    # a tied leaf's gradient from its owner's row (the runtime summed both copies there)
    loss, grads = run(want, batch)
    back = jax.jit(repack.unstack)(grads)
    ref = run.unstack(grads)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, storage_spec(mesh, a.shape)), a.ndim)
    want_loss, want_grads = jax.value_and_grad(_loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def repack_bytes_per_device(fast, *args) -> tuple[int, int]:
    """(bytes per device the compiled step's repack moves -- its all-to-alls over `pipe` and
    all-gathers over the other axes --, the largest stage's parameter bytes)."""
    prog = fast.pipelined.program
    hlo = fast.lower(*args).compile().as_text()
    names, sizes = prog.mesh.axis_names, tuple(prog.mesh.shape[a] for a in prog.mesh.axis_names)
    # the runtime's own collectives are permutes and all-reduces; a has_aux step's extra forward
    # pass on the whole batch gathers parameters outside the shard_maps (legitimately)
    moved = sum(c.bytes * c.count for c in collectives(hlo, names, sizes)
                if c.kind in ("all-to-all", "all-gather") and "shard_map" in c.op_name)
    stages = fast.pipelined.stack(args[0]).layouts
    itemsize = 4
    largest = max(lay.size for lay in stages) * itemsize
    return moved, largest


def check_repack_traffic(fast, params, opt_state, batch) -> None:
    """Per device the step moves about a stage's parameters in and its gradients out (before the
    explicit repack XLA replicated the stacked buffer: ~7x the whole model on a debug GPT)."""
    moved, largest = repack_bytes_per_device(fast, params, opt_state, batch)
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    assert 0 < moved <= 2.5 * largest < whole, (moved, largest, whole)
