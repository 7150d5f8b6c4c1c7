"""The shard_map pipeline runtime equals single-device jax.value_and_grad: chains under GPipe and
1F1B, with data parallelism inside stages, a branching stage DAG under graph-1F1B, an optax step
on the stacked parameters, and typed errors for bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec

import pipeline
from autoshard import PipelineError
from autoshard._src.bridge.runtimes.runtime import StackedParams, pipeline_value_and_grad


def mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:n])


def dense(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (n_in, n_out)) / np.sqrt(n_in), "b": 0.1 * jax.random.normal(k2, (n_out,))}


def hidden(p, batch, x=None):
    x = batch["x"] if x is None else x
    return jnp.tanh(x @ p["w"] + p["b"])


def head(p, batch, x):
    return jnp.mean((x @ p["w"] + p["b"] - batch["y"]) ** 2)


def chain_problem(stages, width=6, batch=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), stages + 1)
    params = [dense(keys[s], width, width if s < stages - 1 else 2) for s in range(stages)]
    data = {"x": jax.random.normal(keys[-1], (batch, width)),
            "y": jax.random.normal(jax.random.fold_in(keys[-1], 1), (batch, 2))}
    fns = [hidden] * (stages - 1) + [head]

    def full_loss(ps, b):
        x = None
        for f, p in zip(fns[:-1], ps[:-1], strict=True):
            x = f(p, b, x)
        return head(ps[-1], b, x)

    return fns, params, data, full_loss


def assert_close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("schedule,shape,names,microbatches", [
    ("gpipe", (4,), ("pipe",), 4),
    ("1f1b", (4,), ("pipe",), 8),
    ("1f1b", (4, 2), ("pipe", "data"), 4),
    ("gpipe", (2, 2, 2), ("data", "pipe", "model"), 2),
])
@pytest.mark.slow
def test_chain_matches_single_device(schedule, shape, names, microbatches):
    m = mesh(shape, names)
    S = m.shape["pipe"]
    fns, params, data, full_loss = chain_problem(S)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=microbatches, schedule=schedule)
    loss, grads = prog.value_and_grad(params, data)
    want_loss, want_grads = jax.value_and_grad(full_loss)(params, data)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_close(grads, want_grads)
    assert prog.data_parallel == int(np.prod(shape)) // S


def test_parameters_live_on_their_stage_only():
    m = mesh((4, 2), ("pipe", "data"))
    fns, params, data, _ = chain_problem(4, width=8)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=4)
    stacked = prog.stack(params)
    assert stacked.flat.sharding.spec == PartitionSpec("pipe")
    sizes = [sum(x.size for x in jax.tree.leaves(p)) for p in params]
    # every device holds one row: the largest stage's parameters, not the model's
    assert {s.data.shape for s in stacked.flat.addressable_shards} == {(1, max(sizes))}
    _, grads = prog(stacked, data)
    assert grads.flat.sharding.spec == PartitionSpec("pipe")
    # the compiled step never gathers parameters: per tick one activation and one gradient permute
    # along the chain, then the loss sum over pipe and the gradient mean over data
    from autoshard._src.bridge.audit.hlo import collectives, summarize
    hlo = prog.lower(stacked, data).compile().as_text()
    summary = summarize(collectives(hlo, ["pipe", "data"], [4, 2]))
    assert set(summary) == {"collective-permute@pipe", "all-reduce@pipe", "all-reduce@data"}
    assert summary["collective-permute@pipe"]["count"] == 2 * prog.ticks
    assert summary["all-reduce@data"]["bytes"] == 4 * max(sizes) + 4   # f32 gradient row + the loss


def test_1f1b_reuses_input_slots():
    m = mesh((4,), ("pipe",))
    fns, params, data, full_loss = chain_problem(4)
    gpipe = pipeline_value_and_grad(fns, m, num_microbatches=8, schedule="gpipe")
    one_f = pipeline_value_and_grad(fns, m, num_microbatches=8, schedule="1f1b")
    # stage inputs held per device: GPipe keeps all 8; under 1F1B a stage holds what its producer
    # has in flight (stage 0's p = 4: three waiting for their backward plus one just arrived)
    assert gpipe.slots[0] == 8
    assert one_f.slots[0] == max(pipeline.simulate(one_f.schedule).peak_inflight) == 4
    longer = pipeline_value_and_grad(fns, m, num_microbatches=32, schedule="1f1b")
    assert longer.slots == (4, one_f.slots[1])   # independent of the micro-batch count
    assert_close(one_f.value_and_grad(params, data), jax.value_and_grad(full_loss)(params, data))


@pytest.mark.slow
def test_graph_pipeline_matches_single_device():
    # stages 0 and 1 are branches reading the batch; 2 joins them; 3 is the head (Fig. 2's shape)
    m = mesh((4, 2), ("pipe", "data"))
    keys = jax.random.split(jax.random.key(3), 5)
    params = [dense(keys[0], 5, 4), dense(keys[1], 3, 4), dense(keys[2], 8, 6), dense(keys[3], 6, 1)]
    data = {"a": jax.random.normal(keys[4], (16, 5)), "b": jax.random.normal(jax.random.fold_in(keys[4], 1), (16, 3)),
            "y": jax.random.normal(jax.random.fold_in(keys[4], 2), (16, 1))}

    def branch_a(p, b):
        return jnp.tanh(b["a"] @ p["w"] + p["b"])

    def branch_b(p, b):
        return {"h": jax.nn.relu(b["b"] @ p["w"] + p["b"])}

    def join(p, b, xa, xb):
        return jnp.tanh(jnp.concatenate([xa, xb["h"]], axis=-1) @ p["w"] + p["b"])

    def out(p, b, x):
        return jnp.mean((x @ p["w"] + p["b"] - b["y"]) ** 2)

    def full(ps, b):
        return out(ps[3], b, join(ps[2], b, branch_a(ps[0], b), branch_b(ps[1], b)))

    edges = [(0, 2), (1, 2), (2, 3)]
    prog = pipeline_value_and_grad([branch_a, branch_b, join, out], m, num_microbatches=4,
                                   schedule="graph-1f1b", edges=edges)
    assert prog.schedule.edges == tuple(edges)
    assert_close(prog.value_and_grad(params, data), jax.value_and_grad(full)(params, data))


@pytest.mark.slow
def test_fan_out_sums_gradients():
    # stage 0 feeds both 1 and 2 (two ppermute groups); 3 joins; its input gradient sums both paths
    m = mesh((4,), ("pipe",))
    keys = jax.random.split(jax.random.key(5), 5)
    params = [dense(keys[0], 4, 4), dense(keys[1], 4, 3), dense(keys[2], 4, 3), dense(keys[3], 6, 1)]
    data = {"x": jax.random.normal(keys[4], (8, 4)), "y": jnp.ones((8, 1))}

    def src(p, b):
        return jnp.tanh(b["x"] @ p["w"] + p["b"])

    def mid(p, b, x):
        return jnp.sin(x @ p["w"] + p["b"])

    def sink(p, b, u, v):
        return jnp.mean((jnp.concatenate([u, v], -1) @ p["w"] + p["b"] - b["y"]) ** 2)

    def full(ps, b):
        x = src(ps[0], b)
        return sink(ps[3], b, mid(ps[1], b, x), mid(ps[2], b, x))

    sched = pipeline.schedule("graph-1f1b", num_stages=4, num_microbatches=2, edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
    prog = pipeline_value_and_grad([src, mid, mid, sink], m, schedule=sched)
    assert_close(prog.value_and_grad(params, data), jax.value_and_grad(full)(params, data))


@pytest.mark.slow
def test_tied_copies_get_the_summed_gradient():
    # one matrix E used by stage 0 (embed) and stage 2 (project back): each stage holds a copy and
    # both copies' gradients equal d loss / d E over both uses
    m = mesh((3, 2), ("pipe", "data"))
    keys = jax.random.split(jax.random.key(7), 4)
    E = jax.random.normal(keys[0], (5, 4))
    mid_p = dense(keys[1], 4, 4)
    data = {"x": jax.random.normal(keys[2], (8, 5)), "y": jax.random.normal(keys[3], (8, 5))}

    def embed(p, b):
        return b["x"] @ p["E"]

    def unembed(p, b, x):
        return jnp.mean((x @ p["E"].T + p["bias"] - b["y"]) ** 2)

    def full(e, mp, bias, b):
        return unembed({"E": e, "bias": bias}, b, hidden(mp, b, embed({"E": e}, b)))

    bias = jnp.zeros((5,))
    prog = pipeline_value_and_grad([embed, hidden, unembed], m, num_microbatches=2,
                                   tied=[[(0, "['E']"), (2, "['E']")]])
    loss, grads = prog.value_and_grad([{"E": E}, mid_p, {"E": E, "bias": bias}], data)
    want_loss, (gE, gmid, gbias) = jax.value_and_grad(full, argnums=(0, 1, 2))(E, mid_p, bias, data)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_close([grads[0]["E"], grads[2]["E"], grads[1], grads[2]["bias"]], [gE, gE, gmid, gbias])

    with pytest.raises(PipelineError, match="two or more distinct stages"):
        pipeline_value_and_grad([embed, hidden, unembed], m, num_microbatches=2, tied=[[(0, "['E']")]])
    wrong = pipeline_value_and_grad([embed, hidden, unembed], m, num_microbatches=2,
                                    tied=[[(0, "['E']"), (2, "['F']")]])
    with pytest.raises(PipelineError, match=r"tied parameter \['F'\] is not in stage 2"):
        wrong.value_and_grad([{"E": E}, mid_p, {"E": E, "bias": bias}], data)


@pytest.mark.slow
def test_optax_step_on_stacked_params_matches_per_stage_update():
    m = mesh((4, 2), ("pipe", "data"))
    fns, params, data, full_loss = chain_problem(4)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=2)
    opt = optax.adam(1e-2)
    stacked = prog.stack(params)
    state = opt.init(stacked)
    want_state = opt.init(params)
    want = params
    for _ in range(3):
        loss, grads = prog(stacked, data)
        updates, state = opt.update(grads, state, stacked)
        stacked = optax.apply_updates(stacked, updates)
        want_loss, want_grads = jax.value_and_grad(full_loss)(want, data)
        upd, want_state = opt.update(want_grads, want_state, want)
        want = optax.apply_updates(want, upd)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert isinstance(stacked, StackedParams)
    assert_close(prog.unstack(stacked), want)


@pytest.mark.slow
def test_mixed_dtypes_round_trip_exactly():
    m = mesh((2,), ("pipe",))

    def first(p, b):
        return (b["x"].astype(jnp.bfloat16) @ p["w"]).astype(jnp.bfloat16)

    def last(p, b, x):
        return jnp.mean((x.astype(jnp.float32) @ p["w"]) ** 2)

    params = [{"w": jnp.ones((3, 4), jnp.bfloat16)}, {"w": jnp.full((4, 1), 0.5, jnp.float32)}]
    data = {"x": jnp.arange(12.0).reshape(4, 3) / 10}
    prog = pipeline_value_and_grad([first, last], m, num_microbatches=2)
    stacked = prog.stack(params)
    assert stacked.flat.dtype == jnp.float32
    back = prog.unstack(stacked)
    assert back[0]["w"].dtype == jnp.bfloat16 and back[1]["w"].dtype == jnp.float32
    loss, grads = prog.value_and_grad(params, data)
    want_loss, want_grads = jax.value_and_grad(lambda ps, b: last(ps[1], b, first(ps[0], b)))(params, data)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-2)
    assert grads[0]["w"].dtype == jnp.bfloat16
    assert_close(grads, want_grads, tol=2e-2)


def test_errors_name_the_problem():
    m = mesh((4,), ("pipe",))
    fns, params, data, _ = chain_problem(4)
    with pytest.raises(PipelineError, match="'pipe' axis of size 3"):
        pipeline_value_and_grad(fns[:3], m, num_microbatches=2)
    with pytest.raises(PipelineError, match="pipe_axis='stages' is not an axis"):
        pipeline_value_and_grad(fns, m, num_microbatches=2, pipe_axis="stages")
    with pytest.raises(PipelineError, match="needs schedule='graph-1f1b'"):
        pipeline_value_and_grad(fns, m, num_microbatches=2, edges=[(0, 2), (1, 2), (2, 3)])
    with pytest.raises(PipelineError, match="needs num_microbatches"):
        pipeline_value_and_grad(fns, m)
    uneven = pipeline.schedule("graph-1f1b", num_stages=4, num_microbatches=[2, 2, 4, 4])
    with pytest.raises(PipelineError, match="per-stage micro-batch counts"):
        pipeline_value_and_grad(fns, m, schedule=uneven)
    prog = pipeline_value_and_grad(fns, m, num_microbatches=3)
    with pytest.raises(PipelineError, match="batch size 16 does not split into 3 micro-batches"):
        prog.value_and_grad(params, data)
    with pytest.raises(PipelineError, match="one parameter pytree per stage"):
        prog.stack(params[:2])
    bad = pipeline_value_and_grad(fns[:3] + [hidden], m, num_microbatches=2)
    with pytest.raises(PipelineError, match="stage 3 has no successor"):
        bad.value_and_grad(params, data)
    int_params = params[:3] + [{"w": jnp.ones((6, 2), jnp.int32), "b": params[3]["b"]}]
    with pytest.raises(PipelineError, match="stage 3's parameters has a int32 leaf"):
        prog.stack(int_params)
    broken = pipeline_value_and_grad(fns[:3] + [lambda p, b, x: head(p, b, x[:, :2])], m, num_microbatches=2)
    with pytest.raises(PipelineError, match="stage 3 failed on a micro-batch of 8 samples"):
        broken.value_and_grad(params, data)
