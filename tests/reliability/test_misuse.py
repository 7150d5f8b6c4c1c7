"""Misuse gets a typed error (or a warning where results stay right), never a crash or a raw jax
error, and never costs the caller an array: one table, one row per case (issue 17)."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import autoshard
import models
from autoshard import ConfigError, HardwareError, MeshError, NotCallableError, PlanError, UntraceableArgumentError
from autoshard._src.tensor.search import SearchOptions

M = models.get("mlp", "debug")
GPT6 = models.get("gpt", "debug", num_heads=6, d_model=48)     # 6 heads: the model axis of 4 cannot split them


def fresh():
    params = M.init(jax.random.key(0))
    return params, M.optimizer.init(params), M.batch()


def step_on(mesh=None, **kw):
    return autoshard.autoshard(M.train_step, mesh=mesh or {"data": 8}, hardware="cpu-sim", **kw)


def plan8():
    return autoshard.plan(M.train_step, *fresh(), mesh={"data": 8}, hardware="cpu-sim")


def edited_plan(edit):
    d = json.loads(plan8().to_json())
    edit(d)
    return json.dumps(d)


def reuse_donated(args):
    s = step_on()
    p, o, _ = s(*args)
    s(p, o, args[2])                        # consumes p, o
    return s(p, o, args[2])


def second_call_other_count(args):
    s = step_on(donate=False)
    s(*args)
    return s(*args[:2])


def abstract_call(args):
    return step_on()(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args))


def plan_file(tmp, text):
    f = tmp / "plan.json"
    f.write_text(text)
    return f


def with_search(**opts):
    return lambda args: autoshard.plan(M.train_step, *args, mesh={"data": 8}, hardware="cpu-sim", search=opts)


def set_axis(name):
    def edit(d):
        d["mesh"] = [[name, 8]]
        d["input_specs_flat"][0] = [["data"]]
    return edit


CASES = [
    # (id, call(args, tmp_path), error type, message pattern)
    ("donated arrays reused", lambda a, t: reuse_donated(a), PlanError, "was deleted.*donate=False"),
    ("abstract arguments to a call", lambda a, t: abstract_call(a), PlanError, r"abstract jax.ShapeDtypeStruct.*lower"),
    ("other argument count later", lambda a, t: second_call_other_count(a), PlanError, "planned for 3 argument"),
    ("plan file missing", lambda a, t: step_on(plan=t / "nope.json")(*a), PlanError, "cannot read the plan file"),
    ("plan file not JSON", lambda a, t: step_on(plan=plan_file(t, "{oops"))(*a), PlanError, "not JSON"),
    ("plan file missing a key", lambda a, t: step_on(plan=plan_file(t, edited_plan(lambda d: d.pop("stages"))))(*a),
     PlanError, "key 'stages' is missing"),
    ("plan of another format", lambda a, t: autoshard.Plan.from_json(edited_plan(lambda d: d.update(format_version=1))),
     PlanError, "earlier autoshard"),
    ("plan naming an axis its mesh lacks", lambda a, t: autoshard.autoshard(
        M.train_step, plan=autoshard.Plan.from_json(edited_plan(set_axis("zzz"))), hardware="cpu-sim")(*a),
     PlanError, r"axes \['data'\] that its mesh"),
    ("plan with a different explicit mesh", lambda a, t: step_on({"data": 2, "model": 4}, plan=plan8())(*a),
     PlanError, "was also given"),
    ("plan of another step", lambda a, t: autoshard.autoshard(
        lambda p, o, b: M.train_step(p, o, {k: v * 2 for k, v in b.items()}), plan=plan8(), hardware="cpu-sim")(*a),
     PlanError, "another model or step"),
    ("storage mode unknown", lambda a, t: with_search(storage_modes=("bogus",))(a), ConfigError, "storage_modes"),
    ("storage modes as a string", lambda a, t: with_search(storage_modes="zero1")(a), ConfigError, "storage_modes"),
    ("storage modes empty", lambda a, t: with_search(storage_modes=())(a), ConfigError, "storage_modes"),
    ("max_plans 0", lambda a, t: with_search(max_plans=0)(a), ConfigError, "max_plans=0"),
    ("overlap above 1", lambda a, t: with_search(overlap=2.0)(a), ConfigError, "overlap=2.0"),
    ("bucket_bytes negative", lambda a, t: with_search(bucket_bytes=-1)(a), ConfigError, "bucket_bytes=-1"),
    ("search key unknown", lambda a, t: with_search(beam=3)(a), ConfigError, r"unknown key\(s\) \['beam'\]"),
    ("SearchOptions object invalid", lambda a, t: autoshard.plan(
        M.train_step, *a, mesh={"data": 8}, search=SearchOptions(max_plans=-2)), ConfigError, "max_plans=-2"),
    ("memory budget negative", lambda a, t: step_on(memory_budget=-5)(*a), ConfigError, "memory_budget=-5"),
    ("memory budget as text", lambda a, t: step_on(memory_budget="1GB")(*a), ConfigError, "memory_budget='1GB'"),
    ("mesh larger than the host", lambda a, t: step_on({"data": 16})(*a), MeshError, "needs 16 devices, but 8"),
    ("mesh axis of size 0", lambda a, t: step_on({"data": 0})(*a), MeshError, "data"),
    ("hardware preset unknown", lambda a, t: autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="tpu-v9")(*a),
     HardwareError, "h100-sxm"),
    ("no mesh", lambda a, t: autoshard.autoshard(M.train_step)(*a), ConfigError, "no mesh given"),
    ("config key unknown", lambda a, t: autoshard.autoshard(M.train_step, mesh={"data": 8}, meshh=3), ConfigError,
     "meshh"),
    ("pipeline unknown", lambda a, t: step_on(pipeline="zigzag")(*a), ConfigError, "zigzag"),
    ("step not callable", lambda a, t: autoshard.plan(42, *a, mesh={"data": 8}), NotCallableError, "callable"),
    ("string leaf in the arguments", lambda a, t: step_on()(a[0], a[1], {**a[2], "name": "x"}),
     UntraceableArgumentError, "str"),
    ("expert unknown", lambda a, t: autoshard.expert_plan("zero-bubble", M.train_step, *a, mesh={"data": 8}),
     PlanError, "unknown"),
    ("expert whose heads do not divide", lambda a, t: autoshard.expert_plan(
        "data-megatron", GPT6.train_step, *GPT6.abstract_state(), mesh={"data": 2, "model": 4}, hardware="h100-sxm"),
     PlanError, r"dims do not divide axes \('model',\) \(4 devices\): \[0\]\S+ dim \d .*of size \[6\] "
                r"\(parts of the dim of size 48\)"),
    ("checkpoint of a string", lambda a, t: autoshard.save(t / "c", {"w": a[0], "tag": "x"}), ConfigError,
     "checkpoints hold arrays"),
    ("checkpoint missing", lambda a, t: autoshard.restore(t / "none", like=a[0]), ConfigError, "no checkpoint at"),
    ("checkpoint of another tree", lambda a, t: (autoshard.save(t / "c", a[0]),
                                                 autoshard.restore(t / "c", like=(a[0], a[1]))),
     ConfigError, "arrays, like= has"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_misuse_is_a_typed_error_and_the_callers_arrays_survive(case, tmp_path):
    _, call, error, pattern = case
    args = fresh()
    with pytest.raises(error, match=pattern):
        call(args, tmp_path)
    assert isinstance(error, type) and issubclass(error, autoshard.AutoshardError)
    deleted = [jax.tree_util.keystr(kp) for kp, x in jax.tree_util.tree_flatten_with_path(args)[0]
               if isinstance(x, jax.Array) and x.is_deleted()]
    if case[0] != "donated arrays reused":        # that case deletes them by design, before the error
        assert not deleted, deleted


def test_meshes_on_part_of_the_host_run():
    """A mesh over 4 of 8 devices (a dict, or a jax Mesh naming its devices) runs there, like jax."""
    params, opt, batch = fresh()
    want = float(jax.jit(M.train_step)(params, opt, batch)[2])
    four = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[4:])
    for mesh in ({"data": 4}, four):
        s = step_on(mesh, donate=False)
        _, _, loss = s(params, opt, batch)
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
        assert s.mesh.size == 4
    assert set(s.mesh.devices.flat) == set(jax.devices()[4:])


def test_python_scalars_and_silent_replication():
    """A Python float argument is a traced scalar; a mesh axis no dim divides is a warning naming it."""
    params, opt, batch = fresh()
    opt_fn = optax.adam(1e-3)

    def step(params, opt_state, batch, scale):
        loss, grads = jax.value_and_grad(M.loss)(params, batch)
        updates, opt_state = opt_fn.update(jax.tree.map(lambda g: g * scale, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    s = autoshard.autoshard(step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    loss = s(params, opt_fn.init(params), batch, 0.5)[2]
    assert np.isfinite(float(loss))

    x = jnp.ones((6, 30))
    w = {"a": jnp.ones((30, 30)) * 0.01, "b": jnp.ones((30, 30)) * 0.01}

    def odd(w, o, batch):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((batch @ w["a"] @ w["b"]) ** 2))(w)
        u, o = opt_fn.update(g, o, w)
        return optax.apply_updates(w, u), o, loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoshard.autoshard(odd, mesh={"data": 2, "model": 4}, hardware="cpu-sim")(w, opt_fn.init(w), x)
    msgs = [str(c.message) for c in caught if "splits nothing" in str(c.message)]
    assert len(msgs) == 1 and "'model' (size 4)" in msgs[0] and "30" in msgs[0]
