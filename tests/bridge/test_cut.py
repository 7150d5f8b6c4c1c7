"""autoshard.pipelined cuts a model's loss into pipeline stages and runs them with the shard_map
runtime: loss and gradients equal single-device jax.value_and_grad (balanced and plan-guided cuts,
tied embeddings, remat and nnx models), training on the stage-sharded parameters equals the
model's own train step, and what cannot be cut gets a typed error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard import PipelineError


def assert_close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def model_args(name, **overrides):
    m = models.get(name, "debug", **overrides)
    return m, m.init(jax.random.key(0)), m.batch()


@pytest.mark.parametrize("name,overrides,mesh,microbatches,schedule", [
    ("mlp", {}, {"pipe": 4, "data": 2}, 2, "1f1b"),
    ("gpt", {}, {"pipe": 4, "data": 2}, 2, "1f1b"),
    pytest.param("gpt", {"remat": True}, {"pipe": 2, "data": 2}, 2, "gpipe", marks=pytest.mark.slow),
    pytest.param("gpt_nnx", {}, {"pipe": 4}, 4, "1f1b", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_matches_single_device(name, overrides, mesh, microbatches, schedule):
    m, params, batch = model_args(name, **overrides)
    run = autoshard.pipelined(m.loss, params, batch, mesh=mesh, num_microbatches=microbatches, schedule=schedule)
    assert len(run.stages) == mesh["pipe"]
    assert all(st.eqns > 0 for st in run.stages)
    loss, grads = run.value_and_grad(params, batch)
    want_loss, want_grads = jax.value_and_grad(m.loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_close(grads, want_grads)
    # every parameter is owned by exactly one stage
    owned = [k for st in run.stages for k in st.params]
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    assert sorted(owned) == sorted(jax.tree_util.keystr(kp) for kp, _ in paths)


@pytest.mark.slow
def test_tied_embedding_is_copied_and_its_gradients_summed():
    m, params, batch = model_args("gpt")
    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4}, num_microbatches=2)
    wte = [k for k in run.stages[0].params if "wte" in k]
    assert wte, run.describe()
    assert "GPT/wte.attend" in run.stages[-1].modules   # the head reads wte three stages later
    # the head's stage holds a copy of the embedding (nothing that large travels per micro-batch);
    # both copies' gradients are the sum over both uses
    assert run.stages[-1].borrows == ("['wte']['embedding']",)
    assert all(not st.borrows for st in run.stages[:-1])
    # only activations cross into the head's stage, never the embedding
    assert run.stages[-1].receive_shapes and all(len(shp) == 3 for shp in run.stages[-1].receive_shapes)
    want = jax.grad(m.loss)(params, batch)["wte"]["embedding"]
    _, grads = run(run.stack(params), batch)
    rows = run.program.unstack(grads)
    key = "['wte']['embedding']"
    assert_close(rows[0][key], want)
    assert_close(rows[-1][key], want)


@pytest.mark.slow      # the decorator's RaNNC steps (default suite) run plan-guided cuts
def test_plan_guides_the_cut():
    m, params, batch = model_args("gpt")
    opt = m.optimizer.init(params)
    plan = autoshard.plan(m.train_step, params, opt, batch, mesh={"pipe": 4, "data": 2}, hardware="cpu-sim",
                          pipeline="rannc")
    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=2, plan=plan)
    plan_stage = {kp[len("[0]"):]: st.index for st in plan.stages for kp in st.params}
    for st in run.stages:
        for k in st.params:
            if "wte" not in k:     # the tied embedding follows its first use instead
                assert plan_stage[k] == st.index, (k, plan_stage[k], st.index)
    balanced = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=2)
    assert [st.params for st in run.stages] != [st.params for st in balanced.stages]
    assert_close(run.value_and_grad(params, batch), jax.value_and_grad(m.loss)(params, batch))


@pytest.mark.slow
def test_training_on_stacked_params_matches_train_step():
    m, params, batch = model_args("gpt")
    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 2, "data": 4}, num_microbatches=1)
    opt = m.optimizer   # adamw: elementwise, so it updates the flat stage buffer exactly
    state = run.stack(params)
    opt_state = opt.init(state)
    ref_params, ref_opt = params, opt.init(params)
    step = jax.jit(m.train_step)
    for _ in range(3):
        loss, grads = run(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
        ref_params, ref_opt, ref_loss = step(ref_params, ref_opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(run.unstack(state), ref_params)


@pytest.mark.slow      # bert compiles for ~25 s; tests/reliability/test_loss_form.py runs the MLP ones
def test_ratio_loss_is_computed_on_the_whole_batch():
    m, params, batch = model_args("bert")    # sum(ce * weights) / max(sum(weights), 1): the normaliser spans chunks
    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 2, "data": 2}, num_microbatches=2)
    loss, grads = run.value_and_grad(params, batch)
    want_loss, want_grads = jax.value_and_grad(m.loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_close(grads, want_grads)


def test_loss_mixing_samples_is_refused_unless_accepted():
    m, params, batch = model_args("mlp")

    def worst(params, batch):    # a max over samples: no chunking computes it
        pred = m.module.apply({"params": params}, batch["x"])
        return jnp.max(jnp.mean((pred - batch["y"]) ** 2, axis=1))

    with pytest.raises(PipelineError, match="'reduce_max' in the loss combines the samples"):
        autoshard.pipelined(worst, params, batch, mesh={"pipe": 2, "data": 2}, num_microbatches=2)
    run = autoshard.pipelined(worst, params, batch, mesh={"pipe": 2, "data": 2}, num_microbatches=2,
                              check_loss=False)
    loss, grads = run.value_and_grad(params, batch)
    chunks = [jax.tree.map(lambda x, i=i: x[2 * i:2 * i + 2], batch) for i in range(4)]
    parts = [jax.value_and_grad(worst)(params, c) for c in chunks]
    np.testing.assert_allclose(float(loss), np.mean([float(p[0]) for p in parts]), rtol=1e-5)
    assert_close(grads, jax.tree.map(lambda *g: sum(g) / 4, *[p[1] for p in parts]))


def test_errors():
    m, params, batch = model_args("mlp")
    with pytest.raises(PipelineError, match="no 'pipe' axis"):
        autoshard.pipelined(m.loss, params, batch, mesh={"data": 8}, num_microbatches=2)
    with pytest.raises(PipelineError, match="batch size 8 does not split into 3 micro-batches x 2"):
        autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=3)
    with pytest.raises(PipelineError, match="one scalar float loss"):
        autoshard.pipelined(lambda p, b: (m.loss(p, b), 0.0), params, batch, mesh={"pipe": 2}, num_microbatches=2)
    opt = m.optimizer.init(params)
    plan = autoshard.plan(m.train_step, params, opt, batch, mesh={"pipe": 2, "data": 4}, hardware="cpu-sim",
                          pipeline="rannc")
    with pytest.raises(PipelineError, match="the plan has 2 stages but the mesh's pipe axis has 4"):
        autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=2, plan=plan)
    tensor_plan = autoshard.plan(m.train_step, params, opt, batch, mesh={"data": 8}, hardware="cpu-sim")
    with pytest.raises(PipelineError, match="this is a tensor plan"):
        autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 2}, num_microbatches=2, plan=tensor_plan)


def test_integer_value_between_stages_is_refused():
    keys = jax.random.split(jax.random.key(1), 3)
    params = {"a": jax.random.normal(keys[0], (8, 64)), "b": jax.random.normal(keys[1], (64, 64)),
              "c": jax.random.normal(keys[2], (64, 64))}
    batch = {"x": jnp.ones((4, 8))}

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["a"])
        idx = jnp.argmax(h, axis=-1)                 # integer, computed from stage-0 activations
        h = jnp.tanh(jnp.tanh(h @ p["b"]) @ p["c"])
        return jnp.mean(h * idx[:, None].astype(h.dtype))

    with pytest.raises(PipelineError, match="int32.*stages exchange only floating-point values"):
        autoshard.pipelined(loss, params, batch, mesh={"pipe": 2}, num_microbatches=1)


def test_balanced_cuts_trade_stage_flops_against_boundary_bytes():
    from autoshard._src.bridge.runtimes.cut_place import balanced_cuts as _balanced_cuts

    # 12 unit-flop eqns; cutting before eqn i sends live[i] bytes: cheap only before 3, 7 and 10
    before = np.arange(12, dtype=float)
    live = np.full(12, 1000.0)
    live[[3, 7, 10]] = 10.0
    movable = [True] * 12
    # bytes nearly free: equal thirds (cuts at 4 and 8), whatever they send
    assert _balanced_cuts(3, before, 12.0, live, movable, flop_rate=1.0, link_bandwidth=1e9) == [4, 8]
    # bytes dear: the cheap boundaries, the stage flops only as balanced as they allow
    assert _balanced_cuts(3, before, 12.0, live, movable, flop_rate=1.0, link_bandwidth=1.0) == [3, 7]
    # batch-only eqns (not movable) are never a cut
    movable[7] = False
    assert 7 not in _balanced_cuts(3, before, 12.0, live, movable, flop_rate=1.0, link_bandwidth=1.0)
    with pytest.raises(PipelineError, match="places to cut"):
        _balanced_cuts(13, before, 12.0, live, [True] * 12, flop_rate=1.0, link_bandwidth=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dlrm"])   # mmt takes the same path at 25 s
def test_graphpipe_dag_plan_matches_single_device(name):
    # GraphPipe's plan: branch stages with no predecessors feeding one join stage; the cut follows
    # the plan's parameter placement and each value goes straight to the stage using it
    m, params, batch = model_args(name)
    opt = m.optimizer.init(params)
    plan = autoshard.plan(m.train_step, params, opt, batch, mesh={"data": 4}, hardware="v100-sxm",
                          pipeline="graphpipe")
    S = len(plan.stages)
    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": S}, num_microbatches=plan.microbatches,
                              plan=plan)
    assert [st.after for st in run.stages] == [tuple(s.after) for s in plan.stages]
    assert run.program.schedule.name == "graph-1f1b"
    plan_stage = {kp[len("[0]"):]: st.index for st in plan.stages for kp in st.params}
    for st in run.stages:
        assert all(plan_stage[k] == st.index for k in st.params)
    assert_close(run.value_and_grad(params, batch), jax.value_and_grad(m.loss)(params, batch))


def test_dag_assignment_rules():
    from autoshard._src.bridge.runtimes.cut_dag import PipelineError, assign, plan_edges

    # values 0, 1 (params of stages 0, 1) -> eqn0 on 0 makes 10, eqn1 on 1 makes 11; eqn2 reads both
    # (no parameter: the join 2); eqn3 reads only a tied param (floating: the stage of its user);
    # eqn4 (stage 2's parameter) makes the loss
    key_ins = [[0], [1], [10, 11], [5], [12, 13, 2]]
    outputs = [[10], [11], [12], [13], [14]]
    anchor = [0, 1, None, None, 2]
    stage, edges, sends, sink = assign(3, [(0, 2), (1, 2)], anchor, key_ins, outputs, [False] * 5, 14)
    assert stage == [0, 1, 2, 2, 2] and edges == [(0, 2), (1, 2)] and sink == 2
    assert sends == {0: [10], 1: [11], 2: []}
    # on a chain, a value stage 2's parameters need from stage 0 goes straight there, not through 1
    stage, edges, sends, sink = assign(3, [(0, 1), (1, 2)], [0, 1, 2, None, 2], key_ins, outputs,
                                       [False] * 5, 14)
    assert stage == [0, 1, 2, 2, 2] and edges == [(0, 2), (1, 2)] and sends[0] == [10]
    with pytest.raises(PipelineError, match="sinks"):
        assign(3, [(0, 1)], anchor, key_ins, outputs, [False] * 5, 14)
    with pytest.raises(PipelineError, match="compute nothing"):      # stage 1 gets no eqn at all
        assign(3, [(0, 2), (1, 2)], [0, 0, None, None, 2], key_ins, outputs, [False] * 5, 14)

    class St:
        def __init__(self, index, after):
            self.index, self.after = index, after

    assert plan_edges([St(0, ()), St(1, (0,)), St(2, (1,))]) is None
    assert plan_edges([St(0, ()), St(1, ()), St(2, (0, 1))]) == [(0, 2), (1, 2)]



def test_remat_and_scan_bodies_are_priced_like_the_planner_prices_them():
    # the cut keeps remat / scan eqns whole; their flops are those of the ops inside (times the trip
    # count), as the planner's OpGraph counts them, not one flop per output element
    from autoshard._src.bridge.trace.trace import eqn_flops

    w = jnp.ones((64, 64))

    def body(x):
        return jnp.tanh(x @ w)

    def scanned(x):
        return jax.lax.scan(lambda c, _: (body(c), None), x, None, length=5)[0]

    x = jnp.ones((8, 64))
    dot = 2 * 8 * 64 * 64
    for fn, want in ((jax.checkpoint(body), dot), (scanned, 5 * dot)):
        eqn = next(e for e in jax.make_jaxpr(fn)(x).jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2", "scan"))
        got = eqn_flops(eqn)
        assert want <= got <= want * 1.05, (fn, got, want)


@pytest.mark.slow
def test_remat_gpt_stages_carry_the_plain_gpt_flops():
    m, params, batch = model_args("gpt", remat=True)
    plain, _, _ = model_args("gpt")
    cut = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 2}, num_microbatches=2, check_loss=False)
    ref = autoshard.pipelined(plain.loss, params, batch, mesh={"pipe": 2}, num_microbatches=2, check_loss=False)
    got, want = sum(s.flops for s in cut.stages), sum(s.flops for s in ref.stages)
    assert abs(got - want) <= 0.02 * want, (got, want)
